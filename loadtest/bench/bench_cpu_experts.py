#!/usr/bin/env python
"""One MoE layer's experts on CPU in float32, the two GEMM operand orders per expert: ``x @ W.T`` (torch's
grouped GEMM and F.linear: MKL with the weights transposed) against ``W @ x.T`` (the weights as the left
operand; ``Experts._forward_cpu`` for experts with fewer than CPU_WEIGHT_LEFT_MAX_ROWS rows), at the Mixtral
shape of bench_vs_vllm_cpu.py (8 experts, hidden 512, intermediate 1024, top-2), 1 thread. Each expert's weights
(12 MiB) are read once per call: a decode step is memory-bound, and the order decides how fast MKL streams them.

    .venv/bin/python loadtest/bench/bench_cpu_experts.py [--rows 1,2,4,8,16]

Prints per row count (rows per expert) the median ms of every hit expert's two projections, the orders
alternating (the machine may be shared), and their max difference (float32 rounding of another blocking).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="1,2,4,8,16", help="rows per expert")
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--intermediate", type=int, default=1024)
    p.add_argument("--reps", type=int, default=20)
    args = p.parse_args()
    torch.set_num_threads(1)
    E, H, I = args.experts, args.hidden, args.intermediate
    gate_up = torch.randn(E, 2 * I, H) * 0.02  # [E, 2I, H] as Experts holds it
    down = torch.randn(E, H, I) * 0.02  # [E, H, I]

    def weights_right(xs):  # x @ W.T per expert
        out = []
        for e, x in enumerate(xs):
            gate, up = F.linear(x, gate_up[e]).chunk(2, dim=-1)  # [n, I] each
            out.append(F.linear(F.silu(gate) * up, down[e]))  # [n, H]
        return out

    def weights_left(xs):  # W @ x.T per expert
        out = []
        for e, x in enumerate(xs):
            h = torch.mm(gate_up[e], x.t())  # [2I, n]
            act = (F.silu(h[:I]) * h[I:]).t().contiguous()  # [n, I]
            out.append(torch.mm(down[e], act.t()).t())  # [n, H]
        return out

    print(f"{E} experts, hidden {H}, intermediate {I}, float32, 1 thread; median of {args.reps} alternating reps")
    print("| rows per expert | x @ W.T ms | W @ x.T ms | ratio | max diff |")
    print("|---:|---:|---:|---:|---:|")
    for n in (int(r) for r in args.rows.split(",")):
        xs = [torch.randn(n, H) for _ in range(E)]
        diff = max((a - b).abs().max().item() for a, b in zip(weights_right(xs), weights_left(xs)))
        times = {weights_right: [], weights_left: []}
        for rep in range(args.reps):
            for f in (weights_right, weights_left) if rep % 2 == 0 else (weights_left, weights_right):
                t0 = time.perf_counter()
                f(xs)
                times[f].append(time.perf_counter() - t0)
        a, b = (statistics.median(times[f]) * 1e3 for f in (weights_right, weights_left))
        print(f"| {n} | {a:.2f} | {b:.2f} | {b / a:.2f} | {diff:.1e} |")


if __name__ == "__main__":
    main()
