"""The request guard on the real app over the fake engine: deadlines, backend failure, draining, body limit,
rejection counting. Every ended request must end properly: a JSON error, or an SSE error event then [DONE]."""
from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from openai_frontend.triton_client import BackendError
from tests.unit.conftest import SCRIPT_TEXT, ServerThread, make_model_info
from tests.unit.fake_engine import FakeEngine


@pytest.fixture
def guarded(fe_checkpoint_dir, fe_tokenizer):
    """An app whose engine takes 20 ms per token, with a 1.5 s request deadline and a 4 KiB body limit."""
    from openai_frontend.app import create_app
    from openai_frontend.config import FrontendConfig

    engine = FakeEngine(info=make_model_info(max_model_len=4096), step_delay=0.02,
                        script=fe_tokenizer.encode(SCRIPT_TEXT, add_special_tokens=False))
    cfg = FrontendConfig(triton_grpc_url="unused:0", served_model_name="m", checkpoint_dir=fe_checkpoint_dir,
                         max_pending_requests=8, request_timeout_s=1.5, max_request_bytes=4096)
    app = create_app(cfg, engine=engine)
    with ServerThread(app) as srv:
        srv.engine = engine
        srv.state = app.state.server_state
        yield srv


def metric(srv, name: str) -> float:
    for line in httpx.get(srv.root_url + "/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return 0.0


def start_requests(srv, out: dict) -> list[threading.Thread]:
    """One streamed and one non-streamed completion that would run for 10 s; returns once both run and
    the stream has sent its first event."""
    body = {"prompt": "Hi", "max_tokens": 500, "ignore_eos": True}
    streaming = threading.Event()

    def streamed():
        with httpx.stream("POST", srv.base_url + "/completions", json={**body, "stream": True}, timeout=30) as r:
            lines = []
            for line in r.iter_lines():
                streaming.set()
                if line:
                    lines.append(line)
            out["stream"] = (r.status_code, lines, time.monotonic())

    def plain():
        r = httpx.post(srv.base_url + "/completions", json=body, timeout=30)
        out["plain"] = (r.status_code, r.json(), time.monotonic())

    threads = [threading.Thread(target=streamed), threading.Thread(target=plain)]
    for t in threads:
        t.start()
    assert streaming.wait(10) and wait_for(lambda: len(srv.engine.requests) >= 2)
    return threads


def assert_ended(out: dict, status: int, code: str, t0: float, within: float) -> None:
    s, body, ended = out["plain"]
    assert s == status and body["error"]["code"] == code and ended - t0 < within
    s, lines, ended = out["stream"]
    assert s == 200 and ended - t0 < within
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[-2][len("data: "):])["error"]["code"] == code


def wait_for(cond, timeout=5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return False


def test_requests_past_the_deadline_end_with_504_and_free_the_engine(guarded):
    out: dict = {}
    t0 = time.monotonic()
    for t in start_requests(guarded, out):
        t.join(20)
    assert_ended(out, 504, "request_timeout", t0, within=4)
    assert out["plain"][2] - t0 > 1.4  # not before the deadline
    assert wait_for(lambda: len(guarded.engine.cancelled) == 2)  # both engine requests were cancelled
    assert 'moe_serve_aborted_requests_total{reason="timeout"} 2.0' in httpx.get(guarded.root_url + "/metrics").text
    r = httpx.post(guarded.base_url + "/completions", json={"prompt": "Hi", "max_tokens": 3})
    assert r.status_code == 200  # short requests are unaffected, the slots came back


def test_backend_failure_ends_in_flight_requests_and_health_follows(guarded):
    out: dict = {}
    threads = start_requests(guarded, out)
    t0 = time.monotonic()
    guarded.state.backend_down("stub exited (test)")  # what the watchdog calls, from its thread
    for t in threads:
        t.join(20)
    assert_ended(out, 503, "backend_unavailable", t0, within=1.0)
    r = httpx.get(guarded.root_url + "/health")
    assert r.status_code == 503 and r.json()["error"]["code"] == "backend_unavailable" and r.headers["retry-after"]
    rejected = metric(guarded, "moe_serve_rejected_requests_total")
    r = httpx.post(guarded.base_url + "/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 503 and r.json()["error"]["code"] == "backend_unavailable"
    assert metric(guarded, "moe_serve_rejected_requests_total") == rejected + 1
    guarded.state.backend_up()
    assert httpx.get(guarded.root_url + "/health").status_code == 200
    assert httpx.post(guarded.base_url + "/completions", json={"prompt": "Hi", "max_tokens": 2}).status_code == 200


def test_draining_ends_what_is_left_after_the_grace_period(guarded):
    out: dict = {}
    threads = start_requests(guarded, out)
    t0 = time.monotonic()
    guarded.state.begin_shutdown(0.5)  # what SIGTERM does (moe-serve also closes the listening socket)
    r = httpx.post(guarded.base_url + "/completions", json={"prompt": "Hi", "max_tokens": 2})
    assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down"
    assert r.headers["connection"] == "close"
    for t in threads:
        t.join(20)
    assert_ended(out, 503, "shutting_down", t0, within=1.4)
    assert out["plain"][2] - t0 > 0.45  # they had their grace period
    assert httpx.get(guarded.root_url + "/health").json()["error"]["code"] == "shutting_down"


def test_body_limit_is_413_with_or_without_content_length(guarded):
    body = json.dumps({"prompt": "x" * 5000, "max_tokens": 1}).encode()
    r = httpx.post(guarded.base_url + "/completions", content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    r = httpx.post(guarded.base_url + "/completions", content=iter([body[:3000], body[3000:]]),
                   headers={"Content-Type": "application/json"})
    assert r.status_code == 413
    assert len(guarded.engine.requests) == 0


def test_engine_queue_rejections_are_503_overloaded_and_counted_once(guarded):
    before = metric(guarded, "moe_serve_rejected_requests_total")
    guarded.engine.fail_with = BackendError(BackendError.UNAVAILABLE, "the engine's waiting queue is full",
                                           code="overloaded")
    try:
        for stream in (False, True):
            r = httpx.post(guarded.base_url + "/completions", json={"prompt": "x", "max_tokens": 1, "stream": stream})
            assert r.status_code == 503 and r.json()["error"]["code"] == "overloaded"
        guarded.engine.fail_with = BackendError(BackendError.UNAVAILABLE, "Stub process is not healthy.",
                                               code="backend_unavailable")
        r = httpx.post(guarded.base_url + "/completions", json={"prompt": "x", "max_tokens": 1})
        assert r.status_code == 503 and r.json()["error"]["code"] == "backend_unavailable"
    finally:
        guarded.engine.fail_with = None
    assert metric(guarded, "moe_serve_rejected_requests_total") == before + 3
