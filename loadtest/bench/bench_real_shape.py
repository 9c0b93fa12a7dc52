#!/usr/bin/env python
"""Real-shape GPU benchmark (issues 16 and 17): the Qwen3-30B-A3B shape with random bf16 weights built on the
GPU (no checkpoint on disk), driven through the engine's public API, and transformers ``generate`` on the same
shape and GPU.

Cases (``--cases``, default all; sizes at ``--scale 1``):
  a   1 x (128 prompt + 256 out): decode ITL p50 vs the HBM roofline (weight bytes one token reads / measured
      copy bandwidth; the bytes are broken down at start)
  b   64 x (1024 + 256), all submitted at once: output tok/s (output tokens / first submit to last finish),
      decode ITL p50, TTFT
  e   capture on vs off at (b), paired: one engine, repetitions alternate requests with and without
      ``return_routed_experts`` (off: the step does no capture work; this engine has the expert load off), order
      swapped each pair; median of the per-pair tok/s ratios. The expert load's own cost (counts on vs off):
      ``ab_real_shape.py --variant on=. --variant off=.,--disable-expert-load -- --quick --cases a,b``
  c   16 x (8192 + 128): decode ITL p50, TTFT p50/p99, prefill matmul TFLOP/s (16 x 8192 / last first token)
  d   512 requests of 1024 + 512 at max_model_len 32768, max_num_seqs 512: peak of ``stats()["running"]``.
      512 output tokens, not 64: with 64 the earliest sequences finish while later ones are still prefilled,
      and the peak measures the prefill rate instead of the KV capacity. Stops when all are admitted, one
      finishes, or the peak has not grown for --d-stall-s.
  hf  transformers generate, greedy, min_new_tokens = max_new_tokens: 1 x (128 + 256) and 64 x (256 + 256);
      the engine runs the same two shapes (batch 1 is case a) before its model is freed; ratios engine / HF.
Each case is warmed up by a short run of its shape (--warmup-tokens outputs) before timing; repetitions use
fresh random prompts (seeded), and prefix caching is off, so no repetition reuses another's KV.

Engine versions: ``EngineConfig`` is built from the fields the installed engine has (the others are printed as
dropped). On an engine without ``gpu_memory_utilization`` (slot KV cache) the KV budget is 85% of free memory,
as the baseline of issue 16 was measured.

Random weights: ``--init balanced`` (default) keeps the routing near uniform; every weight normal(0, 0.02)
(``--init std0.02``) makes every token pick the same experts past layer 2 (real_shape_model.py says why). The
warm-up of case b reports what the weights routed.

Usage:
    python loadtest/bench/bench_real_shape.py --quick --out $OUT/bench          # H200, about 5 minutes (paged engine)
    python loadtest/bench/bench_real_shape.py --shape gpt-oss-120b-8l --quick --cases a,b,c,hf   # issue 49
    python loadtest/bench/bench_real_shape.py --shape gpt-oss-120b-8l --quantization mxfp4 --quick --cases a,b,c  # 50
    python loadtest/bench/bench_real_shape.py --shape gpt-oss-120b --quantization mxfp4 --quick --cases a,b  # 36 layers
    python loadtest/bench/bench_real_shape.py --cases c --profile c:prefill     # profile: kernel time per op class
    .venv/bin/python loadtest/bench/bench_real_shape.py --shape tiny --device cpu --scale 0.05 --quick   # CPU, <1 min
    python loadtest/bench/bench_real_shape.py --shape moonlight --cases a,b --quick --out $OUT/moonlight  # MLA shape
Shapes (``--shape``, real_shape_model.py): qwen3-30b-a3b (default), moonlight (Moonlight-16B-A3B: DeepSeek-V3
architecture, MLA; issue 48's targets are added to its report), gpt-oss-120b-8l (GPT-OSS-120B cut to 8 of 36 layers:
sinks, sliding windows, biased clamped experts, vocabulary 201,088; issue 49's targets in its report),
qwen3.5-35b-a3b, nemotron-3-nano-30b-a3b, and tiny versions of each family for CPUs.
Without --quick (5 repetitions of a, 3 of b and c, 2 of HF after a full-length HF warm-up) a run takes 10+
minutes: split it with --cases (``--cases hf`` alone also runs the engine side of the comparison).

This file is longer than the project's usual ~450 lines: one benchmark, whose engine driving, cases, profile
and report share one context object (``Ctx``); the model and its rooflines live in real_shape_model.py.

Output: progress lines with elapsed seconds; after every case ``results.json`` (every number, the engine
config, torch/triton/transformers/GPU, git commit) and ``report.md`` (case, metric, value, % of roofline,
target) in --out (default loadtest/results/real_shape-<time>/). A case that fails or runs past its time limit
is recorded as such and the next one runs.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import faulthandler
import gzip
import itertools
import json
import logging
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "backends"))
sys.path.insert(0, str(REPO))  # the repo root: loadtest.* when run by path
from loadtest.bench import real_shape_model as rsm  # noqa: E402
from loadtest.bench import step_trace  # noqa: E402
from moe_engine.kernels import support as kernel_support  # noqa: E402

CASES = ("a", "b", "e", "c", "d", "hf")  # run order: engines of one size together, HF last (after freeing)
# name -> (count, prompt, output) at scale 1
SIZES = {"a": (1, 128, 256), "b": (64, 1024, 256), "c": (16, 8192, 128), "d": (512, 1024, 512),
         "hf1": (1, 128, 256), "hf64": (64, 256, 256)}
D_MAX_MODEL_LEN = 32768
T0 = time.perf_counter()
_BATCHES = itertools.count()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:7.1f} s] {msg}", flush=True)


def pct(xs, q) -> float | None:
    return float(np.percentile(np.asarray(xs, dtype=float), q)) if len(xs) else None


def med(xs) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


class CaseTimeout(RuntimeError):
    """A case ran past its time limit; what it measured so far is kept."""


# ----------------------------------------------------------------------------- engine driving


def engine_config(args, device: torch.device, **want):
    """EngineConfig from the fields the installed engine has; returns (config, passed, dropped)."""
    from moe_engine.engine import EngineConfig

    have = {f.name for f in dataclasses.fields(EngineConfig)}
    want.update(enable_routed_experts=True, enable_prefix_caching=False)
    optional = {"max_num_batched_tokens": args.max_num_batched_tokens, "block_size": args.block_size,
                "gpu_memory_utilization": args.gpu_memory_utilization, "enforce_eager": args.enforce_eager or None,
                "fused_kernels": False if args.no_fused_kernels else None,
                "exact_kernels": True if args.exact_kernels else None,
                "deterministic_inference": True if args.enable_deterministic_inference else None,
                "expert_load": False if args.disable_expert_load else None,
                "kv_cache_memory_bytes": int(args.kv_cache_memory * 2**30) if args.kv_cache_memory else None,
                "kv_cache_dtype": args.kv_cache_dtype}
    want.update({k: v for k, v in optional.items() if v is not None})
    if "kv_cache_bytes" in have and "kv_cache_memory_bytes" not in have:  # the slot-cache engine (de221cd)
        budget = want.pop("kv_cache_memory_bytes", None)
        if budget is None and device.type == "cuda":
            free, total = torch.cuda.mem_get_info(device)
            util = want.get("gpu_memory_utilization")
            budget = int(0.85 * free) if util is None else int(util * total - (total - free))
        if budget is not None:
            want["kv_cache_bytes"] = budget
    passed = {k: v for k, v in want.items() if k in have}
    dropped = {k: v for k, v in want.items() if k not in have}
    return EngineConfig(**passed), passed, dropped


class Engines:
    """At most one engine at a time (a new engine may size its KV cache from the free memory)."""

    def __init__(self, ctx):
        self.ctx, self.group, self.engine, self.info = ctx, None, None, {}
        self.tracer: step_trace.StepTracer | None = None  # --step-trace: the current engine's steps

    def get(self, group: str):
        if self.group == group and self.engine is not None:
            return self.engine
        self.close()
        from moe_engine.engine import Engine

        ecfg, passed, dropped = engine_config(self.ctx.args, self.ctx.device, **self.ctx.groups[group])
        log(f"engine '{group}': EngineConfig {passed}" + (f"; not in this engine, dropped: {dropped}" if dropped else ""))
        t = time.perf_counter()
        engine = Engine(self.ctx.model, self.ctx.cfg, ecfg)
        self.tracer = step_trace.StepTracer(engine) if self.ctx.args.step_trace else None
        engine.start()
        self.engine, self.group = engine, group
        self.info = {"group": group, "engine_config": passed, "dropped": dropped, "stats_at_start": engine.stats(),
                     "build_s": time.perf_counter() - t,
                     # --enable-deterministic-inference or VLLM_BATCH_INVARIANT=1 (ab_real_shape.py's variants)
                     "deterministic_inference": bool(getattr(engine.settings, "deterministic_inference", False))}
        log(f"engine built in {self.info['build_s']:.1f} s; stats() = {self.info['stats_at_start']}")
        return engine

    def close(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = self.group = None
            rsm.free_device_memory(self.ctx.device)


class Batch:
    """Submits requests and records, from their callbacks (engine thread), each output's time and tokens."""

    def __init__(self, engine, prompts: list[list[int]], out_len: int, capture: bool, tag: str, watch=None):
        from moe_engine.engine import Request
        from moe_engine.core.sampling import SamplingParams

        n = len(prompts)
        self.engine, self.prompts, self.out_len, self.capture, self.n = engine, prompts, out_len, capture, n
        batch_no = next(_BATCHES)  # ids unique over the run: an engine may remember finished ones
        self.ids = [f"{tag}-{batch_no}-{i}" for i in range(n)]
        self.times: list[list[tuple[float, int]]] = [[] for _ in range(n)]
        self.tokens: list[list[int]] = [[] for _ in range(n)]
        self.rows, self.row_shape, self.finish = [0] * n, None, [None] * n
        self.routing: list = []  # routing row arrays, only when collect_routing is set (warm-ups)
        self.collect_routing = False
        self.n_finished, self.done = 0, threading.Event()
        self.watch = watch  # (request index, callable(token count)) called on that request's outputs
        self.submit = [0.0] * n
        sampling = SamplingParams(max_tokens=out_len, temperature=0.0, ignore_eos=True)
        self.requests = [Request(request_id=self.ids[i], prompt_token_ids=p, sampling=sampling,
                                 return_routed_experts=capture, on_output=self._callback(i))
                         for i, p in enumerate(prompts)]

    def _callback(self, i: int):
        def on_output(out) -> None:
            now = time.perf_counter()
            if out.new_token_ids:
                self.times[i].append((now, len(out.new_token_ids)))
                self.tokens[i].extend(out.new_token_ids)
            if out.routed_experts is not None:
                self.rows[i] += out.routed_experts.shape[0]
                self.row_shape = tuple(out.routed_experts.shape[1:])
                if self.collect_routing:
                    self.routing.append(out.routed_experts)
            if out.finished:
                self.finish[i] = (out.finish_reason, out.error)
                self.n_finished += 1
                if self.n_finished == self.n:
                    self.done.set()
            if self.watch is not None and self.watch[0] == i:
                self.watch[1](len(self.tokens[i]))
        return on_output

    def start(self) -> None:
        self.t_start = time.perf_counter()
        for i, req in enumerate(self.requests):
            self.submit[i] = time.perf_counter()
            self.engine.add_request(req)

    def abort_rest(self, wait_s: float = 30.0) -> None:
        for i, rid in enumerate(self.ids):
            if self.finish[i] is None:
                self.engine.abort(rid)
        self.done.wait(wait_s)

    def wait(self, deadline: float) -> bool:
        """True when every request finished; on the deadline the rest are aborted and False returned."""
        if self.done.wait(max(0.0, deadline - time.perf_counter())):
            return True
        self.abort_rest()
        return False

    def metrics(self) -> dict:
        """tok/s, TTFT, decode ITL (gaps between a request's successive outputs, per token)."""
        ends = [ts[-1][0] for ts in self.times if ts]
        wall = (max(ends) - self.t_start) if ends else None
        out_tokens = sum(len(t) for t in self.tokens)
        ttft = [ts[0][0] - s for ts, s in zip(self.times, self.submit) if ts]
        gaps = [(b[0] - a[0]) / b[1] for ts in self.times for a, b in zip(ts, ts[1:])]
        return {"requests": self.n, "output_tokens": out_tokens, "wall_s": wall,
                "tok_s": out_tokens / wall if wall else None, "ttft_p50_s": pct(ttft, 50), "ttft_p99_s": pct(ttft, 99),
                "ttft_max_s": max(ttft) if ttft else None, "itl_p50_s": pct(gaps, 50), "itl_p90_s": pct(gaps, 90),
                "itl_p99_s": pct(gaps, 99), "complete": self.n_finished == self.n and all(
                    f is not None and f[0] == "length" for f in self.finish)}

    def check(self, cfg) -> None:
        """Every request got exactly out_len tokens and, with capture, prompt + output - 1 rows of (L, K)."""
        errors = [f"{self.ids[i]}: {f[0]} {f[1] or ''}" for i, f in enumerate(self.finish) if f and f[0] != "length"]
        for i, p in enumerate(self.prompts):
            if len(self.tokens[i]) != self.out_len:
                errors.append(f"{self.ids[i]}: {len(self.tokens[i])} tokens, expected {self.out_len}")
            want = len(p) + self.out_len - 1 if self.capture else 0
            if self.rows[i] != want:
                errors.append(f"{self.ids[i]}: {self.rows[i]} routed-experts rows, expected {want}")
        if self.capture and self.row_shape != (cfg.num_hidden_layers, cfg.num_experts_per_tok):
            errors.append(f"routed-experts rows of shape {self.row_shape}")
        if errors:
            raise RuntimeError(f"{len(errors)} wrong results, e.g. " + "; ".join(errors[:3]))


