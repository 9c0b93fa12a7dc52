#!/usr/bin/env python
"""Sampling cost of one decode step on a GPU: the old per-row loop vs the batched sampler.

What it measures
----------------
Logits [N, 151936] float32 (Qwen3's vocabulary) on the GPU, N in {1, 16, 64, 256}, for these mixes (every
sampled row seeded, as RL rollouts are):

  greedy            temperature 0
  temp1             temperature 1
  topp0.9+topk50    temperature 1, top-p 0.9, top-k 50
  temp1+logprobs5   temperature 1, logprobs 5 (chosen + top 5)
  topp0.9           temperature 1, top-p 0.9 alone (the nucleus from 1024 top-k candidates)
  topp0.9-flat      the same on flat logits (standard normal): nuclei of ~10^5 tokens, past the candidates,
                    settled by the in-kernel bisection (the worst case; full run only)

Logits are "peaked" (1.5 x standard normal, plus 64 tokens raised by ~N(12, 2)): nuclei of a few to a few
tens of tokens, as an LM's usually are. Per (N, mix), median microseconds over the repetitions, each timed
with CUDA events around one step after a synchronize (so a host-bound loop counts its launch time):

  old      the sampler as it was before this rewrite (copied below): a Python loop over rows, several kernels
           per sampled row, a torch.Generator per seeded request; plus the engine's compute_logprobs
  new      Sampler.prepare (one host->device copy) + Sampler.sample + Sampler.logprobs
  graph    Sampler.prepare + one replay of a CUDA graph holding sample + logprobs

Checks on every case (reported, never silent): greedy tokens equal torch.argmax; filtered tokens lie inside
the exact kept set (threshold from a full sort); the graph's tokens equal the eager call's (same seeds and
draw indices, so the same noise).

    .venv/bin/python loadtest/bench/bench_sampling.py            # about 2-3 minutes on an H200
    .venv/bin/python loadtest/bench/bench_sampling.py --quick    # N in {1, 64}, 10 repetitions: under a minute

A markdown table on stdout; a JSON file under loadtest/results/.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "backends"))

import torch  # noqa: E402

from moe_engine.core.sampling import Sampler, SamplingParams, compute_logprobs, make_state  # noqa: E402

V = 151_936
DEVICE = "cuda"
MIXES = {
    "greedy": dict(temperature=0.0),
    "temp1": dict(temperature=1.0),
    "topp0.9+topk50": dict(temperature=1.0, top_p=0.9, top_k=50),
    "temp1+logprobs5": dict(temperature=1.0, logprobs=5),
    "topp0.9": dict(temperature=1.0, top_p=0.9),
    "topp0.9-flat": dict(temperature=1.0, top_p=0.9),
}


def progress(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ---- the sampler before the rewrite (moe_engine/sampling.py at de221cd), as the baseline -----------------
def old_generators(params: list[SamplingParams], device) -> list[torch.Generator | None]:
    gens = []
    for p in params:
        g = None
        if p.seed is not None and not p.greedy:
            g = torch.Generator(device=device)
            g.manual_seed(p.seed & 0xFFFF_FFFF_FFFF_FFFF)
        gens.append(g)
    return gens


def old_filter_logits(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    logits = logits / p.temperature
    if p.top_k > 0 and p.top_k < logits.shape[-1]:
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cum = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
        drop_sorted = (cum - torch.softmax(sorted_logits, dim=-1)) >= p.top_p
        logits = logits.masked_fill(torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted), float("-inf"))
    return logits


def old_step(logits: torch.Tensor, params: list[SamplingParams], gens: list) -> torch.Tensor:
    out = torch.argmax(logits, dim=-1)
    for i, p in enumerate(params):
        if p.greedy:
            continue
        probs = torch.softmax(old_filter_logits(logits[i], p), dim=-1)
        race = torch.empty_like(probs).exponential_(generator=gens[i])
        out[i] = torch.argmax(probs / race)
    top_n = max((p.logprobs for p in params if p.logprobs is not None), default=-1)
    if top_n >= 0:
        compute_logprobs(logits, out, top_n)
    return out


# ---- measurement ------------------------------------------------------------------------------------------
def make_logits(n: int, flat: bool, gen: torch.Generator) -> torch.Tensor:
    x = torch.randn(n, V, generator=gen, device=DEVICE)
    if flat:
        return x
    x *= 1.5
    spikes = torch.randint(0, V, (n, 64), generator=gen, device=DEVICE)
    x.scatter_add_(1, spikes, 12 + 2 * torch.randn(n, 64, generator=gen, device=DEVICE))
    return x.contiguous()


def time_us(fn, reps: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def exact_floor(x: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The smallest logit each row may sample (the module doc's rule, by a full sort)."""
    vals = torch.sort(x, dim=-1, descending=True).values
    t_k = vals[:, p.top_k - 1] if p.top_k > 0 else torch.full_like(vals[:, 0], float("-inf"))
    if p.top_p >= 1:
        return t_k
    e = torch.where(vals >= t_k[:, None], torch.exp((vals - vals[:, :1]) / p.temperature), torch.zeros_like(vals))
    incl = torch.cumsum(e, -1)
    count = ((incl < p.top_p * incl[:, -1:]).sum(-1) + 1).clamp(max=V)
    return torch.maximum(t_k, vals.gather(1, (count - 1)[:, None]).squeeze(1))


