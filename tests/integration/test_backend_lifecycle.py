"""A moe-serve of its own, as users start it (Triton private): what an attacker on the host can reach,
the request deadline (504, the engine slot comes back), a crashed python stub (in-flight requests end with
503 at once, /health 503, the crash and its Python stacks in the log, the backend comes back), and SIGTERM
with a long stream in flight (an error event, then [DONE]; nothing left running).

The tests run in file order on one server; the last one stops it.
"""
from __future__ import annotations

import json
import os
import re
import signal
import stat
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import psutil
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from openai_frontend.server_process import start_server

from .conftest import API_KEY

# Requests that must still be running seconds later (the deadline, a killed stub, shutdown): 4,000 tokens of the
# tiny model take well over 4 s even on a quiet 2-core machine (1,000 could finish inside the deadline).
LONG = 4000

AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = start_server(tmp_path_factory.mktemp("private"), ["--max-model-len", "4096",
                     "--max-backend-restarts", "1", "--shutdown-timeout", "2", "--request-timeout", "4"],
                     api_key=API_KEY,
                     triton_api_key=None)
    yield s
    if s.proc.poll() is None:
        s.stop()


def tree(server) -> dict[str, list[psutil.Process]]:
    out: dict[str, list[psutil.Process]] = {}
    for p in psutil.Process(server.proc.pid).children(recursive=True):
        out.setdefault(p.name(), []).append(p)
    return out


def triton_cmdline(server) -> list[str]:
    triton = tree(server).get("tritonserver")
    assert triton, f"no tritonserver under moe-serve (exit code {server.proc.poll()}):\n{server.log_tail(200)}"
    return triton[0].cmdline()


def health(server) -> int:
    """/health's status; a server that stopped answering fails the test with its log (why it stopped)."""
    try:
        return httpx.get(server.root_url + "/health", timeout=10).status_code
    except httpx.TransportError as exc:
        time.sleep(1)
        pytest.fail(f"moe-serve stopped answering ({exc!r}; exit code {server.proc.poll()}):\n{server.log_tail(200)}")


def shm_prefix(server) -> str:
    arg = next(a for a in triton_cmdline(server) if "shm-region-prefix-name=" in a)
    return arg.split("shm-region-prefix-name=")[1]


def long_stream(server, out: dict, key: str, **body) -> threading.Thread:
    """A streamed completion that would run for long; records its status, last two events and end time."""
    def run():
        lines = []
        with httpx.stream("POST", server.base_url + "/completions", headers=AUTH, timeout=120,
                          json={"model": server.model, "prompt": "tell", "max_tokens": LONG, "stream": True,
                                "ignore_eos": True, **body}) as r:
            for line in r.iter_lines():
                if line:
                    lines.append(line)
        out[key] = (r.status_code, lines, time.monotonic())

    t = threading.Thread(target=run)
    t.start()
    return t


