#!/usr/bin/env python
"""One MoE layer's routed experts at a real model shape on a GPU: torch's grouped GEMMs vs moe_engine/fused_moe.py.

What it measures
----------------
The Qwen3-30B-A3B expert shape by default (E 128 experts, hidden H 2048, expert width I 768, top-K 8, bf16),
random weights built on the GPU, router-like ids (top-K of noisy logits with a per-expert popularity, so some
experts are hit more than others, as real routers do) and softmax weights, routing capture on. Per token count
T (1 .. 16384), the time of one layer's experts (route + expert GEMMs + combine) of

  grouped_mm   today's path, ``Experts._forward_fused`` (model.py): route kernel, x[tok], torch._grouped_mm over
               all E experts for gate_up, silu * up in torch, grouped_mm for down, combine kernel;
  fused        route kernel, ``fused_moe.expert_mlp`` (two Triton GEMMs over the hit experts only, SwiGLU in the
               first one's epilogue), the same combine kernel.

Steps of T <= 256 run as CUDA graphs (as decode steps do; no launch gaps of Python), larger ones eagerly. Each
timing unit is G calls, each on its own routing and one of L weight sets in turn, like consecutive layers: the
weights of one layer (E x 3 x H x I x 2 bytes = 1.2 GB) are far beyond the 50 MB L2, so one set alone would be
enough for the weights as a whole, but back-to-back calls on the same routing would find part of the same hit
experts (75 MB at T=1) in L2. Times are medians over reps of (unit time / G).

Columns: hit = distinct experts per call (mean); GB/s = weight bytes of the hit experts only (what must be read)
per second; %HBM = that over --hbm-tbps (4.3 TB/s: what this H200 copies); TFLOP/s = 2 x T*K x 3HI / time (no
padding counted); %peak over --peak-tflops (989: H200 bf16 dense).

    .venv/bin/python loadtest/tune/bench_fused_moe.py                # table for T in 1 .. 16384 (~3 min)
    .venv/bin/python loadtest/tune/bench_fused_moe.py --quick        # T in 1, 16, 256, 4096 (< 2 min)
    .venv/bin/python loadtest/tune/bench_fused_moe.py --check        # + error vs torch at these shapes
    .venv/bin/python loadtest/tune/bench_fused_moe.py --tune  # sweep tile configs per bucket (< 6 min), write JSON

``--tune`` times each GEMM (gate_up, down) alone per bucket of T*K on a representative T: the best tile shape
(BLOCK_M x BLOCK_N) with the current table's other parameters, then coordinate descent from it (TMA loads or
pointers, BLOCK_N, BLOCK_K, stages, BLOCK_M, warps, GROUP_M), within --tune-budget seconds, and writes the best
per bucket to --tune-out (default backends/moe_engine/fused_moe_configs.json, which fused_moe reads: commit it).
Bucket "1" (T*K = 1) needs K = 1 and keeps its default here.
"""
from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time
import warnings
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "backends"))

from moe_engine.kernels import fused_moe  # noqa: E402
from moe_engine.kernels import moe_routing as routing_kernels  # noqa: E402
from moe_engine.kernels import support as kernel_support  # noqa: E402
from moe_engine.kernels.fused_moe import TileConfig  # noqa: E402
from moe_engine.layers.experts import _GMM, Experts  # noqa: E402

ALL_T = (1, 4, 16, 64, 256, 1024, 4096, 16384)
QUICK_T = (1, 16, 256, 4096)
GRAPH_MAX_T = 256
# representative T per bucket of T*K (top-8), most important first (decode batch 1, decode batch 64-256, prefill),
# and each bucket's share of the tuning budget
TUNE_T = {"2-8": 1, "513-2048": 256, ">16384": 8192, "129-512": 64, "33-128": 16, "9-32": 4, "2049-8192": 1024,
          "8193-16384": 2048}
TUNE_SHARE = {"2-8": 3, "513-2048": 2, ">16384": 2, "129-512": 1, "33-128": 1, "9-32": 1, "2049-8192": 1,
              "8193-16384": 1}
