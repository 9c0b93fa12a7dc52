#!/usr/bin/env python
"""linear_kernels.small_linear against cuBLAS (F.linear) for the dense GEMMs of a decode step of a few tokens.

For each projection of the real shape (Qwen3-30B-A3B: router 128 x 2048, q/k/v 5120 x 2048, o 2048 x 4096) and
each step size T: both ways of computing ``x @ W.T`` over 48 different weights (one per layer, so the weights come
from HBM, not L2) captured in one CUDA graph, replayed ``--reps`` times; the median time per GEMM and the weight
bytes over it. Also the largest difference from a float32 reference and the share of outputs equal to cuBLAS's.

    PYTHONPATH=backends:. python3 loadtest/bench/bench_small_linear.py --out OUT      # one H200: ~1 minute
    PYTHONPATH=backends:. python3 loadtest/bench/bench_small_linear.py --sweep --tokens 1,2,4   # + tile / warps configs
    PYTHONPATH=backends:. python3 loadtest/bench/bench_small_linear.py --moe-gemm --tokens 16,32,64  # + one-expert GEMM
    PYTHONPATH=backends:. python3 loadtest/bench/bench_small_linear.py --cublaslt --tokens 16,64,128  # + cuBLASLt

--cublaslt also times F.linear with torch's preferred BLAS library set to cuBLASLt (its own heuristics, no split-K
by cuBLAS's rules), with the share of its outputs equal to cuBLAS's.

--moe-gemm also times the expert GEMM kernel (``fused_moe.down_proj``) with one expert holding every token: the
projection as a plain Triton GEMM, over a grid of tile configs (row tile = the step's tokens, column tile, K tile,
stages, TMA weight loads), the best three per (projection, T) printed against cuBLAS. At 16-64 tokens cuBLAS reads
o_proj at ~1.7 TB/s with a split-K pass and a reduction launch (probe_splitk_linear.py, in git at 4080248).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "backends"))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: loadtest.* when run by path
from loadtest.bench import real_shape_model as rsm  # noqa: E402
from moe_engine.kernels import fused_moe  # noqa: E402
from moe_engine.kernels import small_linear as linear_kernels  # noqa: E402
from moe_engine.kernels import support as kernel_support  # noqa: E402

SHAPES = {"router": (128, 2048), "qkv": (5120, 2048), "o": (2048, 4096)}  # name: (N outputs, H inputs)


def graph_time(fn, xs, ws, reps: int) -> float:
    """Seconds per GEMM: ``fn(x, w)`` for each of the layers' weights, in one CUDA graph."""
    return rsm.graph_replay_seconds(lambda: [fn(x, w) for x, w in zip(xs, ws)], reps) / len(ws)


def moe_gemm_configs(T: int, N: int) -> list[fused_moe.TileConfig]:
    """Tile configs for a one-expert GEMM of T rows: one row tile (16-64 rows), column tiles that divide N."""
    bm = max(16, kernel_support._pow2(T))
    return [fused_moe.TileConfig(bm, bn, bk, 1, 4, stages, tma)
            for bn in (16, 32, 64, 128) if N % bn == 0 and N // bn >= 4
            for bk in (64, 128) for stages in (3, 5) for tma in (0, 1)]


