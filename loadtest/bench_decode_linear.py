"""Decode-sized dense projections: decode_linear.py (the expert-GEMM kernel with one expert) against F.linear.

Shapes of Qwen3-30B-A3B and Qwen3-235B-A22B (q/k/v fused, o, router), 1-16 tokens; weights rotate over copies
that together exceed the L2 cache, so every call reads its weight from HBM. Prints us per call and GB/s of
weight read, and with --sweep the tile configs around decode_linear's choice at one token.

    python loadtest/bench_decode_linear.py [--sweep] [--out results.json]        # CUDA
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "backends"))
from moe_engine import decode_linear, fused_moe  # noqa: E402

SHAPES = {  # name -> (N, K)
    "30b qkv": (5120, 2048), "30b o": (2048, 4096), "30b router": (128, 2048),
    "235b qkv": (9216, 4096), "235b o": (4096, 8192), "235b router": (128, 4096),
}


def time_us(fn, weights, x, iters: int = 100) -> float:
    """Median over 5 runs of the mean time per call, cycling through ``weights``."""
    for w in weights[:3]:
        fn(x, w)
    runs = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for i in range(iters):
            fn(x, weights[i % len(weights)])
        end.record()
        torch.cuda.synchronize()
        runs.append(start.elapsed_time(end) * 1000 / iters)
    return statistics.median(runs)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sweep", action="store_true")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    dev = torch.device("cuda")
    results = []
    print(f"{'shape':<12} {'T':>3} {'F.linear us':>12} {'GB/s':>7} {'decode_linear us':>17} {'GB/s':>7} {'speed-up':>8}")
    for name, (N, K) in SHAPES.items():
        nbytes = N * K * 2
        copies = max(2, (512 << 20) // nbytes)  # > the 50 MB L2, many times over
        weights = [torch.randn(N, K, device=dev, dtype=torch.bfloat16) for _ in range(copies)]
        for T in (1, 2, 4, 8, 16):
            x = torch.randn(T, K, device=dev, dtype=torch.bfloat16)
            torch.testing.assert_close(decode_linear.linear(x, weights[0]), F.linear(x, weights[0]))
            a = time_us(F.linear, weights, x)
            b = time_us(decode_linear.linear, weights, x)
            row = dict(shape=name, N=N, K=K, T=T, f_linear_us=a, decode_linear_us=b,
                       f_linear_gbs=nbytes / a / 1e3, decode_linear_gbs=nbytes / b / 1e3, speedup=a / b)
            results.append(row)
            print(f"{name:<12} {T:>3} {a:>12.2f} {row['f_linear_gbs']:>7.0f} {b:>17.2f} {row['decode_linear_gbs']:>7.0f} "
                  f"{a / b:>8.2f}", flush=True)
        if args.sweep:
            x = torch.randn(1, K, device=dev, dtype=torch.bfloat16)
            offs = torch.ones(1, dtype=torch.int32, device=dev)
            best = None
            for bn in (16, 32, 64):
                for bk in (64, 128, 256):
                    for stages in (3, 4, 5):
                        for warps in (2, 4):
                            cfg = fused_moe.TileConfig(BLOCK_M=16, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=1, num_warps=warps,
                                                       num_stages=stages)
                            try:
                                us = time_us(lambda x, w, c=cfg: fused_moe.down_proj(x, w.unsqueeze(0), offs, c),
                                             weights, x)
                            except Exception as exc:  # noqa: BLE001 - a config that does not compile
                                print(f"  {cfg}: {type(exc).__name__}")
                                continue
                            results.append(dict(shape=name, sweep=dataclasses.asdict(cfg), us=us))
                            if best is None or us < best[0]:
                                best = (us, cfg)
            chosen = decode_linear._config(N, K)
            print(f"  sweep {name}, T=1: best {best[0]:.2f} us {best[1]}; decode_linear's {chosen}", flush=True)
        del weights
        torch.cuda.empty_cache()
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
