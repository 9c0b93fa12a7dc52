"""Probe (not used by the engine): split-K decode attention and its merge in one launch.

A batch-1 decode over 129-1,024 keys runs ``paged_attention``'s split kernel (4-16 splits per kv head) and then
``_merge_splits_kernel``: two launches per layer, one boundary (~1.3 us under programmatic dependent launch) of
(a)'s ~2.96 ms ITL. Here each split program, after writing its partial (max, sum, unnormalised output) as the split
kernel does, counts itself in ``counters[sequence, kv head]`` (an atomic add, release after a CTA barrier); the
program that completes the count merges the G heads' partials of all splits (acquire; read past L1), writes the
output rows and resets the counter (so a CUDA graph can replay it).

The merge's arithmetic is the merge kernel's, but reduced over a [rows, splits, dims] tile instead of a
[splits, dims] one, so the float32 summation order may differ: the output is compared with the two-launch
result within float tolerance (and with the torch reference).

    PYTHONPATH=backends:.:loadtest python3 loadtest/probe_split_merge.py            # H200: time, ~1 min
    TRITON_INTERPRET=1 PYTHONPATH=backends:.:loadtest python3 loadtest/probe_split_merge.py --check-cpu
"""
from __future__ import annotations

import argparse
import sys

import torch
import triton
import triton.language as tl

from moe_engine import paged_attention as pa
from moe_engine.kernels import _await_inputs, pdl
from moe_engine.paged_attention import _attend_tiles

HQ, HKV, D, BLOCK = 32, 4, 128, 16