def one_expert_linear(cfg: fused_moe.TileConfig):
    """x [T, H] @ w.T through fused_moe.down_proj with w as the only expert's weight (offs = [T])."""
    offs_cache: dict[tuple, torch.Tensor] = {}

    def fn(x, w):
        key = (x.shape[0], x.device)
        if key not in offs_cache:
            offs_cache[key] = torch.tensor([x.shape[0]], dtype=torch.int32, device=x.device)
        return fused_moe.down_proj(x, w[None], offs_cache[key], cfg)
    return fn


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", default="1,2,4,8,16")
    p.add_argument("--layers", type=int, default=48)
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--out", default=None)
    p.add_argument("--sweep", action="store_true", help="also every (weight elements per program, warps) config")
    p.add_argument("--moe-gemm", action="store_true", help="also the expert GEMM kernel with one expert, per config")
    p.add_argument("--cublaslt", action="store_true", help="also F.linear through cuBLASLt")
    args = p.parse_args()
    dev, dt = torch.device("cuda"), torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    rows, t0 = [], time.perf_counter()
    print(f"bench_small_linear on {torch.cuda.get_device_name(dev)}; torch {torch.__version__}; {args.layers} weights "
          f"per projection, {args.reps} graph replays", flush=True)
    for name, (N, H) in SHAPES.items():
        ws = [(torch.randn(N, H, device=dev, generator=g) / H**0.5).to(dt) for _ in range(args.layers)]
        for T in (int(t) for t in args.tokens.split(",")):
            xs = [torch.randn(T, H, device=dev, generator=g).to(dt) for _ in range(args.layers)]
            t_cublas = graph_time(F.linear, xs, ws, args.reps)
            t_small = graph_time(linear_kernels.small_linear, xs, ws, args.reps)
            ref = F.linear(xs[0].float(), ws[0].float())
            ours, theirs = linear_kernels.small_linear(xs[0], ws[0]), F.linear(xs[0], ws[0])
            gb = N * H * 2 / 1e9
            row = dict(name=name, N=N, H=H, T=T, cublas_us=t_cublas * 1e6, small_us=t_small * 1e6,
                       cublas_tbps=gb / t_cublas / 1e3, small_tbps=gb / t_small / 1e3,
                       speedup=t_cublas / t_small, max_err_small=(ours.float() - ref).abs().max().item(),
                       max_err_cublas=(theirs.float() - ref).abs().max().item(),
                       equal_to_cublas=(ours == theirs).float().mean().item())
            if args.cublaslt:
                default = torch.backends.cuda.preferred_blas_library()
                torch.backends.cuda.preferred_blas_library("cublaslt")
                try:
                    t_lt = graph_time(F.linear, xs, ws, args.reps)
                    lt = F.linear(xs[0], ws[0])
                finally:
                    torch.backends.cuda.preferred_blas_library(default)
                row["cublaslt"] = dict(us=t_lt * 1e6, speedup=t_cublas / t_lt,
                                       max_err=(lt.float() - ref).abs().max().item(),
                                       equal_to_cublas=(lt == theirs).float().mean().item())
                print(f"    cuBLASLt: {t_lt * 1e6:.2f} us, {t_cublas / t_lt:.2f}x cuBLAS, max err "
                      f"{row['cublaslt']['max_err']:.2e}, {100 * row['cublaslt']['equal_to_cublas']:.1f}% equal",
                      flush=True)
            if args.sweep:
                row["sweep"] = {}
                for tile in (2048, 4096, 8192, 16384, 32768):
                    for warps in (2, 4, 8, 16):
                        if tile < H or tile // H > 64:
                            continue
                        fn = lambda x, w, _t=tile, _w=warps: linear_kernels.small_linear(x, w, tile=_t, num_warps=_w)
                        row["sweep"][f"tile {tile} warps {warps}"] = graph_time(fn, xs, ws, args.reps) * 1e6
                best = min(row["sweep"], key=row["sweep"].get)
                print(f"    sweep: best {best} {row['sweep'][best]:.2f} us; " + ", ".join(
                    f"{k} {v:.2f}" for k, v in row["sweep"].items()), flush=True)
            if args.moe_gemm:
                times = {}
                for cfg in moe_gemm_configs(T, N):
                    fn = one_expert_linear(cfg)
                    times[cfg] = graph_time(fn, xs, ws, args.reps) * 1e6
                best = sorted(times, key=times.get)
                b = best[0]
                y = one_expert_linear(b)(xs[0], ws[0])
                row["moe_gemm"] = {str(tuple(vars(c).values())): t for c, t in times.items()}
                row["moe_gemm_best"] = dict(config=vars(b), us=times[b], speedup=t_cublas * 1e6 / times[b],
                                            max_err=(y.float() - ref).abs().max().item(),
                                            equal_to_cublas=(y == theirs).float().mean().item())
                print(f"    one-expert GEMM: best " + ", ".join(
                    f"(M{c.BLOCK_M} N{c.BLOCK_N} K{c.BLOCK_K} s{c.num_stages} tma{c.tma}) {times[c]:.2f} us"
                    for c in best[:3]) + f"; {t_cublas * 1e6 / times[b]:.2f}x cuBLAS, max err "
                    f"{row['moe_gemm_best']['max_err']:.2e}, {100 * row['moe_gemm_best']['equal_to_cublas']:.1f}% "
                    f"equal ({len(times)} configs)", flush=True)
            rows.append(row)
            print(f"{name:6s} {N:5d}x{H:<5d} T={T:2d}  cuBLAS {row['cublas_us']:6.2f} us ({row['cublas_tbps']:.2f} TB/s)"
                  f"  small_linear {row['small_us']:6.2f} us ({row['small_tbps']:.2f} TB/s)  {row['speedup']:.2f}x  "
                  f"max err {row['max_err_small']:.2e} (cuBLAS {row['max_err_cublas']:.2e}), "
                  f"{100 * row['equal_to_cublas']:.1f}% equal  [{time.perf_counter() - t0:.0f} s]", flush=True)
        del ws
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "small_linear.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
