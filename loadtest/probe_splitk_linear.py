"""Probe (not used by the engine): split-K GEMM for a decode step's dense projections, reduced in the same launch.

At 64 decode rows the q/k/v, o and router projections run in cuBLAS at 1.7-2.7 TB/s (1.1 ms of (b)'s 17.7 ms decode
step for 0.43 ms of weight bytes; ``real_shape/run31_profile_b.txt``). A Triton GEMM without a split over K has too
few programs to stream the weights at full bandwidth, and with one the reduction launch cuBLAS pays comes back
(``run52_53_skinny_linear_h100.txt``). Here the split's partial sums go to a float32 workspace and the program that
completes a column tile (an atomic count, release after a CTA barrier) adds the partials in split order, rounds
and writes y, then resets its counter (so a CUDA graph can replay it): one launch, a fixed summation order
(deterministic), no reduction kernel.

Timed against ``F.linear`` (cuBLAS) with 48 weights per CUDA graph at 16-64 rows for Qwen3-30B-A3B's projections
(q/k/v 5120 x 2048, o 2048 x 4096, router 128 x 2048), bf16, and compared with it (within bf16 rounding: another
summation order).

    PYTHONPATH=backends:.:loadtest python3 loadtest/probe_splitk_linear.py            # H200, ~1 min
    TRITON_INTERPRET=1 PYTHONPATH=backends:.:loadtest python3 loadtest/probe_splitk_linear.py --check-cpu
"""
from __future__ import annotations

import argparse
import itertools
import sys

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from moe_engine import paged_attention as pa
from moe_engine.kernels import _await_inputs, interpreting, pdl

PROJECTIONS = {"qkv": (5120, 2048), "o": (2048, 4096), "router": (128, 2048)}  # (N, K)


