"""The watchdog's progress check (openai_frontend/watchdog.py) on Triton's metrics text: a stall is seen per
engine, so one stuck data-parallel replica is caught while the others keep stepping. Its restart: a restarted
tritonserver that exits while starting is tried again (three attempts), one that is not ready in time is not; and
killing Triton leaves no process of its group behind before the next one starts.

The metrics are served over a loopback HTTP server in the format Triton's /metrics writes for the moe backend's
custom gauges (labels model, version and, with more than one instance, instance)."""
from __future__ import annotations

import http.server
import os
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest

from openai_frontend import procfs, watchdog as watchdog_module
from openai_frontend.triton_server import TritonError
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


class ScriptedTriton:
    """Stands in for the tritonserver process only: each start either comes up, exits while loading, or loads
    for ever (``outcomes``: 'ready', 'exits', 'hangs'). The watchdog's restart policy is what runs for real."""

    model_name = "moe"

    def __init__(self, outcomes: list[str]) -> None:
        self.outcomes = outcomes
        self.starts = 0
        self.kills = 0
        self.running = False

    def kill(self) -> None:
        self.kills += 1
        self.running = False

    def start(self) -> None:
        self.starts += 1
        self.running = True

    def alive(self) -> bool:
        return self.running

    def wait_ready(self, timeout: float) -> None:
        outcome = self.outcomes[self.starts - 1]
        if outcome == "exits":
            self.running = False
            raise TritonError("tritonserver exited with code 1 while loading model 'moe'")
        if outcome == "hangs":
            raise TritonError(f"model 'moe' was not ready within {timeout:.0f} s")


def restart_with(outcomes: list[str], monkeypatch) -> tuple[bool, ScriptedTriton, list]:
    monkeypatch.setattr(watchdog_module, "START_RETRY_S", 0.01)
    events = []
    triton = ScriptedTriton(outcomes)
    dog = BackendWatchdog(triton, on_down=lambda r: events.append(("down", r)), on_up=lambda: events.append("up"),
                          on_give_up=lambda r: events.append(("give_up", r)), max_restarts=3, load_timeout_s=5)
    dog.arm = lambda: None  # arm() scans the real tritonserver's stubs
    return dog._handle("the python backend stub (pid 1) exited"), triton, events


def test_a_restart_that_exits_while_starting_is_tried_again(monkeypatch):
    watching, triton, events = restart_with(["exits", "exits", "ready"], monkeypatch)
    assert watching and triton.starts == 3 and events[-1] == "up"
    assert dog_gave_up(events) is None


def test_a_restart_gives_up_after_three_exits_or_one_load_timeout(monkeypatch):
    watching, triton, events = restart_with(["exits", "exits", "exits", "ready"], monkeypatch)
    assert not watching and triton.starts == 3 and "restart failed" in dog_gave_up(events)
    watching, triton, events = restart_with(["hangs", "ready"], monkeypatch)  # a load timeout is not retried
    assert not watching and triton.starts == 1 and "not ready within 5 s" in dog_gave_up(events)
    assert not triton.running  # the server that hung was killed


def dog_gave_up(events: list) -> str | None:
    return next((e[1] for e in events if isinstance(e, tuple) and e[0] == "give_up"), None)


def test_killing_a_process_group_waits_until_none_of_it_is_left():
    # A leader with a child in its own session, as tritonserver and its python stubs.
    code = "import subprocess, time; subprocess.Popen(['sleep', '60']); time.sleep(60)"
    leader = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    deadline = time.monotonic() + 10
    while len(procfs.group_members(leader.pid)) < 2:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    child = next(p for p in procfs.group_members(leader.pid) if p != leader.pid)
    os.killpg(leader.pid, signal.SIGKILL)
    leader.wait()
    assert procfs.wait_group_gone(leader.pid, timeout=10) == []
    assert not psutil.pid_exists(child) or psutil.Process(child).status() == psutil.STATUS_ZOMBIE


@pytest.mark.parametrize("gauge", ["moe_engine_paused", "moe_engine_sleeping", "moe_engine_control_ops"])
def test_a_paused_sleeping_or_updating_engine_is_never_a_stall_and_its_clock_restarts_after(metrics_server, gauge):
    """Issue 47: a trainer's pause (in place), a memory release or a long weight update holds queued requests for
    longer than the stall timeout; none of it is a stall, and the timeout counts again from when it ends."""
    state, url = metrics_server
    dog = watchdog(stall_s=10)
    held = metrics_text({"": (1, 3, 42)}) + f'{gauge}{{model="moe",version="1"}} 1\n'
    for i in range(120):  # 60 s held with 4 requests and no step
        state["text"] = held
        assert dog._check_progress(read_engine_gauges(url), 100.0 + 0.5 * i) is None
    state["text"] = metrics_text({"": (1, 3, 42)}) + f'{gauge}{{model="moe",version="1"}} 0\n'  # let go, still no step
    assert dog._check_progress(read_engine_gauges(url), 169.0) is None  # 9.5 s after the last held probe
    reason = dog._check_progress(read_engine_gauges(url), 170.0)
    assert reason is not None and "made no step for 10 s with 4 request(s)" in reason
