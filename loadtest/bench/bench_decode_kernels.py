#!/usr/bin/env python
"""Launch-granularity sweep of a decode step's small kernels and the expert GEMMs, at the real shape, on a GPU.

A batch-1 decode step of Qwen3-30B-A3B is ~11 launches per layer, all but the GEMMs latency-bound (a few us for
kilobytes); how many programs a kernel splits its work into sets that latency. For each knob below, every value is
timed as the model runs it: the call for each of 48 layers captured in one CUDA graph (inputs and weights per
layer, so nothing is served from L2 that would not be in the engine), replayed ``--reps`` times; the median per
call. Each variant's output is compared with the default's (the knobs change the split of the work, not the math:
bit-identical but for the expert GEMMs, whose K tiles change the float32 summation order; >= 99% equal counts).

  combine      columns per program (routing_kernels.COMBINE_BLOCK)
  combine_norm a MoE layer's combine and the next residual add + norm as two launches (combine, rms_norm) or one
               (combine_rms_norm, what the decoder runs from routing_kernels.COMBINE_NORM_MIN_TOKENS tokens)
  qk_norm_rope heads per program (rotary_kernels.QK_HEADS_BLOCKS by step size), per-head norms summed in-kernel, k/v stored
  route        pairs per program
  rms_norm     warps (residual add + norm of a [T, 2048] row)
  experts      fused_moe tile configs of the gate_up and down GEMMs (BLOCK_N, BLOCK_K, stages, warps), 8 weight
               sets of 128 experts used in turn, fresh routing per call

    PYTHONPATH=backends:. python3 loadtest/bench/bench_decode_kernels.py --tokens 1,64 --out OUT   # one H200: ~4 min
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "backends"))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: loadtest.* when run by path
from loadtest.bench import real_shape_model as rsm  # noqa: E402
from moe_engine.kernels import fused_moe  # noqa: E402
from moe_engine.kernels import moe_routing as routing_kernels  # noqa: E402
from moe_engine.kernels import norm as norm_kernels  # noqa: E402
from moe_engine.kernels import rotary as rotary_kernels  # noqa: E402
from moe_engine.kernels.fused_moe import TileConfig  # noqa: E402

H, HQ, HK, D, E, K, I, L = 2048, 32, 4, 128, 128, 8, 768, 48  # Qwen3-30B-A3B; L layers per graph


def name_of(v) -> str:
    if isinstance(v, TileConfig):
        return f"n{v.BLOCK_N} k{v.BLOCK_K} w{v.num_warps} s{v.num_stages}" + (" tma" if v.tma else "")
    return str(v)


def per_call_us(calls, reps: int) -> float:
    return rsm.graph_replay_seconds(lambda: [c() for c in calls], reps) / len(calls) * 1e6


def layer_calls(fn) -> tuple[list, list]:
    """fn(i) -> layer i's output: the L calls (each storing its output), run once eagerly (compiled, and a config
    that does not fit fails here), and the list their outputs land in (the graph's, once captured)."""
    outs = [None] * L

    def call(i):
        outs[i] = fn(i)
    calls = [lambda i=i: call(i) for i in range(L)]
    for c in calls:
        c()
    return calls, outs


def flat(outs: list) -> list[torch.Tensor]:
    """The calls' outputs, a call's tuple of outputs (q and k of qk_norm_rope) spread out."""
    return [t for o in outs for t in (o if isinstance(o, tuple) else (o,))]


def equal_share(a: list, b: list) -> float:
    return min((x == y).float().mean().item() for x, y in zip(flat(a), flat(b)))


def sweep(name: str, T: int, values, make_calls, reps: int, rows: list, t0: float) -> None:
    """make_calls(value) -> (calls, outputs); the first value is the reference for the equality check."""
    ref = None
    line = []
    for v in values:
        try:
            calls, outs = make_calls(v)
            us = per_call_us(calls, reps)
        except Exception as err:  # noqa: BLE001  (a config that does not compile: skip it)
            print(f"  {name} T={T} {name_of(v)}: {type(err).__name__}: {str(err)[:100]}", flush=True)
            continue
        same = 1.0 if ref is None else equal_share(outs, ref)
        ref = ref or [o.clone() for o in flat(outs)]
        rows.append(dict(kernel=name, T=T, value=name_of(v), us=us, equal=same))
        line.append(f"{name_of(v)}: {us:.2f}" + ("" if same == 1.0 else f" ({100 * same:.1f}% eq)"))
    print(f"{name:12s} T={T:3d}  " + ", ".join(line) + f"  [{time.perf_counter() - t0:.0f} s]", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", default="1,64")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--kernels", default="combine,qk,route,rms_norm,experts")
    p.add_argument("--expert-sets", type=int, default=8, help="weight sets of E experts used in turn")
    p.add_argument("--expert-tokens", default="1", help="token counts at which the expert GEMMs are swept")
    p.add_argument("--expert-tma", type=int, default=0, choices=(0, 1),
                   help="sweep the expert tiles with TMA loads (1) or pointer loads (0)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    dev, dt = torch.device("cuda"), torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    which = set(args.kernels.split(","))
    rows: list[dict] = []
    t0 = time.perf_counter()
    print(f"bench_decode_kernels on {torch.cuda.get_device_name(dev)}; torch {torch.__version__}; {L} calls per "
          f"graph, {args.reps} replays", flush=True)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, device=dev, generator=g) * scale).to(dt)

    def routing(T):  # distinct experts per token, softmax weights as Qwen3's router gives them
        ids = torch.rand(T, E, device=dev, generator=g).argsort(dim=1)[:, :K]
        return ids, torch.softmax(torch.randn(T, K, device=dev, generator=g), -1).to(dt)

    sets = None
    if "experts" in which:
        sets = [(rnd(E, 2 * I, H, scale=H**-0.5), rnd(E, H, I, scale=I**-0.5)) for _ in range(args.expert_sets)]
    for T in (int(t) for t in args.tokens.split(",")):
        torch.cuda.empty_cache()
        P = T * K
        if "combine" in which:
            ys = [rnd(P, H) for _ in range(L)]
            rts = [routing(T) for _ in range(L)]
            rows_of = [routing_kernels.route(ids, E)[0] for ids, _ in rts]  # each pair's grouped row

            def combine_calls(block):
                return layer_calls(lambda i: routing_kernels.combine(ys[i], rts[i][0], rows_of[i], rts[i][1], dt,
                                                             block=block))
            sweep("combine", T, (1024, 2048, 512, 256, 128), combine_calls, args.reps, rows, t0)
        if "combine_norm" in which:
            ys, xs, w = [rnd(P, H) for _ in range(L)], [rnd(T, H) for _ in range(L)], rnd(H)
            rts = [routing(T) for _ in range(L)]
            rows_of = [routing_kernels.route(ids, E)[0] for ids, _ in rts]

            def combine_norm_calls(launches):
                def one(i):
                    ids, wts = rts[i]
                    if launches == "one":
                        return routing_kernels.combine_rms_norm(ys[i], ids, rows_of[i], wts, xs[i], w, 1e-6, False)
                    return norm_kernels.rms_norm(xs[i], w, 1e-6, False, routing_kernels.combine(ys[i], ids, rows_of[i], wts, dt))
                return layer_calls(one)
            sweep("combine_norm", T, ("two", "one"), combine_norm_calls, args.reps, rows, t0)
            del ys, xs
        if "qk" in which:
            qs, ks, vs = [rnd(T, HQ * D) for _ in range(L)], [rnd(T, HK * D) for _ in range(L)], \
                [rnd(T, HK * D) for _ in range(L)]
            cos, sin = rnd(T, D), rnd(T, D)
            qw, kw = rnd(D), rnd(D)
            blocks = max(64, T)
            cache_k, cache_v = rnd(blocks, 16, HK, D), rnd(blocks, 16, HK, D)
            slots = torch.randperm(blocks * 16, device=dev, generator=g)[:T]

            def qk_calls(hpp):
                return layer_calls(lambda i: rotary_kernels.qk_norm_rope(  # (q, k): no copy timed with the kernel
                    qs[i], ks[i], cos, sin, D, "head", q_weight=qw, k_weight=kw, eps=1e-6,
                    kv_cache=(vs[i], cache_k, cache_v, slots), heads_per_program=hpp))
            sweep("qk_norm_rope", T, (64, 16, 8, 4, 2, 1), qk_calls, args.reps, rows, t0)
        if "route" in which:
            rts = [routing(T) for _ in range(L)]
            cap = torch.zeros(T, K, dtype=torch.int32, device=dev)

            def route_calls(bi):
                return layer_calls(lambda i: torch.cat(
                    [t.reshape(-1).long() for t in routing_kernels.route(rts[i][0], E, cap, block_i=bi)]))
            sweep("route", T, (16, 8, 4, 32), route_calls, args.reps, rows, t0)
        if "rms_norm" in which:
            xs, ds, w = [rnd(T, H) for _ in range(L)], [rnd(T, H) for _ in range(L)], rnd(H)

            def norm_calls(warps):
                return layer_calls(lambda i: norm_kernels.rms_norm(xs[i], w, 1e-6, False, ds[i], num_warps=warps)[1])
            sweep("rms_norm", T, (4, 1, 2, 8, 16), norm_calls, args.reps, rows, t0)
        if "experts" in which and str(T) in args.expert_tokens.split(","):
            xs = [rnd(T, H) for _ in range(L)]
            routed = [routing_kernels.route(routing(T)[0], E) for _ in range(L)]
            default = fused_moe.tile_configs(P, dev, E, H, I, dt)
            hs = [fused_moe.gate_up_swiglu(xs[i], sets[i % len(sets)][0], routed[i][1], routed[i][2], default[0])
                  for i in range(L)]

            def expert_calls(gate_up):
                def one(i, cfg):
                    gu, dn = sets[i % len(sets)]
                    if gate_up:
                        return fused_moe.gate_up_swiglu(xs[i], gu, routed[i][1], routed[i][2], cfg)
                    return fused_moe.down_proj(hs[i], dn, routed[i][2], cfg)

                def make(cfg):
                    with warnings.catch_warnings():
                        warnings.filterwarnings("error", message="fused_moe:")  # would shrink: not this config
                        return layer_calls(lambda i: one(i, cfg))
                return make
            bm = default[0].BLOCK_M
            for gate_up, start in ((True, default[0]), (False, default[1])):
                ns = (16, 32, 64) if gate_up else (32, 64, 128, 256)
                grid = [start] + [TileConfig(bm, n, k, 1, 4, s, args.expert_tma) for n, k, s in itertools.product(
                    ns, (64, 128, 256), (3, 4, 5, 6))
                    if (n, k, s, args.expert_tma) != (start.BLOCK_N, start.BLOCK_K, start.num_stages, start.tma)]
                name = "gate_up" if gate_up else "down"
                sweep(f"{name}", T, grid, expert_calls(gate_up), args.reps, rows, t0)
                mine = [r for r in rows if r["kernel"] == name and r["T"] == T and r["equal"] >= 0.99]
                best = sorted(mine, key=lambda r: r["us"])[:3]
                cfgs = [c for c in grid if name_of(c) in {r["value"] for r in best}]
                more = [start] + [TileConfig(c.BLOCK_M, c.BLOCK_N, c.BLOCK_K, 1, w, c.num_stages, c.tma)
                                  for c in cfgs for w in (2, 8) if w != c.num_warps]
                sweep(f"{name}", T, more, expert_calls(gate_up), args.reps, rows, t0)
                mine = [r for r in rows if r["kernel"] == name and r["T"] == T and r["equal"] >= 0.99]
                b = min(mine, key=lambda r: r["us"])
                print(f"  best {name} T={T}: {b['us']:.2f} us ({b['value']}); default {mine[0]['us']:.2f} us",
                      flush=True)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "decode_kernels.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