def prompts_for(ctx, key: str, rep: int, n: int, length: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(ctx.args.seed * 7919 + sum(map(ord, key)) * 104729 + rep)
    return torch.randint(3, ctx.cfg.vocab_size, (n, length), generator=gen).tolist()


def run_once(ctx, engine, key: str, rep: int, n: int, p: int, o: int, capture: bool = True) -> tuple[dict, Batch]:
    """One timed run: n requests of the rep's prompts submitted at once, checked, measured."""
    batch = Batch(engine, prompts_for(ctx, key, rep, n, p), o, capture, f"{key}-{rep}-{'on' if capture else 'off'}")
    batch.start()
    if not batch.wait(ctx.deadline):
        raise CaseTimeout(f"{key} rep {rep}: time limit reached ({batch.n_finished}/{n} requests finished)")
    batch.check(ctx.cfg)
    return batch.metrics(), batch


def warm_up(ctx, engine, key: str, n: int, p: int, captures=(True,), collect_routing: bool = False) -> Batch:
    """A short run of the case's shape (--warmup-tokens outputs) per capture setting; returns the last one."""
    o = min(ctx.args.warmup_tokens, ctx.sizes[key][2])
    batch = None
    for capture in captures:
        t = time.perf_counter()
        batch = Batch(engine, prompts_for(ctx, key, -1, n, p), o, capture, f"{key}-warmup-{capture}")
        batch.collect_routing = collect_routing
        batch.start()
        if not batch.wait(ctx.deadline):
            raise CaseTimeout(f"{key}: time limit reached in the warm-up")
        log(f"{key}: warm-up {n} x ({p} + {o}), capture {'on' if capture else 'off'}: {time.perf_counter() - t:.1f} s")
    return batch


def timed_reps(ctx, engine, key: str, into: dict) -> None:
    """Timed runs of the ``key`` shape (capture on): each one's metrics appended to into["reps"], their medians
    in ``into`` updated after each run (a case cut short keeps what it measured)."""
    n, p, o = ctx.sizes[key]
    reps, count = into.setdefault("reps", []), ctx.reps[{"hf64": "b"}.get(key, key)]
    tracer = ctx.engines.tracer
    for rep in range(count):
        first = len(tracer.steps) if tracer else 0
        m, batch = run_once(ctx, engine, key, rep, n, p, o)
        if tracer:  # where this rep's wall time went, step by step
            m["step_trace"] = step_trace.summarize(tracer.since(first), batch.t_start, batch.t_start + m["wall_s"])
            for line in step_trace.describe(m["step_trace"]):
                log(f"{key}: rep {rep + 1} steps: {line}")
        reps.append({"rep": rep, **m})
        into.update(summary(reps))
        if rep == 0:
            ctx.tokens[key] = batch.tokens
        log(f"{key}: rep {rep + 1}/{count}: {m['output_tokens']} tok in {m['wall_s']:.2f} s = "
            f"{m['tok_s']:.1f} tok/s, ITL p50 {m['itl_p50_s'] * 1e3:.2f} ms, TTFT p50 {m['ttft_p50_s'] * 1e3:.0f} ms")


def summary(reps: list[dict]) -> dict:
    keys = ("tok_s", "itl_p50_s", "itl_p90_s", "itl_p99_s", "ttft_p50_s", "ttft_p99_s", "ttft_max_s", "wall_s")
    return {k: med([r.get(k) for r in reps]) for k in keys}


# ----------------------------------------------------------------------------- cases


def case_a(ctx) -> None:
    engine = ctx.engines.get("short")
    n, p, _ = ctx.sizes["a"]
    warm_up(ctx, engine, "a", n, p)
    timed_reps(ctx, engine, "a", ctx.current)


def case_b(ctx) -> None:
    engine = ctx.engines.get("short")
    n, p, _ = ctx.sizes["b"]
    warm = warm_up(ctx, engine, "b", n, p, collect_routing=True)
    if warm.routing:  # what the random weights route (not a trained model's load)
        load = ctx.current["routing_load"] = rsm.routing_stats(np.concatenate(warm.routing), ctx.cfg, n)
        log(f"routing of {load['rows']} warm-up rows ({ctx.args.init} init): busiest expert {load['max_over_mean']:.2f}x "
            f"the mean, idlest {load['min_over_mean']:.2f}x; {load['distinct_per_step']:.1f} experts per layer hit by "
            f"{n} tokens (uniform routing: {load['distinct_uniform']:.1f})")
    timed_reps(ctx, engine, "b", ctx.current)


def case_e(ctx) -> None:
    """Capture on vs off at (b)'s shape (or (a)'s with --e-shape a), paired: both members of a pair use the same
    prompts, the order alternates between pairs; the medians of the per-pair ratios are updated after each pair.
    Its engine has the expert load off (with it on, every step captures, for the counts)."""
    engine = ctx.engines.get("short_capture")
    key = ctx.args.e_shape
    n, p, o = ctx.sizes[key]
    ctx.current["shape"] = key
    warm_up(ctx, engine, key, n, p, captures=(True, False))
    pairs = ctx.current.setdefault("pairs", [])
    for i in range(ctx.reps["e"]):
        r = {}
        for capture in ((True, False) if i % 2 == 0 else (False, True)):
            r["on" if capture else "off"] = run_once(ctx, engine, "e", i, n, p, o, capture)[0]
        r.update(tok_s_ratio=r["on"]["tok_s"] / r["off"]["tok_s"], itl_ratio=r["on"]["itl_p50_s"] / r["off"]["itl_p50_s"])
        pairs.append(r)
        ctx.current.update(tok_s_ratio_median=med([x["tok_s_ratio"] for x in pairs]),
                           itl_ratio_median=med([x["itl_ratio"] for x in pairs]))
        log(f"e: pair {i + 1}/{ctx.reps['e']}: on {r['on']['tok_s']:.1f} / off {r['off']['tok_s']:.1f} tok/s = "
            f"{r['tok_s_ratio']:.4f}; ITL p50 on/off {r['itl_ratio']:.4f}")


def case_c(ctx) -> None:
    engine = ctx.engines.get("long")
    n, p, _ = ctx.sizes["c"]
    warm_up(ctx, engine, "c", n, p)
    timed_reps(ctx, engine, "c", ctx.current)


def case_d(ctx) -> None:
    """Submit every request at once; poll stats() until all are admitted, one finishes, the peak of "running"
    stalls or time is up; then abort the rest."""
    engine = ctx.engines.get("capacity")
    n, p, o = ctx.sizes["d"]
    warm_up(ctx, engine, "d", 1, p)
    batch = Batch(engine, prompts_for(ctx, "d", 0, n, p), o, True, "d")
    batch.start()
    peak, t_peak, at_peak, samples, reason = 0, time.perf_counter(), None, [], None
    while reason is None:
        stats = engine.stats()
        now = time.perf_counter()
        running = stats.get("running")
        if running is None:  # no such key: requests that produced a token and are not finished (a lower bound)
            running = sum(1 for i in range(n) if batch.tokens[i] and batch.finish[i] is None)
        if running > peak:
            peak, t_peak, at_peak = running, now, dict(stats)
        if not samples or now - T0 - samples[-1][0] >= 0.25:
            samples.append((round(now - T0, 2), running, stats.get("waiting")))
        if batch.n_finished:
            reason = "a request finished"
        elif running + batch.n_finished >= n:
            reason = "all requests admitted"
        elif now - t_peak > ctx.args.d_stall_s:
            reason = f"the peak did not grow for {ctx.args.d_stall_s:.0f} s"
        elif now > ctx.deadline:
            reason = "time limit"
        else:
            time.sleep(0.02)
    ctx.current.update(peak_running=peak, stop_reason=reason, time_to_peak_s=t_peak - batch.t_start,
                       stats_at_peak=at_peak, samples=samples, requests=n)
    log(f"d: peak running {peak} of {n} (stop: {reason}; peak after {t_peak - batch.t_start:.1f} s); stats at peak {at_peak}")
    batch.abort_rest()


def case_hf_engine(ctx) -> None:
    """The engine side of the HF comparison, before the engine's model is freed: 64 x (256 + 256), and the batch-1
    shape (case a's) unless case a measured it."""
    engine = ctx.engines.get("short")
    for key, needed in (("a", "a" not in ctx.tokens), ("hf64", True)):
        if needed:
            n, p, _ = ctx.sizes[key]
            warm_up(ctx, engine, key, n, p)
            timed_reps(ctx, engine, key, ctx.current.setdefault("hf1" if key == "a" else key, {}))


def hf_generate(model, prompts: list[list[int]], out_len: int, deadline: float) -> dict:
    """One greedy ``generate`` call of fixed length (min_new_tokens = max_new_tokens); per-token times from a
    stopping criterion, which also stops the call at the deadline."""
    from transformers import StoppingCriteria, StoppingCriteriaList

    class Clock(StoppingCriteria):
        def __init__(self):
            self.times = []

        def __call__(self, input_ids, scores, **kwargs):
            self.times.append(time.perf_counter())
            return torch.full((input_ids.shape[0],), time.perf_counter() > deadline, dtype=torch.bool,
                              device=input_ids.device)

    clock = Clock()
    ids = torch.tensor(prompts, device=model.device)
    start = time.perf_counter()
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=out_len,
                         min_new_tokens=out_len, do_sample=False, pad_token_id=0,
                         stopping_criteria=StoppingCriteriaList([clock]))
    new = out[:, ids.shape[1]:].tolist()  # synchronises
    wall = time.perf_counter() - start
    if len(new[0]) < out_len:
        raise CaseTimeout(f"HF generate: time limit after {len(new[0])} of {out_len} tokens")
    return {"tok_s": len(new) * len(new[0]) / wall, "wall_s": wall, "ttft_s": clock.times[0] - start,
            "itl_p50_s": pct(np.diff(clock.times), 50), "tokens": new}


