"""`moe-serve` as a process: bad --model or keys, clean stop on SIGTERM, exit when tritonserver dies and no
restart is allowed."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil

from .conftest import start_moe_serve, stop_moe_serve

MOE_SERVE = str(Path(sys.executable).parent / "moe-serve")


def run_cli(*args, timeout=60):
    return subprocess.run([MOE_SERVE, *args], capture_output=True, text=True, timeout=timeout)


def test_missing_model_dir_is_a_one_line_error(tmp_path):
    r = run_cli("--model", str(tmp_path / "nope"))
    assert r.returncode != 0
    lines = [line for line in r.stderr.splitlines() if "error" in line]
    assert len(lines) == 1 and "nope" in lines[0] and "no such directory" in lines[0]


def test_non_moe_checkpoint_is_a_one_line_error(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "vocab_size": 100})
    )
    r = run_cli("--model", str(tmp_path))
    assert r.returncode != 0
    errors = [line for line in r.stderr.splitlines() if "error" in line]
    assert len(errors) == 1 and "llama" in errors[0]
    assert "Traceback" not in r.stderr


def test_config_without_config_json_is_a_one_line_error(tmp_path):
    r = run_cli("--model", str(tmp_path))
    assert r.returncode != 0 and "config.json" in r.stderr and "Traceback" not in r.stderr


def _descendants(pid: int) -> list[psutil.Process]:
    return psutil.Process(pid).children(recursive=True)


def test_sigterm_stops_everything_and_triton_death_is_reported(tmp_path):
    server = start_moe_serve(tmp_path, ["--max-num-seqs", "2"])
    children = _descendants(server.proc.pid)
    names = {p.name() for p in children}
    assert "tritonserver" in names and "triton_python_backend_stub" in names
    assert stop_moe_serve(server) == 0
    time.sleep(0.5)
    assert not [p for p in children if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]

    server = start_moe_serve(tmp_path, ["--max-num-seqs", "2", "--max-backend-restarts", "0"])
    triton = next(p for p in _descendants(server.proc.pid) if p.name() == "tritonserver")
    stubs = [p for p in triton.children(recursive=True)]
    prefix = next(a for a in triton.cmdline() if "shm-region-prefix-name=" in a).split("=")[-1]
    assert list(Path("/dev/shm").glob(prefix + "*"))
    answer = {}

    def in_flight():
        r = httpx.post(server.base_url + "/completions", headers={"Authorization": f"Bearer {server.api_key}"},
                       json={"prompt": "x", "max_tokens": 1000, "ignore_eos": True}, timeout=60)
        answer["r"] = r

    t = threading.Thread(target=in_flight)
    t.start()
    time.sleep(1.0)
    triton.send_signal(signal.SIGKILL)
    t.join(30)
    assert answer["r"].status_code == 503 and answer["r"].json()["error"]["code"] == "backend_unavailable"
    code = server.proc.wait(60)
    assert code == 1
    log = server.log_path.read_text()
    assert "tritonserver exited" in log and "exits (status 1)" in log
    time.sleep(1.0)
    assert not [p for p in stubs if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not list(Path("/dev/shm").glob(prefix + "*"))  # the killed server's shared memory was removed


def test_exposing_triton_needs_a_key_and_key_files_are_checked(tmp_path):
    r = run_cli("--triton-host", "0.0.0.0")
    assert r.returncode == 2 and "--triton-api-key" in r.stderr and "Traceback" not in r.stderr
    empty = tmp_path / "key"
    empty.write_text("\n")
    r = run_cli("--api-key-file", str(empty))
    assert r.returncode == 2 and "is empty" in r.stderr
    r = run_cli("--api-key", "a", "--api-key-file", str(empty))
    assert r.returncode == 2 and "not both" in r.stderr
