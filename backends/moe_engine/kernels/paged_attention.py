"""Attention over a paged KV cache: the cache write, two Triton kernels, and the torch reference.

Cache layout (per layer, allocated by the KV cache): ``k_cache [num_blocks, block_size, Hkv, Dk]`` and
``v_cache [num_blocks, block_size, Hkv, Dv]`` in the model dtype, ``block_size`` a power of two. Token p of a
sequence lives at block ``block_tables[b, p // block_size]``, offset ``p % block_size``; its flat slot is
``block * block_size + offset``.

A step's T query tokens are B sequences' chunks concatenated (``cu_seqlens_q [B+1]`` offsets). Sequence b has
``seq_lens[b]`` keys in the cache after ``store_kv`` wrote this step's k/v, and its q_len queries are its LAST
q_len positions: query i sits at ``seq_lens[b] - q_len + i`` and attends the keys at positions <= its own; with a
sliding window W only the W most recent of them (itself included), as HF's and layers/attend.py's masks. Sinks
(GPT-OSS): one logit per query head joins the softmax denominator and carries no value.

``paged_attention`` (CUDA, or CPU under ``TRITON_INTERPRET=1``) runs one of two kernels, picked from host ints:

* ``_attn_2d_kernel``, any step (decode, prefill from empty, chunks with cached context, mixed): a program
  takes BLOCK_Q query tokens of one sequence times the G = Hq / Hkv query heads of one kv head (BLOCK_M =
  BLOCK_Q * G rows, so a K/V tile is read once for all G heads: grouped-query attention without repeated K/V),
  and walks that sequence's keys in tiles of TILE_N (each key's block looked up in its block table; on Hopper,
  where a block holds whole tiles, a prefill's unmasked tiles are copied by TMA instead) with an online (flash)
  softmax in float32. A program finds its sequence by binary search over ``cu_seqlens_q``;
  the grid is the upper bound ``T // BLOCK_Q + B`` tiles (extra programs exit), so no host value depends on
  the data.
* ``_attn_split_kernel`` + ``_merge_splits_kernel``, decode steps (one query per sequence) with long contexts
  (flash-decoding): each (sequence, kv head) splits its keys into ``num_splits`` ranges, computed at run time
  from ``seq_lens``; each writes a partial (max, sum, unnormalised output) and a second kernel merges them
  (and adds the sink). ``choose_num_splits`` is the recommended rule.

Both are CUDA-graph capturable: no host syncs, grids from host ints only (T, B, Hkv, num_splits). Padding:
rows of ``out`` for tokens past ``cu_seqlens_q[B]`` are not written; a sequence with seq_len 0 (a padded decode
entry) gets zero rows and reads nothing through its block table row, which may hold anything. A block table
entry is only read for positions < seq_len. Results agree with the reference within float tolerance (not
bit-exact: another summation order); ``store_kv`` is an exact copy.

``paged_attention_reference`` is the op-by-op torch path (CPU engine, tests, ``--check`` of the benchmark):
it gathers each sequence's blocks and computes exactly as layers/attend.py's ``attend_cached`` (same mask, SDPA
in the model dtype, HF-eager sinks), so a CPU engine on it keeps the HF parity of layers/attend.py. It reads
host copies of ``cu_seqlens_q`` / ``seq_lens`` and is therefore not capturable.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import kv_fp8
from .support import _DT, pdl

try:
    import triton
    import triton.language as tl

    from .support import _await_inputs
except ImportError:  # CPU wheels of torch do not bring Triton
    triton = None

_LOG2E = 1.4426950408889634
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def available(device: torch.device | str) -> bool:
    """Whether the Triton kernels can run on tensors of this device (CUDA, or any device when interpreting)."""
    return triton is not None and (interpreting() or torch.device(device).type == "cuda")


def _pow2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


@dataclass(frozen=True)
class KernelConfig:
    """Tile sizes and launch options. Defaults are for Hopper with head dims up to 128; tests shrink the
    tiles to cover many tiles with short sequences.

    The prefill defaults were swept on an H200 (Qwen3-30B-A3B's 32/4 heads of 128, bf16; 57 configs,
    ``loadtest/tune/sweep_prefill_tiles.py``): 256 rows (32 tokens x 8 heads) on 16 warps with
    3 stages beat the earlier 128 rows / 8 warps / 2 stages by 21-23% on 27 x 303 queries over 7.5k cached keys
    (multi-turn), 16 x 8k prompts and 4 x 2k chunks over 6k cached keys. The key tile stays at 64, so every row's
    arithmetic, and its result, is what the earlier tiles gave to the bit (the query tile only groups rows).

    K tiles: the prefill kernel loads them as rows (each key's dims contiguous, as the cache holds them) and
    transposes them for the dot; with the softmax scale inside the exponent (one FMA per score) that is 3-14%
    faster on the same shapes (27 x 303 over 7.5k: 3.02 -> 2.93 ms per layer; 4 x 2k over 6k 2.53 -> 2.35;
    8 x 1k prompts 0.331 -> 0.291; 16 x 8k 21.3 -> 19.9; ``loadtest/bench/bench_paged_attention.py --sweep --cases
    prefill``). Decode keeps them loaded transposed: rows were 2% slower for 64 x 1,152 keys and 16% for 32 x 7,900
    (``loadtest/tune/sweep_decode_tiles.py``). A decode step that is not split walks 128-key tiles: 41.7 against
    45.3 us per layer for 64 sequences x 1,152 keys (the same step in two splits of 64-key tiles), 17.8 against
    20.9 us for 32 x 512 unsplit, 4.8 against 5.1 us for 1 x 128 (``bench_paged_attention.py --cases layers``)."""

    prefill_block_m: int = 256  # query rows (tokens x G heads) per program when some sequence has > 1 query
    prefill_tile_n: int = 64  # keys per iteration, prefill
    prefill_num_warps: int = 16
    prefill_num_stages: int = 3
    prefill_k_rows: bool = True  # K tiles loaded as [keys, dims] rows and transposed for the dot (see above)
    # Prefill tiles through TMA (Hopper+) where a key tile lies in one block (block_size a multiple of the key
    # tile, 64: ``--block-size 64``), with their own launch: one warpgroup of 4 warps over 128 rows (16 tokens x
    # 8 heads) with 3 stages ran 27 x 303 queries over 7.5k cached keys in 2.14 ms per layer (478 TFLOP/s)
    # against the pointer kernel's 2.98 ms (1.39x), 4 x 2k over 6k in 1.98 against 2.51 (1.27x); the wider
    # launches gained nothing through TMA (``loadtest/probes/probe_prefill_attention_tma.py``).
    prefill_tma: bool = True
    prefill_tma_block_m: int = 128
    prefill_tma_num_warps: int = 4
    prefill_tma_num_stages: int = 3
    decode_block_m: int = 16  # rows per program of a decode step (at least G rounded to a power of two)
    decode_tile_n: int = 64  # keys per iteration of the split-decode kernel
    decode_unsplit_tile_n: int = 128  # keys per iteration of a decode step in the 2-D kernel (one split)
    decode_num_warps: int = 4
    decode_num_stages: int = 2
    decode_k_rows: bool = False


DEFAULT_CONFIG = KernelConfig()
SPLIT_MIN_KEYS = 64  # choose_num_splits: keys per split range (the decode key tile)


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, num_sms: int = 132) -> int:
    """Recommended split count for a decode step, from host ints only (1 = no split, the 2-D kernel).

    Splits only while (sequence, kv head) programs are fewer than one wave of the GPU: into the power of two
    (enough for two waves) that covers max_seq_len in ranges of 64 keys (one key tile), at most 64; no split up
    to 128 keys. From one wave the 2-D kernel's 128-key tiles are faster (x 1,152 keys, us per layer unsplit
    against two splits of 64-key tiles: 64 sequences 41.8 / 45.1, 48: 34.7 / 42.7;
    ``loadtest/tune/sweep_decode_tiles.py``), while 32 sequences (0.97 waves) over 1,024 or 2,048 keys still gain
    from splits (``loadtest/bench/bench_paged_attention.py --cases layers``). The 2-D
    kernel walks a sequence's keys one tile after another, so at a few hundred keys a handful of programs is
    latency-bound: a batch-1 decode over 384 keys takes 11.3 us per layer unsplit and 6.8 us in 8 splits, 512
    keys 15.9 vs 7.2 us (H200, 48 layers per CUDA graph, the same benchmark). Under CUDA graphs pass the largest ``max_seq_len`` a
    graph replays with (e.g. its key bucket): the kernel sizes each sequence's ranges from its own length, and
    splits beyond a short sequence's keys do no work."""
    if max_seq_len <= 2 * SPLIT_MIN_KEYS:
        return 1
    programs = max(num_seqs * num_kv_heads, 1)
    if programs >= num_sms:
        return 1
    want = _pow2(-(-2 * num_sms // programs))
    by_length = _pow2(-(-max_seq_len // SPLIT_MIN_KEYS))
    return max(1, min(want, by_length, 64))


# --------------------------------------------------------------------------------------------------------
# Triton kernels

if triton is not None:

    @triton.jit
    def _store_kv_kernel(
        k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, k_scale_ptr, v_scale_ptr,
        s_kt, s_kh, s_vt, s_vh,  # source strides (token, head); unit last stride
        s_kcb, s_kco, s_kch, s_vcb, s_vco, s_vch,  # cache strides (block, offset, head); unit last stride
        H, DK: tl.constexpr, DV: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        BLOCK_H: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr, KV_FP8: tl.constexpr,
    ):
        """Token program_id(0): its k [H, DK] and v [H, DV] copied to slot_mapping[t] (skipped when < 0); KV_FP8:
        quantised with the layer's scales (kv_fp8.py)."""
        t = tl.program_id(0)
        slot = tl.load(slot_ptr + t).to(tl.int64)
        if slot < 0:
            return
        blk = slot // BLOCK_SIZE
        off = slot % BLOCK_SIZE
        h = tl.arange(0, BLOCK_H)[:, None]
        dk = tl.arange(0, BLOCK_DK)[None, :]
        mk = (h < H) & (dk < DK)
        k = tl.load(k_ptr + t * s_kt + h * s_kh + dk, mask=mk)
        dv = tl.arange(0, BLOCK_DV)[None, :]
        mv = (h < H) & (dv < DV)
        v = tl.load(v_ptr + t * s_vt + h * s_vh + dv, mask=mv)
        if KV_FP8:
            k = kv_fp8.to_fp8(k, tl.load(k_scale_ptr))
            v = kv_fp8.to_fp8(v, tl.load(v_scale_ptr))
        tl.store(kc_ptr + blk * s_kcb + off * s_kco + h * s_kch + dk, k, mask=mk)
        tl.store(vc_ptr + blk * s_vcb + off * s_vco + h * s_vch + dv, v, mask=mv)

    @triton.jit
    def _dot(a, b, IEEE: tl.constexpr, INTERPRET: tl.constexpr):
        """a @ b accumulated in float32. fp32 operands use full-precision products (no TF32). The interpreter
        multiplies bf16 operands as their raw uint16 bits, so there they are widened first; and its tl.dot is
        numpy's matmul, whose BLAS (OpenBLAS on an AMD EPYC) sums a row's products in an order that depends on the
        row's place in the tile, so there a row is summed over K by itself: the same order wherever it sits, as a
        row of a GPU's MMA (what the tests of chunking and prefix hits compare to the bit)."""
        if INTERPRET:
            return tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], axis=1)
        elif IEEE:
            return tl.dot(a, b, input_precision="ieee")
        else:
            return tl.dot(a, b)

    @triton.jit
    def _find_seq(cu_ptr, pid, num_seqs, BLOCK_Q: tl.constexpr):
        """The sequence whose query tiles hold tile pid: sequence b's tiles start at cu[b] // BLOCK_Q + b
        (strictly increasing in b, and enough tiles for ceil(q_len / BLOCK_Q))."""
        lo = pid * 0  # tensors from the start: an int argument equal to 1 arrives as a constant
        hi = pid * 0 + num_seqs
        while lo < hi:
            mid = (lo + hi) // 2
            if tl.load(cu_ptr + mid) // BLOCK_Q + mid <= pid:
                lo = mid + 1
            else:
                hi = mid
        return lo - 1

    @triton.jit
    def _load_tile(ptrs, mask, FULL: tl.constexpr):
        """tl.load of a K or V tile; FULL: every element is in bounds (no mask, so the loads vectorise)."""
        if FULL:
            return tl.load(ptrs)
        else:
            return tl.load(ptrs, mask=mask, other=0.0)

    @triton.jit
    def _k_tile(ptrs_rows, ptrs_cols, mask_rows, mask_cols, FULL: tl.constexpr, KROW: tl.constexpr):
        """A K tile as the dot's right operand [DK_PAD, TILE_N]. KROW: loaded as rows [TILE_N, DK_PAD] (each
        key's dims contiguous, as the cache lays them out) and transposed in registers; else loaded transposed."""
        if KROW:
            return tl.trans(_load_tile(ptrs_rows, mask_rows, FULL))
        else:
            return _load_tile(ptrs_cols, mask_cols, FULL)

    @triton.jit
    def _kv_scales(k_scale_ptr, v_scale_ptr, KV_FP8: tl.constexpr):
        """The layer's FP8 cache scales (float32 scalars; 1.0 unused when the cache is in the model dtype)."""
        if KV_FP8:
            return tl.load(k_scale_ptr), tl.load(v_scale_ptr)
        else:
            return 1.0, 1.0

    @triton.jit
    def _attend_tiles(
        q, m_i, l_i, acc, qpos, key_lo, full_hi, key_hi,
        k_cache_ptr, v_cache_ptr, k_desc, v_desc, table_ptr, kvh, window,
        s_kb, s_ko, s_kh, s_vb, s_vo, s_vh, scale_log2, k_scale, v_scale,
        DK: tl.constexpr, DV: tl.constexpr, DK_PAD: tl.constexpr, DV_PAD: tl.constexpr,
        BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr, HAS_WINDOW: tl.constexpr, KROW: tl.constexpr,
        TMA: tl.constexpr, IEEE: tl.constexpr, INTERPRET: tl.constexpr, KV_FP8: tl.constexpr, DT: tl.constexpr,
    ):
        """Online softmax of the rows of q [BLOCK_M, DK_PAD] (positions qpos [BLOCK_M]) over keys [key_lo,
        key_hi) of one sequence (key_lo a multiple of TILE_N; key_hi <= its length). Causal and window masks
        per row; keys past key_hi are neither loaded nor attended. Scores in log2 units: the scale is applied
        inside the exponent, exp2(s * scale_log2 - m) (one FMA per score), and to the row maximum (scaling by a
        positive number keeps the maximum, to the bit).

        Keys [key_lo, full_hi) (full_hi a multiple of TILE_N, the caller's promise: every row may see every one
        of them) run without masks: the same arithmetic as the masked loop, whose masks would all be true
        there, so the result is the same to the bit; only the diagonal (and window) tiles pay for masks. A row's
        result therefore does not depend on which query tile or step chunk it came in (a prefix-cache hit
        computes a prompt's rows as a cold prefill does).

        TMA (Hopper+, TILE_N dividing BLOCK_SIZE, head dims powers of two): the unmasked tiles come through the
        tensor descriptors k_desc / v_desc (the caches as [num_blocks * BLOCK_SIZE, Hkv * D] rows, [TILE_N, D]
        boxes: a tile is TILE_N consecutive rows of one block), copied to shared memory asynchronously instead of
        gathered key by key. The same tiles feed the same dots: the result is the same to the bit.

        KV_FP8: the caches hold float8 e4m3; each K and V tile is dequantised right after its load (float32 times
        k_scale / v_scale, rounded once to q's dtype DT: kv_fp8.from_fp8), so the dots see what the reference's
        dequantised gather holds."""
        offs_n = tl.arange(0, TILE_N)
        dk = tl.arange(0, DK_PAD)
        dv = tl.arange(0, DV_PAD)
        k_base = k_cache_ptr + kvh * s_kh  # this kv head's keys
        for start in range(key_lo, full_hi, TILE_N):
            if TMA:
                row = tl.load(table_ptr + start // BLOCK_SIZE) * BLOCK_SIZE + start % BLOCK_SIZE
                kt = tl.trans(k_desc.load([row, kvh * DK]))  # [TILE_N, DK] box -> [DK, TILE_N]
            else:
                kpos = start + offs_n  # [TILE_N]
                blk = tl.load(table_ptr + kpos // BLOCK_SIZE).to(tl.int64)
                off = kpos % BLOCK_SIZE
                kt = _k_tile(  # [DK_PAD, TILE_N]
                    k_base + blk[:, None] * s_kb + off[:, None] * s_ko + dk[None, :],
                    k_base + blk[None, :] * s_kb + off[None, :] * s_ko + dk[:, None],
                    dk[None, :] < DK, dk[:, None] < DK, DK == DK_PAD, KROW,
                )
            if KV_FP8:
                kt = kv_fp8.from_fp8(kt, k_scale, DT, q.dtype)
            s = _dot(q, kt, IEEE, INTERPRET)  # [BLOCK_M, TILE_N] unscaled
            m_new = tl.maximum(m_i, tl.max(s, axis=1) * scale_log2)
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp2(s * scale_log2 - m_safe[:, None])
            alpha = tl.exp2(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            if TMA:
                v = v_desc.load([row, kvh * DV])  # [TILE_N, DV]
            else:
                v = _load_tile(  # [TILE_N, DV_PAD]
                    v_cache_ptr + blk[:, None] * s_vb + off[:, None] * s_vo + kvh * s_vh + dv[None, :],
                    dv[None, :] < DV, DV == DV_PAD,
                )
            if KV_FP8:
                v = kv_fp8.from_fp8(v, v_scale, DT, q.dtype)
            acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, IEEE, INTERPRET)
            m_i = m_new
        for start in range(full_hi, key_hi, TILE_N):
            kpos = start + offs_n  # [TILE_N]
            kvalid = kpos < key_hi
            blk = tl.load(table_ptr + kpos // BLOCK_SIZE, mask=kvalid, other=0).to(tl.int64)
            off = kpos % BLOCK_SIZE
            kt = _k_tile(  # [DK_PAD, TILE_N]
                k_base + blk[:, None] * s_kb + off[:, None] * s_ko + dk[None, :],
                k_base + blk[None, :] * s_kb + off[None, :] * s_ko + dk[:, None],
                kvalid[:, None] & (dk[None, :] < DK), kvalid[None, :] & (dk[:, None] < DK), False, KROW,
            )
            if KV_FP8:
                kt = kv_fp8.from_fp8(kt, k_scale, DT, q.dtype)
            s = _dot(q, kt, IEEE, INTERPRET)  # [BLOCK_M, TILE_N] unscaled
            allowed = kvalid[None, :] & (kpos[None, :] <= qpos[:, None])
            if HAS_WINDOW:
                allowed = allowed & (kpos[None, :] > qpos[:, None] - window)
            s = tl.where(allowed, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1) * scale_log2)
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing allowed yet
            p = tl.exp2(s * scale_log2 - m_safe[:, None])
            alpha = tl.exp2(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = tl.load(  # [TILE_N, DV_PAD]
                v_cache_ptr + blk[:, None] * s_vb + off[:, None] * s_vo + kvh * s_vh + dv[None, :],
                mask=kvalid[:, None] & (dv[None, :] < DV), other=0.0,
            )
            if KV_FP8:
                v = kv_fp8.from_fp8(v, v_scale, DT, q.dtype)
            acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, IEEE, INTERPRET)
            m_i = m_new
        return m_i, l_i, acc

    # Integers that vary from step to step are not specialised (Triton compiles a variant per class of an integer
    # argument: 1, a multiple of 16, other): a step whose sequence count or block-table width falls in a class
    # no earlier step had would wait for a compile (1-2 s at real shapes) inside serving. They index nothing
    # that the divisibility hint would speed up.
    @triton.jit(do_not_specialize=["num_seqs", "s_bt"])
    def _attn_2d_kernel(
        out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, k_desc, v_desc, sinks_ptr, tables_ptr, cu_ptr, seq_lens_ptr,
        k_scale_ptr, v_scale_ptr, num_seqs, scale_log2, window,
        s_qt, s_qh, s_ot, s_oh, s_bt,
        s_kb, s_ko, s_kh, s_vb, s_vo, s_vh,
        G: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, TILE_N: tl.constexpr,
        BLOCK_SIZE: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, DK_PAD: tl.constexpr, DV_PAD: tl.constexpr,
        HAS_WINDOW: tl.constexpr, HAS_SINKS: tl.constexpr, KROW: tl.constexpr, TMA: tl.constexpr,
        IEEE: tl.constexpr, INTERPRET: tl.constexpr, PDL: tl.constexpr, KV_FP8: tl.constexpr, DT: tl.constexpr,
    ):
        """Program (query tile, kv head): BLOCK_Q tokens of one sequence x its G query heads, rows m ->
        (token m // G, head kvh * G + m % G). k_desc / v_desc: TMA descriptors of the caches when TMA (else
        unused)."""
        _await_inputs(PDL)
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

        m = tl.arange(0, BLOCK_M)
        qi = tile * BLOCK_Q + m // G  # query index inside the sequence's chunk
        row_ok = (m < BLOCK_Q * G) & (qi < q_len)
        head = kvh * G + m % G
        qpos = context + qi  # [BLOCK_M] absolute positions
        tok = (q_start + qi).to(tl.int64)
        dk = tl.arange(0, DK_PAD)
        q = tl.load(q_ptr + tok[:, None] * s_qt + head[:, None] * s_qh + dk[None, :],
                    mask=row_ok[:, None] & (dk[None, :] < DK), other=0.0)

        if HAS_SINKS:
            m_i = tl.load(sinks_ptr + head).to(tl.float32) * 1.4426950408889634  # the sink: exp2(0) = 1 in l_i
            l_i = tl.full([BLOCK_M], 1.0, dtype=tl.float32)
        else:
            m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
            l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, DV_PAD], dtype=tl.float32)

        first = context + tile * BLOCK_Q  # position of the tile's first query
        key_hi = tl.minimum(first + BLOCK_Q, seq_len)  # keys after the tile's last query are never seen
        key_lo = 0
        full_hi = (first + 1) // TILE_N * TILE_N  # every row's position is >= first: no causal mask below
        if HAS_WINDOW:
            key_lo = tl.maximum(first - window + 1, 0) // TILE_N * TILE_N
            full_hi = key_lo  # (window masks: every tile masked)
        k_scale, v_scale = _kv_scales(k_scale_ptr, v_scale_ptr, KV_FP8)
        m_i, l_i, acc = _attend_tiles(
            q, m_i, l_i, acc, qpos, key_lo, full_hi, key_hi, k_cache_ptr, v_cache_ptr, k_desc, v_desc,
            tables_ptr + seq * s_bt, kvh, window, s_kb, s_ko, s_kh, s_vb, s_vo, s_vh, scale_log2, k_scale, v_scale,
            DK, DV, DK_PAD, DV_PAD, BLOCK_SIZE, TILE_N, HAS_WINDOW, KROW, TMA, IEEE, INTERPRET, KV_FP8, DT,
        )
        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        dv = tl.arange(0, DV_PAD)
        tl.store(out_ptr + tok[:, None] * s_ot + head[:, None] * s_oh + dv[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & (dv[None, :] < DV))

    @triton.jit(do_not_specialize=["s_bt"])
    def _attn_split_kernel(
        part_m_ptr, part_l_ptr, part_acc_ptr,  # [B, Hq, S], [B, Hq, S], [B, Hq, S, DV_PAD] float32
        q_ptr, k_cache_ptr, v_cache_ptr, tables_ptr, cu_ptr, seq_lens_ptr, k_scale_ptr, v_scale_ptr,
        scale_log2, window,
        s_qt, s_qh, s_bt,
        s_kb, s_ko, s_kh, s_vb, s_vo, s_vh,
        Hq: tl.constexpr, G: tl.constexpr, BLOCK_M: tl.constexpr, TILE_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        DK: tl.constexpr, DV: tl.constexpr, DK_PAD: tl.constexpr, DV_PAD: tl.constexpr,
        HAS_WINDOW: tl.constexpr, KROW: tl.constexpr, IEEE: tl.constexpr, INTERPRET: tl.constexpr,
        PDL: tl.constexpr, KV_FP8: tl.constexpr, DT: tl.constexpr,
    ):
        """Program (sequence, kv head, split) of a decode step: the G heads' one query over split's share of
        the keys (whole tiles, split evenly at run time). Empty splits write (-inf, 0, 0). The split count is
        the grid's third dimension (one compiled kernel for every count)."""
        _await_inputs(PDL)
        seq = tl.program_id(0)
        kvh = tl.program_id(1)
        split = tl.program_id(2)
        num_splits = tl.num_programs(2)
        q_start = tl.load(cu_ptr + seq)
        if tl.load(cu_ptr + seq + 1) == q_start:  # no query for this sequence (a padding entry)
            return
        seq_len = tl.load(seq_lens_ptr + seq)
        qpos = seq_len - 1

        m = tl.arange(0, BLOCK_M)
        row_ok = m < G
        head = kvh * G + m
        dk = tl.arange(0, DK_PAD)
        q = tl.load(q_ptr + q_start.to(tl.int64) * s_qt + head[:, None] * s_qh + dk[None, :],
                    mask=row_ok[:, None] & (dk[None, :] < DK), other=0.0)

        lo = 0
        if HAS_WINDOW:
            lo = tl.maximum(qpos - window + 1, 0) // TILE_N * TILE_N
        tiles_per_split = tl.cdiv(tl.cdiv(seq_len - lo, TILE_N), num_splits)
        key_lo = lo + split * tiles_per_split * TILE_N
        key_hi = tl.minimum(key_lo + tiles_per_split * TILE_N, seq_len)
        full_hi = key_lo  # the one query sees every key < seq_len: only a last partial tile needs a mask
        if not HAS_WINDOW:
            full_hi = key_lo + tl.maximum(key_hi - key_lo, 0) // TILE_N * TILE_N

        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, DV_PAD], dtype=tl.float32)
        k_scale, v_scale = _kv_scales(k_scale_ptr, v_scale_ptr, KV_FP8)
        m_i, l_i, acc = _attend_tiles(
            q, m_i, l_i, acc, tl.zeros([BLOCK_M], dtype=tl.int32) + qpos, key_lo, full_hi, key_hi,
            k_cache_ptr, v_cache_ptr, None, None, tables_ptr + seq * s_bt, kvh,
            window, s_kb, s_ko, s_kh, s_vb, s_vo, s_vh, scale_log2, k_scale, v_scale,
            DK, DV, DK_PAD, DV_PAD, BLOCK_SIZE, TILE_N, HAS_WINDOW, KROW, False, IEEE, INTERPRET, KV_FP8, DT,
        )
        part = (seq * Hq + head) * num_splits + split  # [BLOCK_M]
        tl.store(part_m_ptr + part, m_i, mask=row_ok)
        tl.store(part_l_ptr + part, l_i, mask=row_ok)
        dv = tl.arange(0, DV_PAD)
        tl.store(part_acc_ptr + part[:, None] * DV_PAD + dv[None, :], acc, mask=row_ok[:, None])

    # SPLITS_PAD follows the split count (a variant per power of two, compiled at start by the captures of
    # DecodeGraphs.capture_all): padding every merge to 64 splits measured 0.4 us more per call at 1
    # sequence, 2-7 us at 32-64 (H200).
    @triton.jit(do_not_specialize=["num_splits"])
    def _merge_splits_kernel(
        out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr, sinks_ptr, cu_ptr, s_ot, s_oh, num_splits,
        Hq: tl.constexpr, SPLITS_PAD: tl.constexpr,
        DV: tl.constexpr, DV_PAD: tl.constexpr, HAS_SINKS: tl.constexpr, PDL: tl.constexpr,
    ):
        """Program (sequence, query head): out = sum_s exp2(m_s - M) acc_s / (sum_s exp2(m_s - M) l_s [+ sink])."""
        _await_inputs(PDL)
        seq = tl.program_id(0)
        head = tl.program_id(1)
        tok = tl.load(cu_ptr + seq)
        if tl.load(cu_ptr + seq + 1) == tok:
            return
        s = tl.arange(0, SPLITS_PAD)
        s_ok = s < num_splits
        part = (seq * Hq + head) * num_splits + s
        pm = tl.load(part_m_ptr + part, mask=s_ok, other=float("-inf"))
        pl = tl.load(part_l_ptr + part, mask=s_ok, other=0.0)
        big = tl.max(pm, axis=0)
        if HAS_SINKS:
            sink = tl.load(sinks_ptr + head).to(tl.float32) * 1.4426950408889634
            big = tl.maximum(big, sink)
        big = tl.where(big == float("-inf"), 0.0, big)
        w = tl.where(s_ok, tl.exp2(pm - big), 0.0)  # [SPLITS_PAD]; empty splits weigh 0
        total = tl.sum(w * pl, axis=0)
        if HAS_SINKS:
            total += tl.exp2(sink - big)
        dv = tl.arange(0, DV_PAD)
        pacc = tl.load(part_acc_ptr + part[:, None] * DV_PAD + dv[None, :], mask=s_ok[:, None], other=0.0)
        o = tl.sum(pacc * w[:, None], axis=0) / tl.where(total > 0, total, 1.0)
        tl.store(out_ptr + tok.to(tl.int64) * s_ot + head * s_oh + dv, o.to(out_ptr.dtype.element_ty), mask=dv < DV)


# --------------------------------------------------------------------------------------------------------
# Host wrappers


def _check_triton(device: torch.device) -> None:
    if not available(device):
        raise RuntimeError(
            f"paged attention kernels need Triton and a CUDA device (or TRITON_INTERPRET=1); got {device}: "
            "use the *_reference functions"
        )


def _launch(kernel, grid, *args, num_warps: int | None = None, num_stages: int | None = None, **meta):
    if interpreting() or num_warps is None:
        return kernel[grid](*args, **meta)
    if meta.get("PDL"):  # programmatic dependent launch: support.py says what it does
        meta["launch_pdl"] = True
    return kernel[grid](*args, num_warps=num_warps, num_stages=num_stages, **meta)


def _unit_last(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _check_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, fp8: bool) -> None:
    if k_cache.dim() != 4 or v_cache.dim() != 4 or k_cache.shape[:3] != v_cache.shape[:3]:
        raise ValueError(f"caches must be [num_blocks, block_size, Hkv, D]: {tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    if k.shape[1:] != k_cache.shape[2:] or v.shape[1:] != v_cache.shape[2:] or k.shape[0] != v.shape[0]:
        raise ValueError(
            f"k {tuple(k.shape)} / v {tuple(v.shape)} do not match the caches' [Hkv, D] "
            f"{tuple(k_cache.shape[2:])} / {tuple(v_cache.shape[2:])}"
        )
    if k.dtype != v.dtype or (not fp8 and k.dtype != k_cache.dtype):
        raise TypeError(f"k/v dtypes {k.dtype}/{v.dtype} differ from the cache's {k_cache.dtype}")
    _check_cache_dtype(k.dtype, k_cache, v_cache, fp8)


def _check_cache_dtype(dtype: torch.dtype, k_cache: torch.Tensor, v_cache: torch.Tensor, fp8: bool) -> None:
    """The caches hold ``dtype`` (the model's), or float8 e4m3 when the layer's scales are given (``fp8``)."""
    want = kv_fp8.FP8_KV_DTYPE if fp8 else dtype
    if k_cache.dtype != want or v_cache.dtype != want:
        raise TypeError(f"caches of {k_cache.dtype}/{v_cache.dtype} for {dtype} keys/values"
                        + (" and FP8 scales" if fp8 else "") + f": expected {want}"
                        + ("" if fp8 else " (an FP8 cache needs k_scale and v_scale)"))


def _scale_args(k_scale: torch.Tensor | None, v_scale: torch.Tensor | None, fallback: torch.Tensor):
    """(k_scale, v_scale, KV_FP8) for a launch: the layer's float32 scales, or ``fallback`` (unread) twice."""
    if (k_scale is None) != (v_scale is None):
        raise ValueError("an FP8 cache needs both k_scale and v_scale")
    if k_scale is None:
        return fallback, fallback, False
    if k_scale.dtype != torch.float32 or v_scale.dtype != torch.float32 or k_scale.numel() != 1 \
            or v_scale.numel() != 1:
        raise ValueError("k_scale / v_scale must be float32 tensors of one element")
    return k_scale, v_scale, True


def store_kv(
    k: torch.Tensor,  # [T, Hkv, Dk]
    v: torch.Tensor,  # [T, Hkv, Dv]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, Dk]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, Dv]
    slot_mapping: torch.Tensor,  # [T] int64 (or int32): flat slot of each token, < 0 = skip (padding)
    k_scale: torch.Tensor | None = None,  # float32 [1]: an FP8 cache's scales (kv_fp8.py), else None
    v_scale: torch.Tensor | None = None,
) -> None:
    """Write each token's k/v at its flat slot (block * block_size + offset): one Triton launch, an exact
    copy (same dtype required), or with ``k_scale`` / ``v_scale`` quantised into an FP8 cache as
    ``kv_fp8.quantize``. Capturable: grid T."""
    _check_triton(k.device)
    _check_kv(k, v, k_cache, v_cache, k_scale is not None)
    k_scale, v_scale, fp8 = _scale_args(k_scale, v_scale, slot_mapping)
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("caches need a unit last stride")
    T, H, DK = k.shape
    DV = v.shape[-1]
    if T == 0:
        return
    k, v = _unit_last(k), _unit_last(v)
    _launch(
        _store_kv_kernel, (T,), k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        H, DK=DK, DV=DV, BLOCK_SIZE=k_cache.shape[1],
        BLOCK_H=_pow2(H), BLOCK_DK=_pow2(DK), BLOCK_DV=_pow2(DV), KV_FP8=fp8,
    )


def store_kv_reference(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
) -> None:
    """Torch version of ``store_kv`` (same arguments). Reads which slots are valid on the host."""
    _check_kv(k, v, k_cache, v_cache, k_scale is not None)
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    block_size = k_cache.shape[1]
    blocks, offsets = slots // block_size, slots % block_size
    k, v = k[keep], v[keep]
    if k_scale is not None:
        k, v = kv_fp8.quantize(k, k_scale), kv_fp8.quantize(v, v_scale)
    k_cache[blocks, offsets] = k
    v_cache[blocks, offsets] = v


def _check_attention_args(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, sinks, sliding_window,
                          fp8: bool = False):
    if q.dim() != 3 or k_cache.dim() != 4 or v_cache.dim() != 4:
        raise ValueError(f"q must be [T, Hq, Dk] and caches [num_blocks, block_size, Hkv, D]; got "
                         f"{tuple(q.shape)}, {tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    Hq, Dk = q.shape[1], q.shape[2]
    Hkv, block_size = k_cache.shape[2], k_cache.shape[1]
    if k_cache.shape[:3] != v_cache.shape[:3] or k_cache.shape[3] != Dk:
        raise ValueError(f"cache shapes {tuple(k_cache.shape)} / {tuple(v_cache.shape)} do not fit q {tuple(q.shape)}")
    if Hq % Hkv:
        raise ValueError(f"query heads ({Hq}) must be a multiple of kv heads ({Hkv})")
    if block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two, got {block_size}")
    if q.dtype not in _DTYPES:
        raise TypeError(f"q must have a dtype among {_DTYPES}, got {q.dtype}")
    _check_cache_dtype(q.dtype, k_cache, v_cache, fp8)
    B = seq_lens.shape[0]
    if block_tables.dim() != 2 or block_tables.shape[0] < B or cu_seqlens_q.shape[0] != B + 1:
        raise ValueError(f"block_tables [B, max_blocks], cu_seqlens_q [B+1], seq_lens [B]: got "
                         f"{tuple(block_tables.shape)}, {tuple(cu_seqlens_q.shape)}, {tuple(seq_lens.shape)}")
    if sinks is not None and sinks.shape != (Hq,):
        raise ValueError(f"sinks must be [Hq] = [{Hq}], got {tuple(sinks.shape)}")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")


def _fit_shared_memory(block_m: int, tile_n: int, min_block_m: int, dk_pad: int, dv_pad: int, esize: int,
                       stages: int) -> tuple[int, int]:
    """Halve the query tile, then the key tile, until Q plus the pipelined K/V tiles fit in ~160 KiB of shared
    memory (fp32 or head dims of 256 with the prefill defaults would not compile on an H100/H200). An upper
    bound: a decode step's kernel (16 rows on mma, not wgmma) compiles to far less (40 KiB with 128-key bf16
    tiles), so a decode keeps 128-key tiles for bf16 heads of 128 and falls back to 64 for float32 or wider heads."""
    def smem(bm, tn):
        return (bm * dk_pad + stages * tn * (dk_pad + dv_pad)) * esize

    while smem(block_m, tile_n) > 160 * 1024 and block_m > min_block_m:
        block_m //= 2
    while smem(block_m, tile_n) > 160 * 1024 and tile_n > 16:
        tile_n //= 2
    return block_m, tile_n


def tiles_2d(decode: bool, G: int, dk_pad: int, dv_pad: int, esize: int, config: KernelConfig = DEFAULT_CONFIG,
             tma: bool = False):
    """The 2-D kernel's launch for a decode step (one query per sequence, not split) or any other step:
    (query rows per program, key tile, warps, stages, K tiles as rows), the tiles shrunk to fit shared memory
    (a decode step keeps its rows: G query heads of one token). ``tma``: a prefill launch whose key tiles come
    through TMA (``tma_fits``): the config's TMA rows, warps and stages."""
    if decode:
        block_m, tile_n = max(config.decode_block_m, _pow2(G)), config.decode_unsplit_tile_n
        warps, stages, krow = config.decode_num_warps, config.decode_num_stages, config.decode_k_rows
        min_block_m = block_m
    elif tma:
        block_m, tile_n = max(config.prefill_tma_block_m, _pow2(G)), config.prefill_tile_n
        warps, stages, krow = config.prefill_tma_num_warps, config.prefill_tma_num_stages, True
        min_block_m = max(_pow2(G), 16)
    else:
        block_m, tile_n = max(config.prefill_block_m, _pow2(G)), config.prefill_tile_n
        warps, stages, krow = config.prefill_num_warps, config.prefill_num_stages, config.prefill_k_rows
        min_block_m = max(_pow2(G), 16)
    block_m, tile_n = _fit_shared_memory(block_m, tile_n, min_block_m, dk_pad, dv_pad, esize, stages)
    return block_m, tile_n, warps, stages, krow


def _tma_capable(device: torch.device, dtype: torch.dtype, head_dims) -> bool:
    """Hopper or later (or the interpreter), a 16-bit dtype, head dims that are powers of two from 16 to 256 (a
    [tile, D] box is whole rows of 32+ bytes, and a box spans at most 256 elements per dimension)."""
    if dtype not in (torch.bfloat16, torch.float16) or not all(16 <= d <= 256 and d == _pow2(d) for d in head_dims):
        return False
    device = torch.device(device)
    return interpreting() or (device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9)


def tma_fits(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tile_n: int) -> bool:
    """Whether a prefill launch can load its key tiles through TMA: ``_tma_capable``, contiguous caches, and key
    tiles that never leave a block (block_size a multiple of tile_n)."""
    return (k_cache.shape[1] % tile_n == 0 and _tma_capable(q.device, q.dtype, (k_cache.shape[3], v_cache.shape[3]))
            and k_cache.is_contiguous() and v_cache.is_contiguous()
            and k_cache.data_ptr() % 16 == 0 and v_cache.data_ptr() % 16 == 0)


def default_block_size(use_kernels: bool, device: torch.device, dtype: torch.dtype, head_dims) -> int:
    """The KV block size when none is given (``--block-size``): 64 where the prefill kernel loads its key tiles
    through TMA (these kernels on a Hopper or later GPU, a 16-bit dtype, head dims powers of two): a 64-key tile is
    one block; elsewhere 16 (vLLM's default), the finer prefix-cache granularity. On an H200 at the real shape the
    multi-turn turn-16 step takes 223 ms of GPU time with 64-key blocks against 242 with 16, and a prompt's
    admission hashes a quarter of the blocks (``loadtest/bench/bench_multiturn.py``; loadtest/reports/multiturn.md)."""
    if use_kernels and _tma_capable(device, dtype, head_dims):
        return max(64, DEFAULT_CONFIG.prefill_tile_n)
    return 16


def _cache_descriptor(cache: torch.Tensor, tile_n: int):
    """The cache [num_blocks, block_size, Hkv, D] as a TMA descriptor over [num_blocks * block_size, Hkv * D] rows
    with [tile_n, D] boxes. Made per launch (a few microseconds): a memo would hold the cache alive."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    nb, bs, h, d = cache.shape
    return TensorDescriptor.from_tensor(cache.view(nb * bs, h * d), [tile_n, d])


def paged_attention(
    q: torch.Tensor,  # [T, Hq, Dk]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, Dk]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, Dv]
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    cu_seqlens_q: torch.Tensor,  # [B+1] int32: query offsets into T
    seq_lens: torch.Tensor,  # [B] int32: keys in the cache per sequence (this step's included)
    *,
    max_query_len: int,  # host upper bound of cu_seqlens_q[b+1] - cu_seqlens_q[b] (1: a decode step)
    max_seq_len: int,  # host upper bound of seq_lens (only used to choose num_splits)
    scale: float,
    sliding_window: int | None = None,  # window W: a query sees the W most recent positions, itself included
    sinks: torch.Tensor | None = None,  # [Hq] per-head sink logits (GPT-OSS)
    out: torch.Tensor | None = None,  # [T, Hq, Dv], q's dtype, unit last stride
    num_splits: int | None = None,  # decode split-K count; None: choose_num_splits(...)
    config: KernelConfig = DEFAULT_CONFIG,
    k_scale: torch.Tensor | None = None,  # float32 [1]: an FP8 cache's scales (kv_fp8.py), else None
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:  # [T, Hq, Dv]
    """Causal attention of a step's queries over their sequences' paged keys (see the module docstring). With
    ``k_scale`` / ``v_scale`` the caches hold float8 e4m3, dequantised as each tile is loaded.

    Decode steps (max_query_len == 1) with num_splits > 1 take the split-K kernels, everything else the 2-D
    kernel; the choice and every grid come from host ints. Output rows of tokens past cu_seqlens_q[B] are
    left as they are."""
    _check_triton(q.device)
    _check_attention_args(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, sinks, sliding_window,
                          k_scale is not None)
    k_scale, v_scale, fp8 = _scale_args(k_scale, v_scale, seq_lens)
    T, Hq, Dk = q.shape
    Hkv, block_size, Dv = k_cache.shape[2], k_cache.shape[1], v_cache.shape[3]
    B, G = seq_lens.shape[0], Hq // Hkv
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("caches need a unit last stride")
    q = _unit_last(q)
    if out is None:
        out = torch.empty(T, Hq, Dv, dtype=q.dtype, device=q.device)
    elif out.shape != (T, Hq, Dv) or out.dtype != q.dtype or out.stride(-1) != 1:
        raise ValueError(f"out must be [T, Hq, Dv] = {(T, Hq, Dv)} of {q.dtype} with a unit last stride")
    if T == 0 or B == 0:
        return out
    if num_splits is None:
        num_splits = choose_num_splits(B, Hkv, max_seq_len) if max_query_len == 1 else 1

    common = dict(
        DK=Dk, DV=Dv, DK_PAD=max(_pow2(Dk), 16), DV_PAD=max(_pow2(Dv), 16), BLOCK_SIZE=block_size,
        HAS_WINDOW=sliding_window is not None, IEEE=q.dtype == torch.float32, INTERPRET=interpreting(),
        PDL=pdl(q.device), KV_FP8=fp8, DT=_DT[q.dtype],
    )
    cache_strides = (k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                     v_cache.stride(0), v_cache.stride(1), v_cache.stride(2))
    scale_log2 = float(scale) * _LOG2E
    window = int(sliding_window or 0)

    if max_query_len == 1 and num_splits > 1:
        block_m = max(config.decode_block_m, _pow2(G))
        part_m = torch.empty(B, Hq, num_splits, dtype=torch.float32, device=q.device)
        part_l = torch.empty_like(part_m)
        part_acc = torch.empty(B, Hq, num_splits, common["DV_PAD"], dtype=torch.float32, device=q.device)
        _launch(
            _attn_split_kernel, (B, Hkv, num_splits),
            part_m, part_l, part_acc, q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, k_scale, v_scale,
            scale_log2, window, q.stride(0), q.stride(1), block_tables.stride(0), *cache_strides,
            Hq=Hq, G=G, BLOCK_M=block_m, TILE_N=config.decode_tile_n, KROW=config.decode_k_rows, **common,
            num_warps=config.decode_num_warps, num_stages=config.decode_num_stages,
        )
        _launch(
            _merge_splits_kernel, (B, Hq),
            out, part_m, part_l, part_acc, sinks if sinks is not None else part_m, cu_seqlens_q,
            out.stride(0), out.stride(1), num_splits,
            Hq=Hq, SPLITS_PAD=_pow2(num_splits), DV=Dv, DV_PAD=common["DV_PAD"],
            HAS_SINKS=sinks is not None, PDL=common["PDL"], num_warps=4, num_stages=1,
        )
        return out

    decode = max_query_len == 1
    tma = not decode and config.prefill_tma and tma_fits(q, k_cache, v_cache, config.prefill_tile_n)
    block_m, tile_n, warps, stages, krow = tiles_2d(decode, G, common["DK_PAD"], common["DV_PAD"],
                                                    q.element_size(), config, tma)
    tma = tma and k_cache.shape[1] % tile_n == 0  # (a tile shrunk to fit shared memory still divides the block)
    k_desc, v_desc = (_cache_descriptor(k_cache, tile_n), _cache_descriptor(v_cache, tile_n)) if tma else (None, None)
    block_q = 1 if decode else block_m // G
    _launch(
        _attn_2d_kernel, (T // block_q + B, Hkv),
        out, q, k_cache, v_cache, k_desc, v_desc, sinks if sinks is not None else q, block_tables, cu_seqlens_q,
        seq_lens, k_scale, v_scale, B, scale_log2, window, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        block_tables.stride(0), *cache_strides,
        G=G, BLOCK_Q=block_q, BLOCK_M=block_m, TILE_N=tile_n, HAS_SINKS=sinks is not None, KROW=krow, TMA=tma,
        **common, num_warps=warps, num_stages=stages,
    )
    return out


# --------------------------------------------------------------------------------------------------------
# Torch reference


def gather_blocks(cache: torch.Tensor, block_tables: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """cache [num_blocks, block_size, H, D], block_tables [B, max_blocks] -> [B, num_tokens, H, D]: each
    sequence's first num_tokens cache rows, contiguous (positions past a sequence's length hold whatever its
    blocks hold, or block 0's rows where the table has no entry). For op-by-op paths: the reference, MLA's
    latent expansion."""
    num_blocks, block_size = cache.shape[:2]
    B = block_tables.shape[0]
    nblk = -(-num_tokens // block_size)
    tables = block_tables[:, :nblk].long().clamp(0, num_blocks - 1)  # entries past a sequence's blocks: any
    return cache[tables].reshape(B, nblk * block_size, *cache.shape[2:])[:, :num_tokens]


def _dense(
    q: torch.Tensor,  # [n, Hq, Lq, Dk]
    keys: torch.Tensor,  # [n, Hkv, Lk, Dk]
    values: torch.Tensor,  # [n, Hkv, Lk, Dv]
    mask: torch.Tensor,  # [n, 1, Lq, Lk] bool, True = may attend
    scale: float,
    sinks: torch.Tensor | None,
) -> torch.Tensor:  # [n, Hq, Lq, Dv]
    """layers/attend.py's ``attend_cached`` arithmetic: SDPA in the model dtype, or HF eager with sinks."""
    Hq, Hkv = q.shape[1], keys.shape[1]
    if Hkv != Hq:
        keys = keys.repeat_interleave(Hq // Hkv, dim=1)
        values = values.repeat_interleave(Hq // Hkv, dim=1)
    if sinks is None:
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale)
    n, _, Lq, _ = q.shape
    scores = torch.matmul(q, keys.transpose(-1, -2)) * scale  # [n, Hq, Lq, Lk]
    scores = scores.masked_fill(~mask, float("-inf"))
    sink = sinks.to(scores.dtype).reshape(1, Hq, 1, 1).expand(n, Hq, Lq, 1)
    combined = torch.cat([scores, sink], dim=-1)
    combined = combined - combined.max(dim=-1, keepdim=True).values
    probs = torch.softmax(combined, dim=-1, dtype=combined.dtype)[..., :-1]
    return torch.matmul(probs.to(values.dtype), values)


def paged_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    max_query_len: int,
    max_seq_len: int,
    scale: float,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,  # accepted for a drop-in signature; unused
    config: KernelConfig | None = None,  # idem
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:  # [T, Hq, Dv]
    """``paged_attention`` op by op: per group of sequences (single-query ones, then the others, so that
    decode rows are not padded to a prefill chunk), gather the blocks into [n, Hkv, Lk, D], pad queries to
    [n, Hq, Lq, Dk], mask as layers/attend.py does, and run ``_dense``. Stale cache contents past a sequence's
    length are zeroed before use (they may be anything, NaN included). Rows of padding tokens are zero.
    ``max_query_len`` / ``max_seq_len`` are not needed (host copies give the exact lengths). An FP8 cache
    (``k_scale`` / ``v_scale``) is dequantised after the gather as ``kv_fp8.dequantize``: the values the kernels read."""
    _check_attention_args(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, sinks, sliding_window,
                          k_scale is not None)
    _scale_args(k_scale, v_scale, seq_lens)
    T, Hq, Dk = q.shape
    Dv = v_cache.shape[3]
    result = q.new_zeros(T, Hq, Dv)
    cu, lens = cu_seqlens_q.tolist(), seq_lens.tolist()
    q_lens = [cu[b + 1] - cu[b] for b in range(len(lens))]
    decode = [b for b, n in enumerate(q_lens) if n == 1 and lens[b] > 0]  # no keys (padding): zero rows
    others = [b for b, n in enumerate(q_lens) if n > 1 and lens[b] > 0]
    device = q.device
    for group in (decode, others):
        if not group:
            continue
        n, Lq, Lk = len(group), max(q_lens[b] for b in group), max(lens[b] for b in group)
        idx = torch.tensor(group, device=device)
        kv_len = seq_lens[idx].long()  # [n]
        k_pos = torch.arange(Lk, device=device)  # [Lk]
        valid = k_pos[None, :] < kv_len[:, None]  # [n, Lk]
        keys = gather_blocks(k_cache, block_tables[idx], Lk)  # [n, Lk, Hkv, Dk]
        values = gather_blocks(v_cache, block_tables[idx], Lk)
        if k_scale is not None:
            keys, values = kv_fp8.dequantize(keys, k_scale, q.dtype), kv_fp8.dequantize(values, v_scale, q.dtype)
        keys = keys.masked_fill(~valid[:, :, None, None], 0).transpose(1, 2)  # [n, Hkv, Lk, Dk]
        values = values.masked_fill(~valid[:, :, None, None], 0).transpose(1, 2)  # [n, Hkv, Lk, Dv]

        rows, seq_i, q_i, q_pos_list = [], [], [], []
        for i, b in enumerate(group):
            for j in range(q_lens[b]):
                rows.append(cu[b] + j)
                seq_i.append(i)
                q_i.append(j)
                q_pos_list.append(lens[b] - q_lens[b] + j)
        rows_t, seq_t, qi_t = (torch.tensor(x, device=device) for x in (rows, seq_i, q_i))
        q_pad = q.new_zeros(n, Lq, Hq, Dk)
        q_pad[seq_t, qi_t] = q[rows_t]
        q_pos = torch.full((n, Lq), -1, dtype=torch.long, device=device)  # -1 = padding
        q_pos[seq_t, qi_t] = torch.tensor(q_pos_list, device=device)
        allowed = (k_pos[None, None, :] <= q_pos[:, :, None]) & valid[:, None, :]  # [n, Lq, Lk]
        if sliding_window is not None:
            allowed &= k_pos[None, None, :] > (q_pos[:, :, None] - sliding_window)
        allowed[:, :, 0] |= q_pos < 0  # padding rows attend key 0 (no empty softmax row); dropped below
        o = _dense(q_pad.transpose(1, 2), keys, values, allowed[:, None], scale, sinks)  # [n, Hq, Lq, Dv]
        result[rows_t] = o.transpose(1, 2)[seq_t, qi_t]
    if out is not None:
        out.copy_(result)
        return out
    return result