@triton.jit(do_not_specialize=["s_bt"])
def _split_merge_kernel(
    out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr, count_ptr,
    q_ptr, k_cache_ptr, v_cache_ptr, tables_ptr, cu_ptr, seq_lens_ptr,
    scale_log2, s_qt, s_qh, s_ot, s_oh, s_bt,
    s_kb, s_ko, s_kh, s_vb, s_vo, s_vh,
    Hq: tl.constexpr, G: tl.constexpr, BLOCK_M: tl.constexpr, TILE_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    DK: tl.constexpr, DV: tl.constexpr, SPLITS_PAD: tl.constexpr, IEEE: tl.constexpr, INTERPRET: tl.constexpr,
    PDL: tl.constexpr,
):
    """paged_attention._attn_split_kernel (no window, no sinks, head dims powers of two), then the merge of its
    (sequence, kv head) by the program that finishes last."""
    _await_inputs(PDL)
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)
    q_start = tl.load(cu_ptr + seq)
    if tl.load(cu_ptr + seq + 1) == q_start:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    m = tl.arange(0, BLOCK_M)
    row_ok = m < G
    head = kvh * G + m
    dk = tl.arange(0, DK)
    q = tl.load(q_ptr + q_start.to(tl.int64) * s_qt + head[:, None] * s_qh + dk[None, :], mask=row_ok[:, None],
                other=0.0)
    tiles_per_split = tl.cdiv(tl.cdiv(seq_len, TILE_N), num_splits)
    key_lo = split * tiles_per_split * TILE_N
    key_hi = tl.minimum(key_lo + tiles_per_split * TILE_N, seq_len)
    full_hi = key_lo + tl.maximum(key_hi - key_lo, 0) // TILE_N * TILE_N
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, DV], dtype=tl.float32)
    m_i, l_i, acc = _attend_tiles(
        q, m_i, l_i, acc, tl.zeros([BLOCK_M], dtype=tl.int32) + seq_len - 1, key_lo, full_hi, key_hi,
        k_cache_ptr, v_cache_ptr, tables_ptr + seq * s_bt, kvh, 0, s_kb, s_ko, s_kh, s_vb, s_vo, s_vh, scale_log2,
        DK, DV, DK, DV, BLOCK_SIZE, TILE_N, False, False, IEEE, INTERPRET,
    )
    part = (seq * Hq + head) * num_splits + split  # [BLOCK_M]
    tl.store(part_m_ptr + part, m_i, mask=row_ok)
    tl.store(part_l_ptr + part, l_i, mask=row_ok)
    dv = tl.arange(0, DV)
    tl.store(part_acc_ptr + part[:, None] * DV + dv[None, :], acc, mask=row_ok[:, None])

    counter = count_ptr + seq * tl.num_programs(1) + kvh
    tl.debug_barrier()  # every thread's partial stores precede the release below
    before = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
    if before == num_splits - 1:
        tl.debug_barrier()  # the acquire above precedes every thread's reads below
        s = tl.arange(0, SPLITS_PAD)
        s_ok = s < num_splits
        parts = (seq * Hq + head)[:, None] * num_splits + s[None, :]  # [BLOCK_M, SPLITS_PAD]
        pm_mask = row_ok[:, None] & s_ok[None, :]
        pm = tl.load(part_m_ptr + parts, mask=pm_mask, other=float("-inf"), cache_modifier=".cg")
        pl = tl.load(part_l_ptr + parts, mask=pm_mask, other=0.0, cache_modifier=".cg")
        big = tl.max(pm, axis=1)
        big = tl.where(big == float("-inf"), 0.0, big)
        w = tl.where(pm_mask, tl.exp2(pm - big[:, None]), 0.0)  # empty splits weigh 0
        total = tl.sum(w * pl, axis=1)
        pacc = tl.load(part_acc_ptr + parts[:, :, None] * DV + dv[None, None, :], mask=pm_mask[:, :, None],
                       other=0.0, cache_modifier=".cg")  # [BLOCK_M, SPLITS_PAD, DV]
        o = tl.sum(pacc * w[:, :, None], axis=1) / tl.where(total > 0, total, 1.0)[:, None]
        tl.store(out_ptr + q_start.to(tl.int64) * s_ot + head[:, None] * s_oh + dv[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
        tl.store(counter, 0)  # ready for the next replay


def split_merge(q, k_cache, v_cache, tables, cu, seq_lens, num_splits, counters, out, tile_n=64):
    B, Hkv, G = seq_lens.shape[0], k_cache.shape[2], q.shape[1] // k_cache.shape[2]
    Dv = v_cache.shape[3]
    part_m = torch.empty(B, q.shape[1], num_splits, dtype=torch.float32, device=q.device)
    part_l = torch.empty_like(part_m)
    part_acc = torch.empty(B, q.shape[1], num_splits, Dv, dtype=torch.float32, device=q.device)
    pa._launch(
        _split_merge_kernel, (B, Hkv, num_splits), out, part_m, part_l, part_acc, counters, q, k_cache, v_cache, tables, cu, seq_lens,
        q.shape[-1] ** -0.5 * 1.4426950408889634, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        tables.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0),
        v_cache.stride(1), v_cache.stride(2),
        Hq=q.shape[1], G=G, BLOCK_M=max(16, pa._pow2(G)), TILE_N=tile_n, BLOCK_SIZE=k_cache.shape[1],
        DK=q.shape[-1], DV=Dv, SPLITS_PAD=pa._pow2(num_splits), IEEE=q.dtype == torch.float32,
        INTERPRET=pa.interpreting(), PDL=pdl(q.device), num_warps=4, num_stages=2,
    )
    return out


def decode_step(B, L, hq, hkv, d, block, device, dtype, seed):
    g = torch.Generator(device=device).manual_seed(seed)
    nblk = -(-L // block)
    k = torch.randn(B * nblk, block, hkv, d, device=device, generator=g).to(dtype)
    v = torch.randn(B * nblk, block, hkv, d, device=device, generator=g).to(dtype)
    tables = torch.randperm(B * nblk, device=device, generator=g).view(B, nblk).to(torch.int32)
    q = torch.randn(B, hq, d, device=device, generator=g).to(dtype)
    cu = torch.arange(B + 1, device=device, dtype=torch.int32)
    seq_lens = torch.full((B,), L, device=device, dtype=torch.int32)
    return q, k, v, tables, cu, seq_lens


def check_cpu() -> None:
    assert pa.interpreting(), "run with TRITON_INTERPRET=1"
    for B, L, splits in ((1, 70, 4), (2, 33, 3), (3, 129, 8)):
        q, k, v, tables, cu, seq_lens = decode_step(B, L, 8, 2, 16, 8, "cpu", torch.float32, seed=L)
        counters = torch.zeros(B * 2, dtype=torch.int32)
        out = split_merge(q, k, v, tables, cu, seq_lens, splits, counters, torch.full_like(q, float("nan")),
                          tile_n=16)
        ref = pa.paged_attention_reference(q, k, v, tables, cu, seq_lens, max_query_len=1, max_seq_len=L,
                                           scale=16**-0.5)
        two = pa.paged_attention(q, k, v, tables, cu, seq_lens, max_query_len=1, max_seq_len=L, scale=16**-0.5,
                                 num_splits=splits, config=pa.KernelConfig(decode_tile_n=16))
        assert (out - ref).abs().max() < 1e-5 and (out - two).abs().max() < 1e-5, (B, L, splits)
        assert not counters.any()
    print("interpreter: split + merge in one launch equals the two launches and the reference")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check-cpu", action="store_true")
    p.add_argument("--shapes", default="1x160,1x256,1x384,1x1024,4x512")
    p.add_argument("--reps", type=int, default=20)
    args = p.parse_args()
    if args.check_cpu:
        check_cpu()
        return 0
    import real_shape_model as rsm

    device, layers = torch.device("cuda"), 48
    print(f"{torch.cuda.get_device_name()}; Hq {HQ} Hkv {HKV} D {D} bf16; {layers} layers per CUDA graph", flush=True)
    for shape in args.shapes.split(","):
        B, L = (int(x) for x in shape.split("x"))
        steps = [decode_step(B, L, HQ, HKV, D, BLOCK, device, torch.bfloat16, seed=i) for i in range(layers)]
        splits = pa.choose_num_splits(B, HKV, L)
        counters = torch.zeros(B * HKV, dtype=torch.int32, device=device)
        outs_two = [torch.empty(B, HQ, D, device=device, dtype=torch.bfloat16) for _ in steps]
        outs_one = [torch.empty_like(o) for o in outs_two]

        def two():
            for st, o in zip(steps, outs_two):
                pa.paged_attention(*st, max_query_len=1, max_seq_len=L, scale=D**-0.5, num_splits=splits, out=o)

        def one():
            for st, o in zip(steps, outs_one):
                split_merge(*st, splits, counters, o)

        t_two = rsm.graph_replay_seconds(two, args.reps) * 1e6 / layers
        t_one = rsm.graph_replay_seconds(one, args.reps) * 1e6 / layers
        err = max((a.float() - b.float()).abs().max().item() for a, b in zip(outs_one, outs_two))
        print(f"B={B} L={L} ({splits} splits): split + merge {t_two:.2f} us per layer, one launch {t_one:.2f} us "
              f"({t_two / t_one:.3f}x); max |difference| {err:.1e}; counters left {int(counters.count_nonzero())}",
              flush=True)
        del steps, outs_two, outs_one
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
