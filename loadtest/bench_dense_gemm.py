#!/usr/bin/env python
"""Dense projections of decode-sized steps on a GPU: cuBLAS (F.linear) vs moe_engine/dense_gemm.py.

What it measures
----------------
The attention projections of the Qwen3-30B-A3B shape by default: q/k/v as one weight [5120, 2048] and o
[2048, 4096], bf16, random weights built on the GPU. Per row count M (1 .. 64), the time of one projection:
each timing unit is L calls (one per layer, each on its own weight, as consecutive layers are: 48 x 20 MB is far
beyond the L2) captured in one CUDA graph and replayed (decode steps run as graphs; Python-loop timing of
such short kernels measures the launches, which misled an earlier sweep: real_shape/run9*). Times are medians
over reps of (replay time / L). GB/s counts the weight bytes (what must be read); %HBM is that over --hbm-tbps.

    python3 loadtest/bench_dense_gemm.py                 # table: cuBLAS vs the table's config vs the default
    python3 loadtest/bench_dense_gemm.py --check          # + error against the exact product, per shape and M
    python3 loadtest/bench_dense_gemm.py --tune --write   # sweep tile configs per bucket of M, write the JSON

``--tune`` times a grid of tile configs (BLOCK_N x BLOCK_K x stages at 4 warps, then 2 and 8 warps for the three
best) per bucket of M, at the bucket's representative row counts, and keeps the fastest; a bucket where cuBLAS is
faster than every config gets ``null`` (dense_gemm then calls F.linear). ``--write`` stores the tables in
backends/moe_engine/dense_gemm_configs.json (or $MOE_DENSE_GEMM_CONFIGS), which the engine reads: commit it.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "backends"))

from moe_engine import dense_gemm, kernels  # noqa: E402
from moe_engine.fused_moe import TileConfig  # noqa: E402

ROWS = (1, 2, 4, 8, 16, 24, 32, 48, 64)
# row counts each bucket is tuned on (decode batch sizes; CUDA graphs pad to 1, 2, 4, 8, 16, 24, 32, 48, 64)
TUNE_ROWS = {"1-16": (1, 4, 16), "17-32": (24, 32), "33-64": (48, 64)}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="5120x2048,2048x4096", help="N x K of each weight (default: Qwen3-30B-A3B's "
                   "q/k/v and o)")
    p.add_argument("--rows", type=int, nargs="+", default=list(ROWS))
    p.add_argument("--layers", type=int, default=48, help="weights per timing unit (L)")
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--check", action="store_true", help="also: error against the exact product")
    p.add_argument("--tune", action="store_true", help="sweep tile configs per bucket of M")
    p.add_argument("--write", action="store_true", help="with --tune: write the tables to dense_gemm's JSON")
    p.add_argument("--hbm-tbps", type=float, default=4.3)
    return p.parse_args()


def time_per_call(calls, reps: int) -> float:
    """Median seconds per call over reps of one CUDA graph holding ``calls`` in order."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up (compiles) off the default stream, as capture wants
        for c in calls:
            c()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for c in calls:
            c()
    for _ in range(3):
        g.replay()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / len(calls))
    del g
    return statistics.median(times)


class Shape:
    """L weights [N, K] and, per M, an input and outputs."""

    def __init__(self, N: int, K: int, L: int, device):
        self.N, self.K = N, K
        g = torch.Generator(device=device).manual_seed(N * 7 + K)
        self.w = torch.randn(L, N, K, device=device, generator=g, dtype=torch.bfloat16) / K**0.5
        self.x = {}
        self.y = torch.empty(L, max(ROWS), N, device=device, dtype=torch.bfloat16)

    def input(self, M: int) -> torch.Tensor:
        if M not in self.x:
            self.x[M] = torch.randn(M, self.K, device=self.w.device, dtype=torch.bfloat16)
        return self.x[M]

    def cublas(self, M: int, reps: int) -> float:
        x = self.input(M)
        return time_per_call([lambda l=l: torch.matmul(x, self.w[l].T, out=self.y[l, :M])
                              for l in range(self.w.shape[0])], reps)

    def kernel(self, M: int, cfg: TileConfig, reps: int) -> float:
        x = self.input(M)
        return time_per_call([lambda l=l: dense_gemm.gemm(x, self.w[l], None, cfg, out=self.y[l, :M])
                              for l in range(self.w.shape[0])], reps)

    @property
    def bytes(self) -> int:
        return self.N * self.K * 2


def fits(cfg: TileConfig) -> bool:
    """The pipeline's shared memory within Hopper's 227 KB (with room), accumulators within the registers."""
    smem = cfg.num_stages * (cfg.BLOCK_M + cfg.BLOCK_N) * cfg.BLOCK_K * 2
    return smem <= 200 * 1024 and cfg.BLOCK_M * cfg.BLOCK_N // (32 * cfg.num_warps) <= 128


