"""Probe: prefill attention with K/V tiles loaded through TMA, against the engine's paged kernel, on one GPU.

The engine's ``_attn_2d_kernel`` gathers each K/V tile key by key through the block table (pointer loads, 16-key
blocks) and runs at ~340 TFLOP/s on a multi-turn turn-16 step (27 chunks of 303 queries over ~7,500 cached keys);
cuDNN's Hopper kernel ran the same step's cached part at ~495 TFLOP/s (``real_shape/run59_cudnn_padded_probe.txt``).
Hopper's TMA copies a whole [keys, dims] box into shared memory asynchronously, but only a box of rows that are
contiguous in one tensor, so this probe asks how much a TMA-fed kernel would gain before the engine pays for it:

* ``paged``: the engine kernel (16-key blocks), the baseline;
* ``tma bs64``: the same program on a cache of 64-key blocks (a 64-key tile is one block: one TMA box per tile);
* ``tma contig``: the sequences' keys gathered first into one contiguous [B, Lp, Hkv, D] buffer (a "block" per
  sequence), timed with and without that gather, tiles of 64 or 128 keys.

Each TMA variant runs its unmasked key tiles (all below the tile's first query) through descriptors and its
diagonal tiles with masked pointer loads (as the engine, so that keys past a sequence are never read); outputs
are compared with the engine kernel's. Timing: CUDA events, median of ``--reps``.

    PYTHONPATH=backends:.:loadtest python3 loadtest/probe_prefill_attention_tma.py
    TRITON_INTERPRET=1 PYTHONPATH=backends:.:loadtest python3 loadtest/probe_prefill_attention_tma.py --check-cpu
"""
from __future__ import annotations

import argparse
import sys

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from moe_engine import paged_attention as pa
from moe_engine.paged_attention import _find_seq

HQ, HKV, D = 32, 4, 128
SHAPES = {  # name: (sequences, new tokens each, cached tokens each)
    "T16 27x303 over 7500": (27, 303, 7500),
    "4x2k over 6k": (4, 2048, 6144),
}


@triton.jit
def _dot(a, b, UPCAST: tl.constexpr):
    if UPCAST:  # the interpreter multiplies bf16 as integers
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b)


@triton.jit(do_not_specialize=["num_seqs", "s_bt"])
def _tma_kernel(
    out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, k_desc, v_desc, tables_ptr, cu_ptr, seq_lens_ptr, num_seqs, scale_log2,
    s_qt, s_qh, s_ot, s_oh, s_bt, s_kb, s_ko, s_kh, s_vb, s_vo, s_vh,
    G: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, TILE_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, DP: tl.constexpr, UPCAST: tl.constexpr,
):
    """Program (query tile, kv head), rows m -> (token m // G, head kvh * G + m % G), as the engine's kernel.
    k_desc / v_desc: the caches as [num_blocks * BLOCK_SIZE, Hkv * DP] rows, [TILE_N, DP] boxes
    (TILE_N divides BLOCK_SIZE, so a tile never leaves its block)."""
    pid = tl.program_id(0)
    kvh = tl.program_id(1)
    seq = _find_seq(cu_ptr, pid, num_seqs, BLOCK_Q)
    q_start = tl.load(cu_ptr + seq)
    q_len = tl.load(cu_ptr + seq + 1) - q_start
    tile = pid - (q_start // BLOCK_Q + seq)
    if tile * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context = seq_len - q_len
    table_ptr = tables_ptr + seq * s_bt

    m = tl.arange(0, BLOCK_M)
    qi = tile * BLOCK_Q + m // G
    row_ok = qi < q_len
    head = kvh * G + m % G
    qpos = context + qi
    tok = (q_start + qi).to(tl.int64)
    d = tl.arange(0, DP)
    q = tl.load(q_ptr + tok[:, None] * s_qt + head[:, None] * s_qh + d[None, :], mask=row_ok[:, None], other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, DP], dtype=tl.float32)

    first = context + tile * BLOCK_Q
    key_hi = tl.minimum(first + BLOCK_Q, seq_len)
    full_hi = (first + 1) // TILE_N * TILE_N
    col = kvh * DP
    for start in range(0, full_hi, TILE_N):
        blk = tl.load(table_ptr + start // BLOCK_SIZE)
        row = blk * BLOCK_SIZE + start % BLOCK_SIZE
        k = k_desc.load([row, col])  # [TILE_N, DP]
        s = _dot(q, tl.trans(k), UPCAST)
        m_new = tl.maximum(m_i, tl.max(s, axis=1) * scale_log2)
        p = tl.exp2(s * scale_log2 - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = v_desc.load([row, col])  # [TILE_N, DP]
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, UPCAST)
        m_i = m_new
    offs_n = tl.arange(0, TILE_N)
    for start in range(full_hi, key_hi, TILE_N):  # diagonal tiles: masked pointer loads, as the engine
        kpos = start + offs_n
        kvalid = kpos < key_hi
        blk = tl.load(table_ptr + kpos // BLOCK_SIZE, mask=kvalid, other=0).to(tl.int64)
        off = kpos % BLOCK_SIZE
        k = tl.load(k_cache_ptr + blk[:, None] * s_kb + off[:, None] * s_ko + kvh * s_kh + d[None, :],
                    mask=kvalid[:, None], other=0.0)
        s = _dot(q, tl.trans(k), UPCAST)
        s = tl.where(kvalid[None, :] & (kpos[None, :] <= qpos[:, None]), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1) * scale_log2)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s * scale_log2 - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_cache_ptr + blk[:, None] * s_vb + off[:, None] * s_vo + kvh * s_vh + d[None, :],
                    mask=kvalid[:, None], other=0.0)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, UPCAST)
        m_i = m_new
    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + tok[:, None] * s_ot + head[:, None] * s_oh + d[None, :], o.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None])