def case_hf(ctx) -> None:
    """transformers generate at 1 x (128 + 256) (case a's first prompt) and 64 x (256 + 256), after the engines
    and the engine's model are freed; ratios engine / HF."""
    ctx.engines.close()
    ctx.model = None
    rsm.free_device_memory(ctx.device)
    if ctx.device.type == "cuda":
        log(f"engine model freed: {torch.cuda.memory_allocated(ctx.device) / 2**30:.1f} GiB still allocated")
    log("building the transformers model (same seed and init: the engine's weights) ...")
    t = time.perf_counter()
    model = rsm.build_hf_model(ctx.raw, ctx.device, ctx.dtype, ctx.args.seed, ctx.args.init, log, ctx.args.hf_attn,
                               ctx.args.hf_experts)
    impl = ctx.current["hf_implementation"] = {"attn": model.config._attn_implementation,
                                               "experts": getattr(model.config, "_experts_implementation", None)}
    log(f"HF model built in {time.perf_counter() - t:.1f} s; {impl}")
    for key in ("hf1", "hf64"):
        n, p, o = ctx.sizes[key]
        prompts = prompts_for(ctx, "a" if key == "hf1" else key, 0, n, p)
        warm = min(o, ctx.args.warmup_tokens) if ctx.args.quick else o
        t = time.perf_counter()
        try:
            hf_generate(model, prompts, warm, ctx.deadline)
        except RuntimeError as e:  # e.g. a grouped GEMM this GPU/torch lacks: HF's per-expert loop instead
            if isinstance(e, CaseTimeout) or not hasattr(model, "set_experts_implementation"):
                raise
            log(f"{key}: HF generate failed ({type(e).__name__}: {str(e)[:200]}); retrying with experts 'eager'")
            model.set_experts_implementation("eager")
            impl["experts"] = "eager (fallback)"
            hf_generate(model, prompts, warm, ctx.deadline)
        log(f"{key}: HF warm-up {n} x ({p} + {warm}): {time.perf_counter() - t:.1f} s")
        res = ctx.current[key] = {"reps": []}
        for rep in range(ctx.reps["hf"]):
            r = hf_generate(model, prompts, o, ctx.deadline)
            res["reps"].append({k: v for k, v in r.items() if k != "tokens"})
            res.update(tok_s=med([x["tok_s"] for x in res["reps"]]), itl_p50_s=med([x["itl_p50_s"] for x in res["reps"]]))
            log(f"{key}: HF rep {rep + 1}: {n * o} tok in {r['wall_s']:.2f} s = {r['tok_s']:.1f} tok/s, "
                f"ITL p50 {r['itl_p50_s'] * 1e3:.1f} ms")
            if key == "hf1" and rep == 0 and "a" in ctx.tokens:  # greedy agreement with case a's first run
                a, h = ctx.tokens["a"][0], r["tokens"][0]
                res["greedy_common_prefix_vs_engine"] = next((i for i, (x, y) in enumerate(zip(a, h)) if x != y), len(h))
                log(f"hf1: greedy tokens equal to the engine's for the first {res['greedy_common_prefix_vs_engine']} of "
                    f"{o} (in bf16 they part at the first near tie)")
    del model
    rsm.free_device_memory(ctx.device)


