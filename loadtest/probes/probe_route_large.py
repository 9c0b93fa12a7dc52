#!/usr/bin/env python
"""A prefill step's expert grouping at the real shape: ``routing_kernels.route``'s per-chunk counting (two launches, no
host sync) against the torch path it replaced (a stable sort of the pairs, which waits for the GPU, or above 4,096
and up to 16,384 pairs a cumulative sum over an [E, pairs] one-hot table).

For each step size: 48 calls (one per layer, fresh ids each) issued back to back as an eager step issues them,
timed with CUDA events around the 48 (the sort's waits included), median of ``--reps``; the counting also replayed
from one CUDA graph of the 48 calls. Every call's outputs are checked against the sort's.

    PYTHONPATH=backends:. python3 loadtest/probes/probe_route_large.py --out OUT      # one H200: ~20 s
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "backends"))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: loadtest.* when run by path
from moe_engine.kernels import moe_routing as routing_kernels  # noqa: E402
from loadtest.tune.sweep_prefill_tiles import median_ms  # noqa: E402  (CUDA-event timing, median of reps)

E, K, L = 128, 8, 48  # Qwen3-30B-A3B: experts, top-k, layers


def torch_grouping(ids: torch.Tensor, num_experts: int):
    """The grouping the fused experts used above routing_kernels.ROUTE_MAX_PAIRS until this probe's change (experts.py
    ``group_pairs`` at c6591ba): counting up to 16,384 pairs, torch's stable sort above."""
    T, K_ = ids.shape
    flat = ids.t().reshape(-1)
    n = flat.numel()
    if n <= 16384:
        seen = torch.zeros(num_experts, n, dtype=torch.int32, device=ids.device)
        seen.scatter_(0, flat[None, :], 1)
        ranks = seen.cumsum(1, dtype=torch.int32)
        counts = ranks[:, -1]
        ends = counts.cumsum(0, dtype=torch.int32)
        rows = ((ends - counts).gather(0, flat) + ranks.gather(0, flat[None, :])[0] - 1).long()
        tok = torch.empty(n, dtype=torch.long, device=ids.device)
        tok.scatter_(0, rows, torch.arange(n, device=ids.device) % T)
        return rows.view(K_, T).t(), tok, ends
    order = torch.argsort(flat.to(torch.uint8), stable=True)
    counts = torch.zeros(num_experts, dtype=torch.long, device=ids.device)
    counts.scatter_add_(0, flat, torch.ones_like(order))
    pos = torch.empty_like(order).scatter_(0, order, torch.arange(n, device=ids.device))
    return pos.view(K_, T).t(), order % T, torch.cumsum(counts, 0).to(torch.int32)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="1024,2048,4096,8192")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    lines = [f"probe_route_large on {torch.cuda.get_device_name(dev)}; {L} calls per timing, median of {args.reps}"]
    for T in (int(t) for t in args.tokens.split(",")):
        ids = [torch.rand(T, E, device=dev, generator=g).argsort(dim=1)[:, :K].contiguous() for _ in range(L)]
        caps = [torch.empty(T, K, dtype=torch.int32, device=dev) for _ in range(L)]
        for i in range(L):  # the same grouping, and the capture rows
            new, old = routing_kernels.route(ids[i], E, caps[i]), torch_grouping(ids[i], E)
            assert all(torch.equal(a, b) for a, b in zip(new, old)) and torch.equal(caps[i], ids[i].int()), T

        def run_new():
            return [routing_kernels.route(ids[i], E, caps[i]) for i in range(L)]

        def run_old():
            return [(caps[i].copy_(ids[i]), torch_grouping(ids[i], E)) for i in range(L)]

        for fn in (run_new, run_old):
            fn()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run_new()
        t_new, t_old, t_graph = (median_ms(fn, args.reps) for fn in (run_new, run_old, graph.replay))
        old_way = "sort" if T * K > 16384 else "counting"
        lines.append(f"T={T:5d} pairs={T * K:6d}: torch {old_way} {t_old / L * 1e3:7.1f} us/layer, route eager "
                     f"{t_new / L * 1e3:6.1f} us/layer ({t_old / t_new:.1f}x), graph {t_graph / L * 1e3:6.1f} us/layer;"
                     f" outputs equal")
        print(lines[-1], flush=True)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "probe_route_large.txt").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
