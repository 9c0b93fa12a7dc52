"""The watchdog's progress check (openai_frontend/watchdog.py) on Triton's metrics text: a stall is seen per
engine, so one stuck data-parallel replica is caught while the others keep stepping.

The metrics are served over a loopback HTTP server in the format Triton's /metrics writes for the moe backend's
custom gauges (labels model, version and, with more than one instance, instance)."""
from __future__ import annotations

import http.server
import threading

import pytest

from openai_frontend.watchdog import BackendWatchdog, read_engine_gauges


def metrics_text(instances: dict[str, tuple[int, int, int]]) -> str:
    """{instance: (running, waiting, steps)} -> Triton's exposition lines ('' = the single-instance labels)."""
    lines = []
    for name, (running, waiting, steps) in instances.items():
        labels = 'model="moe",version="1"' + (f',instance="{name}"' if name else "")
        lines += [
            f'moe_engine_requests{{{labels},state="running"}} {running}',
            f'moe_engine_requests{{{labels},state="waiting"}} {waiting}',
            f"moe_engine_steps{{{labels}}} {steps}",
            f"moe_engine_alive{{{labels}}} 1",
        ]
    return "\n".join(["# HELP moe_engine_steps Engine steps run since the model was loaded",
                      "# TYPE moe_engine_steps gauge", *lines]) + "\n"


@pytest.fixture
def metrics_server():
    state = {"text": ""}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            body = state["text"].encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield state, f"http://127.0.0.1:{server.server_address[1]}/metrics"
    server.shutdown()


def watchdog(stall_s: float) -> BackendWatchdog:
    return BackendWatchdog(None, on_down=lambda r: None, on_up=lambda: None, on_give_up=lambda r: None,
                           stall_timeout_s=stall_s)


def test_one_stuck_replica_is_caught_while_the_other_steps(metrics_server):
    state, url = metrics_server
    dog = watchdog(stall_s=10)
    t = 1000.0
    for i in range(30):  # 15 s: replica 0 steps every probe, replica 1 holds 3 requests and never steps
        state["text"] = metrics_text({"moe_0_0": (2, 0, 100 + i), "moe_0_1": (3, 0, 50)})
        g = read_engine_gauges(url)
        assert g.steps == 150 + i and g.running == 5  # the totals still add up
        reason = dog._check_progress(g, t + 0.5 * i)
        if reason:
            break
    assert reason is not None and "'moe_0_1'" in reason and "3 request(s)" in reason
    assert 10 < 0.5 * i <= 11


def test_idle_or_stepping_engines_are_never_a_stall(metrics_server):
    state, url = metrics_server
    dog = watchdog(stall_s=1)
    for i in range(20):  # a busy engine that steps, and one with no requests (not stepping is fine then)
        state["text"] = metrics_text({"moe_0_0": (1, 4, 7 + i), "moe_0_1": (0, 0, 3)})
        assert dog._check_progress(read_engine_gauges(url), 100.0 + i) is None
    state["text"] = metrics_text({"": (1, 0, 5)})  # one instance: no instance label
    dog = watchdog(stall_s=1)
    assert dog._check_progress(read_engine_gauges(url), 0.0) is None
    reason = dog._check_progress(read_engine_gauges(url), 1.5)
    assert reason is not None and reason.startswith("the engine made no step") and "instance" not in reason
