"""Backend watchdog: notice a dead, stopped, unready or stuck Triton model, then restart it or give up.

A thread probes every ``interval_s`` (0.5 s):

- tritonserver exited;
- a python backend stub (``triton_python_backend_stub``, a child of tritonserver) is gone or a zombie;
- tritonserver or a stub is stopped (``kill -STOP``, state T) for more than 1 s;
- the model is not ready over gRPC three times in a row (probed once a second);
- the engine gauges on Triton's metrics port say the engine thread died (``moe_engine_alive`` 0) or made
  no step for ``stall_timeout_s`` while it holds requests (``moe_engine_steps`` flat with running+waiting > 0).
  An engine that makes no step on purpose is not stuck, however long: generation paused (``moe_engine_paused``),
  memory released (``moe_engine_sleeping``), or a control operation running on the engine thread, such as a long
  weight update (``moe_engine_control_ops`` > 0). The stall clock starts again when the engine may step again, so
  a trainer's pause of any length keeps the queued requests queued.

On a failure it calls ``on_down(reason)`` at once (the API ends every in-flight request with a 503 and
``/health`` turns 503), then either restarts tritonserver (which loads the model again) and calls
``on_up()``, or, after ``max_restarts`` restarts without ten healthy minutes in between, or while moe-serve
is shutting down, or when the restarted server exits while starting three times in a row, calls
``on_give_up(reason)`` (moe-serve exits non-zero for a supervisor).
"""
from __future__ import annotations

import logging
import re
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field

from .procfs import descendants, process_state
from .triton_server import TritonError, TritonServer

log = logging.getLogger("moe_serve")

STUB_NAME = "triton_python_backend_stub"
STOPPED_GRACE_S = 1.0  # a debugger or py-spy stops a process for milliseconds; a SIGSTOP lasts
READY_PROBE_EVERY_S = 1.0
READY_FAILURES = 3
HEALTHY_RESETS_RESTARTS_S = 600.0
START_ATTEMPTS = 3  # per restart: tritonserver exiting while it starts is tried again (after 1 s, then 2 s)
START_RETRY_S = 1.0


# --------------------------------------------------------------------------- engine gauges


@dataclass
class InstanceGauges:
    """One model instance's engine (one per --data-parallel-size replica)."""

    running: float = 0.0
    waiting: float = 0.0
    steps: float | None = None
    held: bool = False  # paused, sleeping or running a control operation: no steps on purpose


# Gauges that say the engine makes no steps on purpose (backends/moe/engine_metrics.py).
_HOLD_GAUGES = frozenset({"moe_engine_paused", "moe_engine_sleeping", "moe_engine_control_ops"})


@dataclass
class EngineGauges:
    """The moe backend's gauges as Triton's metrics endpoint shows them (None = not exported): totals over the
    model instances, and each instance's own (a stall is per engine: one stuck replica among busy ones must
    still be seen)."""

    running: float | None = None
    waiting: float | None = None
    steps: float | None = None
    alive: float | None = None
    instances: dict[str, InstanceGauges] = field(default_factory=dict)


_GAUGE_LINE = re.compile(r"^(moe_engine_\w+)\{([^}]*)\} (\S+)$", re.M)


def read_engine_gauges(metrics_url: str, timeout_s: float = 2.0) -> EngineGauges | None:
    try:
        with urllib.request.urlopen(metrics_url, timeout=timeout_s) as r:
            text = r.read().decode("utf-8", "replace")
    except OSError:
        return None
    g = EngineGauges()
    # One series per model instance (--data-parallel-size): requests and steps add up, alive is the least.
    for name, labels, value in _GAUGE_LINE.findall(text):
        label = re.search(r'instance="([^"]*)"', labels)
        inst = g.instances.setdefault(label.group(1) if label else "", InstanceGauges())
        if name == "moe_engine_requests":
            state = re.search(r'state="(\w+)"', labels)
            if state and state.group(1) in ("running", "waiting"):
                setattr(g, state.group(1), (getattr(g, state.group(1)) or 0) + float(value))
                setattr(inst, state.group(1), getattr(inst, state.group(1)) + float(value))
        elif name == "moe_engine_steps":
            g.steps = (g.steps or 0) + float(value)
            inst.steps = (inst.steps or 0) + float(value)
        elif name == "moe_engine_alive":
            g.alive = float(value) if g.alive is None else min(g.alive, float(value))
        elif name in _HOLD_GAUGES and float(value) > 0:
            inst.held = True
    return g


# --------------------------------------------------------------------------- the watchdog


@dataclass
class _ProbeState:
    stubs: dict[int, str] = field(default_factory=dict)
    stopped_since: dict[int, float] = field(default_factory=dict)
    ready_failures: int = 0
    next_ready_probe: float = 0.0
    armed_at: float = 0.0
    last_steps: dict[str, float] = field(default_factory=dict)  # per model instance
    steps_changed_at: dict[str, float] = field(default_factory=dict)