TUNE_SPACE = {
    "BLOCK_N": {True: (16, 32, 64, 128), False: (32, 64, 128, 256)},  # by gate_up
    "BLOCK_K": (32, 64, 128, 256),
    "num_stages": (2, 3, 4, 5),
    "BLOCK_M": {"1": (16,), "2-8": (16,), "9-32": (16,), "33-128": (16,), "129-512": (16, 32),
                "513-2048": (16, 32, 64), "2049-8192": (32, 64, 128), "8193-16384": (32, 64, 128),
                ">16384": (64, 128)},
    "num_warps": (4, 8),
    "GROUP_M": (1, 8, 16),
    "tma": (0, 1),  # weight tiles (and down's rows) through TMA descriptors (Hopper+)
}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="+", help=f"token counts T (default {ALL_T}); with --tune: "
                   "only the buckets whose representative T is listed")
    p.add_argument("--quick", action="store_true", help=f"T in {QUICK_T}, fewer reps (tune: 90 s budget)")
    p.add_argument("--check", action="store_true", help="also: error of fused vs torch at these shapes")
    p.add_argument("--tune", action="store_true", help="sweep tile configs per bucket, write the best to JSON")
    p.add_argument("--tune-budget", type=float, default=None, help="seconds of sweeping (default 300; quick 90)")
    p.add_argument("--tune-out", type=Path, default=None, help="JSON to write (default: fused_moe.config_path())")
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--inter", type=int, default=768, help="expert width I")
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--layers", type=int, default=4, help="weight sets used in turn (L)")
    p.add_argument("--routings", type=int, default=16, help="routings per timing unit (G; large T: a quarter)")
    p.add_argument("--reps", type=int, default=None, help="timed reps per case (default 40; quick 15)")
    p.add_argument("--hbm-tbps", type=float, default=4.3)
    p.add_argument("--peak-tflops", type=float, default=989.0)
    p.add_argument("--no-grouped-mm", action="store_true", help="time the fused path only")
    p.add_argument("--device", default="cuda", help="cpu: a smoke run of this script under TRITON_INTERPRET=1 "
                   "(tiny --experts/--hidden/--inter; wall-clock times, no graphs)")
    args = p.parse_args()
    args.device = torch.device(args.device)
    return args


def empty_cache(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


def make_layers(args, dtype=torch.bfloat16) -> list[Experts]:
    E, H, I = args.experts, args.hidden, args.inter
    layers = []
    for _ in range(args.layers):
        with torch.device("meta"):  # no host copy of 1.2 GB per layer: the weights are made on the device
            ex = Experts(SimpleNamespace(num_experts=E, intermediate_size=I), H)
        ex.gate_up_proj = torch.nn.Parameter((torch.randn(E, 2 * I, H, device=args.device) / H**0.5).to(dtype), False)
        ex.down_proj = torch.nn.Parameter((torch.randn(E, H, I, device=args.device) / I**0.5).to(dtype), False)
        ex.fused = True
        layers.append(ex)
    return layers


def router_like(T: int, E: int, K: int, popularity: torch.Tensor, gen: torch.Generator):
    """ids [T, K] long (top-K of noisy logits, no ties), weights [T, K] bf16 (softmax over the top-K, as Qwen3)."""
    logits = torch.randn(T, E, device=popularity.device, generator=gen) + popularity
    top, ids = torch.topk(logits, K, dim=-1)
    return ids, torch.softmax(top.float(), dim=-1).to(torch.bfloat16)


def fused_layer(ex: Experts, x, ids, weights, capture):
    """What replaces the two grouped GEMMs of Experts._forward_fused."""
    pos, tok, offs = routing_kernels.route(ids, ex.num_experts, capture)
    y = fused_moe.expert_mlp(x, ex.gate_up_proj, ex.down_proj, pos, tok, offs)
    return routing_kernels.combine(y, ids, pos, weights, x.dtype)


def grouped_mm_layer(ex: Experts, x, ids, weights, capture):
    return ex._forward_fused(x, ids, weights, capture)


def time_per_call(calls, graph: bool, reps: int, device: torch.device) -> float:
    """Median seconds per call over reps of the unit ``calls`` (run in order; as one CUDA graph when ``graph``)."""
    if device.type != "cuda":  # smoke run on the CPU
        times = []
        for _ in range(reps + 1):
            start = time.perf_counter()
            for c in calls:
                c()
            times.append((time.perf_counter() - start) / len(calls))
        return statistics.median(times[1:])
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up (compiles the kernels) off the default stream, as capture wants
        for c in calls:
            c()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    if graph:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for c in calls:
                c()
        run = g.replay
    else:
        def run():
            for c in calls:
                c()
    for _ in range(2):
        run()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / len(calls))
    if graph:
        del g
    return statistics.median(times)


