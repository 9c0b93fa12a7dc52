"""Probe: inner-loop variants of the paged prefill attention kernel, against the engine's kernel, on one GPU.

The engine's ``_attn_2d_kernel`` (paged_attention.py) runs at ~330-400 TFLOP/s on Qwen3-30B-A3B's attention; a
multi-turn turn-16 step spends most of its time there. This copy of its program (no window, no sinks, head dim a
power of two) has three switches:

* KROW: each K tile loaded as [keys, dims] (rows contiguous in the cache) and transposed for the dot, instead of
  loaded as [dims, keys];
* FMA: the softmax scale folded into the exponent (exp2(s * c - m), one FMA per score) instead of scaling the
  scores first (a multiply, then a subtract);
* PIPE: the next key tile's scores (an asynchronous wgmma on Hopper) issued before this tile's softmax, so the
  tensor cores and the softmax's arithmetic can overlap (FlashAttention-3's intra-warpgroup pipelining, by hand).

Each variant's output is compared with the engine kernel's (max |difference|) and timed with CUDA events (median
of ``--reps``) on the shapes of ``sweep_prefill_tiles.py`` plus (b)'s prefill (8 x 1,024 from position 0).

    PYTHONPATH=backends:. python3 loadtest/probes/probe_prefill_attention_variants.py
    TRITON_INTERPRET=1 PYTHONPATH=backends:. python3 loadtest/probes/probe_prefill_attention_variants.py --check-cpu
"""
from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

from moe_engine.kernels import paged_attention as pa
from moe_engine.kernels.paged_attention import _find_seq

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: loadtest.* when run by path
from loadtest.tune.sweep_prefill_tiles import median_ms  # noqa: E402

HQ, HKV, D, BLOCK = 32, 4, 128, 16
SHAPES = {  # name: (sequences, new tokens each, cached tokens each)
    "T16 27x303 over 7500": (27, 303, 7500),
    "4x2k over 6k": (4, 2048, 6144),
    "8x1024 from 0": (8, 1024, 0),
    "16x8k from 0": (16, 8192, 0),
}


