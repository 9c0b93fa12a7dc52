"""Times every step of an in-process ``moe_engine.Engine`` (benchmarks' ``--step-trace``).

``StepTracer(engine)`` wraps the engine's ``runner.launch`` / ``runner.results`` before the engine starts. Each step
that reaches ``results`` appends a dict to ``tracer.steps``:

- ``t_launch`` / ``t_launched``: the host clock when ``launch`` was called / returned (the host's share: building
  the step and queueing its kernels or graph replays; the engine's host work for the step's outputs follows, while
  the GPU computes);
- ``t_results`` / ``t_done``: when ``results`` was called / returned (waiting for the GPU, then the hand-out);
- ``gpu_s`` (CUDA only): the stream's time from the step's first queued work to its last (CUDA events recorded
  around ``launch``); includes the GPU waiting for the host inside the step, not the gaps between steps;
- ``gap_before_s`` (CUDA only): the stream's time between the previous traced step's end and this one's start
  (the GPU idle between steps, unless other work ran there);
- ``tokens``, ``seqs``, ``prefill_tokens``, ``prefill_seqs``, ``prefill_context`` (mean cached tokens before a
  prefill chunk).

Event times are read when a step's results are taken (the events are complete by then), so tracing adds two event
records per step and no sync. ``summarize`` turns a run's steps into the totals that say where its wall time went.
"""
from __future__ import annotations

import statistics
import time

import torch


class StepTracer:
    def __init__(self, engine):
        runner = engine.runner
        self.steps: list[dict] = []
        self._last_end = None  # the previous traced step's end event
        cuda = runner.device.type == "cuda"
        launch, results = runner.launch, runner.results

        def traced_launch(plan, *a, **k):
            t = time.perf_counter()
            ev = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) if cuda else None
            if ev:
                ev[0].record()
            step = launch(plan, *a, **k)
            if ev:
                ev[1].record()
            chunks = [(n, c) for (_, n), c in zip(plan.items, plan.context) if n > 1]
            step.trace = dict(t_launch=t, t_launched=time.perf_counter(), tokens=plan.num_tokens,
                              seqs=len(plan.items), prefill_tokens=sum(n for n, _ in chunks),
                              prefill_seqs=len(chunks),
                              prefill_context=sum(c for _, c in chunks) // max(1, len(chunks)), events=ev)
            return step

        def traced_results(step):
            t = time.perf_counter()
            out = results(step)
            trace = getattr(step, "trace", None)
            if trace is not None:
                ev = trace.pop("events")
                if ev:
                    trace["gpu_s"] = ev[0].elapsed_time(ev[1]) / 1e3
                    trace["gap_before_s"] = self._last_end.elapsed_time(ev[0]) / 1e3 if self._last_end else None
                    self._last_end = ev[1]
                self.steps.append(dict(trace, t_results=t, t_done=time.perf_counter()))
            return out

        runner.launch, runner.results = traced_launch, traced_results

    def since(self, first: int) -> list[dict]:
        return self.steps[first:]


def summarize(steps: list[dict], t0: float, t_end: float) -> dict:
    """Where a run's wall time (t0: submitted, t_end: last output) went, by step kind: prefill steps (any chunk of
    more than one token) and decode steps; per kind the count, each step's wall (from the previous step's
    ``t_done``, the first step's from t0: the walls and ``last_done_to_end_s`` add up to the run's wall),
    the host's launch time, the GPU span and the GPU idle before the step (medians and sums, seconds)."""
    out = {"wall_s": t_end - t0, "steps": len(steps)}
    if not steps:
        return out
    out["submit_to_first_launch_s"] = steps[0]["t_launch"] - t0
    out["last_done_to_end_s"] = t_end - steps[-1]["t_done"]
    ends = [t0] + [s["t_done"] for s in steps[:-1]]  # each step's wall: from the previous step's end to its own
    for kind, pick in (("prefill", lambda s: s["prefill_tokens"] > 0), ("decode", lambda s: s["prefill_tokens"] == 0)):
        rows = [s for s in steps if pick(s)]
        walls = [s["t_done"] - e for s, e in zip(steps, ends) if pick(s)]
        if not rows:
            continue
        k = out[kind] = {"n": len(rows), "tokens": sum(s["tokens"] for s in rows),
                         "wall_s": sum(walls), "wall_p50_s": statistics.median(walls),
                         "launch_s": sum(s["t_launched"] - s["t_launch"] for s in rows),
                         "launch_p50_s": statistics.median(s["t_launched"] - s["t_launch"] for s in rows),
                         "wall_max_s": max(walls)}
        if kind == "prefill":  # few and large: each one
            k["each"] = [{"tokens": s["tokens"], "prefill_tokens": s["prefill_tokens"], "wall_s": w,
                          "launch_s": s["t_launched"] - s["t_launch"], "gpu_s": s.get("gpu_s"),
                          "gpu_idle_before_s": s.get("gap_before_s")} for s, w in zip(rows, walls)]
        if "gpu_s" in rows[0]:
            gaps = [s["gap_before_s"] for s in rows if s.get("gap_before_s") is not None]
            k.update(gpu_s=sum(s["gpu_s"] for s in rows), gpu_p50_s=statistics.median(s["gpu_s"] for s in rows),
                     gpu_idle_before_s=sum(gaps), gpu_idle_before_p50_s=statistics.median(gaps) if gaps else None)
    return out


def describe(summary: dict) -> list[str]:
    """The summary as log lines (ms)."""
    ms = lambda v: "-" if v is None else f"{1e3 * v:.1f}"  # noqa: E731
    lines = [f"wall {ms(summary['wall_s'])} ms over {summary['steps']} steps; submit -> first launch "
             f"{ms(summary.get('submit_to_first_launch_s'))} ms, last step -> end "
             f"{ms(summary.get('last_done_to_end_s'))} ms"]
    for kind in ("prefill", "decode"):
        k = summary.get(kind)
        if not k:
            continue
        line = (f"{kind}: {k['n']} steps, {k['tokens']} tokens; wall {ms(k['wall_s'])} ms "
                f"(p50 {ms(k['wall_p50_s'])}, max {ms(k['wall_max_s'])}); host launch {ms(k['launch_s'])} "
                f"(p50 {ms(k['launch_p50_s'])})")
        if "gpu_s" in k:
            line += (f"; GPU span {ms(k['gpu_s'])} (p50 {ms(k['gpu_p50_s'])}); GPU idle before these steps "
                     f"{ms(k['gpu_idle_before_s'])} (p50 {ms(k['gpu_idle_before_p50_s'])})")
        lines.append(line)
        for e in k.get("each", []):
            lines.append(f"  {e['tokens']} tokens ({e['prefill_tokens']} prefill): wall {ms(e['wall_s'])} ms, "
                         f"host launch {ms(e['launch_s'])}, GPU span {ms(e['gpu_s'])}, "
                         f"GPU idle before {ms(e['gpu_idle_before_s'])}")
    return lines