def derive(ctx, name: str, case: dict) -> None:
    """Rooflines, ratios and targets' inputs from a case's medians (also for a case cut short)."""
    bw = ctx.bandwidth["bytes_per_s"]
    if name == "a" and case.get("itl_p50_s"):
        case.update(roofline_s=ctx.roofline["batch1_s"], pct_of_roofline=100 * ctx.roofline["batch1_s"] / case["itl_p50_s"])
    if name in ("b", "c"):
        n, p, o = ctx.sizes[name]
        step = rsm.decode_step_bytes(ctx.cfg, ctx.elem, n, p + o / 2)
        case.update(step_roofline_bytes=step, step_roofline_s=step["total"] / bw, roofline_tok_s=n * bw / step["total"])
        if case.get("tok_s"):
            case["pct_of_roofline"] = 100 * case["tok_s"] / case["roofline_tok_s"]
    if name == "c" and case.get("ttft_max_s"):
        n, p, _ = ctx.sizes["c"]
        flops = case["prefill_flops"] = rsm.prefill_matmul_flops(ctx.cfg, p, n)
        case["prefill_tflop_s"] = flops["total"] / case["ttft_max_s"] / 1e12
        if ctx.peak_flops:
            case["prefill_pct_of_peak"] = 100 * case["prefill_tflop_s"] * 1e12 / ctx.peak_flops
    if name == "hf":
        engine_side = ctx.results["cases"].get("hf_engine", {})
        for key in ("hf1", "hf64"):
            eng = (engine_side.get(key) or (ctx.results["cases"].get("a", {}) if key == "hf1" else {})).get("tok_s")
            if eng and (case.get(key) or {}).get("tok_s"):
                case[key]["engine_over_hf"] = eng / case[key]["tok_s"]
                log(f"{key}: engine {eng:.1f} / HF {case[key]['tok_s']:.1f} tok/s = {case[key]['engine_over_hf']:.2f}x")


CASE_FUNCS = {"a": case_a, "b": case_b, "e": case_e, "hf_engine": case_hf_engine, "c": case_c, "d": case_d,
              "hf": case_hf}


# ----------------------------------------------------------------------------- profile

def profile_case(ctx) -> None:
    """torch.profiler over --profile-steps steps of case a, b, c or e (e: b's shape, capture off): "decode" (the
    default; steady state, from the last request's third token) or "prefill" (from the submission). The profiler
    runs on this thread: it records every CUDA kernel of the process, CPU ops only of this thread."""
    from torch.profiler import ProfilerActivity, profile

    case, _, phase = ctx.args.profile.partition(":")
    phase = phase or "decode"
    if case not in ("a", "b", "c", "e") or phase not in ("decode", "prefill"):
        raise ValueError(f"--profile {ctx.args.profile}: expected a, b, c or e, optionally :decode or :prefill")
    key, capture, cuda = ("b" if case == "e" else case), case != "e", ctx.device.type == "cuda"
    engine = ctx.engines.get("long" if case == "c" else "short")
    n, p, o = ctx.sizes[key]
    warm_up(ctx, engine, key, n, p, captures=(capture,))
    want = min(ctx.args.profile_steps, max(1, o - 4))
    seen, ready, reached, target = [0], threading.Event(), threading.Event(), [o]

    def on_tokens(k: int) -> None:  # outputs of the last request, which starts decoding last
        seen[0] = k
        if k >= 3:
            ready.set()
        if k >= target[0]:
            reached.set()

    def steps() -> int | None:
        return engine.stats().get("steps")

    batch = Batch(engine, prompts_for(ctx, key, 0, n, p), o, capture, f"profile-{case}", (n - 1, on_tokens))
    prof = profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else []))
    if phase == "decode":
        batch.start()
        if not ready.wait(max(0.0, ctx.deadline - time.perf_counter())):
            raise CaseTimeout("profile: time limit before the steady state")
    prof.start()
    t0, s0, k0 = time.perf_counter(), steps(), seen[0]
    if phase == "decode":
        target[0] = min(k0 + want, o)
        reached.wait(max(0.0, ctx.deadline - time.perf_counter()))
    else:
        batch.start()
        while not ready.is_set() and time.perf_counter() < ctx.deadline and (s0 is None or steps() - s0 < want):
            time.sleep(0.005)
    if cuda:
        torch.cuda.synchronize(ctx.device)
    prof.stop()
    wall, s1, k1 = time.perf_counter() - t0, steps(), seen[0]
    batch.abort_rest()
    trace = ctx.out / f"profile_{case}_{phase}.json"
    prof.export_chrome_trace(str(trace))
    events = json.loads(trace.read_text()).get("traceEvents", [])
    with open(trace, "rb") as src, gzip.open(str(trace) + ".gz", "wb") as dst:
        dst.write(src.read())
    trace.unlink()
    lm_us = 0.5 * ctx.roofline["bytes"]["lm_head"] / ctx.bandwidth["bytes_per_s"] * 1e6
    n_steps = (s1 - s0) if s0 is not None and s1 is not None else (k1 - k0)
    summ = rsm.summarize_trace(events, n_steps, wall, lm_us if cuda and phase == "decode" else None)
    lm_alone = rsm.time_lm_head(ctx.model, n)
    summ.update(case=case, phase=phase, batch=n, trace=trace.name + ".gz", lm_head_alone_ms=lm_alone and lm_alone * 1e3)
    ctx.current.update(summ)
    log(f"profile {case}:{phase}: {n_steps} steps ({summ['trace_steps']} with kernels in the trace), wall "
        f"{summ['wall_per_step_ms']:.2f} ms/step, device busy {summ['busy_per_step_ms']:.2f} ms/step" + (f"; lm_head alone at {n} rows {lm_alone * 1e3:.3f} ms" if lm_alone else ""))
    if cuda and kernel_support.pdl(ctx.device):
        log("  (programmatic dependent launch on: a kernel starts before its predecessor ends and waits for it, so "
            "the per-kernel times below include that wait and add up to more than the busy time; MOE_PDL=0 for "
            "each kernel's own time)")
    for cls, ms in summ["classes_ms_per_step"].items():
        log(f"  {cls:14s} {ms:8.3f} ms/step")
    for k in summ["top_kernels"][:15]:
        log(f"  {k['per_step_us']:9.1f} us/step {k['count']:6d}x  [{k['class']}] {k['name'][:100]}")
    log("  device idle between kernels, ms/step: " + ", ".join(f"{b} {ms:.3f}"
                                                          for b, ms in summ["idle_per_step_ms"].items()))
    for g in summ["top_idle"]:
        log(f"  {g['per_step_us']:9.1f} us/step idle {g['count']:6d}x  after {g['before'][:60]}  before "
            f"{g['after'][:60]}")


