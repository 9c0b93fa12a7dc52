#!/usr/bin/env python
"""Prototype, not used by the engine: a batch-1 decode step's routed experts in one launch instead of two.

Why (reports/real_shape/run38_ncu_batch1_gemms.txt): at one token the engine's expert GEMMs (fused_moe.py: gate_up
with SwiGLU, then down) take ~41% of a decode step and stream their 75.5 MB per layer at 2.5-2.9 TB/s. Each is a
launch of 0.44-0.55 waves of programs with a ramp and a drain of several microseconds (SMs active 78% of gate_up's
time), and down starts only when gate_up has drained.

What this tries: program (slot k, slice s) computes the token's gate and up projections for intermediate columns
[s*BI, (s+1)*BI) of expert ids[k] (GEMV: a float32 sum over H, loaded in BK-wide chunks, the next chunk's load
issued before this chunk's sums), SwiGLU rounded as torch rounds it, then that slice's share of the down
projection for all H outputs, stored as float32 partial sums [K, S, H]. A second small launch sums the S partials
of each slot in a fixed order, rounds, weights and adds the slots in ascending expert order (what
``kernels.combine`` does with the down GEMM's rows). The down projection's sum is split over the intermediate
dimension, so the result equals the engine's within bf16 rounding (not bit for bit; the expert ids of the next
layer would be checked in the model before any use).

    PYTHONPATH=backends:. python3 loadtest/proto_expert_mlp_one_launch.py            # H200: ~1 minute
    TRITON_INTERPRET=1 PYTHONPATH=backends:. python3 loadtest/proto_expert_mlp_one_launch.py --check   # CPU

Prints, for each config, the time per layer of both forms (48 layers' calls in one CUDA graph, 8 weight sets of
128 experts used in turn, fresh routing per layer; both under programmatic dependent launch where the GPU has it)
and how the outputs compare (max |difference| against the engine's path, share of equal bf16 values).
"""
from __future__ import annotations

import argparse
import itertools
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "backends"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from moe_engine import fused_moe, kernels  # noqa: E402
from moe_engine.kernels import _DT, _launch, _pow2, interpreting, pdl, triton  # noqa: E402

