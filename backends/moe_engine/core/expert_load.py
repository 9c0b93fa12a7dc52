"""Expert load: tokens per (MoE layer, expert), counted on the device inside every step, and what is read from it
(a sliding window, a per-interval timeline, SGLang's expert-distribution recorder).

Counting (``ExpertLoad.count``, the runner calls it after a step's forward): the step's capture buffer already holds
the ids every MoE layer used (experts.py writes them, forced ids of a replay included), so two launches add them to a
device tensor ``counts`` [moe layers * experts] int64: one ``add`` turns the ids of the MoE layers' columns into flat
(layer, expert) indices (int32, in a preallocated buffer), one ``index_add_`` of a broadcast one counts them. No host
sync, no allocation (a model whose MoE layers are not contiguous gathers their columns first: one more launch). Only the step's first T
rows are read (CUDA-graph padding rows are never counted). Dense layers have no column here.

What is counted is what the experts computed: every token forwarded, once per step it is forwarded in. A prompt
token served from the prefix cache is not forwarded and not counted (its routing was counted when it was computed);
a token recomputed after a preemption is counted again; a replayed token counts its forced ids; with overlapped
steps, the one row a finished sequence forwards in vain is counted (its experts ran).

To the host: the cumulative counts travel with a step's transfer (a second non-blocking copy into pinned memory,
before the step's event) at most once per ``interval`` seconds, every step while the recorder records, and once when
the engine goes idle (``flush``: a synchronous read, the device has nothing queued then). On CPU every step (a copy
of Lm x E integers). The host keeps ``ticks``: the cumulative counts, tokens and engine gauges at most every
``interval`` seconds over the window; the window's counts are the newest counts minus those of the tick at
``now - window``, and consecutive ticks give the timeline (per-layer imbalance, throughput, KV use, prefix hits).

Reads (``summary``, ``gauges``, the recorder's dump) come from other threads under a lock; the engine thread writes.
"""
from __future__ import annotations

import collections
import math
import threading
import time
from dataclasses import dataclass, field

import numpy as np
import torch

RECORDER_MODES = ("stat", "per_pass")  # SGLang's --expert-distribution-recorder-mode values that apply here
MAX_TICKS = 120  # the window is kept in at most this many ticks (interval = window / MAX_TICKS, at least 1 s)