def run_case(sampler: Sampler, n: int, mix: str, reps: int, warmup: int, gen: torch.Generator) -> dict:
    params = [SamplingParams(**MIXES[mix], seed=1000 + i) for i in range(n)]
    states = [make_state(p) for p in params]
    gens = old_generators(params, DEVICE)
    logits = make_logits(n, mix.endswith("flat"), gen)
    draw = [0] * n

    def new_step():
        batch = sampler.prepare(states, draw)
        tokens = sampler.sample(logits, batch)
        sampler.logprobs(logits, tokens, batch)
        return tokens

    row = {"N": n, "mix": mix}
    row["old_us"] = time_us(lambda: old_step(logits, params, gens), reps, warmup)
    row["new_us"] = time_us(new_step, reps, warmup)
    eager = new_step()
    checks = []
    if params[0].greedy:
        if not torch.equal(eager, torch.argmax(logits, dim=-1)):
            checks.append("greedy != argmax")
    else:
        floor = exact_floor(logits, params[0])
        outside = int((logits.gather(1, eager[:, None]).squeeze(1) < floor).sum())
        if outside:
            checks.append(f"{outside} tokens outside the kept set")
    try:  # the new path in a CUDA graph, as the runner will capture it
        batch = sampler.prepare(states, draw)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                sampler.logprobs(logits, sampler.sample(logits, batch), batch)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            g_tokens = sampler.sample(logits, batch)
            sampler.logprobs(logits, g_tokens, batch)

        def graph_step():
            sampler.prepare(states, draw)
            graph.replay()

        row["graph_us"] = time_us(graph_step, reps, warmup)
        graph_step()
        if not torch.equal(g_tokens, eager):
            checks.append("graph tokens != eager tokens")
    except Exception as e:  # reported in the table, the other cases still run
        row["graph_us"] = None
        checks.append(f"graph capture failed: {type(e).__name__}: {e}"[:200])
    row["checks"] = "; ".join(checks) or "ok"
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="N in {1, 64}, 10 repetitions, no flat case")
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--batch", type=int, nargs="*", default=None, help="row counts (default 1 16 64 256)")
    ap.add_argument("--candidates", type=int, default=1024, help="Sampler(candidates=...)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_sampling.py needs a CUDA GPU")
    sizes = args.batch or ([1, 64] if args.quick else [1, 16, 64, 256])
    reps = args.reps or (10 if args.quick else 50)
    warmup = 2 if args.quick else 5
    mixes = [m for m in MIXES if not (args.quick and m.endswith("flat"))]
    import triton

    env = {
        "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
        "vocab": V, "reps": reps, "candidates": args.candidates,
    }
    progress(f"{env}")
    sampler = Sampler(V, DEVICE, max_rows=max(sizes), candidates=args.candidates)
    assert sampler.use_triton, "the Triton path is not selected on this GPU"
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    rows = []
    for n in sizes:
        for mix in mixes:
            rows.append(run_case(sampler, n, mix, reps, warmup, gen))
            r = rows[-1]
            progress(f"N={n} {mix}: old {r['old_us']:.0f} us, new {r['new_us']:.0f} us, graph {r['graph_us']} ({r['checks']})")

    print(f"\nSampling one step, V={V}, {env['gpu']}, torch {env['torch']}, Triton {env['triton']}; "
          f"median of {reps} (CUDA events), microseconds\n")
    print("| N | mix | old (per-row loop) | new (batched) | new in a CUDA graph | old / new | checks |")
    print("|---:|---|---:|---:|---:|---:|---|")
    for r in rows:
        graph = "n/a" if r["graph_us"] is None else f"{r['graph_us']:.0f}"
        print(f"| {r['N']} | {r['mix']} | {r['old_us']:.0f} | {r['new_us']:.0f} | {graph} | "
              f"{r['old_us'] / r['new_us']:.1f}x | {r['checks']} |")
    out = REPO / "loadtest" / "results" / f"bench_sampling-{dt.datetime.now():%Y%m%d-%H%M%S}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"env": env, "rows": rows}, indent=1))
    progress(f"wrote {out}")


if __name__ == "__main__":
    main()