if triton is not None:
    import triton.language as tl
    from triton.language.extra import libdevice

    from moe_engine.kernels import _await_inputs, _round

    @triton.jit
    def _one_token_expert_mlp_kernel(
        x_ptr, gu_ptr, dn_ptr, ids_ptr, part_ptr, H, I,
        s_ge, s_gn, s_de, s_dn,  # gate_up [E, 2I, H] strides (expert, row); down [E, H, I] (expert, row)
        BI: tl.constexpr, BK: tl.constexpr, BN: tl.constexpr, PRECISE: tl.constexpr, PDL: tl.constexpr,
    ):
        """Program (k, s): part[k, s, :] = down[e][:, slice] @ swiglu(gate_up[e][slice rows] @ x), e = ids[k]."""
        _await_inputs(PDL)
        k = tl.program_id(0)
        s = tl.program_id(1)
        S = tl.num_programs(1)
        e = tl.load(ids_ptr + k).to(tl.int64)
        cols = s * BI + tl.arange(0, BI)  # this program's intermediate columns
        cm = cols < I
        hk = tl.arange(0, BK)
        g_ptrs = gu_ptr + e * s_ge + cols[:, None] * s_gn + hk[None, :]  # [BI, BK]
        u_ptrs = g_ptrs + I * s_gn
        wm = cm[:, None] & (hk[None, :] < H)
        wg = tl.load(g_ptrs, mask=wm, other=0.0)
        wu = tl.load(u_ptrs, mask=wm, other=0.0)
        acc_g = tl.zeros([BI], dtype=tl.float32)
        acc_u = tl.zeros([BI], dtype=tl.float32)
        for h0 in range(0, H, BK):
            x = tl.load(x_ptr + h0 + hk, mask=h0 + hk < H, other=0.0).to(tl.float32)
            cur_g, cur_u = wg.to(tl.float32), wu.to(tl.float32)
            nm = cm[:, None] & (h0 + BK + hk[None, :] < H)  # the next chunk, loaded before these sums
            wg = tl.load(g_ptrs + h0 + BK, mask=nm, other=0.0)
            wu = tl.load(u_ptrs + h0 + BK, mask=nm, other=0.0)
            acc_g += tl.sum(cur_g * x[None, :], axis=1)
            acc_u += tl.sum(cur_u * x[None, :], axis=1)
        g = _round(acc_g, 1)
        if PRECISE:  # expf, as torch's silu and fused_moe's epilogue (tl.exp is an approximation)
            denom = 1.0 + libdevice.exp(-g)
        else:
            denom = 1.0 + tl.exp(-g)
        h = _round(_round(tl.math.div_rn(g, denom), 1) * _round(acc_u, 1), 1)  # [BI], bf16 values
        n = tl.arange(0, BN)
        d_ptrs = dn_ptr + e * s_de + n[:, None] * s_dn + cols[None, :]  # [BN, BI]
        wd = tl.load(d_ptrs, mask=(n[:, None] < H) & cm[None, :], other=0.0)
        for n0 in range(0, H, BN):
            cur = wd.to(tl.float32)
            wd = tl.load(d_ptrs + (n0 + BN) * s_dn, mask=(n0 + BN + n[:, None] < H) & cm[None, :], other=0.0)
            y = tl.sum(cur * h[None, :], axis=1)  # [BN]
            tl.store(part_ptr + (k * S + s) * H + n0 + n, y, mask=n0 + n < H)

    @triton.jit
    def _sum_parts_kernel(
        part_ptr, ids_ptr, w_ptr, out_ptr, H, S,
        K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
    ):
        """out[cols] = sum over the slots in ascending expert order of round(round(sum_s part[k, s]) * w[k])."""
        _await_inputs(PDL)
        cols = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = cols < H
        j = tl.arange(0, BLOCK_K)
        jm = j < K
        ids = tl.load(ids_ptr + j, mask=jm, other=0)
        w = tl.load(w_ptr + j, mask=jm, other=0.0).to(tl.float32)
        rank = tl.sum(((ids[None, :] < ids[:, None]) & jm[None, :]).to(tl.int32), axis=1)
        rank = tl.where(jm, rank, BLOCK_K)
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for r in tl.static_range(K):
            slot = tl.sum(tl.where(rank == r, j, 0))
            wr = tl.sum(tl.where(rank == r, w, 0.0))
            y = tl.zeros([BLOCK], dtype=tl.float32)
            for s in range(S):
                y += tl.load(part_ptr + (slot * S + s) * H + cols, mask=m, other=0.0)
            p = _round(_round(y, 1) * wr, 1)
            acc = p if r == 0 else _round(acc + p, 1)
        tl.store(out_ptr + cols, acc.to(out_ptr.dtype.element_ty), mask=m)


def one_launch(x, gate_up, down, ids, weights, BI: int, BK: int, BN: int, warps: int, block: int = 256):
    """x [1, H] bf16, ids/weights [1, K] -> [1, H] bf16 (two launches: the experts, then the partial sums)."""
    E, I2, H = gate_up.shape
    I, K = I2 // 2, ids.shape[1]
    S = triton.cdiv(I, BI)
    part = torch.empty(K, S, H, dtype=torch.float32, device=x.device)
    out = torch.empty(1, H, dtype=x.dtype, device=x.device)
    meta = {} if interpreting() else {"num_warps": warps}
    _launch(_one_token_expert_mlp_kernel, (K, S), x, gate_up, down, ids, part, H, I,
            gate_up.stride(0), gate_up.stride(1), down.stride(0), down.stride(1),
            BI=BI, BK=BK, BN=BN, PRECISE=not interpreting(), PDL=pdl(x.device), **meta)
    _launch(_sum_parts_kernel, (triton.cdiv(H, block),), part, ids, weights, out, H, S,
            K=K, BLOCK_K=_pow2(K), BLOCK=block, PDL=pdl(x.device))
    return out