# ----------------------------------------------------------------------------- report


def _f(x, fmt: str, none: str = "-") -> str:
    return none if x is None else fmt.format(x)


def _ms(s) -> str:
    return _f(s and s * 1e3, "{:.2f} ms")


def report_rows(ctx) -> list[tuple[str, ...]]:
    """(case, metric, value, % of roofline, target, met) for report.md: one row per measured number."""
    R, rows = ctx.results["cases"], []
    name = ctx.results["shape"]["name"]
    if name == "gpt-oss-120b-8l":
        return gpt_oss_report_rows(ctx)
    real = name == rsm.REAL_SHAPE and ctx.args.scale == 1.0

    def add(case, metric, value, roof="", target="", *checks):
        met = ", ".join(f"{label}{'yes' if ok else 'no'}" for label, ok in checks if ok is not None)
        rows.append((case, metric, value, roof, target, met if real or not met else "n/a (not the real shape)"))

    def cmp(x, op, limit):
        return None if x is None else (x <= limit if op == "<=" else x >= limit)

    def shape(key):
        n, p, o = ctx.sizes[key]
        return f"{n} x ({p} + {o})"

    for key, c in R.items():
        if c.get("status") != "ok":
            add(key, "status", f"{c.get('status')}: {str(c.get('error') or c.get('reason') or '')[:160]}")
    a, b, e, c, d = (R.get(k) or {} for k in "abecd")
    hf, hfe = R.get("hf") or {}, R.get("hf_engine") or {}
    if a.get("reps"):
        add("a", f"decode ITL p50, {shape('a')}", _ms(a.get("itl_p50_s")),
            _f(a.get("pct_of_roofline"), "{:.0f}% of " + _ms(a.get("roofline_s")), ""), "<= 2.8 ms (17)",
            ("", cmp(a.get("itl_p50_s"), "<=", 2.8e-3)))
        add("a", "output tok/s", _f(a.get("tok_s"), "{:,.1f}"))
    if b.get("reps"):
        add("b", f"output tok/s, {shape('b')}", _f(b.get("tok_s"), "{:,.1f}"),
            _f(b.get("pct_of_roofline"), "{:.0f}% of " + _f(b.get("roofline_tok_s"), "{:,.0f}"), ""),
            ">= 3,000 (17); >= 1,500 (16)", ("17: ", cmp(b.get("tok_s"), ">=", 3000)), ("16: ", cmp(b.get("tok_s"), ">=", 1500)))
        add("b", "decode ITL p50", _ms(b.get("itl_p50_s")), f"step roofline {_ms(b.get('step_roofline_s'))}")
        add("b", "TTFT p50", _ms(b.get("ttft_p50_s")))
    if e.get("pairs"):
        r = e.get("tok_s_ratio_median")
        add("e", f"capture on/off tok/s, median of {len(e['pairs'])} pairs, {shape(e.get('shape', 'b'))}", _f(r, "{:.4f}"), "",
            "within 2% (16), 1% (17)", ("16: ", abs(r - 1) <= 0.02), ("17: ", abs(r - 1) <= 0.01))
        add("e", "capture on/off decode ITL p50", _f(e.get("itl_ratio_median"), "{:.4f}"))
    if c.get("reps"):
        add("c", f"decode ITL p50, {shape('c')}", _ms(c.get("itl_p50_s")), f"step roofline {_ms(c.get('step_roofline_s'))}",
            "<= 25 ms (16)", ("", cmp(c.get("itl_p50_s"), "<=", 0.025)))
        add("c", "TTFT p50", _ms(c.get("ttft_p50_s")), "", "<= 4 s (16)", ("", cmp(c.get("ttft_p50_s"), "<=", 4.0)))
        add("c", "TTFT p99", _ms(c.get("ttft_p99_s")))
        add("c", "prefill matmul TFLOP/s (all prompts / last first token)", _f(c.get("prefill_tflop_s"), "{:,.1f}"),
            _f(c.get("prefill_pct_of_peak"), "{:.0f}% of bf16 peak", ""), ">= 35% of peak (17)",
            ("", cmp(c.get("prefill_pct_of_peak"), ">=", 35)))
    if d.get("stop_reason"):
        kv = {k: v for k, v in (d.get("stats_at_peak") or {}).items() if "block" in k or "kv" in k}
        add("d", f"peak running, {shape('d')}, max_model_len {ctx.groups['capacity']['max_model_len']}",
            _f(d.get("peak_running"), "{:d}"), "", ">= 256 (16)", ("", cmp(d.get("peak_running"), ">=", 256)))
        add("d", "stopped because; KV stats at the peak", f"{d['stop_reason']}; {kv or '-'}")
    for key, limit in (("hf1", 20), ("hf64", 8)):
        if (hf.get(key) or {}).get("tok_s") or (hfe.get(key) or {}).get("tok_s"):
            add("hf", f"engine tok/s, {shape(key)}", _f((hfe.get(key) or (a if key == "hf1" else {})).get("tok_s"), "{:,.1f}"))
            add("hf", f"HF generate tok/s, {shape(key)}", _f((hf.get(key) or {}).get("tok_s"), "{:,.1f}"))
            ratio = (hf.get(key) or {}).get("engine_over_hf")
            add("hf", f"engine / HF, {shape(key)}", _f(ratio, "{:.2f}x"), "", f">= {limit}x (17)", ("", cmp(ratio, ">=", limit)))
    if ctx.results["shape"]["name"] == "moonlight":
        rows += moonlight_rows(ctx, a, b, c, e, hf)
    prof = R.get("profile") or {}
    if prof.get("classes_ms_per_step"):
        top = ", ".join(f"{k} {v:.2f}" for k, v in list(prof["classes_ms_per_step"].items())[:5])
        add("profile", f"{prof['case']}:{prof['phase']} ms/step: wall / device busy / top op classes",
            f"{prof['wall_per_step_ms']:.2f} / {prof['busy_per_step_ms']:.2f} / {top}")
    return rows


# Issue 49's targets at the GPT-OSS shape, set on an H200; on another GPU the latency limits of (c) scale by the copy
# bandwidth measured there against the H200's (4.15-4.23 TB/s measured copy bandwidth, docs/benchmarks.md).
H200_COPY_BYTES_PER_S = 4.2e12


