"""Probe (not used by the engine): the MoE layer's down projection and ``combine`` in one launch.

A batch-1 decode step launches ~12 kernels per layer, each boundary ~1.3 us under programmatic dependent launch
(``loadtest/reports/real_shape_h200.md``), and (a)'s ITL is 2.96 ms against a 2.8 ms target. ``combine`` (the
weighted, HF-ordered sum of a token's K expert rows) is one of those launches. Here the down GEMM's programs do
it themselves, without a single program summing whole rows (the norm + combine fusion that lost in run 36):

* a down program stores its [BLOCK_M rows, BLOCK_N columns] tile of y as ``fused_moe`` does, then, per real row,
  counts itself in ``counters[token, column block]`` (an atomic add, release after a CTA barrier);
* the program whose add completes a (token, column block), the K-th, sums that token's K rows of those columns
  in ascending expert order exactly as ``kernels._combine_kernel`` does (acquire; the other programs' rows read
  past L1), writes out[token, columns] and resets the counter to 0 (so a CUDA graph can replay it).

The combine work is spread over the column blocks as before; what goes is one launch and its boundary, what comes
is one atomic per row and, for the finishing program, one more round trip to L2. Equal to the bit to
``down_proj`` + ``combine`` (checked here over many replays on the GPU, where the ordering matters; the
interpreter runs programs one after another, so on the CPU it checks the arithmetic only).

    PYTHONPATH=backends:.:loadtest python3 loadtest/probe_down_combine.py            # H200: bits + time, ~1 min
    TRITON_INTERPRET=1 PYTHONPATH=backends:.:loadtest python3 loadtest/probe_down_combine.py --check-cpu
"""
from __future__ import annotations

import argparse
import statistics
import sys

import torch
import triton
import triton.language as tl

from moe_engine import fused_moe, kernels
from moe_engine.kernels import _DT, _await_inputs, _round, interpreting, pdl
from moe_engine.fused_moe import _expert_tile