@triton.jit
def _k_tile(k_cache_ptr, table_ptr, start, kvh, s_kb, s_ko, s_kh,
            BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr, DP: tl.constexpr, KROW: tl.constexpr):
    """K tile [DP, TILE_N] of keys [start, start + TILE_N) (all valid), and their blocks / offsets."""
    kpos = start + tl.arange(0, TILE_N)
    blk = tl.load(table_ptr + kpos // BLOCK_SIZE).to(tl.int64)
    off = kpos % BLOCK_SIZE
    d = tl.arange(0, DP)
    if KROW:
        k = tl.load(k_cache_ptr + blk[:, None] * s_kb + off[:, None] * s_ko + kvh * s_kh + d[None, :])
        kt = tl.trans(k)
    else:
        kt = tl.load(k_cache_ptr + blk[None, :] * s_kb + off[None, :] * s_ko + kvh * s_kh + d[:, None])
    return kt, blk, off


@triton.jit
def _softmax_pv(s, m_i, l_i, acc, v, scale_log2, FMA: tl.constexpr):
    """One unmasked tile of the online softmax: raw scores s [BLOCK_M, TILE_N], values v [TILE_N, DP]."""
    if FMA:
        m_new = tl.maximum(m_i, tl.max(s, axis=1) * scale_log2)
        p = tl.exp2(s * scale_log2 - m_new[:, None])
    else:
        s = s * scale_log2
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.exp2(s - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc


@triton.jit(do_not_specialize=["num_seqs", "s_bt"])
def _variant_kernel(
    out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, tables_ptr, cu_ptr, seq_lens_ptr, num_seqs, scale_log2,
    s_qt, s_qh, s_ot, s_oh, s_bt, s_kb, s_ko, s_kh, s_vb, s_vo, s_vh,
    G: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, TILE_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, DP: tl.constexpr, KROW: tl.constexpr, FMA: tl.constexpr, PIPE: tl.constexpr,
):
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
    row_ok = (m < BLOCK_Q * G) & (qi < q_len)
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
    if PIPE:
        if full_hi > 0:
            kt, blk, off = _k_tile(k_cache_ptr, table_ptr, 0, kvh, s_kb, s_ko, s_kh, BLOCK_SIZE, TILE_N, DP, KROW)
            s = tl.dot(q, kt)
            for start in range(TILE_N, full_hi, TILE_N):
                kt, blk_next, off_next = _k_tile(k_cache_ptr, table_ptr, start, kvh, s_kb, s_ko, s_kh,
                                                 BLOCK_SIZE, TILE_N, DP, KROW)
                s_next = tl.dot(q, kt)
                v = tl.load(v_cache_ptr + blk[:, None] * s_vb + off[:, None] * s_vo + kvh * s_vh + d[None, :])
                m_i, l_i, acc = _softmax_pv(s, m_i, l_i, acc, v, scale_log2, FMA)
                s, blk, off = s_next, blk_next, off_next
            v = tl.load(v_cache_ptr + blk[:, None] * s_vb + off[:, None] * s_vo + kvh * s_vh + d[None, :])
            m_i, l_i, acc = _softmax_pv(s, m_i, l_i, acc, v, scale_log2, FMA)
    else:
        for start in range(0, full_hi, TILE_N):
            kt, blk, off = _k_tile(k_cache_ptr, table_ptr, start, kvh, s_kb, s_ko, s_kh, BLOCK_SIZE, TILE_N, DP, KROW)
            s = tl.dot(q, kt)
            v = tl.load(v_cache_ptr + blk[:, None] * s_vb + off[:, None] * s_vo + kvh * s_vh + d[None, :])
            m_i, l_i, acc = _softmax_pv(s, m_i, l_i, acc, v, scale_log2, FMA)
    offs_n = tl.arange(0, TILE_N)
    for start in range(full_hi, key_hi, TILE_N):  # diagonal tiles: causal mask (as the engine's masked loop)
        kpos = start + offs_n
        kvalid = kpos < key_hi
        blk = tl.load(table_ptr + kpos // BLOCK_SIZE, mask=kvalid, other=0).to(tl.int64)
        off = kpos % BLOCK_SIZE
        kt = tl.load(k_cache_ptr + blk[None, :] * s_kb + off[None, :] * s_ko + kvh * s_kh + d[:, None],
                     mask=kvalid[None, :], other=0.0)
        s = tl.dot(q, kt) * scale_log2
        s = tl.where(kvalid[None, :] & (kpos[None, :] <= qpos[:, None]), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_cache_ptr + blk[:, None] * s_vb + off[:, None] * s_vo + kvh * s_vh + d[None, :],
                    mask=kvalid[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + tok[:, None] * s_ot + head[:, None] * s_oh + d[None, :], o.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None])


def variant(q, k_cache, v_cache, tables, cu, seq_lens, out, *, krow, fma, pipe, block_m=256, tile_n=64, warps=16,
            stages=3):
    T, Hq, Dk = q.shape
    Hkv, G = k_cache.shape[2], Hq // k_cache.shape[2]
    block_q = block_m // G
    kw = {} if pa.interpreting() else dict(num_warps=warps, num_stages=stages)
    _variant_kernel[(T // block_q + seq_lens.shape[0], Hkv)](
        out, q, k_cache, v_cache, tables, cu, seq_lens, seq_lens.shape[0], Dk**-0.5 * 1.4426950408889634,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), tables.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1),
        v_cache.stride(2), G=G, BLOCK_Q=block_q, BLOCK_M=block_m, TILE_N=tile_n, BLOCK_SIZE=k_cache.shape[1],
        DP=Dk, KROW=krow, FMA=fma, PIPE=pipe, **kw,
    )
    return out


def step(S, new, cached, device, dtype, hq=HQ, hkv=HKV, d=D, block=BLOCK, seed=0):
    """A step of S sequences, each `new` queries after `cached` keys: q, caches, tables, cu, seq_lens."""
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


def check_cpu() -> None:
    """Under TRITON_INTERPRET=1: every variant equals the torch reference on small float32 shapes."""
    assert pa.interpreting(), "run with TRITON_INTERPRET=1"
    for S, new, cached in ((2, 9, 0), (3, 5, 37), (1, 40, 70)):
        q, k, v, tables, cu, seq_lens = step(S, new, cached, "cpu", torch.float32, hq=4, hkv=2, d=16, block=4)
        ref = pa.paged_attention_reference(q, k, v, tables, cu, seq_lens, max_query_len=new,
                                           max_seq_len=new + cached, scale=16**-0.5)
        for krow, fma, pipe in itertools.product((0, 1), repeat=3):
            out = variant(q, k, v, tables, cu, seq_lens, torch.full_like(q, float("nan")), krow=krow, fma=fma,
                          pipe=pipe, block_m=8, tile_n=8)
            err = (out - ref).abs().max().item()
            assert err < 1e-4, (S, new, cached, krow, fma, pipe, err)
    print("interpreter: every variant equals the reference")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check-cpu", action="store_true")
    p.add_argument("--reps", type=int, default=10)
    args = p.parse_args()
    if args.check_cpu:
        check_cpu()
        return
    device = torch.device("cuda")
    print(f"{torch.cuda.get_device_name(device)}; torch {torch.__version__}, triton {triton.__version__}", flush=True)
    variants = [dict(krow=a, fma=b, pipe=c) for a, b, c in itertools.product((0, 1), repeat=3)]
    tiles = [(256, 64, 16, 3), (128, 64, 8, 3), (128, 128, 8, 2)]
    for name, (S, new, cached) in SHAPES.items():
        q, k, v, tables, cu, seq_lens = step(S, new, cached, device, torch.bfloat16)
        L = new + cached
        flops = 4 * D * HQ * S * sum(cached + i + 1 for i in range(new))
        engine_out = torch.empty_like(q)

        def engine():
            pa.paged_attention(q, k, v, tables, cu, seq_lens, max_query_len=new, max_seq_len=L, scale=D**-0.5,
                               out=engine_out)

        base = median_ms(engine, args.reps)
        print(f"{name}: engine kernel {base:.3f} ms {flops / base / 1e9:.0f} TFLOP/s", flush=True)
        out = torch.empty_like(q)
        for (bm, tn, w, st), var in itertools.product(tiles, variants):
            label = f"bm{bm} tn{tn} w{w} s{st} " + " ".join(f"{k_.upper()}{int(x)}" for k_, x in var.items())
            try:
                ms = median_ms(lambda: variant(q, k, v, tables, cu, seq_lens, out, block_m=bm, tile_n=tn, warps=w,
                                               stages=st, **var), args.reps)
            except Exception as exc:  # noqa: BLE001 - a config may not fit in shared memory: say so, go on
                print(f"  {label}: {type(exc).__name__}: {str(exc)[:120]}", flush=True)
                continue
            err = (out.float() - engine_out.float()).abs().max().item()
            print(f"  {label}: {ms:.3f} ms {flops / ms / 1e9:.0f} TFLOP/s  {base / ms:.3f}x  max |diff| {err:.1e}",
                  flush=True)
        del q, k, v, out, engine_out
        torch.cuda.empty_cache()


if __name__ == "__main__":
    sys.exit(main())