class BackendWatchdog(threading.Thread):
    def __init__(
        self,
        triton: TritonServer,
        *,
        on_down: Callable[[str], None],
        on_up: Callable[[], None],
        on_give_up: Callable[[str], None],
        max_restarts: int = 3,
        stall_timeout_s: float = 10.0,
        interval_s: float = 0.5,
        load_timeout_s: float = 3600.0,
    ) -> None:
        super().__init__(name="backend-watchdog", daemon=True)
        self.triton = triton
        self.on_down, self.on_up, self.on_give_up = on_down, on_up, on_give_up
        self.max_restarts = max_restarts
        self.stall_timeout_s = stall_timeout_s
        self.interval_s = interval_s
        self.load_timeout_s = load_timeout_s
        self.restarts = 0
        self.restart_times: list[float] = []
        self.shutting_down = threading.Event()  # set on SIGTERM: fail, never restart
        self._finished = threading.Event()  # set when moe-serve no longer needs Triton
        self._probe = _ProbeState()
        self._client = None

    def finish(self) -> None:
        """moe-serve no longer needs Triton: stop watching (a tritonserver this thread restarted gets
        SIGTERM when the thread ends, which the caller's own stop then completes)."""
        self._finished.set()

    # -- probes ------------------------------------------------------------

    def arm(self) -> None:
        """Record the stubs of a freshly READY tritonserver."""
        pid = self.triton.proc.pid
        stubs = {p: n for p, n in descendants(pid).items() if n.startswith(STUB_NAME[:15])}  # comm: 15 chars
        now = time.monotonic()
        self._probe = _ProbeState(stubs=stubs, armed_at=now, next_ready_probe=now + READY_PROBE_EVERY_S)
        if not stubs:
            log.warning("watchdog: no python backend stub found under tritonserver (pid %d)", pid)
        log.info("watchdog: watching tritonserver (pid %d) and stub(s) %s", pid, sorted(stubs))

    def check(self) -> str | None:
        """One probe round; the reason for a failure, or None."""
        t = self.triton
        if not t.alive():
            return f"tritonserver exited (code {t.proc.returncode})"
        now = time.monotonic()
        st = self._probe
        watched = {t.proc.pid: "tritonserver", **{p: "the python backend stub" for p in st.stubs}}
        stopped = False
        for pid, what in watched.items():
            state = process_state(pid)
            if state is None or state in "ZX":
                return f"{what} (pid {pid}) exited"
            if state in "Tt":
                stopped = True
                since = st.stopped_since.setdefault(pid, now)
                if now - since > STOPPED_GRACE_S:
                    return f"{what} (pid {pid}) is stopped (SIGSTOP or a debugger)"
            else:
                st.stopped_since.pop(pid, None)
        if now >= st.next_ready_probe and not stopped:  # a stopped server would only make the probes time out
            st.next_ready_probe = now + READY_PROBE_EVERY_S
            if self._client is None:
                self._client = t.client()
            if t.is_ready(self._client, timeout_s=1.0):
                st.ready_failures = 0
            else:
                st.ready_failures += 1
                if st.ready_failures >= READY_FAILURES:
                    return f"model {t.model_name!r} is not ready"
            g = read_engine_gauges(t.metrics_url, timeout_s=1.0)
            if g is not None:
                reason = self._check_progress(g, now)
                if reason:
                    return reason
        return None

    def _check_progress(self, g: EngineGauges, now: float) -> str | None:
        st = self._probe
        if g.alive is not None and g.alive < 1:
            return "the engine thread died"
        if g.steps is None:
            return None  # a backend without the progress gauge: no stall detection
        for name, inst in g.instances.items():  # each engine on its own: one stuck replica among busy ones
            if inst.steps is None:
                continue
            busy = inst.running + inst.waiting
            if inst.steps != st.last_steps.get(name) or busy == 0 or inst.held:
                st.last_steps[name] = inst.steps
                st.steps_changed_at[name] = now
                continue
            idle_for = now - st.steps_changed_at.get(name, st.armed_at)
            if idle_for > self.stall_timeout_s:
                which = f" of model instance {name!r}" if len(g.instances) > 1 else ""
                return f"the engine{which} made no step for {idle_for:.0f} s with {busy:.0f} request(s)"
        return None

    # -- the loop ------------------------------------------------------------

    def run(self) -> None:
        try:
            while not self._finished.wait(self.interval_s):
                reason = self.check()
                if reason is not None and not self._finished.is_set():
                    if not self._handle(reason):
                        return
        finally:
            if self._client is not None:
                self._client.close()

    def _handle(self, reason: str) -> bool:
        """Returns whether watching goes on (restarted) or not (gave up)."""
        log.error("backend failure: %s", reason)
        self.on_down(reason)
        now = time.monotonic()
        self.restart_times = [t for t in self.restart_times if now - t < HEALTHY_RESETS_RESTARTS_S]
        if self.shutting_down.is_set() or len(self.restart_times) >= self.max_restarts:
            why = "shutting down" if self.shutting_down.is_set() else f"{len(self.restart_times)} restart(s) already"
            log.error("not restarting the backend (%s)", why)
            self.triton.kill()
            self.on_give_up(reason)
            return False
        self.restart_times.append(now)
        self.restarts += 1
        log.warning("restarting tritonserver (restart %d of at most %d per %.0f min)", len(self.restart_times),
                    self.max_restarts, HEALTHY_RESETS_RESTARTS_S / 60)
        if self._client is not None:
            self._client.close()
            self._client = None
        for attempt in range(1, START_ATTEMPTS + 1):
            try:
                self.triton.kill()
                self.triton.start()  # a child of this thread, which lives until moe-serve stops Triton
                self.triton.wait_ready(self.load_timeout_s)
                break
            except TritonError as exc:
                if self._finished.is_set():
                    return False  # moe-serve is stopping Triton itself
                # A server that exited while starting may have met something passing (a port or memory the killed
                # one still held): try again. One that loaded for load_timeout_s without getting ready: give up.
                if attempt < START_ATTEMPTS and not self.triton.alive():
                    log.warning("restarted tritonserver failed (attempt %d of %d): %s; trying again in %.0f s",
                                attempt, START_ATTEMPTS, exc, attempt * START_RETRY_S)
                    if self._finished.wait(attempt * START_RETRY_S):
                        return False
                    continue
                log.error("restarting tritonserver failed: %s", exc)
                self.triton.kill()
                self.on_give_up(f"{reason}; restart failed: {exc}")
                return False
        self.arm()
        log.info("backend restarted; serving again")
        self.on_up()
        return True
