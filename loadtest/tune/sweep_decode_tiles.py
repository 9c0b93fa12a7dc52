"""Sweep the paged-attention kernel's decode launch (key tile, warps, pipeline stages, split count) on one GPU.

Decode steps as the engine replays them: one ``paged_attention`` call per layer, 48 layers (each its own cache of
``--block``-token blocks from a shuffled free list; 64, the engine's default on Hopper) in one CUDA graph,
Qwen3-30B-A3B's attention (32 query / 4 kv heads of 128, bf16). Shapes: (b)'s decode (64 x ~1,150 keys), the
multi-turn turn-16 decode (32 x 7,900), a middle one (16 x 2,048) and (a)'s batch-1 decode (1 x 384). Time per
layer = replay / 48 (median of ``--reps``); GB/s = the K/V bytes a layer reads / that time. Each config's output is
compared with the engine's (max |difference|; splits and key tiles change the summation order, so within bf16
rounding, not to the bit).

    PYTHONPATH=backends:. python3 loadtest/tune/sweep_decode_tiles.py [--shapes 64x1152,32x7900] [--budget 400]
"""
from __future__ import annotations

import argparse
import itertools
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

from moe_engine.kernels import paged_attention as pa

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: loadtest.* when run by path
from loadtest.bench import real_shape_model as rsm  # noqa: E402

HQ, HKV, D, LAYERS = 32, 4, 128, 48
SHAPES = ((64, 1152), (32, 7900), (16, 2048), (1, 384))
TILES, WARPS, STAGES, SPLITS = (32, 64, 128), (2, 4, 8), (2, 3, 4), (1, 2, 4, 8, 16)


def layer_caches(B: int, L: int, device, seed: int, block: int):
    g = torch.Generator(device=device).manual_seed(seed)
    nblk = -(-L // block)
    k = torch.randn(B * nblk, block, HKV, D, device=device, dtype=torch.bfloat16, generator=g)
    v = torch.randn(B * nblk, block, HKV, D, device=device, dtype=torch.bfloat16, generator=g)
    tables = torch.randperm(B * nblk, device=device, generator=g).view(B, nblk).to(torch.int32)
    return k, v, tables


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default=",".join(f"{b}x{n}" for b, n in SHAPES), help="BxL,... (sequences x keys)")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--budget", type=float, default=400.0, help="seconds; configs past it are skipped")
    p.add_argument("--block", type=int, default=64, help="KV block size (tokens)")
    args = p.parse_args()
    device = torch.device("cuda")
    t_start = time.time()
    print(f"{torch.cuda.get_device_name(device)}; torch {torch.__version__}; {LAYERS} layers per graph, "
          f"{args.reps} replays; engine decode config {pa.DEFAULT_CONFIG}", flush=True)
    for shape in args.shapes.split(","):
        B, L = (int(x) for x in shape.split("x"))
        caches = [layer_caches(B, L, device, seed=i, block=args.block) for i in range(LAYERS)]
        g = torch.Generator(device=device).manual_seed(1)
        qs = [torch.randn(B, HQ, D, device=device, dtype=torch.bfloat16, generator=g) for _ in range(LAYERS)]
        cu = torch.arange(B + 1, device=device, dtype=torch.int32)
        seq_lens = torch.full((B,), L, device=device, dtype=torch.int32)
        outs = [torch.empty(B, HQ, D, device=device, dtype=torch.bfloat16) for _ in range(LAYERS)]
        kv_bytes = 2 * B * L * HKV * D * 2
        engine_splits = pa.choose_num_splits(B, HKV, L)

        def run_with(config: pa.KernelConfig, splits: int):
            def run():
                for q, (k, v, t), o in zip(qs, caches, outs):
                    pa.paged_attention(q, k, v, t, cu, seq_lens, max_query_len=1, max_seq_len=L, scale=D**-0.5,
                                       out=o, num_splits=splits, config=config)
            return run

        ref_run = run_with(pa.DEFAULT_CONFIG, engine_splits)
        engine_us = rsm.graph_replay_seconds(ref_run, args.reps) * 1e6 / LAYERS
        reference = [o.clone() for o in outs]
        engine_tile = pa.DEFAULT_CONFIG.decode_tile_n if engine_splits > 1 else pa.DEFAULT_CONFIG.decode_unsplit_tile_n
        print(f"B={B} L={L}: engine (tile {engine_tile}, warps {pa.DEFAULT_CONFIG.decode_num_warps},"
              f" stages {pa.DEFAULT_CONFIG.decode_num_stages}, splits {engine_splits}) {engine_us:.2f} us "
              f"{kv_bytes / engine_us / 1e3:.0f} GB/s", flush=True)
        cols = replace(pa.DEFAULT_CONFIG, decode_k_rows=not pa.DEFAULT_CONFIG.decode_k_rows)
        cols_us = rsm.graph_replay_seconds(run_with(cols, engine_splits), args.reps) * 1e6 / LAYERS
        print(f"  the engine's launch with decode_k_rows={cols.decode_k_rows}: {cols_us:.2f} us "
              f"({engine_us / cols_us:.3f}x engine)", flush=True)
        cells = []
        for tile, warps, stages, splits in itertools.product(TILES, WARPS, STAGES, SPLITS):
            if time.time() - t_start > args.budget:
                print("  (budget spent: remaining configs skipped)", flush=True)
                break
            if splits > 1 and L // splits < tile:
                continue
            config = pa.KernelConfig(decode_tile_n=tile, decode_unsplit_tile_n=tile, decode_num_warps=warps,
                                     decode_num_stages=stages)
            try:
                us = rsm.graph_replay_seconds(run_with(config, splits), args.reps) * 1e6 / LAYERS
            except Exception as exc:  # noqa: BLE001 - a config may not compile (shared memory): say so, go on
                print(f"  tile {tile} warps {warps} stages {stages} splits {splits}: {type(exc).__name__}", flush=True)
                continue
            err = max((o.float() - r.float()).abs().max().item() for o, r in zip(outs, reference))
            cells.append((us, tile, warps, stages, splits, err))
        cells.sort()
        for us, tile, warps, stages, splits, err in cells[:12]:
            print(f"  tile {tile:3d} warps {warps} stages {stages} splits {splits:2d}: {us:7.2f} us "
                  f"{kv_bytes / us / 1e3:5.0f} GB/s  {engine_us / us:.3f}x engine  max |diff| {err:.1e}", flush=True)
        caches = qs = outs = reference = None
        torch.cuda.empty_cache()
    print(f"done in {time.time() - t_start:.0f} s")


if __name__ == "__main__":
    main()