def tma_attention(q, k_cache, v_cache, tables, cu, seq_lens, out, *, block_m=256, tile_n=64, warps=16, stages=3):
    T, Hq, Dk = q.shape
    nb, bs, Hkv, _ = k_cache.shape
    assert bs % tile_n == 0, (bs, tile_n)
    G = Hq // Hkv
    block_q = block_m // G
    k_desc = TensorDescriptor.from_tensor(k_cache.view(nb * bs, Hkv * Dk), [tile_n, Dk])
    v_desc = TensorDescriptor.from_tensor(v_cache.view(nb * bs, Hkv * Dk), [tile_n, Dk])
    kw = {} if pa.interpreting() else dict(num_warps=warps, num_stages=stages)
    _tma_kernel[(T // block_q + seq_lens.shape[0], Hkv)](
        out, q, k_cache, v_cache, k_desc, v_desc, tables, cu, seq_lens, seq_lens.shape[0],
        Dk**-0.5 * 1.4426950408889634,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), tables.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1),
        v_cache.stride(2), G=G, BLOCK_Q=block_q, BLOCK_M=block_m, TILE_N=tile_n, BLOCK_SIZE=bs, DP=Dk,
        UPCAST=pa.interpreting(), **kw,
    )
    return out


def step(S, new, cached, device, dtype, block, hq=HQ, hkv=HKV, d=D, seed=0):
    """S sequences of `new` queries after `cached` keys in a paged cache of `block`-key blocks in random order."""
    g = torch.Generator(device=device).manual_seed(seed)
    L = cached + new
    nblk = -(-L // block)
    k = torch.randn(S * nblk, block, hkv, d, device=device, dtype=dtype, generator=g)
    v = torch.randn(S * nblk, block, hkv, d, device=device, dtype=dtype, generator=g)
    tables = torch.randperm(S * nblk, device=device, generator=g).view(S, nblk).to(torch.int32)
    q = torch.randn(S * new, hq, d, device=device, dtype=dtype, generator=g)
    cu = torch.arange(S + 1, device=device, dtype=torch.int32) * new
    seq_lens = torch.full((S,), L, device=device, dtype=torch.int32)
    return q, k, v, tables, cu, seq_lens


def reblock(k, tables, block):
    """The same sequences' keys in a cache of `block`-key blocks (in order; padded): (cache, tables)."""
    S, nb16 = tables.shape
    bs = k.shape[1]
    flat = k[tables.long()].reshape(S, nb16 * bs, *k.shape[2:])  # [S, L16, Hkv, D]
    nblk = -(-flat.shape[1] // block)
    pad = flat.new_zeros(S, nblk * block, *k.shape[2:])
    pad[:, :flat.shape[1]] = flat
    return pad.view(S * nblk, block, *k.shape[2:]), torch.arange(S * nblk, device=k.device, dtype=torch.int32).view(S, nblk)


def gather_contig(k, v, tables, lp, out_k, out_v):
    """The contiguous copy a 'contig' step would make: each sequence's blocks into [S, lp, Hkv, D]."""
    S = tables.shape[0]
    nb = lp // k.shape[1]
    idx = tables[:, :nb].reshape(-1).long()
    torch.index_select(k, 0, idx, out=out_k.view(S * nb, *k.shape[1:]))
    torch.index_select(v, 0, idx, out=out_v.view(S * nb, *v.shape[1:]))


def median_ms(fn, reps: int) -> float:
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


def check_cpu() -> None:
    """Under TRITON_INTERPRET=1: the TMA kernel equals the torch reference on small float32 shapes, on 16-key
    tiles of 16-key blocks and of 64-key blocks (re-blocked), and on a contiguous copy."""
    assert pa.interpreting(), "run with TRITON_INTERPRET=1"
    for S, new, cached in ((2, 9, 0), (3, 5, 37), (1, 40, 70)):
        q, k, v, tables, cu, seq_lens = step(S, new, cached, "cpu", torch.float32, 16, hq=4, hkv=2, d=16)
        ref = pa.paged_attention_reference(q, k, v, tables, cu, seq_lens, max_query_len=new,
                                           max_seq_len=new + cached, scale=16**-0.5)
        for block in (16, 64, 128):
            kb, tb = reblock(k, tables, block)
            vb, _ = reblock(v, tables, block)
            out = tma_attention(q, kb, vb, tb, cu, seq_lens, torch.full_like(q, float("nan")), block_m=8,
                                tile_n=16)
            err = (out - ref).abs().max().item()
            assert err < 1e-4, (S, new, cached, block, err)
    print("interpreter: the TMA kernel equals the reference")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check-cpu", action="store_true")
    p.add_argument("--reps", type=int, default=20)
    args = p.parse_args()
    if args.check_cpu:
        return check_cpu()
    torch.manual_seed(0)
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__, flush=True)
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    configs = [  # (block_m, tile_n, warps, stages)
        (256, 64, 16, 3), (256, 64, 16, 2), (256, 64, 8, 3), (128, 64, 8, 3), (128, 64, 4, 3),
        (128, 128, 8, 2), (128, 128, 8, 3), (128, 64, 8, 4), (256, 128, 16, 2), (64, 64, 4, 3), (64, 128, 4, 2),
    ]
    for name, (S, new, cached) in SHAPES.items():
        q, k, v, tables, cu, seq_lens = step(S, new, cached, "cuda", torch.bfloat16, 16)
        L = cached + new
        flops = 4 * S * new * (cached + (new + 1) / 2) * D * HQ
        kw = dict(max_query_len=new, max_seq_len=L, scale=D**-0.5)
        ref = pa.paged_attention(q, k, v, tables, cu, seq_lens, **kw)
        base = median_ms(lambda: pa.paged_attention(q, k, v, tables, cu, seq_lens, **kw), args.reps)
        print(f"{name}: paged (engine, 16-key blocks) {base:.3f} ms {flops / base / 1e9:.0f} TFLOP/s", flush=True)
        lp = -(-L // 128) * 128
        k64, t64 = reblock(k, tables, 64)
        v64, _ = reblock(v, tables, 64)
        kc, tc = reblock(k, tables, lp)
        vc, _ = reblock(v, tables, lp)
        gk, gv = torch.empty_like(kc), torch.empty_like(vc)
        t16 = torch.nn.functional.pad(tables, (0, lp // 16 - tables.shape[1]))  # pad entries: block 0, never read
        gms = median_ms(lambda: gather_contig(k, v, t16, lp, gk, gv), args.reps)
        print(f"  gather of the keys/values into [B, {lp}, Hkv, D]: {gms:.3f} ms", flush=True)
        for label, kk, vv, tt in (("tma bs64", k64, v64, t64), ("tma contig", kc, vc, tc)):
            for bm, tn, w, st in configs:
                if kk.shape[1] % tn:
                    continue
                out = torch.empty_like(q)
                try:
                    fn = lambda: tma_attention(q, kk, vv, tt, cu, seq_lens, out, block_m=bm, tile_n=tn, warps=w,  # noqa: E731
                                               stages=st)
                    ms = median_ms(fn, args.reps)
                except Exception as err:  # noqa: BLE001 (a config that does not compile or fit: say so, go on)
                    print(f"  {label} bm{bm} tn{tn} w{w} s{st}: failed {type(err).__name__}: {str(err)[:120]}")
                    continue
                err = (out.float() - ref.float()).abs().max().item()
                extra = f", {ms + gms:.3f} with the gather ({base / (ms + gms):.3f}x)" if label == "tma contig" else ""
                print(f"  {label} bm{bm} tn{tn} w{w} s{st}: {ms:.3f} ms {flops / ms / 1e9:.0f} TFLOP/s "
                      f"{base / ms:.3f}x{extra}  max |diff| {err:.1e}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