@triton.jit(do_not_specialize=["num_pid_m"])
def _down_combine_kernel(
    h_ptr, w_ptr, y_ptr, tok_ptr, offs_ptr, ids_ptr, pos_ptr, rw_ptr, out_ptr, count_ptr,
    E, N, K_IN, num_pid_m, s_h, s_we, s_wn, s_wk,
    TOPK: tl.constexpr, BLOCK_TOPK: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr,
    DT: tl.constexpr, UPCAST: tl.constexpr, PDL: tl.constexpr,
):
    """y tile = down[e] @ h rows (fused_moe's down GEMM, GROUP_M 1, K_IN a multiple of BLOCK_K), then the
    combine of every (token, column block) this program completes."""
    _await_inputs(PDL)
    pid = tl.program_id(0)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    pid_m = pid // num_pid_n  # fused_moe's order with GROUP_M 1: a row tile's column blocks one after another
    pid_n = pid % num_pid_n
    expert, row0, row_end = _expert_tile(pid_m, offs_ptr, E, BLOCK_E, BLOCK_M)
    if expert >= E:
        return
    rows = row0 + tl.arange(0, BLOCK_M)
    rmask = rows < row_end
    rows64 = rows.to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N
    a_ptrs = h_ptr + rows64[:, None] * s_h + offs_k[None, :]
    w_ptrs = w_ptr + expert.to(tl.int64) * s_we + offs_n[None, :] * s_wn + offs_k[:, None] * s_wk
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(0, K_IN // BLOCK_K):
        a = tl.load(a_ptrs, mask=rmask[:, None], other=0.0)
        w = tl.load(w_ptrs)
        if UPCAST:
            a = a.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(a, w, acc)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K * s_wk
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < N
    tl.store(y_ptr + rows64[:, None] * N + cols[None, :], _round(acc, DT).to(y_ptr.dtype.element_ty),
             mask=rmask[:, None] & cmask[None, :])

    # count this program's rows in; a token's K rows lie in K distinct experts, so no two rows of one tile share
    # a token and each (token, column block) counter is added to once per program
    toks = tl.load(tok_ptr + rows64, mask=rmask, other=0)
    counter = count_ptr + toks * num_pid_n + pid_n
    tl.debug_barrier()  # every thread's y stores precede the release below
    before = tl.atomic_add(counter, 1, mask=rmask, sem="acq_rel", scope="gpu")
    last = rmask & (before == TOPK - 1)
    if tl.sum(last.to(tl.int32), axis=0) > 0:
        tl.debug_barrier()  # the acquire above precedes every thread's reads below
        j = tl.arange(0, BLOCK_TOPK)
        jm = j < TOPK
        pair = toks[:, None] * TOPK + j[None, :]  # [BLOCK_M, BLOCK_TOPK]
        pm = last[:, None] & jm[None, :]
        ids = tl.load(ids_ptr + pair, mask=pm, other=0)
        pos = tl.load(pos_ptr + pair, mask=pm, other=0)
        wts = tl.load(rw_ptr + pair, mask=pm, other=0.0).to(tl.float32)
        # rank of each slot's expert within its token's experts (kernels._combine_kernel, one token per row)
        rank = tl.sum(((ids[:, None, :] < ids[:, :, None]) & jm[None, None, :]).to(tl.int32), axis=2)
        rank = tl.where(jm[None, :], rank, BLOCK_TOPK)
        out = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        ym = last[:, None] & cmask[None, :]
        for r in tl.static_range(TOPK):
            row = tl.sum(tl.where(rank == r, pos, 0), axis=1)  # [BLOCK_M]
            wr = tl.sum(tl.where(rank == r, wts, 0.0), axis=1)
            yr = tl.load(y_ptr + row.to(tl.int64)[:, None] * N + cols[None, :], mask=ym, other=0.0,
                         cache_modifier=".cg")  # written by other programs: past L1
            p = _round(yr.to(tl.float32) * wr[:, None], DT)
            if r == 0:
                out = p
            else:
                out = _round(out + p, DT)
        if TOPK == 1:
            out = out + 0.0
        tl.store(out_ptr + toks.to(tl.int64)[:, None] * N + cols[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=ym)
        tl.store(counter, tl.zeros([BLOCK_M], dtype=tl.int32), mask=last)  # ready for the next replay


def down_combine(h, down, tok, offs, ids, pos, weights, counters, cfg: fused_moe.TileConfig):
    """h [P, I] grouped rows, down [E, H, I] -> (y [P, H] as down_proj gives it, out [T, H] as combine gives it).
    counters: int32 [T * cdiv(H, BLOCK_N)] zeros (left zero)."""
    P, E, H, I = h.shape[0], down.shape[0], down.shape[1], down.shape[2]
    T, K = ids.shape
    cfg = fused_moe._fit(cfg, H, I)
    assert I % cfg.BLOCK_K == 0 and counters.numel() >= T * triton.cdiv(H, cfg.BLOCK_N)
    y = torch.empty(P, H, dtype=h.dtype, device=h.device)
    out = torch.empty(T, H, dtype=h.dtype, device=h.device)
    num_pid_m = triton.cdiv(P, cfg.BLOCK_M) + min(E, P)
    # kernels._launch: no FMA contraction (combine's roundings, bit for bit), PDL as the engine's kernels
    kernels._launch(
        _down_combine_kernel, (num_pid_m * triton.cdiv(H, cfg.BLOCK_N),), h, down, y, tok, offs, ids.contiguous(), pos.contiguous(), weights.contiguous(), out, counters,
        E, H, I, num_pid_m, h.stride(0), down.stride(0), down.stride(1), down.stride(2),
        TOPK=K, BLOCK_TOPK=kernels._pow2(K), BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N, BLOCK_K=cfg.BLOCK_K,
        BLOCK_E=kernels._pow2(E), DT=_DT[h.dtype], UPCAST=interpreting(), PDL=pdl(h.device),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return y, out


def make_layer(T, E, H, I, K, device, dtype, seed):
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(T, H, device=device, generator=g).to(dtype)
    gate_up = (torch.randn(E, 2 * I, H, device=device, generator=g) / H**0.5).to(dtype)
    down = (torch.randn(E, H, I, device=device, generator=g) / I**0.5).to(dtype)
    logits = torch.randn(T, E, device=device, generator=g)
    top, ids = torch.topk(logits, K, dim=-1)
    weights = torch.softmax(top, dim=-1).to(dtype)
    pos, tok, offs = kernels.route(ids, E, None)
    cfg_g, cfg_d = fused_moe.tile_configs(T * K, device, E, H, I, dtype)
    h = fused_moe.gate_up_swiglu(x, gate_up, tok, offs, cfg_g)
    return dict(h=h, down=down, tok=tok, offs=offs, ids=ids, pos=pos, weights=weights, cfg=cfg_d, dtype=dtype)


def reference(layer):
    y = fused_moe.down_proj(layer["h"], layer["down"], layer["offs"], layer["cfg"])
    return y, kernels.combine(y, layer["ids"], layer["pos"], layer["weights"], layer["dtype"])


def fused(layer, counters):
    return down_combine(layer["h"], layer["down"], layer["tok"], layer["offs"], layer["ids"], layer["pos"],
                        layer["weights"], counters, layer["cfg"])


def check_cpu() -> None:
    assert interpreting(), "run with TRITON_INTERPRET=1"
    for T, E, H, I, K in ((1, 8, 64, 32, 2), (5, 8, 96, 32, 3), (3, 4, 64, 32, 1)):
        for dtype in (torch.bfloat16, torch.float32):
            layer = make_layer(T, E, H, I, K, "cpu", dtype, seed=T + K)
            counters = torch.zeros(T * 64, dtype=torch.int32)
            y_ref, out_ref = reference(layer)
            y, out = fused(layer, counters)
            assert torch.equal(y, y_ref) and torch.equal(out, out_ref), (T, E, H, I, K, dtype)
            assert not counters.any(), "counters left non-zero"
    print("interpreter: down + combine in one launch equals down_proj then combine, to the bit")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check-cpu", action="store_true")
    p.add_argument("--tokens", default="1,4,16,64")
    p.add_argument("--layers", type=int, default=48)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--bit-reps", type=int, default=200, help="graph replays compared to the bit with the reference")
    args = p.parse_args()
    if args.check_cpu:
        check_cpu()
        return 0
    import real_shape_model as rsm

    device = torch.device("cuda")
    E, H, I, K = 128, 2048, 768, 8
    print(f"{torch.cuda.get_device_name()}; E {E} H {H} I {I} top-{K} bf16; {args.layers} layers per CUDA graph",
          flush=True)
    for T in (int(t) for t in args.tokens.split(",")):
        layers = [make_layer(T, E, H, I, K, device, torch.bfloat16, seed=i) for i in range(args.layers)]
        counters = torch.zeros(T * triton.cdiv(H, 16), dtype=torch.int32, device=device)
        refs = [reference(layer)[1] for layer in layers]
        outs = [None] * len(layers)

        def run_fused():
            for i, layer in enumerate(layers):
                outs[i] = fused(layer, counters)[1]

        def run_reference():
            for layer in layers:
                reference(layer)

        fused_us = rsm.graph_replay_seconds(run_fused, args.reps) * 1e6 / len(layers)
        ref_us = rsm.graph_replay_seconds(run_reference, args.reps) * 1e6 / len(layers)
        # bits over many eager runs (the ordering between programs is what could go wrong)
        bad = 0
        for _ in range(args.bit_reps // len(layers) + 1):
            run_fused()
            torch.cuda.synchronize()
            bad += sum(not torch.equal(o, r) for o, r in zip(outs, refs))
        print(f"T={T}: down_proj + combine {ref_us:.2f} us per layer, one launch {fused_us:.2f} us "
              f"({ref_us / fused_us:.3f}x); outputs differing from the reference: {bad}; counters left "
              f"{int(counters.count_nonzero())}", flush=True)
        del layers, refs, outs
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