def layer_stats(counts: np.ndarray) -> dict[str, list[float]]:
    """Per layer (rows of ``counts`` [layers, experts]): ``imbalance`` max / mean tokens per expert (1 = balanced,
    at most experts / top_k), ``entropy`` of the routing distribution divided by log(experts) (1 = uniform), and
    ``top10_share``: the share of selections on the busiest 10% of the experts (at least one). A layer that saw no
    tokens gets 0 for each."""
    counts = np.asarray(counts, dtype=np.float64)
    L, E = counts.shape
    n = counts.sum(axis=1)
    safe = np.where(n > 0, n, 1.0)
    p = counts / safe[:, None]
    imbalance = np.where(n > 0, counts.max(axis=1, initial=0) * E / safe, 0.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        plogp = np.where(p > 0, p * np.log(p), 0.0)
    entropy = np.where(n > 0, -plogp.sum(axis=1) / math.log(E), 0.0) if E > 1 else np.zeros(L)
    top = max(1, math.ceil(E / 10))
    share = np.sort(p, axis=1)[:, E - top:].sum(axis=1) if L else np.zeros(0)
    return {"imbalance": imbalance.round(4).tolist(), "entropy": entropy.round(4).tolist(),
            "top10_share": np.where(n > 0, share, 0.0).round(4).tolist()}


@dataclass
class Snapshot:
    """The cumulative counts at one step, on their way to the host (CUDA: a pinned buffer filled by the step's
    stream; read after the step's transfer event)."""

    host: object  # torch pinned tensor (CUDA) or numpy array (CPU) [Lm * E]
    step: int
    tokens: int  # tokens forwarded up to and including that step
    sampled: int


@dataclass
class Tick:
    mono: float
    wall: float
    counts: np.ndarray  # cumulative [Lm, E] int64
    tokens: int
    sampled: int
    gauges: dict = field(default_factory=dict)  # the engine's KV use, prefix-cache counters, requests


class Recorder:
    """SGLang's expert-distribution recorder (start / stop / dump) over the per-step counts. ``stat``: the counts
    summed over the recorded steps (the last ``buffer_size`` of them; -1: all); ``per_pass``: one record per step
    (the last ``buffer_size``; -1: all). A dump returns what was recorded and clears it (recording goes on if on)."""

    def __init__(self, mode: str, buffer_size: int, shape: tuple[int, int]):
        if mode not in RECORDER_MODES:
            raise ValueError(f"expert distribution recorder mode must be one of {RECORDER_MODES}, got {mode!r}")
        self.mode, self.buffer_size, self.shape = mode, buffer_size, shape
        self.recording = False
        self._reset()

    def _reset(self) -> None:
        maxlen = None if self.buffer_size < 0 else self.buffer_size
        self.steps: collections.deque = collections.deque(maxlen=maxlen)  # (step, tokens, counts [Lm, E] int32)
        self.sum = np.zeros(self.shape, dtype=np.int64)  # stat with buffer_size -1: no per-step copies kept
        self.sum_steps = self.sum_tokens = 0
        self.started = self.stopped = None

    def start(self) -> None:
        self._reset()
        self.recording = True
        self.started = time.time()

    def stop(self) -> None:
        self.recording = False
        self.stopped = time.time()

    def add(self, step: int, tokens: int, counts: np.ndarray) -> None:
        if self.mode == "stat" and self.buffer_size < 0:
            self.sum += counts
            self.sum_steps += 1
            self.sum_tokens += tokens
        else:
            self.steps.append((step, tokens, counts.astype(np.int32)))

    def dump(self) -> dict:
        """The record (arrays as numpy) and clear it."""
        out = {"mode": self.mode, "buffer_size": self.buffer_size, "recording": self.recording,
               "start_time": self.started, "end_time": self.stopped if not self.recording else time.time()}
        steps = list(self.steps)
        if self.mode == "stat":
            total = self.sum.copy()
            for _, _, c in steps:
                total += c
            out.update(dims=["layer", "expert"], logical_count=total, num_steps=self.sum_steps + len(steps),
                       num_tokens=self.sum_tokens + sum(t for _, t, _ in steps))
        else:
            arr = (np.stack([c for _, _, c in steps]) if steps
                   else np.zeros((0, *self.shape), dtype=np.int32))
            out.update(dims=["step", "layer", "expert"], logical_count=arr, num_steps=len(steps),
                       steps=[s for s, _, _ in steps], step_tokens=[t for _, t, _ in steps],
                       num_tokens=sum(t for _, t, _ in steps))
        recording, started = self.recording, self.started
        self._reset()
        self.recording, self.started = recording, (time.time() if recording else started)
        return out


class ExpertLoad:
    """The device counter of one engine and its host side (module docstring)."""

    def __init__(self, moe_layers, num_experts: int, top_k: int, step_tokens: int, device: torch.device,
                 window_s: float = 60.0, recorder_mode: str = "stat", recorder_buffer_size: int = 1000):
        self.layers = tuple(int(i) for i in moe_layers)
        Lm, E, K = len(self.layers), num_experts, top_k
        self.num_experts, self.top_k = E, K
        self.device = torch.device(device)
        self.counts = torch.zeros(Lm * E, dtype=torch.int64, device=self.device)
        lo, hi = self.layers[0], self.layers[-1] + 1
        contiguous = self.layers == tuple(range(lo, hi))
        self._columns = slice(lo, hi) if contiguous else None
        self._index = None if contiguous else torch.tensor(self.layers, dtype=torch.long, device=self.device)
        self._base = (torch.arange(Lm, dtype=torch.int32, device=self.device) * E).view(1, Lm, 1)
        self._flat = torch.empty(step_tokens, Lm, K, dtype=torch.int32, device=self.device)  # flat (layer, expert)
        self._one = torch.ones(1, dtype=torch.int64, device=self.device)
        cuda = self.device.type == "cuda"
        self._pinned = [torch.zeros(Lm * E, dtype=torch.int64, pin_memory=True) for _ in range(2)] if cuda else None
        self._parity = 0
        self.window_s = float(window_s)
        self.interval_s = max(1.0, self.window_s / MAX_TICKS)
        # host side (engine thread writes, any thread reads, under the lock)
        self._lock = threading.Lock()
        self.tokens = 0  # tokens forwarded (counted at launch)
        self.sampled = 0  # tokens sampled
        self.steps = 0  # steps counted
        self._host_counts = np.zeros((Lm, E), dtype=np.int64)  # the newest cumulative counts on the host
        self._host_tokens = self._host_sampled = self._host_step = 0
        self._last_snapshot = -math.inf  # monotonic time of the last snapshot queued
        self.stale = False  # counted on the device since the last snapshot
        self.probe = lambda: {}  # the engine's gauges for a tick (KV use, prefix cache), set by the engine
        now = time.monotonic()
        self.ticks: collections.deque[Tick] = collections.deque([Tick(now, time.time(), self._host_counts.copy(), 0, 0)])
        self.recorder = Recorder(recorder_mode, recorder_buffer_size, (Lm, E))

    # ------------------------------------------------------------------ the step (engine thread)

    def count(self, capture: torch.Tensor, T: int, sampled: int) -> None:
        """Add the MoE layers' ids of the step's first T rows of ``capture`` [>= T, L, K] int32 to ``counts``
        (queued on the device, nothing read back)."""
        if T:
            ids = capture[:T, self._columns] if self._index is None else capture[:T].index_select(1, self._index)
            flat = self._flat[:T]
            torch.add(ids, self._base, out=flat)
            self.counts.index_add_(0, flat.view(-1), self._one.expand(flat.numel()))
            self.stale = True
        self.tokens += T
        self.sampled += sampled
        self.steps += 1

    def snapshot(self) -> Snapshot | None:
        """The cumulative counts queued for the host after this step, when one is due (CPU: every step; CUDA: at
        most every ``interval``, every step while recording), else None. Read it with ``collect`` once the step's
        transfer has completed."""
        now = time.monotonic()
        if self._pinned is None:
            host = self.counts.numpy().copy()
        elif self.recorder.recording or now - self._last_snapshot >= self.interval_s:
            self._parity ^= 1
            host = self._pinned[self._parity]
            host.copy_(self.counts, non_blocking=True)
        else:
            return None
        self._last_snapshot = now
        self.stale = False
        return Snapshot(host, self.steps, self.tokens, self.sampled)

    def collect(self, snap: Snapshot) -> None:
        """A snapshot whose copy has completed (after the step's transfer event): the host's counts, the recorder's
        record of that step, a tick when one is due."""
        counts = (snap.host if isinstance(snap.host, np.ndarray) else snap.host.numpy()).reshape(self._host_counts.shape)
        counts = counts.copy()
        with self._lock:
            if self.recorder.recording:
                self.recorder.add(snap.step, snap.tokens - self._host_tokens, counts - self._host_counts)
            self._host_counts, self._host_tokens, self._host_sampled = counts, snap.tokens, snap.sampled
            self._host_step = snap.step
        self._maybe_tick(force=False)

    def flush(self) -> None:
        """Bring the device's counts to the host now (synchronous: call it when the engine is idle or between
        steps, when nothing is in flight), with a tick."""
        if self.stale:
            snap = self.snapshot() if self._pinned is None else None
            if snap is None:  # CUDA: a synchronous copy
                self.stale = False
                snap = Snapshot(self.counts.cpu().numpy(), self.steps, self.tokens, self.sampled)
            self.collect(snap)
        self._maybe_tick(force=True)

    def _maybe_tick(self, force: bool) -> None:
        now = time.monotonic()
        last = self.ticks[-1]
        if not (now - last.mono >= self.interval_s or (force and last.tokens != self._host_tokens)):
            return
        tick = Tick(now, time.time(), self._host_counts, self._host_tokens, self._host_sampled, self.probe())
        with self._lock:
            self.ticks.append(tick)
            # keep the window: the newest tick at or before now - window, and everything after it
            while len(self.ticks) > 2 and self.ticks[1].mono <= now - self.window_s:
                self.ticks.popleft()

    # ------------------------------------------------------------------ the recorder (engine thread, between steps)

    def start_record(self) -> str:
        self.flush()  # the record starts from the counts of every step before it
        with self._lock:
            was = self.recorder.recording
            self.recorder.start()
        return ("Start recording the expert distribution."
                + (" (It was recording: the record so far was discarded.)" if was else ""))

    def stop_record(self) -> str:
        self.flush()
        with self._lock:
            was = self.recorder.recording
            self.recorder.stop()
        return "Stop recording the expert distribution." + ("" if was else " (It was not recording.)")

    def dump_record(self) -> dict:
        self.flush()
        with self._lock:
            out = self.recorder.dump()
        out.update(layers=list(self.layers), num_experts=self.num_experts, top_k=self.top_k)
        return out

    # ------------------------------------------------------------------ reads (any thread)

    def _window(self, now: float) -> tuple[Tick, np.ndarray, int]:
        """(the tick the window starts at, counts in the window [Lm, E], tokens in the window)."""
        start = self.ticks[0]
        for t in self.ticks:
            if t.mono <= now - self.window_s:
                start = t
        return start, self._host_counts - start.counts, self._host_tokens - start.tokens

    def gauges(self) -> dict:
        """For /metrics: the totals and each MoE layer's balance over the window (lists in ``layers`` order)."""
        with self._lock:
            _, counts, tokens = self._window(time.monotonic())
            total = self._host_tokens
        return {"layers": self.layers, "routed_tokens": total, "expert_load_window_tokens": tokens,
                "expert_load_window_seconds": self.window_s, **{f"expert_load_{k}": v
                                                                 for k, v in layer_stats(counts).items()}}

    def summary(self) -> dict:
        """For the dashboard: the window's counts and per-layer balance, the totals since start, and the timeline
        (per interval: throughput, per-layer imbalance, the engine's gauges at that time). JSON-able."""
        now = time.monotonic()
        with self._lock:
            start, counts, tokens = self._window(now)
            total = self._host_counts.copy()
            ticks = list(self.ticks)
            totals = dict(tokens=self._host_tokens, sampled=self._host_sampled, steps=self._host_step)
            recording = self.recorder.recording
        wall_now = time.time()
        timeline = []
        for a, b in zip(ticks, ticks[1:]):
            dt = max(b.mono - a.mono, 1e-6)
            timeline.append({"t": round(b.wall, 3), "dt": round(dt, 3), "tokens": b.tokens - a.tokens,
                             "sampled": b.sampled - a.sampled,
                             "imbalance": layer_stats(b.counts - a.counts)["imbalance"], **b.gauges})
        return {
            "enabled": True, "layers": list(self.layers), "num_experts": self.num_experts, "top_k": self.top_k,
            "window_seconds": self.window_s, "interval_seconds": self.interval_s, "now": round(wall_now, 3),
            "window": {"start": round(wall_now - min(now - start.mono, self.window_s), 3), "tokens": tokens,
                       "counts": counts.tolist(), **layer_stats(counts)},
            "total": {**totals, "counts": total.tolist(), **layer_stats(total)},
            "timeline": timeline, "recording": recording,
        }
