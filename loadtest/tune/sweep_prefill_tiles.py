"""Sweep the paged-attention kernel's prefill tiles (query rows, key tile, warps, pipeline stages) on one GPU.

Three step shapes with Qwen3-30B-A3B's attention (32 query / 4 kv heads of 128, bf16, blocks of 16): a multi-turn
agent's turn-16 step (27 x 303 new tokens, each over 7,500 cached keys), 16 x 8k prompts from position 0 and
4 x 2k chunks over 6k cached keys. Each config's output is compared with the pre-sweep tiles' (max |difference|:
0 when only the query tile changes, since every row's arithmetic is the same) and timed with CUDA events (median of
10). The defaults of ``paged_attention.KernelConfig`` come from this sweep
(57 configs, ~4.5 minutes on an H200: this script with its defaults).

    PYTHONPATH=backends:. python3 loadtest/tune/sweep_prefill_tiles.py [--budget 400]
"""
from __future__ import annotations

import argparse
import itertools
import time

import torch

from moe_engine.kernels import paged_attention as pa

HQ, HKV, D, BLOCK = 32, 4, 128, 16
SHAPES = {  # name: (sequences, new tokens each, cached tokens each)
    "T16 27x303 over 7500": (27, 303, 7500),
    "16x8k from 0": (16, 8192, 0),
    "4x2k over 6k": (4, 2048, 6144),
}
BEFORE = (128, 64, 8, 2)  # (rows, key tile, warps, stages) before the sweep
CONFIGS = [BEFORE] + [c for c in itertools.product((64, 128, 256), (32, 64, 128), (4, 8), (2, 3, 4)) if c != BEFORE]
CONFIGS += [(256, 64, 16, 2), (256, 64, 16, 3), (256, 128, 16, 2)]


def config(rows: int, tile: int, warps: int, stages: int) -> pa.KernelConfig:
    return pa.KernelConfig(prefill_block_m=rows, prefill_tile_n=tile, prefill_num_warps=warps,
                           prefill_num_stages=stages)


def median_ms(fn, reps: int = 10) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[reps // 2]


def step(B: int, L: int, C: int):
    """(args, kwargs, FLOPs) of one step: B sequences of L queries after C cached keys, blocks in random order."""
    nb = -(-(C + L) // BLOCK)
    k_cache = torch.randn(B * nb, BLOCK, HKV, D, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    tables = torch.randperm(B * nb, device="cuda").to(torch.int32).reshape(B, nb)
    cu = torch.arange(B + 1, device="cuda", dtype=torch.int32) * L
    seq_lens = torch.full((B,), C + L, device="cuda", dtype=torch.int32)
    q = torch.randn(B * L, HQ, D, device="cuda", dtype=torch.bfloat16)
    flops = 4 * B * L * (C + (L + 1) / 2) * D * HQ  # QK^T and PV; a query sees the cache and its causal part
    return (q, k_cache, v_cache, tables, cu, seq_lens), dict(max_query_len=L, max_seq_len=C + L, scale=D**-0.5), flops


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--budget", type=float, default=400.0, help="seconds; configs after it are skipped")
    args = ap.parse_args()
    torch.manual_seed(0)
    t0 = time.time()
    for name, shape in SHAPES.items():
        inputs, kw, flops = step(*shape)
        ref = pa.paged_attention(*inputs, **kw, config=config(*BEFORE))
        rows = []
        for c in CONFIGS:
            if time.time() - t0 > args.budget:
                break
            label = "bm{} tn{} w{} s{}".format(*c)
            try:
                out = pa.paged_attention(*inputs, **kw, config=config(*c))
                err = (out.float() - ref.float()).abs().max().item()
                ms = median_ms(lambda: pa.paged_attention(*inputs, **kw, config=config(*c)))
            except Exception as exc:  # noqa: BLE001 - a config may not compile or fit: say so and go on
                print(f"  {name}: {label}: {type(exc).__name__} {str(exc)[:120]}", flush=True)
                continue
            rows.append((ms, c, err))
            print(f"  {name}: {label}: {ms:.3f} ms {flops / ms / 1e9:.0f} TFLOP/s err {err:.4f}", flush=True)
        rows.sort()
        print(f"BEST {name}: " + "; ".join("bm{} tn{} w{} s{}".format(*c) + f" {ms:.3f} ms {flops / ms / 1e9:.0f} "
                                          "TFLOP/s" for ms, c, _ in rows[:6]), flush=True)
        before = [ms for ms, c, _ in rows if c == BEFORE]
        if before:
            print(f"BEFORE {name}: {before[0]:.3f} ms {flops / before[0] / 1e9:.0f} TFLOP/s", flush=True)


if __name__ == "__main__":
    main()