class Case:
    """Inputs of one token count: x, G routings (ids, weights, capture buffers), weight set of each call."""

    def __init__(self, args, layers, T: int, seed: int):
        E, K, H, dev = args.experts, args.topk, args.hidden, args.device
        gen = torch.Generator(device=dev).manual_seed(seed)
        self.T, self.P = T, T * K
        self.G = args.routings if T <= GRAPH_MAX_T else max(2, args.routings // 4)
        popularity = [torch.randn(E, device=dev, generator=gen) * 0.7 for _ in layers]
        self.x = torch.randn(T, H, device=dev, generator=gen).to(torch.bfloat16)
        self.layer = [layers[g % len(layers)] for g in range(self.G)]
        self.routing = [router_like(T, E, K, popularity[g % len(layers)], gen) for g in range(self.G)]
        self.capture = [torch.zeros(T, K, dtype=torch.int32, device=dev) for _ in range(self.G)]
        self.hit = statistics.mean(ids.unique().numel() for ids, _ in self.routing)
        self.weight_bytes = self.hit * 3 * args.hidden * args.inter * 2
        self.flops = 2 * self.P * 3 * args.hidden * args.inter

    def calls(self, layer_fn):
        return [lambda g=g: layer_fn(self.layer[g], self.x, *self.routing[g], self.capture[g]) for g in range(self.G)]

    def gemm_calls(self):
        """fused_moe.expert_mlp alone, on routings grouped beforehand."""
        routed = [routing_kernels.route(ids, ex.num_experts, None) for ex, (ids, _) in zip(self.layer, self.routing)]
        return [lambda g=g: fused_moe.expert_mlp(self.x, self.layer[g].gate_up_proj, self.layer[g].down_proj,
                                                 *routed[g]) for g in range(self.G)]


def bench(args, layers, tokens, reps) -> list[dict]:
    rows = []
    for T in tokens:
        case = Case(args, layers, T, seed=T)
        graph = T <= GRAPH_MAX_T and args.device.type == "cuda"
        ids, w = case.routing[0]
        diff = (fused_layer(case.layer[0], case.x, ids, w, None).float()
                - grouped_mm_layer(case.layer[0], case.x, ids, w, None).float()).abs().max().item()
        row = {"T": T, "P": case.P, "hit": case.hit, "graph": graph, "diff": diff,
               "fused": time_per_call(case.calls(fused_layer), graph, reps, args.device),
               "gemms": time_per_call(case.gemm_calls(), graph, reps, args.device)}
        if not args.no_grouped_mm:
            row["grouped_mm"] = time_per_call(case.calls(grouped_mm_layer), graph, reps, args.device)
        row["bytes"], row["flops"] = case.weight_bytes, case.flops
        rows.append(row)
        print(f"T={T:>6}: fused {row['fused'] * 1e6:9.1f} us (its GEMMs {row['gemms'] * 1e6:9.1f})" + (
            f"   grouped_mm {row['grouped_mm'] * 1e6:9.1f} us" if "grouped_mm" in row else ""), flush=True)
        del case
        empty_cache(args.device)
    return rows


def print_table(args, rows) -> None:
    print(f"\nMoE layer experts, E={args.experts} H={args.hidden} I={args.inter} K={args.topk} bf16, "
          f"{fused_moe.device_name(args.device)}. Layer = route + expert GEMMs + combine; gemms = expert_mlp alone. "
          f"GB/s: weights of the hit experts per second; %HBM of {args.hbm_tbps} TB/s; %peak of {args.peak_tflops:.0f} "
          f"TFLOP/s; graph: CUDA graph (T <= {GRAPH_MAX_T}); max|diff|: layer output fused vs grouped_mm")
    head = (f"{'T':>6} {'T*K':>7} {'hit':>5} {'graph':>5} {'grouped_mm us':>13} {'fused us':>9} {'speedup':>7} "
            f"{'layer GB/s':>10} {'gemms us':>9} {'gemms GB/s':>10} {'%HBM':>5} {'TFLOP/s':>7} {'%peak':>5} "
            f"{'max|diff|':>9}")
    print(head)
    print("-" * len(head))
    nan = float("nan")
    for r in rows:
        t, gmm, gemms = r["fused"], r.get("grouped_mm"), r["gemms"]
        gbs, tfs = r["bytes"] / gemms / 1e9, r["flops"] / gemms / 1e12
        print(f"{r['T']:>6} {r['P']:>7} {r['hit']:>5.1f} {'yes' if r['graph'] else 'no':>5} "
              f"{gmm * 1e6 if gmm else nan:>13.1f} {t * 1e6:>9.1f} {gmm / t if gmm else nan:>6.2f}x "
              f"{r['bytes'] / t / 1e9:>10.0f} {gemms * 1e6:>9.1f} {gbs:>10.0f} {100 * gbs / (args.hbm_tbps * 1e3):>4.0f}% "
              f"{tfs:>7.1f} {100 * tfs / args.peak_tflops:>4.0f}% {r['diff']:>9.2g}")
    if rows and rows[0]["T"] == 1:
        print(f"roofline at T=1: {rows[0]['bytes'] / 1e6:.1f} MB of weights, "
              f"{rows[0]['bytes'] / (args.hbm_tbps * 1e12) * 1e6:.1f} us at {args.hbm_tbps} TB/s")


def check(args, layers, tokens) -> None:
    """fused vs the torch path at real shapes: SwiGLU outputs h (a silu other than torch's would show here as far
    more than the GEMM-order roundings), expert outputs y (before combine), the layer output, the capture."""
    print("\ncheck: fused vs torch (bf16); bound = dh @ |W_down|^T + 2u|y|, dh = 8u|gate||up| + 2u|h|, u = 2^-8: "
          "one rounding of gate/up either way carried through SwiGLU and down (tests/unit/test_fused_moe.py)")
    head = (f"{'T':>6} {'h same':>7} {'y max|d|':>9} {'/bound':>6} {'y same':>7} {'out max|d|':>10} {'out same':>8} "
            f"{'ids':>4}")
    print(head)
    u = 2.0**-8
    for T in tokens:
        case = Case(args, layers, T, seed=1000 + T)
        ex, x, (ids, w) = case.layer[0], case.x, case.routing[0]
        cap_f, cap_t = torch.full_like(case.capture[0], -1), torch.full_like(case.capture[0], -1)
        pos, tok, offs = routing_kernels.route(ids, ex.num_experts, cap_f)
        y = fused_moe.expert_mlp(x, ex.gate_up_proj, ex.down_proj, pos, tok, offs)
        g_cfg = fused_moe.tile_configs(case.P, args.device, args.experts, args.hidden, args.inter, x.dtype)[0]
        h = fused_moe.gate_up_swiglu(x, ex.gate_up_proj, tok, offs, g_cfg)
        gate, up = _GMM(x[tok], ex.gate_up_proj.transpose(1, 2), offs=offs).chunk(2, dim=-1)
        h_ref = F.silu(gate) * up
        y_ref = _GMM(h_ref, ex.down_proj.transpose(1, 2), offs=offs)
        dh = 8 * u * gate.float().abs() * up.float().abs() + 2 * u * h_ref.float().abs()
        bound = 2 * u * y_ref.float().abs() + 1e-6
        start = 0
        for e, end in enumerate(offs.tolist()):
            if end > start:
                bound[start:end] += dh[start:end] @ ex.down_proj[e].float().abs().t()
            start = end
        del dh
        d = (y.float() - y_ref.float()).abs()
        out = routing_kernels.combine(y, ids, pos, w, x.dtype)
        out_ref = grouped_mm_layer(ex, x, ids, w, cap_t)
        od = (out.float() - out_ref.float()).abs()
        print(f"{T:>6} {(h == h_ref).float().mean().item():>7.2%} {d.max().item():>9.2g} "
              f"{(d / bound).max().item():>6.2f} {(y == y_ref).float().mean().item():>7.2%} {od.max().item():>10.2g} "
              f"{(out == out_ref).float().mean().item():>8.2%} {'same' if torch.equal(cap_f, cap_t) else 'DIFF':>4}")
        del case
        empty_cache(args.device)


def _fits(cfg: TileConfig, gate_up: bool) -> bool:
    """Shared memory of the pipeline and accumulator registers within Hopper's limits (227 KB, 255 regs)."""
    smem = cfg.num_stages * (cfg.BLOCK_M + (2 if gate_up else 1) * cfg.BLOCK_N) * cfg.BLOCK_K * 2
    acc_regs = cfg.BLOCK_M * cfg.BLOCK_N * (2 if gate_up else 1) // (32 * cfg.num_warps)
    return smem <= 200 * 1024 and acc_regs <= 160


def tune(args, layers, budget: float, out_path: Path) -> None:
    t_start = time.monotonic()
    key = fused_moe.table_key(fused_moe.device_name(args.device), args.experts, args.hidden, args.inter, torch.bfloat16)
    reps = 8 if args.device.type == "cuda" else 1
    tuned: dict[str, tuple[TileConfig, TileConfig]] = {}
    report = []
    buckets = [b for b in TUNE_T if fused_moe.bucket_of(TUNE_T[b] * args.topk) == b
               and (not args.tokens or TUNE_T[b] in args.tokens)]
    shares = [TUNE_SHARE[b] for b in buckets]
    for i, bucket in enumerate(buckets):
        T = TUNE_T[bucket]
        slice_end = t_start + budget * sum(shares[: i + 1]) / sum(shares)  # what one leaves goes to the next
        case = Case(args, layers, T, seed=7 + T)
        routed = [routing_kernels.route(ids, args.experts, None) for ids, _ in case.routing]
        start = fused_moe.tile_configs(case.P, args.device, args.experts, args.hidden, args.inter, torch.bfloat16)
        # outputs of the starting configs: every candidate must reproduce them (but for GEMM-order roundings)
        h_ref = [fused_moe.gate_up_swiglu(case.x, case.layer[g].gate_up_proj, routed[g][1], routed[g][2], start[0])
                 for g in range(case.G)]
        y_ref = [fused_moe.down_proj(h_ref[g], case.layer[g].down_proj, routed[g][2], start[1]) for g in range(case.G)]
        h, y = [t.clone() for t in h_ref], [t.clone() for t in y_ref]

        def gate_up_calls(cfg):
            return [lambda g=g: fused_moe.gate_up_swiglu(case.x, case.layer[g].gate_up_proj, routed[g][1],
                                                         routed[g][2], cfg, out=h[g]) for g in range(case.G)]

        def down_calls(cfg):
            return [lambda g=g: fused_moe.down_proj(h_ref[g], case.layer[g].down_proj, routed[g][2], cfg, out=y[g])
                    for g in range(case.G)]

        best = []
        for gate_up, calls, outs, refs in ((True, gate_up_calls, h, h_ref), (False, down_calls, y, y_ref)):
            kernel_end = slice_end if not gate_up else (time.monotonic() + slice_end) / 2
            best.append(_descend(bucket, gate_up, calls, outs, refs, start[0 if gate_up else 1], kernel_end, reps,
                                 args.device))
        tuned[bucket] = (best[0][0], best[1][0])
        report.append((bucket, T, best))
        print(f"tuned {bucket:>9} (T={T}): gate_up {best[0][2] * 1e6:.1f} -> {best[0][1] * 1e6:.1f} us, down "
              f"{best[1][2] * 1e6:.1f} -> {best[1][1] * 1e6:.1f} us  [{time.monotonic() - t_start:.0f} s]", flush=True)
        del case, h, y, h_ref, y_ref, routed
        empty_cache(args.device)
    fused_moe.write_table(out_path, key, tuned)
    print(f"\ntile configs per bucket (T*K), {key}; written to {out_path}")
    print(f"{'bucket':>9} {'T':>5} {'kernel':>7} {'start us':>9} {'tuned us':>9}  tuned config (BM BN BK GM warps stages tma)")
    for bucket, T, best in report:
        for name, (cfg, t, t0, n) in zip(("gate_up", "down"), best):
            print(f"{bucket:>9} {T:>5} {name:>7} {t0 * 1e6:>9.1f} {t * 1e6:>9.1f}  {cfg.BLOCK_M} {cfg.BLOCK_N} "
                  f"{cfg.BLOCK_K} {cfg.GROUP_M} {cfg.num_warps} {cfg.num_stages} {cfg.tma}   ({n} configs timed)")
    print("start = the table in use before (defaults, or an earlier tuning); bucket '1' (T*K = 1) and buckets not "
          f"reached keep theirs. Tuning took {time.monotonic() - t_start:.0f} s")


def _descend(bucket, gate_up, calls, outs, refs, start: TileConfig, deadline: float, reps: int, device):
    """Coordinate descent from the best tile shape near ``start`` (seeds: each BLOCK_M x BLOCK_N with start's other
    parameters): each parameter in turn over its values, the others at the best so far, until a pass changes
    nothing or the deadline passes. A config counts only if its outputs (``outs``, NaN before it runs) equal
    ``refs`` in >= 99% of the elements (only GEMM-order roundings may differ).
    -> (best config, its time, start's time, configs timed)."""
    seen: dict[TileConfig, float] = {}

    def timed(cfg: TileConfig) -> float:
        if cfg not in seen:
            seen[cfg] = float("inf")
            if _fits(cfg, gate_up) or cfg == start:
                for o in outs:
                    o.fill_(float("nan"))
                try:
                    with warnings.catch_warnings():
                        warnings.filterwarnings("error", message="fused_moe:")  # it would shrink: not this config
                        t = time_per_call(calls(cfg), True, reps, device)
                except Exception as err:  # noqa: BLE001  (compile failures of odd configs: skip them)
                    print(f"  skip {cfg}: {type(err).__name__}: {str(err)[:120]}")
                    return seen[cfg]
                same = min((o == r).float().mean().item() for o, r in zip(outs, refs))
                if same >= 0.99:
                    seen[cfg] = t
                else:
                    print(f"  skip {cfg}: outputs differ from the starting config's ({same:.2%} equal)")
        return seen[cfg]

    best, best_t = start, timed(start)
    t0 = best_t
    # Seeds first: every tile shape (BLOCK_M x BLOCK_N) with the start's other parameters. One parameter at a time
    # can miss a better shape when the step to it alone is slower (run 110: the table's gate_up tile, tuned that
    # way, was 1.3x slower at 8,192 tokens than a tile twice as wide).
    for bm, bn in itertools.product(TUNE_SPACE["BLOCK_M"][bucket], TUNE_SPACE["BLOCK_N"][gate_up]):
        if time.monotonic() >= deadline:
            break
        cand = replace(start, BLOCK_M=bm, BLOCK_N=bn)
        t = timed(cand)
        if t < best_t * 0.99:
            best, best_t = cand, t
    changed = True
    while changed and time.monotonic() < deadline:
        changed = False
        for param in ("tma", "BLOCK_N", "BLOCK_K", "num_stages", "BLOCK_M", "num_warps", "GROUP_M"):
            values = TUNE_SPACE[param]
            values = values[gate_up] if param == "BLOCK_N" else values[bucket] if param == "BLOCK_M" else values
            if param == "GROUP_M" and TUNE_SPACE["BLOCK_M"][bucket] == (16,):
                continue  # decode buckets: one row tile per expert, nothing for the grouped order to reuse
            for v in values:
                if time.monotonic() >= deadline:
                    break
                cand = replace(best, **{param: v})
                t = timed(cand)
                if t < best_t * 0.99:  # 1%: below the timing noise
                    best, best_t, changed = cand, t, True
    return best, best_t, t0, sum(t != float("inf") for t in seen.values())


def main() -> int:
    args = parse_args()
    if args.device.type == "cuda" and (not torch.cuda.is_available() or kernel_support.interpreting()):
        print("bench_fused_moe: needs a CUDA GPU and TRITON_INTERPRET unset", file=sys.stderr)
        return 2
    if not kernel_support.available(args.device):
        print(f"bench_fused_moe: no Triton for {args.device} (CPU: set TRITON_INTERPRET=1)", file=sys.stderr)
        return 2
    tokens = tuple(args.tokens or (QUICK_T if args.quick else ALL_T))
    reps = args.reps or (15 if args.quick else 40)
    torch.manual_seed(0)
    if args.device.type == "cuda":
        props = torch.cuda.get_device_properties(args.device)
        print(f"{props.name}, {props.multi_processor_count} SMs, L2 {getattr(props, 'L2_cache_size', 0) / 2**20:.0f} MB")
    print(f"torch {torch.__version__}, triton {fused_moe.triton.__version__}; config file {fused_moe.config_path()}"
          f" ({'present' if fused_moe.config_path().is_file() else 'absent: defaults'})")
    layers = make_layers(args)
    print(f"{args.layers} weight sets of {3 * args.experts * args.hidden * args.inter * 2 / 1e9:.2f} GB, "
          f"{args.routings} routings per timing unit, {reps} reps", flush=True)
    if args.tune:
        budget = args.tune_budget if args.tune_budget is not None else (90.0 if args.quick else 300.0)
        tune(args, layers, budget, args.tune_out or fused_moe.config_path())
        return 0
    rows = bench(args, layers, tokens, reps)
    print_table(args, rows)
    if args.check:
        check(args, layers, tokens)
    return 0


if __name__ == "__main__":
    sys.exit(main())