def gpt_oss_report_rows(ctx) -> list[tuple[str, ...]]:
    """report_rows for the GPT-OSS shape: issue 49's targets ((a) and (b) as shares of their rooflines)."""
    R, rows = ctx.results["cases"], []
    real = ctx.args.scale == 1.0
    bw = (getattr(ctx, "bandwidth", None) or {}).get("bytes_per_s")  # None when the run stopped before measuring
    slower = max(1.0, H200_COPY_BYTES_PER_S / bw) if bw else 1.0

    def add(case, metric, value, roof="", target="", *checks):
        met = ", ".join(f"{label}{'yes' if ok else 'no'}" for label, ok in checks if ok is not None)
        rows.append((case, metric, value, roof, target, met if real or not met else "n/a (not the full shape)"))

    def ge(x, limit):
        return None if x is None else x >= limit

    def shape(key):
        n, p, o = ctx.sizes[key]
        return f"{n} x ({p} + {o})"

    for key, c in R.items():
        if c.get("status") != "ok":
            add(key, "status", f"{c.get('status')}: {str(c.get('error') or c.get('reason') or '')[:160]}")
    a, b, e, c = (R.get(k) or {} for k in "abec")
    hf = R.get("hf") or {}
    if a.get("reps"):
        add("a", f"decode ITL p50, {shape('a')}", _ms(a.get("itl_p50_s")),
            _f(a.get("pct_of_roofline"), "{:.0f}% of " + _ms(a.get("roofline_s")), ""), ">= 50% of roofline (49)",
            ("", ge(a.get("pct_of_roofline"), 50)))
        add("a", "output tok/s", _f(a.get("tok_s"), "{:,.1f}"))
    if b.get("reps"):
        add("b", f"output tok/s, {shape('b')}", _f(b.get("tok_s"), "{:,.1f}"),
            _f(b.get("pct_of_roofline"), "{:.0f}% of " + _f(b.get("roofline_tok_s"), "{:,.0f}"), ""),
            ">= 50% of the hit-experts bound (49)", ("", ge(b.get("pct_of_roofline"), 50)))
        add("b", "decode ITL p50", _ms(b.get("itl_p50_s")), f"step roofline {_ms(b.get('step_roofline_s'))}")
        add("b", "TTFT p50", _ms(b.get("ttft_p50_s")))
    if e.get("pairs"):
        r = e.get("tok_s_ratio_median")
        add("e", f"capture on/off tok/s, median of {len(e['pairs'])} pairs", _f(r, "{:.4f}"), "", "within 1% (49)",
            ("", abs(r - 1) <= 0.01))
    if c.get("reps"):
        itl, ttft = 0.025 * slower, 4.0 * slower
        add("c", f"decode ITL p50, {shape('c')}", _ms(c.get("itl_p50_s")), f"step roofline {_ms(c.get('step_roofline_s'))}",
            f"<= {itl * 1e3:.1f} ms (49: 25 ms on an H200, x{slower:.2f} by bandwidth)",
            ("", None if c.get("itl_p50_s") is None else c["itl_p50_s"] <= itl))
        add("c", "TTFT p50", _ms(c.get("ttft_p50_s")), "", f"<= {ttft:.2f} s (49)",
            ("", None if c.get("ttft_p50_s") is None else c["ttft_p50_s"] <= ttft))
        add("c", "prefill matmul TFLOP/s (all prompts / last first token)", _f(c.get("prefill_tflop_s"), "{:,.1f}"),
            _f(c.get("prefill_pct_of_peak"), "{:.0f}% of bf16 peak", ""))
    for key, limit in (("hf1", 20), ("hf64", None)):
        ratio = (hf.get(key) or {}).get("engine_over_hf")
        if ratio is not None or (hf.get(key) or {}).get("tok_s"):
            add("hf", f"HF generate tok/s, {shape(key)}", _f((hf.get(key) or {}).get("tok_s"), "{:,.1f}"))
            add("hf", f"engine / HF, {shape(key)}", _f(ratio, "{:.2f}x"), "", f">= {limit}x (49)" if limit else "",
                ("", ge(ratio, limit) if limit else None))
    return rows


def moonlight_rows(ctx, a, b, c, e, hf) -> list[tuple[str, ...]]:
    """Issue 48's targets for the Moonlight-16B-A3B shape: (a) >= 50% of the batch-1 roofline, (b) >= 50% of the step
    roofline (every hit expert's weights read once per step), (c) ITL <= 20 ms and TTFT <= 3 s on an H200 (scaled by
    nominal HBM bandwidth on other GPUs: H100 SXM x 1.43), capture on/off within 1%, >= 20x transformers at batch 1."""
    gpu = ctx.results["environment"].get("gpu") or ""
    nominal = next((bw for key, bw in (("H200", 4.8e12), ("H100", 3.35e12)) if key in gpu), None)
    f = 4.8e12 / nominal if nominal else None
    real = ctx.args.scale == 1.0 and f is not None

    def row(case, metric, value, target, ok):
        met = ("yes" if ok else "no") if real and ok is not None else ("n/a" if not real else "")
        return case, metric, value, "", target, met

    rows = []
    if a.get("pct_of_roofline") is not None:
        rows.append(row("a (48)", "batch-1 decode, % of roofline", f"{a['pct_of_roofline']:.0f}%", ">= 50%",
                        a["pct_of_roofline"] >= 50))
    if b.get("pct_of_roofline") is not None:
        rows.append(row("b (48)", "64 x (1024 + 256) tok/s, % of step roofline", f"{b['pct_of_roofline']:.0f}%",
                        ">= 50%", b["pct_of_roofline"] >= 50))
    if c.get("itl_p50_s") is not None and f is not None:
        rows.append(row("c (48)", "decode ITL p50", _ms(c["itl_p50_s"]), f"<= {20 * f:.1f} ms ({gpu})",
                        c["itl_p50_s"] <= 0.020 * f))
    if c.get("ttft_p50_s") is not None and f is not None:
        rows.append(row("c (48)", "TTFT p50", _ms(c["ttft_p50_s"]), f"<= {3 * f:.2f} s ({gpu})",
                        c["ttft_p50_s"] <= 3.0 * f))
    if e.get("tok_s_ratio_median") is not None:
        r = e["tok_s_ratio_median"]
        rows.append(row("e (48)", "capture on/off tok/s", f"{r:.4f}", "within 1%", abs(r - 1) <= 0.01))
    ratio = (hf.get("hf1") or {}).get("engine_over_hf")
    if ratio is not None:
        rows.append(row("hf (48)", "engine / HF at batch 1", f"{ratio:.1f}x", ">= 20x", ratio >= 20))
    return rows


def markdown(ctx) -> str:
    res, env = ctx.results, ctx.results["environment"]
    bw = res.get("bandwidth", {}).get("bytes_per_s")
    load = res["cases"].get("b", {}).get("routing_load") or {}
    load = (f"busiest expert {load['max_over_mean']:.2f}x the mean, {load['distinct_per_step']:.1f} experts per layer "
            f"per step (uniform: {load['distinct_uniform']:.1f})") if load else "not measured"
    changed = env.get("git_uncommitted") or []
    # A copy of the tree whose .git is older than its files (a remote run) shows as a commit plus changes.
    code = env.get("git_commit", "?") + (f" with {len(changed)} files changed or added since ("
                                         f"{', '.join(c[3:] for c in changed[:4])}{', ...' if len(changed) > 4 else ''})"
                                         if changed else "")
    lines = [
        f"# Real-shape benchmark: {res['shape']['name']} (scale {ctx.args.scale}), {env.get('gpu') or env['device']}",
        "",
        f"`{res['command']}` at {res['timestamp_utc']}; git {code}; torch {env['torch']}, "
        f"triton {env.get('triton', '-')}, transformers {env.get('transformers', '-')}; {env['dtype']}.",
        f"Random weights, {ctx.args.init} init (real_shape_model.py): not a trained model's routing; what the warm-up "
        f"of b routed: {load}. Copy bandwidth {_f(bw and bw / 1e9, '{:,.0f}')} GB/s; batch-1 roofline "
        f"{_ms(res.get('roofline', {}).get('batch1_s'))} ({_f(res.get('roofline', {}).get('batch1_bytes', 0) / 1e9, '{:.2f}')} "
        "GB of weights per token). Step rooflines: the weights a batch reads under uniform routing + its KV cache at "
        "the mean context. Targets: (16) issue 16, (17) issue 17, (49) issue 49.",
        "",
        "| case | metric | value | % of roofline | target | met |",
        "|---|---|---:|---|---|---|",
    ]
    lines += ["| " + " | ".join(r) + " |" for r in report_rows(ctx)]
    return "\n".join(lines) + "\n"