@triton.jit(do_not_specialize=["M"])
def _splitk_linear_kernel(
    x_ptr, w_ptr, y_ptr, ws_ptr, count_ptr, M, N, K,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr,
    UPCAST: tl.constexpr, PDL: tl.constexpr,
):
    """y[m, n] = x[m, :] . w[n, :] for the M rows (<= BLOCK_M) and column tile program_id(0); program_id(1) sums
    K / SPLIT of the K dimension (K a multiple of SPLIT * BLOCK_K)."""
    _await_inputs(PDL)
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    rows = tl.arange(0, BLOCK_M)
    rmask = rows < M
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < N
    k_per = K // SPLIT
    offs_k = split * k_per + tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + rows[:, None] * K + offs_k[None, :]
    w_ptrs = w_ptr + (cols % N)[None, :].to(tl.int64) * K + offs_k[:, None]  # [BLOCK_K, BLOCK_N]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for _ in range(0, k_per // BLOCK_K):
        a = tl.load(x_ptrs, mask=rmask[:, None], other=0.0)
        w = tl.load(w_ptrs)
        if UPCAST:
            a = a.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(a, w, acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    ws = ws_ptr + (split * BLOCK_M + rows[:, None]) * N + cols[None, :]
    tl.store(ws, acc, mask=rmask[:, None] & cmask[None, :])
    counter = count_ptr + pid_n
    tl.debug_barrier()  # every thread's partial stores precede the release below
    before = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
    if before == SPLIT - 1:
        tl.debug_barrier()  # the acquire above precedes every thread's reads below
        total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for s in tl.static_range(SPLIT):  # split order: the same sum whichever program finishes last
            part = tl.load(ws_ptr + (s * BLOCK_M + rows[:, None]) * N + cols[None, :],
                           mask=rmask[:, None] & cmask[None, :], other=0.0, cache_modifier=".cg")
            total += part
        tl.store(y_ptr + rows[:, None] * N + cols[None, :], total.to(y_ptr.dtype.element_ty),
                 mask=rmask[:, None] & cmask[None, :])
        tl.store(counter, 0)  # ready for the next replay


def splitk_linear(x, w, ws, counters, block_n=64, block_k=128, split=4, warps=4, stages=4):
    """x [M, K] (M <= 64), w [N, K] -> y [M, N] in x's dtype. ws: float32 [split * BLOCK_M * N]; counters: int32
    [cdiv(N, block_n)] zeros (left zero)."""
    M, K = x.shape
    N = w.shape[0]
    block_m = max(16, triton.next_power_of_2(M))
    block_k = min(block_k, K // split)
    assert M <= 64 and K % (split * block_k) == 0 and ws.numel() >= split * block_m * N
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    pa._launch(
        _splitk_linear_kernel, (triton.cdiv(N, block_n), split), x, w, y, ws, counters, M, N, K,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT=split, UPCAST=interpreting(), PDL=pdl(x.device),
        num_warps=warps, num_stages=stages,
    )
    return y


def check_cpu() -> None:
    assert interpreting(), "run with TRITON_INTERPRET=1"
    g = torch.Generator().manual_seed(0)
    for M, N, K, split in ((3, 40, 64, 2), (16, 64, 128, 4), (1, 8, 32, 1)):
        x = torch.randn(M, K, generator=g)
        w = torch.randn(N, K, generator=g)
        ws = torch.empty(split * 16 * N)
        counters = torch.zeros(triton.cdiv(N, 16), dtype=torch.int32)
        y = splitk_linear(x, w, ws, counters, block_n=16, block_k=16, split=split)
        torch.testing.assert_close(y, x @ w.t(), atol=1e-4, rtol=1e-4)
        assert not counters.any()
    print("interpreter: the split-K GEMM equals x @ w.T")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check-cpu", action="store_true")
    p.add_argument("--tokens", default="16,32,64")
    p.add_argument("--reps", type=int, default=20)
    args = p.parse_args()
    if args.check_cpu:
        check_cpu()
        return 0
    import real_shape_model as rsm

    device, layers = torch.device("cuda"), 48
    print(f"{torch.cuda.get_device_name()}; bf16; {layers} weights per CUDA graph; us per call", flush=True)
    for name, (N, K) in PROJECTIONS.items():
        weights = [(torch.randn(N, K, device=device) / K**0.5).to(torch.bfloat16) for _ in range(layers)]
        for T in (int(t) for t in args.tokens.split(",")):
            x = torch.randn(T, K, device=device).to(torch.bfloat16)
            ref_us = rsm.graph_replay_seconds(lambda: [F.linear(x, w) for w in weights], args.reps) * 1e6 / layers
            ref = F.linear(x, weights[0]).float()
            cells = []
            for bn, bk, split, warps, stages in itertools.product((32, 64, 128), (64, 128), (2, 4, 8), (4,), (3, 4)):
                if K % (split * min(bk, K // split)) or (N < bn and bn > 32):
                    continue
                ws = torch.empty(split * 64 * N, device=device)
                counters = torch.zeros(triton.cdiv(N, bn), dtype=torch.int32, device=device)
                try:
                    us = rsm.graph_replay_seconds(
                        lambda: [splitk_linear(x, w, ws, counters, bn, bk, split, warps, stages) for w in weights],
                        args.reps) * 1e6 / layers
                except Exception as exc:  # noqa: BLE001 - a config may not fit: skip it
                    print(f"  {name} T={T} {bn}/{bk}/{split}: {type(exc).__name__}", flush=True)
                    continue
                err = (splitk_linear(x, weights[0], ws, counters, bn, bk, split, warps, stages).float() - ref).abs()
                cells.append((us, f"{bn}/{bk}/split {split}/{stages} stages", err.max().item(),
                              int(counters.count_nonzero())))
            cells.sort()
            best = cells[0]
            gbs = N * K * 2 / best[0] / 1e3
            print(f"{name:>6} {N}x{K} T={T:3d}: cuBLAS {ref_us:6.2f} us ({N * K * 2 / ref_us / 1e3:.0f} GB/s), split-K "
                  f"best {best[1]} {best[0]:6.2f} us ({gbs:.0f} GB/s) {ref_us / best[0]:.3f}x, max |diff| {best[2]:.1e}, "
                  f"counters left {best[3]}; next: " + ", ".join(f"{c[1]} {c[0]:.2f}" for c in cells[1:4]), flush=True)
        del weights
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