def test_triton_is_private_and_model_control_is_off(server, tmp_path):
    # Listening TCP sockets of the whole process tree: the API, and Triton's metrics on loopback. No Triton
    # HTTP port, no TCP gRPC port.
    procs = [psutil.Process(server.proc.pid), *psutil.Process(server.proc.pid).children(recursive=True)]
    listening = {(c.laddr.ip, c.laddr.port) for p in procs for c in p.net_connections("tcp")
                 if c.status == psutil.CONN_LISTEN}
    assert listening == {("127.0.0.1", server.port), ("127.0.0.1", server.triton_metrics_port)}
    for port in (server.triton_http_port, server.triton_grpc_port):
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"http://127.0.0.1:{port}/v2/health/ready", timeout=2)

    # gRPC is a unix socket in a directory only this user can enter.
    cmd = triton_cmdline(server)
    sock = next(a for a in cmd if a.startswith("--grpc-address=unix:")).split("unix:")[1] + ":0"
    assert stat.S_IMODE(os.stat(Path(sock).parent).st_mode) == 0o700
    client = grpcclient.InferenceServerClient(f"unix:{sock}")
    ids = grpcclient.InferInput("input_ids", [3], "INT64")
    ids.set_data_from_numpy(np.array([1, 2, 3], np.int64))
    with pytest.raises(InferenceServerException, match="restricted"):
        client.infer("moe", [ids])  # no key: refused
    with pytest.raises(InferenceServerException, match="restricted"):
        client.get_model_config("moe")

    # Even with everything `ps` shows (the keys on tritonserver's command line), nothing can be loaded:
    # the upload that ran code as the server's user is refused, and so is unloading the model.
    keys = dict(a.split(":", 1)[1].split("=", 1) for a in cmd if a.startswith("--grpc-restricted-protocol="))
    marker = tmp_path / "pwned"
    payload = f"open({str(marker)!r}, 'w').write('x')\nclass TritonPythonModel:\n    pass\n".encode()
    for name, value in keys.items():
        headers = {f"triton-grpc-protocol-{name}": value}
        with pytest.raises(InferenceServerException) as e:
            client.load_model("moe", headers=headers, config=json.dumps({"backend": "python"}),
                              files={"file:1/model.py": payload})
        assert "not allowed" in str(e.value) or "restricted" in str(e.value)
        with pytest.raises(InferenceServerException):
            client.unload_model("moe", headers=headers)
    client.close()
    time.sleep(0.5)
    assert not marker.exists()
    r = httpx.post(server.base_url + "/completions", headers=AUTH,
                   json={"model": server.model, "prompt": "still serving", "max_tokens": 2})
    assert r.status_code == 200


def test_the_engine_process_takes_its_start_up_objects_out_of_garbage_collection(server):
    """A full collection walks every tracked object of the engine's process holding the GIL (~170 ms at start-up on
    2 cores) and so pauses the step loop: what exists after start-up is frozen, and the log says how much."""
    frozen = re.search(r"garbage collector: (\d+) objects alive after start-up frozen", server.log_tail(1_000_000))
    assert frozen and int(frozen.group(1)) > 100_000, server.log_tail(200)


def engine_running(server) -> float:
    text = httpx.get(server.root_url + "/metrics").text  # the engine's gauges, on the API's port
    line = next(x for x in text.splitlines() if x.startswith('moe_engine_requests{model="moe",state="running"'))
    return float(line.split()[-1])


def test_a_request_past_its_deadline_is_cancelled_and_answered_504(server):
    t0 = time.monotonic()
    r = httpx.post(server.base_url + "/completions", headers=AUTH, timeout=60,
                   json={"model": server.model, "prompt": "x", "max_tokens": LONG, "ignore_eos": True})
    assert r.status_code == 504 and r.json()["error"]["code"] == "request_timeout"
    assert 3.9 < time.monotonic() - t0 < 8
    deadline = time.monotonic() + 5
    while engine_running(server) != 0:  # the engine let it go
        assert time.monotonic() < deadline
        time.sleep(0.1)