def _clean(x):
    if isinstance(x, float) and not np.isfinite(x):
        return None
    if isinstance(x, dict):
        return {str(k): _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    if isinstance(x, (np.integer, np.floating)):
        return x.item()
    return x


def write_outputs(ctx) -> None:
    ctx.results["wall_s"] = time.perf_counter() - T0
    (ctx.out / "results.json").write_text(json.dumps(_clean(ctx.results), indent=2, default=str))
    (ctx.out / "report.md").write_text(markdown(ctx))


def environment(device: torch.device, dtype: torch.dtype) -> dict:
    from moe_engine.engine import EngineConfig

    env = {"python": platform.python_version(), "platform": platform.platform(), "torch": torch.__version__,
           "torch_cuda": torch.version.cuda, "device": str(device), "dtype": str(dtype).removeprefix("torch."),
           "engine_config_fields": [f.name for f in dataclasses.fields(EngineConfig)]}
    for mod in ("triton", "transformers"):
        try:
            env[mod] = __import__(mod).__version__
        except ImportError:
            env[mod] = None
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / 2**30, 1),
                   gpu_sms=props.multi_processor_count)
    try:
        git = ["git", "-C", str(REPO)]
        env["git_commit"] = subprocess.check_output(git + ["rev-parse", "HEAD"], text=True, stderr=subprocess.DEVNULL).strip()
        env["git_uncommitted"] = subprocess.check_output(
            git + ["status", "--porcelain", "--", "backends", "loadtest"], text=True, stderr=subprocess.DEVNULL).splitlines()
    except (OSError, subprocess.CalledProcessError):
        env["git_commit"] = os.environ.get("GIT_COMMIT", "unknown (no git checkout)")
    return env


# ----------------------------------------------------------------------------- main


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--cases", default=None, help="comma list of a,b,c,d,e,hf (default: all; none with --profile)")
    p.add_argument("--shape", default=rsm.REAL_SHAPE, choices=sorted(rsm.SHAPES))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float32", "float16"),
                   help="auto: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--scale", type=float, default=1.0, help="multiply every prompt/output length and request count")
    p.add_argument("--quick", action="store_true", help="fewer repetitions (a 3, b/c 1, e 3 pairs, HF 1), short HF "
                   "warm-up, 150 s per case, 500 s in all: about 5 minutes on an H200")
    p.add_argument("--e-shape", default="b", choices=("a", "b"), help="case e (capture on/off) at this case's shape")
    p.add_argument("--reps", type=int, default=None, help="repetitions of every case (e: pairs)")
    p.add_argument("--case-timeout", type=float, default=None, help="seconds per case (default 150 quick, 900)")
    p.add_argument("--time-budget", type=float, default=None, help="seconds for the whole run; cases that would "
                   "start later are skipped (default 500 quick, none)")
    p.add_argument("--out", default=None, help="directory for results.json, report.md, profile traces")
    p.add_argument("--profile", default=None, metavar="CASE[:decode|prefill]",
                   help="torch.profiler over --profile-steps steps of case a, b, c or e (decode by default)")
    p.add_argument("--profile-steps", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dump-stacks", type=float, default=None, metavar="S",
                   help="every S seconds, every thread's Python stack into <out>/stacks.txt (where a long start-up or "
                        "a slow case spends its time)")
    p.add_argument("--step-trace", action="store_true", help="time every step of the timed reps (host launch, "
                   "GPU span and idle by CUDA events) and log where each rep's wall time went")
    p.add_argument("--init", default="balanced", choices=rsm.INITS, help="random weights: balanced (near-uniform "
                   "routing, the default) or std0.02 (every weight normal(0, 0.02): routing collapses); see real_shape_model.py")
    p.add_argument("--warmup-tokens", type=int, default=16, help="output tokens of each case's warm-up run")
    p.add_argument("--threads", type=int, default=1, help="torch threads on CPU (0: torch's default)")
    p.add_argument("--d-stall-s", type=float, default=10.0, help="case d stops when its peak has not grown this long")
    g = p.add_argument_group("engine (passed where the installed EngineConfig has the field)")
    g.add_argument("--max-num-batched-tokens", type=int, default=None)
    g.add_argument("--quantization", default=None, choices=("fp8", "mxfp4"),
                   help="fp8: the random weights quantised to W8A8 block FP8 on the device (loadtest/bench/bench_fp8.py "
                        "compares with bf16 in one run); mxfp4 (GPT-OSS shapes): the experts quantised to MXFP4 on "
                        "the device and served packed (mxfp4_load.pack_in_memory), as a gpt-oss checkpoint on a GPU")
    g.add_argument("--kv-cache-dtype", default=None, choices=("auto", "fp8", "fp8_e4m3"),
                   help="fp8: FP8 (e4m3) KV blocks with scales 1.0; run once with and once without to compare case c's "
                        "ITL and case d's KV tokens with the bf16 cache")
    g.add_argument("--block-size", type=int, default=None)
    g.add_argument("--gpu-memory-utilization", type=float, default=None)
    g.add_argument("--kv-cache-memory", type=float, default=None, help="GiB")
    g.add_argument("--enforce-eager", action="store_true")
    g.add_argument("--no-fused-kernels", action="store_true")
    g.add_argument("--exact-kernels", action="store_true", help="only the bit-identical fused kernels")
    g.add_argument("--disable-expert-load", action="store_true",
                   help="no expert-load counts (on by default: tokens per MoE layer and expert, counted each step)")
    g.add_argument("--enable-deterministic-inference", action="store_true",
                   help="the batch-invariant forward (VLLM_BATCH_INVARIANT=1 in the environment does the same)")
    g.add_argument("--dense-prefill-min", type=int, default=None,
                   help="attention.DENSE_PREFILL_MIN_TOKENS for this run (prompts from position 0 this long take "
                        "dense causal SDPA; a huge value: the paged kernel for every prefill)")
    g = p.add_argument_group("transformers")
    g.add_argument("--hf-attn", default=None, help="attn_implementation (default: transformers' choice)")
    g.add_argument("--hf-experts", default=None, help="experts_implementation (default: transformers' choice)")
    args = p.parse_args(argv)
    cases = [] if args.cases is None and args.profile else (args.cases or ",".join(CASES)).split(",")
    bad = set(cases) - set(CASES)
    if bad:
        p.error(f"unknown cases {sorted(bad)}; known: {', '.join(CASES)}")
    args.case_list = [c for c in CASES if c in cases]
    if args.shape in rsm.MXFP4_ONLY:  # its bf16 experts fit no GPU: built packed, and transformers cannot hold it
        if args.quantization != "mxfp4":
            p.error(f"--shape {args.shape} is built with MXFP4 experts only: add --quantization mxfp4")
        if "hf" in args.case_list:
            p.error(f"--shape {args.shape}: no transformers case (bf16 experts; compare with gpt-oss-120b-8l)")
    return args