def tune(shape: Shape, reps: int, t0: float) -> dict[str, tuple[TileConfig | None, float, float]]:
    """bucket -> (best config or None for cuBLAS, its summed time over the bucket's rows, cuBLAS's)."""
    result = {}
    for bucket, top in dense_gemm.BUCKETS:
        rows = TUNE_ROWS[bucket]
        base = sum(shape.cublas(M, reps) for M in rows)
        timed: dict[TileConfig, float] = {}

        def total(cfg: TileConfig) -> float:
            if cfg not in timed:
                try:
                    timed[cfg] = sum(shape.kernel(M, cfg, reps) for M in rows)
                except Exception as err:  # noqa: BLE001  (configs that do not compile: skip them)
                    print(f"  skip {cfg}: {type(err).__name__}: {str(err)[:100]}", flush=True)
                    timed[cfg] = float("inf")
            return timed[cfg]

        for bm in (16, 32, 64):
            if bm > top:
                continue
            for bn in (16, 32, 64):
                for bk in (128, 256):
                    for stages in (3, 4, 6):
                        cfg = TileConfig(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=4, num_stages=stages)
                        if fits(cfg):
                            total(cfg)
        for cfg in sorted(timed, key=timed.get)[:3]:
            for warps in (2, 8):
                if fits(replace(cfg, num_warps=warps)):
                    total(replace(cfg, num_warps=warps))
        best = min(timed, key=timed.get)
        keep = best if timed[best] < base * 0.98 else None  # 2%: below that, cuBLAS keeps it
        result[bucket] = (keep, timed[best], base)
        print(f"{shape.N}x{shape.K} bucket {bucket:>5} rows {rows}: cuBLAS {base / len(rows) * 1e6:.2f} us, best "
              f"{timed[best] / len(rows) * 1e6:.2f} us {best} ({len(timed)} configs) -> "
              f"{'kernel' if keep else 'cuBLAS'}  [{time.monotonic() - t0:.0f} s]", flush=True)
    return result


def check(shape: Shape) -> None:
    for M in ROWS:
        x, w = shape.input(M), shape.w[0]
        cfg = dense_gemm.config_for(M, w) or dense_gemm.DEFAULT_CONFIG
        y = dense_gemm.gemm(x, w, None, cfg)
        exact = x.double() @ w.double().T
        bound = 2.0**-8 * exact.abs() + shape.K * 2.0**-24 * (x.double().abs() @ w.double().abs().T) + 1e-12
        worst = ((y.double() - exact).abs() / bound).max().item()
        same = (y == F.linear(x, w)).float().mean().item()
        print(f"check {shape.N}x{shape.K} M={M:>2} {cfg}: error / bound {worst:.3f} (<= 1 passes), "
              f"{same:.2%} equal to cuBLAS {'ok' if worst <= 1 else 'FAIL'}", flush=True)


def main() -> int:
    args = parse_args()
    if not torch.cuda.is_available() or kernels.interpreting():
        print("bench_dense_gemm: needs a CUDA GPU and TRITON_INTERPRET unset", file=sys.stderr)
        return 2
    t0 = time.monotonic()
    device = torch.device("cuda")
    print(f"bench_dense_gemm on {torch.cuda.get_device_name()}; torch {torch.__version__}; "
          f"L={args.layers} weights per unit, {args.reps} reps", flush=True)
    shapes = [Shape(*map(int, s.split("x")), args.layers, device) for s in args.shapes.split(",")]
    if args.tune:
        for shape in shapes:
            tuned = tune(shape, args.reps, t0)
            if args.write:
                key = dense_gemm.table_key(torch.cuda.get_device_name(), shape.N, shape.K, torch.bfloat16)
                dense_gemm.write_table(dense_gemm.config_path(), key, {b: cfg for b, (cfg, _, _) in tuned.items()})
                print(f"written {key} to {dense_gemm.config_path()}", flush=True)
    print(f"\n{'N x K':>11} {'M':>3} {'cuBLAS us':>10} {'table us':>9} {'default us':>10} {'speedup':>8} "
          f"{'GB/s':>7} {'%HBM':>5}  table config")
    for shape in shapes:
        for M in args.rows:
            cfg = dense_gemm.config_for(M, shape.w[0])
            t_cublas = shape.cublas(M, args.reps)
            t_default = shape.kernel(M, dense_gemm.DEFAULT_CONFIG, args.reps)
            t_table = shape.kernel(M, cfg, args.reps) if cfg else t_cublas
            best = min(t_table, t_cublas)
            print(f"{shape.N:>5}x{shape.K:<5} {M:>3} {t_cublas * 1e6:>10.2f} {t_table * 1e6:>9.2f} "
                  f"{t_default * 1e6:>10.2f} {t_cublas / t_table:>7.2f}x {shape.bytes / best / 1e9:>7.0f} "
                  f"{shape.bytes / best / (args.hbm_tbps * 1e12):>5.0%}  {cfg or 'cuBLAS'}", flush=True)
    print("table = what dense_gemm.linear runs (cuBLAS where the table says null or M > 64); default = "
          f"DEFAULT_CONFIG {dense_gemm.DEFAULT_CONFIG}")
    if args.check:
        for shape in shapes:
            check(shape)
    print(f"done in {time.monotonic() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
