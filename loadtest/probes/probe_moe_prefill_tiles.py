"""Probe: expert-GEMM tiles for prefill steps that ``bench_fused_moe.py --tune`` does not reach (256-row tiles on
16 warps, wider column tiles), against the table's, on one GPU.

The tuner's space stops at 128-row tiles on 8 warps. A 256-row tile on 16 warps (two warpgroups sharing each
weight tile, as the prefill attention's 256-row query tile) halves the weight tiles' re-reads from L2, and a wider
column tile halves the gathered token rows' re-reads; ncu (run 43) found the 8,192-token gate_up GEMM L2-bound.
Each config is timed per call (median, ``bench_fused_moe.time_per_call``) on the Qwen3-30B-A3B expert shape at
prefill token counts and its output compared with the table config's (share of equal elements: only the GEMM's
float32 summation order may differ).

    PYTHONPATH=backends:. python3 loadtest/probes/probe_moe_prefill_tiles.py [--tokens 8192 2048] [--tma]
"""
from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path
from types import SimpleNamespace

import torch

from moe_engine.kernels import fused_moe
from moe_engine.kernels import moe_routing as routing_kernels
from moe_engine.kernels.fused_moe import TileConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: loadtest.* when run by path
from loadtest.tune import bench_fused_moe as bfm  # noqa: E402

GATE_UP = [  # (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, warps, stages)
    (256, 64, 64, 1, 16, 3), (256, 64, 64, 8, 16, 3), (256, 64, 32, 1, 16, 4), (256, 64, 128, 1, 16, 2),
    (256, 128, 64, 1, 16, 2), (128, 128, 64, 1, 8, 3), (128, 128, 32, 1, 8, 4), (128, 64, 64, 8, 8, 4),
    (256, 32, 64, 1, 8, 4),
]
DOWN = [
    (256, 128, 64, 1, 16, 3), (256, 128, 64, 8, 16, 3), (256, 256, 64, 1, 16, 2), (256, 128, 32, 1, 16, 4),
    (128, 256, 64, 8, 8, 4), (128, 128, 64, 1, 8, 4), (256, 64, 64, 1, 8, 4),
]
# --tma: the same kind of search with the weight tiles (and down's rows) loaded through TMA descriptors (a 7th
# field, TileConfig.tma): bigger tiles and deeper pipelines, which TMA's bulk copies may feed where pointer
# loads could not
GATE_UP_TMA = [
    (128, 64, 64, 1, 8, 3, 1), (128, 64, 64, 1, 8, 4, 1), (128, 128, 64, 1, 8, 3, 1), (128, 128, 64, 1, 8, 4, 1),
    (128, 64, 128, 1, 8, 3, 1), (128, 128, 32, 1, 8, 5, 1), (64, 128, 64, 8, 4, 4, 1), (256, 64, 64, 1, 16, 3, 1),
    (128, 64, 64, 8, 8, 4, 1),
]
DOWN_TMA = [
    (128, 256, 64, 1, 8, 3, 1), (128, 256, 64, 8, 8, 4, 1), (128, 128, 64, 1, 8, 4, 1), (128, 128, 128, 1, 8, 3, 1),
    (256, 128, 64, 1, 16, 3, 1), (256, 256, 64, 1, 16, 2, 1), (128, 256, 128, 1, 8, 2, 1),
]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="+", default=[8192, 2048])
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--tma", action="store_true", help="the TMA candidates instead of the pointer-load ones")
    a = p.parse_args()
    gate_up_cands, down_cands = (GATE_UP_TMA, DOWN_TMA) if a.tma else (GATE_UP, DOWN)
    args = SimpleNamespace(experts=128, hidden=2048, inter=768, topk=8, layers=2, routings=8,
                           device=torch.device("cuda"))
    layers = bfm.make_layers(args)
    print(f"{torch.cuda.get_device_name()}; E 128 H 2048 I 768 top-8 bf16", flush=True)
    for T in a.tokens:
        case = bfm.Case(args, layers, T, seed=T)
        routed = [routing_kernels.route(ids, 128) for ids, _ in case.routing]
        start = fused_moe.tile_configs(case.P, args.device, 128, 2048, 768, torch.bfloat16)
        h_ref = [fused_moe.gate_up_swiglu(case.x, case.layer[g].gate_up_proj, routed[g][1], routed[g][2], start[0])
                 for g in range(case.G)]
        y_ref = [fused_moe.down_proj(h_ref[g], case.layer[g].down_proj, routed[g][2], start[1])
                 for g in range(case.G)]
        h, y = [t.clone() for t in h_ref], [t.clone() for t in y_ref]
        flops = 2 * case.P * 2048 * 768
        for name, table, cands, outs, refs in (("gate_up", start[0], gate_up_cands, h, h_ref), ("down", start[1], down_cands, y, y_ref)):
            def calls(cfg):
                if name == "gate_up":
                    return [lambda g=g: fused_moe.gate_up_swiglu(case.x, case.layer[g].gate_up_proj, routed[g][1],
                                                                 routed[g][2], cfg, out=h[g]) for g in range(case.G)]
                return [lambda g=g: fused_moe.down_proj(h_ref[g], case.layer[g].down_proj, routed[g][2], cfg,
                                                        out=y[g]) for g in range(case.G)]

            gemm_flops = flops * (2 if name == "gate_up" else 1)
            base = bfm.time_per_call(calls(table), False, a.reps, args.device)
            print(f"T={T} {name}: table {table} {base * 1e6:.1f} us {gemm_flops / base / 1e12:.0f} TFLOP/s",
                  flush=True)
            for c in cands:
                cfg = TileConfig(*c)
                for o in outs:
                    o.fill_(float("nan"))
                try:
                    with warnings.catch_warnings():
                        warnings.filterwarnings("error", message="fused_moe:")
                        t = bfm.time_per_call(calls(cfg), False, a.reps, args.device)
                except Exception as exc:  # noqa: BLE001 - a config may not fit: say so, go on
                    print(f"  {c}: {type(exc).__name__}: {str(exc)[:100]}", flush=True)
                    continue
                same = min((o == r).float().mean().item() for o, r in zip(outs, refs))
                print(f"  {c}: {t * 1e6:8.1f} us {gemm_flops / t / 1e12:5.0f} TFLOP/s {base / t:.3f}x  "
                      f"equal {same:.2%}", flush=True)
        del case, h, y, h_ref, y_ref, routed
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