class Ctx:
    """Everything the cases share: arguments, device, model, sizes, engine groups, results."""

    def __init__(self, args):
        self.args = args
        self.device = torch.device(args.device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        auto = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        self.dtype = auto if args.dtype == "auto" else getattr(torch, args.dtype)
        self.elem = torch.empty((), dtype=self.dtype).element_size()
        self.raw = rsm.SHAPES[args.shape]

        def scaled(n, p, o):
            return (max(1, round(n * args.scale)), max(4, round(p * args.scale)), max(8, round(o * args.scale)))

        self.sizes = {k: scaled(*v) for k, v in SIZES.items()}
        short = [self.sizes[k] for k in ("a", "b", "hf1", "hf64")]
        n_d, p_d, o_d = self.sizes["d"]
        short_group = {"max_num_seqs": max(n for n, _, _ in short), "max_model_len": max(p + o for _, p, o in short)}
        self.groups = {
            "short": short_group,
            "long": {"max_num_seqs": self.sizes["c"][0], "max_model_len": sum(self.sizes["c"][1:])},
            "short_capture": {**short_group, "expert_load": False},  # case e: a step without routing captures nothing
            "capacity": {"max_num_seqs": n_d, "max_model_len": max(p_d + o_d, round(D_MAX_MODEL_LEN * args.scale)),
                         "max_waiting": max(1024, n_d + 16)},
        }
        q = args.quick
        self.reps = {k: args.reps or v for k, v in {"a": 3 if q else 5, "b": 1 if q else 3, "c": 1 if q else 3,
                                                     "e": 3, "hf": 1 if q else 2}.items()}
        self.case_timeout = args.case_timeout or (150.0 if q else 900.0)
        budget = args.time_budget if args.time_budget is not None else (500.0 if q else 0.0)
        self.end = T0 + budget if budget > 0 else float("inf")
        self.out = Path(args.out) if args.out else REPO / "loadtest" / "results" / (
            "real_shape-" + dt.datetime.now().strftime("%Y%m%d-%H%M%S"))
        self.out.mkdir(parents=True, exist_ok=True)
        self.engines = Engines(self)
        self.model = self.cfg = None
        self.tokens: dict = {}
        self.current: dict = {}
        self.deadline = float("inf")
        self.peak_flops = rsm.bf16_dense_peak_flops(self.device) if self.dtype == torch.bfloat16 else None


def run_case(ctx, name: str) -> None:
    now = time.perf_counter()
    case = ctx.results["cases"].setdefault(name, {})
    ctx.current = case
    if now >= ctx.end:
        case.update(status="skipped", reason="time budget spent")
        log(f"case {name}: skipped (time budget spent)")
        write_outputs(ctx)
        return
    ctx.deadline = now + min(ctx.case_timeout, ctx.end - now)
    log(f"case {name}: start (time limit {ctx.deadline - now:.0f} s)")
    try:
        CASE_FUNCS.get(name, profile_case)(ctx)
        case["status"] = "ok"
    except Exception as e:  # noqa: BLE001 - one case failing must not lose the others
        case.update(status="timeout" if isinstance(e, CaseTimeout) else "error", error=f"{type(e).__name__}: {e}")
        if not isinstance(e, CaseTimeout):
            case["traceback"] = traceback.format_exc()
            print(case["traceback"], flush=True)
        log(f"case {name}: {case['status']}: {case['error']}")
        ctx.engines.close()  # the next case starts from a fresh engine
    case["elapsed_s"] = time.perf_counter() - now
    try:
        derive(ctx, name, case)
        if ctx.engines.engine is not None:
            case["engine"] = {**ctx.engines.info, "stats_after": ctx.engines.engine.stats()}
            log(f"engine stats() after {name}: {case['engine']['stats_after']}")
    except Exception as e:  # noqa: BLE001
        case["derive_error"] = f"{type(e).__name__}: {e}"
    log(f"case {name}: {case['status']} in {case['elapsed_s']:.1f} s")
    write_outputs(ctx)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.device == "cpu" and args.threads > 0:
        torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.WARNING, stream=sys.stdout, format="%(name)s %(levelname)s: %(message)s")
    logging.getLogger("moe_engine").setLevel(logging.INFO)  # the engine's own line: KV cache, graphs, kernels
    if args.dense_prefill_min is not None:
        from moe_engine.layers import attend
        attend.DENSE_PREFILL_MIN_TOKENS = args.dense_prefill_min
    ctx = Ctx(args)
    if args.dump_stacks:
        stacks = open(ctx.out / "stacks.txt", "w")  # noqa: SIM115 - open for the process's whole life
        faulthandler.dump_traceback_later(args.dump_stacks, repeat=True, file=stacks)
    ctx.results = {"benchmark": "loadtest/bench/bench_real_shape.py",
                   "command": " ".join(["bench_real_shape.py", *(argv or sys.argv[1:])]),
                   "timestamp_utc": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                   "environment": environment(ctx.device, ctx.dtype), "shape": {"name": args.shape, "config": ctx.raw},
                   "sizes": ctx.sizes, "engine_groups": ctx.groups, "reps": ctx.reps, "cases": {}}
    log(f"{args.shape} on {ctx.device} ({ctx.results['environment'].get('gpu', platform.processor())}), "
        f"{ctx.results['environment']['dtype']}; cases {','.join(args.case_list) or '-'}; out {ctx.out}")
    try:
        ctx.bandwidth = ctx.results["bandwidth"] = rsm.measure_copy_bandwidth(ctx.device)
        log(f"copy bandwidth {ctx.bandwidth['bytes_per_s'] / 1e12:.3f} TB/s (best {ctx.bandwidth['best_bytes_per_s'] / 1e12:.3f})")
        t = time.perf_counter()
        log(f"building the engine model with random weights ({args.init} init) ...")
        mxfp4 = args.quantization == "mxfp4"  # GPT-OSS experts as gpt-oss checkpoints store them, packed on the GPU
        try:
            ctx.model, ctx.cfg = rsm.build_engine_model(ctx.raw, ctx.device, ctx.dtype, args.seed, args.init, log,
                                                        mxfp4=mxfp4)
        except ValueError as err:  # no GPT-OSS experts to pack
            raise SystemExit(f"--quantization mxfp4: {err}") from None
        if args.quantization == "fp8":  # W8A8 block FP8, quantised on the device (bench_fp8.py: paired with bf16)
            from moe_engine import fp8_load

            fp8_load.install_fp8(ctx.model, fp8_load.quantize_in_memory(ctx.model, fp8_load.target_names(ctx.model)))
            rsm.free_device_memory(ctx.device)
            log("dense projections and experts quantised to FP8 (128 x 128 blocks); rooflines below count bf16 bytes")
        expert_bytes = None
        if mxfp4:
            from moe_engine import mxfp4_load

            packed = mxfp4_load.packed_bytes(ctx.model)
            expert_bytes = 17 / 32  # 4 bits a weight + one 8-bit scale per 32
            log(f"experts quantised to MXFP4 and kept packed ({packed / 2**30:.2f} GiB); the batch-1 roofline counts "
                "their packed bytes, the batched decode rooflines bf16 bytes")
        ctx.results["model_build_s"] = time.perf_counter() - t
        per_token = rsm.weight_bytes_per_token(ctx.cfg, ctx.elem, expert_bytes)
        total = sum(per_token.values())
        ctx.roofline = ctx.results["roofline"] = {"bytes": per_token, "batch1_bytes": total,
                                                   "batch1_s": total / ctx.bandwidth["bytes_per_s"]}
        log(f"model built in {ctx.results['model_build_s']:.1f} s; weight bytes one decode token reads:")
        for k, v in per_token.items():
            log(f"  {k:60s} {v / 1e9:8.4f} GB")
        log(f"  {'total':60s} {total / 1e9:8.4f} GB -> roofline {ctx.roofline['batch1_s'] * 1e3:.3f} ms/token")
        write_outputs(ctx)
        order = [c for c in ("a", "b", "e") if c in args.case_list]
        order += ["hf_engine"] if "hf" in args.case_list else []
        order += [c for c in ("c", "d") if c in args.case_list]
        order += ["profile"] if args.profile else []
        order += ["hf"] if "hf" in args.case_list else []
        for name in order:
            run_case(ctx, name)
    finally:
        ctx.engines.close()
        write_outputs(ctx)
    print("\n" + markdown(ctx), flush=True)
    log(f"done; {ctx.out / 'results.json'}, {ctx.out / 'report.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