def engine_path(x, gate_up, down, ids, weights):
    """What the engine runs at one token: route's grouping (inside the router's launch there; here route), the
    two expert GEMMs, combine."""
    E, I2, H = gate_up.shape
    pos, tok, offs = kernels.route(ids, E)
    y = fused_moe.expert_mlp(x, gate_up, down, pos, tok, offs)
    return kernels.combine(y, ids, pos, weights, x.dtype)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--check", action="store_true", help="a small shape, outputs compared only (runs on the CPU "
                   "under TRITON_INTERPRET=1)")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--sets", type=int, default=8, help="weight sets of E experts used in turn")
    args = p.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dt = torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    if args.check:
        E, K, H, I, L, sets = 16, 4, 256, 96, 2, 2
        configs = [(32, 64, 64, 4), (16, 128, 128, 4)]
    else:
        E, K, H, I, L, sets = 128, 8, 2048, 768, 48, args.sets  # Qwen3-30B-A3B
        configs = [(bi, bk, bn, w) for bi, bk, bn, w in itertools.product((16, 32, 64), (128, 256), (64, 128), (4, 8))]

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, device=dev, generator=g) * scale).to(dt)

    weights_sets = [(rnd(E, 2 * I, H, scale=H**-0.5), rnd(E, H, I, scale=I**-0.5)) for _ in range(sets)]
    xs = [rnd(1, H) for _ in range(L)]
    routes = []
    for _ in range(L):
        ids = torch.randperm(E, device=dev, generator=g)[:K][None]
        routes.append((ids, torch.softmax(torch.randn(1, K, device=dev, generator=g), -1).to(dt)))

    def layer(i, fn):
        gu, dn = weights_sets[i % sets]
        return fn(xs[i], gu, dn, *routes[i])

    ref = [layer(i, engine_path) for i in range(L)]
    t0 = time.perf_counter()
    if dev.type == "cuda":
        import real_shape_model as rsm
        base_us = rsm.graph_replay_seconds(lambda: [layer(i, engine_path) for i in range(L)], args.reps) / L * 1e6
        print(f"engine path (route + gate_up + down + combine): {base_us:.2f} us per layer", flush=True)
    for bi, bk, bn, w in configs:
        fn = lambda x, gu, dn, ids, wt, c=(bi, bk, bn, w): one_launch(x, gu, dn, ids, wt, *c)  # noqa: E731
        try:
            outs = [layer(i, fn) for i in range(L)]
        except Exception as err:  # noqa: BLE001  (a config that does not compile)
            print(f"BI {bi} BK {bk} BN {bn} w{w}: {type(err).__name__}: {str(err)[:100]}", flush=True)
            continue
        diff = max((o.float() - r.float()).abs().max().item() for o, r in zip(outs, ref))
        scale = max(r.float().abs().max().item() for r in ref)
        equal = min((o == r).float().mean().item() for o, r in zip(outs, ref))
        line = f"BI {bi:3d} BK {bk:3d} BN {bn:3d} w{w}: max |diff| {diff:.3g} (of {scale:.3g}), {100 * equal:.1f}% equal"
        if dev.type == "cuda":
            us = rsm.graph_replay_seconds(lambda: [layer(i, fn) for i in range(L)], args.reps) / L * 1e6
            line += f", {us:.2f} us per layer ({base_us / us:.2f}x)"
        print(line + f"  [{time.perf_counter() - t0:.0f} s]", flush=True)
        if args.check:
            assert diff <= 0.02 * scale and equal >= 0.5, line


if __name__ == "__main__":
    main()