def test_killed_stub_ends_in_flight_requests_with_503_then_the_backend_comes_back(server):
    stub = tree(server)["triton_python_backend_stub"][0]
    old_regions = sorted(Path("/dev/shm").glob(shm_prefix(server) + "*"))
    out: dict = {}
    streaming = long_stream(server, out, "stream")

    def plain():
        r = httpx.post(server.base_url + "/chat/completions", headers=AUTH, timeout=120,
                       json={"model": server.model, "messages": [{"role": "user", "content": "x"}],
                             "max_tokens": LONG, "ignore_eos": True})
        out["plain"] = (r.status_code, r.json(), time.monotonic())

    non_streaming = threading.Thread(target=plain)
    non_streaming.start()
    time.sleep(1.5)  # both are in the engine
    killed_at = time.monotonic()
    stub.send_signal(signal.SIGSEGV)  # a crash, as a fault in native code would end it
    streaming.join(30)
    non_streaming.join(30)

    status, body, ended = out["plain"]
    assert status == 503 and body["error"]["code"] == "backend_unavailable"
    assert ended - killed_at < 5
    status, lines, ended = out["stream"]
    assert status == 200 and ended - killed_at < 5
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[-2][len("data: "):])["error"]["code"] == "backend_unavailable"

    r = httpx.get(server.root_url + "/health")
    assert r.status_code == 503 and r.headers["retry-after"]
    # The crash is in the log with the stub's Python stacks (faulthandler), not only as a process gone.
    deadline = time.monotonic() + 10
    while "Fatal Python error: Segmentation fault" not in server.log_tail(1_000_000):
        assert time.monotonic() < deadline, server.log_tail(200)
        time.sleep(0.2)
    assert re.search(r"Thread 0x[0-9a-f]+ .*\n(\s+File .*\n)+", server.log_tail(1_000_000)), server.log_tail(200)
    r = httpx.post(server.base_url + "/completions", headers=AUTH, json={"prompt": "x", "max_tokens": 2})
    assert r.status_code == 503 and r.json()["error"]["code"] == "backend_unavailable"

    deadline = time.monotonic() + 180
    while health(server) != 200:
        assert time.monotonic() < deadline, server.log_tail()
        time.sleep(0.5)
    r = httpx.post(server.base_url + "/completions", headers=AUTH, json={"prompt": "back", "max_tokens": 3})
    assert r.status_code == 200 and r.json()["choices"][0]["routed_experts"]
    assert not stub.is_running()
    assert old_regions
    for region in old_regions:  # the dead server's shared memory is gone (region names are unique per stub)
        assert not region.exists()
    metrics = httpx.get(server.root_url + "/metrics").text
    assert "moe_serve_backend_restarts_total 1.0" in metrics, server.log_tail(200)  # this kill's restart, no other
    # The server ends the requests still in flight when the watchdog sees the death, counted as aborted; a request
    # whose Triton stream reported the dead stub first ended by itself (with the same 503 checked above). Which path
    # each took is a race, so the count is checked against the server's own log line for that abort.
    ended = sum(int(n) for n in re.findall(r"ended (\d+) in-flight request\(s\): backend_failure",
                                           server.log_tail(1_000_000)))
    counted = re.search(r'moe_serve_aborted_requests_total\{reason="backend_failure"\} ([0-9.]+)', metrics)
    assert (float(counted.group(1)) if counted else 0.0) == ended <= 2, server.log_tail(200)
    assert 'moe_engine_requests{model="moe",state="running",version="1"}' in metrics  # engine gauges, API port


def test_sigterm_ends_a_long_stream_with_an_error_event_then_done(server):
    processes = [p for ps in tree(server).values() for p in ps]
    prefix = shm_prefix(server)
    run_dir = Path(next(a for a in triton_cmdline(server) if a.startswith("--model-repository=")).split("=")[1]).parent
    out: dict = {}
    streaming = long_stream(server, out, "stream", n=3)
    time.sleep(1.5)
    term_at = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    streaming.join(60)
    status, lines, ended = out["stream"]
    assert status == 200
    assert 1.5 < ended - term_at < 2 + 5.5  # it ran on for --shutdown-timeout 2, then was ended
    assert lines[-1] == "data: [DONE]"
    error = json.loads(lines[-2][len("data: "):])["error"]
    assert error["code"] == "shutting_down" and error["type"] == "server_error"
    assert server.proc.wait(60) == 0
    # One fatal-error report: the crash injected above; the stop of the restarted stub adds none.
    assert server.log_tail(1_000_000).count("Fatal Python error") == 1, server.log_tail(200)
    time.sleep(0.5)
    assert not [p for p in processes if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not list(Path("/dev/shm").glob(prefix + "*"))
    assert not run_dir.exists()
