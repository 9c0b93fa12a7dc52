"""Batch-invariant Triton kernels: the GPU half of ``--enable-deterministic-inference`` (layers/invariant.py has the
CPU half and says which operations need what).

A kernel is batch-invariant when every row's arithmetic -- the order of its sums, the instruction that computes each
product and partial sum, the tile and split sizes -- is fixed by the row's own data and by the weight's shape,
never by how many rows share the launch. The kernels here are, by construction:

* ``linear``: a GEMM with ONE tile configuration for every row count (64 x 128 x 64 bf16/fp16 tiles on 4 warps;
  cuBLAS picks tiles, split-K and even the instruction by size) and a FIXED split over K chosen from the weight's
  shape alone (``k_splits``: enough (column tile, K range) programs to fill the GPU for a single row). A small
  GEMM (a decode step) runs the splits as programs that store float32 partial sums, added in split order by a
  second kernel; a large one runs them one after another inside each program, ``total = p0; total += p1; ...``.
  Both add the same float32 partials in the same order: the same bits, whichever the row count picks.
* ``attention``: paged attention whose keys are cut into CHUNK-key ranges counted from position 0, so a query's
  split depends only on its own position: each range gets its own online softmax (TILE_N-key tiles, the
  paged_attention.py tile loop), the ranges are merged one after another in position order (``_merge``), the sink
  (GPT-OSS) last. A decode step of few sequences runs one program per (sequence, kv head, range) and a merge kernel;
  every other step (prefill, chunked prefill, mixed, large decode batches) merges the ranges inside the program of
  its query tile. One query tile size, key tile and warp count for both. Keys past a query (later queries of its
  tile, positions past its window start) add exact zeros or leave the state untouched, so a query gets the same bits
  in a decode step, a prompt's prefill, any chunk of it and after a prefix-cache hit.
* ``row_sum`` (one program per row, a fixed lane order) and ``logsumexp`` (the vocabulary in chunks fixed by its
  size, merged one after another by a finish kernel).

Every kernel is launched without FMA contraction (support.py's ``_launch``), so an expression rounds the same way in
each kernel that inlines it. Under ``TRITON_INTERPRET=1`` (CPU tests) ``tl.dot`` is numpy's matmul, whose BLAS sums a
row's products in an order that depends on the row's place in the tile: there each row is summed by itself
(``_mm``), as a row of the GPU's tensor-core instruction is.
"""
from __future__ import annotations

import functools

import torch

from . import paged_attention
from .support import _DT, _launch, _pow2, interpreting, pdl, triton

_LOG2E = 1.4426950408889634

# GEMM tiles per dtype: (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages). One configuration for every row count.
GEMM_TILES = {2: (64, 128, 64, 4, 3), 4: (64, 64, 32, 4, 2)}  # by element size: bf16/fp16, float32
GEMM_GROUP_M = 8  # row tiles per group of the large-GEMM ordering (a weight column tile stays in L2)
# A GEMM's K is split so that about this many (column tile, K range) programs cover a single row (a decode step's
# GEMM then reads its weights from two programs per SM of an H100/H200: the Qwen3-30B-A3B q/k/v in 4 splits, 160
# programs; o_proj in 16, 256; the router in 32); the split depends on the weight's shape only.
GEMM_TARGET_PROGRAMS = 256

ATTN_BLOCK_M = 64  # query rows (tokens x the G heads of a kv head) per program, decode and prefill alike
ATTN_TILE_N = 64  # keys per online-softmax step
ATTN_CHUNK = 128  # keys per range: a query's keys [0, CHUNK), [CHUNK, 2 CHUNK), ... each get their own softmax state
ATTN_WARPS = 4
ATTN_STAGES = 2

LSE_BLOCK = 1024
LSE_BLOCKS_PER_CHUNK = 8  # the vocabulary's chunks: 8 blocks each, whatever the row count


def gemm_tiles(dtype: torch.dtype) -> tuple[int, int, int, int, int]:
    return GEMM_TILES[2 if dtype in (torch.bfloat16, torch.float16) else 4]


def k_splits(N: int, K: int, dtype: torch.dtype) -> tuple[int, int]:
    """(K steps per split, splits) of a [*, K] x [K, N] GEMM: a power of two of splits, no more than K's steps, until
    the column tiles times the splits reach GEMM_TARGET_PROGRAMS. From the weight's shape only."""
    _, bn, bk, _, _ = gemm_tiles(dtype)
    steps, tiles = -(-K // bk), -(-N // bn)
    s = 1
    while s * 2 <= steps and tiles * s * 2 <= GEMM_TARGET_PROGRAMS:
        s *= 2
    per = -(-steps // s)
    return per, -(-steps // per)


@functools.lru_cache(maxsize=None)
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 132
    return _num_sms(device.index if device.index is not None else torch.cuda.current_device())


if triton is not None:
    import triton.language as tl

    from .paged_attention import _attend_tiles, _find_seq
    from .support import _await_inputs, _grouped_tile, _round

    @triton.jit
    def _mm(a, b, acc, PREC: tl.constexpr, INTERPRET: tl.constexpr):
        """acc + a @ b in float32 (see the module docstring for the interpreter's row-by-row sum)."""
        if INTERPRET:
            return acc + tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], axis=1)
        else:
            return tl.dot(a, b, acc, input_precision=PREC)

    @triton.jit
    def _k_range(a_ptr, w_ptr, rows, rmask, cols, cmask, step_lo, step_hi, K, s_am, s_wn, s_wk,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PREC: tl.constexpr,
                 INTERPRET: tl.constexpr):
        """The float32 sums over K steps [step_lo, step_hi) of rows x cols, from zero."""
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        offs_k = tl.arange(0, BLOCK_K)
        a_rows = a_ptr + rows.to(tl.int64)[:, None] * s_am
        w_cols = w_ptr + cols.to(tl.int64)[None, :] * s_wn
        for step in range(step_lo, step_hi):
            k = step * BLOCK_K + offs_k
            kmask = k < K
            a = tl.load(a_rows + k[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
            w = tl.load(w_cols + k.to(tl.int64)[:, None] * s_wk, mask=kmask[:, None] & cmask[None, :], other=0.0)
            acc = _mm(a, w, acc, PREC, INTERPRET)
        return acc

    @triton.jit
    def _store_rows(out_ptr, total, b_ptr, rows, rmask, cols, cmask, s_om, HAS_BIAS: tl.constexpr,
                    DT: tl.constexpr):
        if HAS_BIAS:
            total = total + tl.load(b_ptr + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + rows.to(tl.int64)[:, None] * s_om + cols[None, :],
                 _round(total, DT).to(out_ptr.dtype.element_ty), mask=rmask[:, None] & cmask[None, :])

    @triton.jit(do_not_specialize=["M"])
    def _linear_kernel(
        a_ptr, w_ptr, b_ptr, out_ptr, part_ptr, M, N, K, STEPS, SPLITS, s_am, s_wn, s_wk, s_om,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
        HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr, DT: tl.constexpr, PREC: tl.constexpr,
        INTERPRET: tl.constexpr, PDL: tl.constexpr,
    ):
        """PARTIAL: program (row tile, column tile, split s) stores the float32 sum over split s's K steps into
        part[s]. Otherwise program (row tile, column tile) in grouped order adds the splits' sums one after another
        (total = p0, total += p1, ...) and stores round(total + bias)."""
        _await_inputs(PDL)
        if PARTIAL:
            pid_m = tl.program_id(0)
            pid_n = tl.program_id(1)
        else:
            pid = tl.program_id(0)
            num_m = tl.cdiv(M, BLOCK_M)
            num_n = tl.cdiv(N, BLOCK_N)
            pid_m, pid_n = _grouped_tile(pid, num_m, num_n, GROUP_M)
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rmask = rows < M
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        cmask = cols < N
        steps = tl.cdiv(K, BLOCK_K)
        if PARTIAL:
            s = tl.program_id(2)
            lo = s * STEPS
            acc = _k_range(a_ptr, w_ptr, rows, rmask, cols, cmask, lo, tl.minimum(lo + STEPS, steps), K,
                           s_am, s_wn, s_wk, BLOCK_M, BLOCK_N, BLOCK_K, PREC, INTERPRET)
            at = (s.to(tl.int64) * M + rows)[:, None] * N + cols[None, :]
            tl.store(part_ptr + at, acc, mask=rmask[:, None] & cmask[None, :])
        else:
            total = _k_range(a_ptr, w_ptr, rows, rmask, cols, cmask, 0, tl.minimum(STEPS, steps), K,
                             s_am, s_wn, s_wk, BLOCK_M, BLOCK_N, BLOCK_K, PREC, INTERPRET)
            for s in range(1, SPLITS):
                lo = s * STEPS
                total = total + _k_range(a_ptr, w_ptr, rows, rmask, cols, cmask, lo, tl.minimum(lo + STEPS, steps),
                                         K, s_am, s_wn, s_wk, BLOCK_M, BLOCK_N, BLOCK_K, PREC, INTERPRET)
            _store_rows(out_ptr, total, b_ptr, rows, rmask, cols, cmask, s_om, HAS_BIAS, DT)

    @triton.jit(do_not_specialize=["M"])
    def _linear_reduce_kernel(
        part_ptr, b_ptr, out_ptr, M, N, SPLITS, s_om,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_BIAS: tl.constexpr, DT: tl.constexpr, PDL: tl.constexpr,
    ):
        """The splits' partial sums of a (row tile, column tile) added in split order, + bias, rounded."""
        _await_inputs(PDL)
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        rmask = rows < M
        cmask = cols < N
        m = rmask[:, None] & cmask[None, :]
        at = rows.to(tl.int64)[:, None] * N + cols[None, :]
        total = tl.load(part_ptr + at, mask=m, other=0.0)
        for s in range(1, SPLITS):
            total = total + tl.load(part_ptr + s * M * N + at, mask=m, other=0.0)  # (M * N * SPLITS < 2**31: small)
        _store_rows(out_ptr, total, b_ptr, rows, rmask, cols, cmask, s_om, HAS_BIAS, DT)

    @triton.jit
    def _row_sum_kernel(x_ptr, out_ptr, W, sx, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        x_row = x_ptr + row.to(tl.int64) * sx
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for off in range(0, W, BLOCK):
            c = off + tl.arange(0, BLOCK)
            acc += tl.load(x_row + c, mask=c < W, other=0.0).to(tl.float32)
        tl.store(out_ptr + row, tl.sum(acc, 0))

    @triton.jit
    def _lse_finish_kernel(pm_ptr, ps_ptr, out_ptr, S, BLOCK_S: tl.constexpr):
        """Row r: its chunks' (max, sum of exp) merged one after another in chunk order."""
        row = tl.program_id(0)
        j = tl.arange(0, BLOCK_S)
        pm = tl.load(pm_ptr + row * S + j, mask=j < S, other=float("-inf"))
        top = tl.max(pm, 0)  # exact in any order
        safe = tl.where(top == float("-inf"), 0.0, top)
        total = tl.zeros_like(safe)
        for s in range(0, S):
            m = tl.load(pm_ptr + row * S + s)
            total += tl.where(m > float("-inf"), tl.load(ps_ptr + row * S + s) * tl.exp(m - safe), 0.0)
        tl.store(out_ptr + row, tl.where(top == float("-inf"), top, safe + tl.log(total)))

    @triton.jit
    def _merge(M, L, A, m, l, acc):
        """Running (max, sum, output) of the ranges so far, with range (m, l, acc) merged in (log2 units)."""
        M_new = tl.maximum(M, m)
        safe = tl.where(M_new == float("-inf"), 0.0, M_new)
        a1 = tl.exp2(M - safe)
        a2 = tl.exp2(m - safe)
        return M_new, L * a1 + l * a2, A * a1[:, None] + acc * a2[:, None]

    @triton.jit
    def _range_state(
        q, qpos, lo, hi, full_hi, k_cache_ptr, v_cache_ptr, k_desc, v_desc, table_ptr, kvh, window,
        s_kb, s_ko, s_kh, s_vb, s_vo, s_vh, scale_log2,
        BLOCK_M: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, DK_PAD: tl.constexpr, DV_PAD: tl.constexpr,
        BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr, HAS_WINDOW: tl.constexpr, KROW: tl.constexpr,
        TMA: tl.constexpr, IEEE: tl.constexpr, INTERPRET: tl.constexpr,
    ):
        """The online softmax state of q's rows over keys [lo, hi) (one range; lo a multiple of TILE_N), from
        (-inf, 0, 0); keys below ``full_hi`` need no mask (paged_attention.py's ``_attend_tiles``)."""
        m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, DV_PAD], dtype=tl.float32)
        unmasked_hi = tl.minimum(tl.maximum(full_hi, lo), hi)
        return _attend_tiles(
            q, m, l, acc, qpos, lo, unmasked_hi, hi, k_cache_ptr, v_cache_ptr, k_desc, v_desc, table_ptr, kvh,
            window, s_kb, s_ko, s_kh, s_vb, s_vo, s_vh, scale_log2, 1.0, 1.0,  # k/v scales: unread, no FP8 cache
            DK, DV, DK_PAD, DV_PAD, BLOCK_SIZE, TILE_N, HAS_WINDOW, KROW, TMA, IEEE, INTERPRET, False, 0,
        )

    @triton.jit(do_not_specialize=["num_seqs", "num_chunks", "s_bt"])
    def _attn_kernel(
        out_ptr, pm_ptr, pl_ptr, pacc_ptr,  # SPLIT: partial states [T, Hq, num_chunks(, DV_PAD)] float32
        q_ptr, k_cache_ptr, v_cache_ptr, k_desc, v_desc, sinks_ptr, tables_ptr, cu_ptr, seq_lens_ptr,
        num_seqs, num_chunks, scale_log2, window,
        s_qt, s_qh, s_ot, s_oh, s_bt, s_kb, s_ko, s_kh, s_vb, s_vo, s_vh,
        Hq: tl.constexpr, G: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, TILE_N: tl.constexpr,
        CHUNK: tl.constexpr, BLOCK_SIZE: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, DK_PAD: tl.constexpr,
        DV_PAD: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SINKS: tl.constexpr, KROW: tl.constexpr,
        TMA: tl.constexpr, IEEE: tl.constexpr, INTERPRET: tl.constexpr, PDL: tl.constexpr, SPLIT: tl.constexpr,
    ):
        """Program (query tile, kv head[, range]): BLOCK_Q tokens of one sequence x the G heads of a kv head, as
        paged_attention.py's 2-D kernel lays them out. SPLIT: the state of range program_id(2) only, stored for
        ``_attn_merge_kernel``; otherwise every range of the tile's keys in position order, merged, the sink last,
        normalised and stored."""
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
        r = tl.arange(0, BLOCK_M)
        qi = tile * BLOCK_Q + r // G
        row_ok = (r < BLOCK_Q * G) & (qi < q_len)
        head = kvh * G + r % G
        qpos = context + qi
        tok = (q_start + qi).to(tl.int64)
        dk = tl.arange(0, DK_PAD)
        q = tl.load(q_ptr + tok[:, None] * s_qt + head[:, None] * s_qh + dk[None, :],
                    mask=row_ok[:, None] & (dk[None, :] < DK), other=0.0)
        first = context + tile * BLOCK_Q
        key_hi = tl.minimum(first + BLOCK_Q, seq_len)
        key_lo = 0
        full_hi = (first + 1) // TILE_N * TILE_N  # every row sees every key below it
        if HAS_WINDOW:
            key_lo = tl.maximum(first - window + 1, 0) // TILE_N * TILE_N
            full_hi = key_lo
        table = tables_ptr + seq * s_bt
        dv = tl.arange(0, DV_PAD)
        if SPLIT:
            c = tl.program_id(2)
            c_lo = c * CHUNK
            if c_lo < key_hi:
                m, l, acc = _range_state(
                    q, qpos, tl.maximum(c_lo, key_lo), tl.minimum(c_lo + CHUNK, key_hi), full_hi, k_cache_ptr,
                    v_cache_ptr, k_desc, v_desc, table, kvh, window, s_kb, s_ko, s_kh, s_vb, s_vo, s_vh, scale_log2,
                    BLOCK_M, DK, DV, DK_PAD, DV_PAD, BLOCK_SIZE, TILE_N, HAS_WINDOW, KROW, TMA, IEEE, INTERPRET,
                )
                part = (tok * Hq + head) * num_chunks + c  # [BLOCK_M]
                tl.store(pm_ptr + part, m, mask=row_ok)
                tl.store(pl_ptr + part, l, mask=row_ok)
                tl.store(pacc_ptr + part[:, None] * DV_PAD + dv[None, :], acc, mask=row_ok[:, None])
        else:
            M = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
            L = tl.zeros([BLOCK_M], dtype=tl.float32)
            A = tl.zeros([BLOCK_M, DV_PAD], dtype=tl.float32)
            for c in range(key_lo // CHUNK, tl.cdiv(key_hi, CHUNK)):
                c_lo = c * CHUNK
                m, l, acc = _range_state(
                    q, qpos, tl.maximum(c_lo, key_lo), tl.minimum(c_lo + CHUNK, key_hi), full_hi, k_cache_ptr,
                    v_cache_ptr, k_desc, v_desc, table, kvh, window, s_kb, s_ko, s_kh, s_vb, s_vo, s_vh, scale_log2,
                    BLOCK_M, DK, DV, DK_PAD, DV_PAD, BLOCK_SIZE, TILE_N, HAS_WINDOW, KROW, TMA, IEEE, INTERPRET,
                )
                M, L, A = _merge(M, L, A, m, l, acc)
            if HAS_SINKS:
                sink = tl.load(sinks_ptr + head).to(tl.float32) * 1.4426950408889634
                M, L, A = _merge(M, L, A, sink, tl.full([BLOCK_M], 1.0, dtype=tl.float32),
                                 tl.zeros([BLOCK_M, DV_PAD], dtype=tl.float32))
            o = A / tl.where(L > 0, L, 1.0)[:, None]
            tl.store(out_ptr + tok[:, None] * s_ot + head[:, None] * s_oh + dv[None, :],
                     o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & (dv[None, :] < DV))

    @triton.jit(do_not_specialize=["num_chunks"])
    def _attn_merge_kernel(
        out_ptr, pm_ptr, pl_ptr, pacc_ptr, sinks_ptr, cu_ptr, seq_lens_ptr, num_chunks, s_ot, s_oh,
        Hq: tl.constexpr, CHUNK: tl.constexpr, DV: tl.constexpr, DV_PAD: tl.constexpr, HAS_SINKS: tl.constexpr,
        PDL: tl.constexpr,
    ):
        """Program (sequence, query head) of a decode step: the ranges' states merged in position order, as
        ``_attn_kernel`` merges them in its program."""
        _await_inputs(PDL)
        seq = tl.program_id(0)
        head = tl.program_id(1)
        tok = tl.load(cu_ptr + seq)
        if tl.load(cu_ptr + seq + 1) == tok:
            return
        seq_len = tl.load(seq_lens_ptr + seq)
        one = tl.arange(0, 1)
        dv = tl.arange(0, DV_PAD)
        M = tl.full([1], float("-inf"), dtype=tl.float32)
        L = tl.zeros([1], dtype=tl.float32)
        A = tl.zeros([1, DV_PAD], dtype=tl.float32)
        base = (tok.to(tl.int64) * Hq + head) * num_chunks
        for c in range(0, tl.cdiv(seq_len, CHUNK)):
            m = tl.load(pm_ptr + base + c + one)
            l = tl.load(pl_ptr + base + c + one)
            acc = tl.load(pacc_ptr + (base + c) * DV_PAD + dv)[None, :]
            M, L, A = _merge(M, L, A, m, l, acc)
        if HAS_SINKS:
            sink = tl.load(sinks_ptr + head + one).to(tl.float32) * 1.4426950408889634
            M, L, A = _merge(M, L, A, sink, tl.full([1], 1.0, dtype=tl.float32), tl.zeros([1, DV_PAD], tl.float32))
        o = A / tl.where(L > 0, L, 1.0)[:, None]
        tl.store(out_ptr + tok.to(tl.int64) * s_ot + head * s_oh + dv[None, :], o.to(out_ptr.dtype.element_ty),
                 mask=dv[None, :] < DV)


# ----------------------------------------------------------------------------------------------- host wrappers


def _check() -> None:
    if triton is None:
        raise RuntimeError("the batch-invariant kernels need Triton")


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           splits: bool | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias): x [..., K], weight [N, K] (any strides) -> [..., N] in x's dtype, every row the same
    bits whatever the row count. ``splits``: force (True) or forbid (False) the split-program organisation (tests;
    default: for GEMMs too small to fill the GPU otherwise). Both give the same bits."""
    _check()
    K, N = x.shape[-1], weight.shape[0]
    if weight.shape[1] != K or weight.dtype != x.dtype:
        raise ValueError(f"linear: x {tuple(x.shape)} {x.dtype} and weight {tuple(weight.shape)} {weight.dtype}")
    a = x.reshape(-1, K)
    if a.stride(-1) != 1:
        a = a.contiguous()
    M = a.shape[0]
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0:
        return out.view(*x.shape[:-1], N)
    bm, bn, bk, warps, stages = gemm_tiles(x.dtype)
    steps, n_splits = k_splits(N, K, x.dtype)
    m_tiles, n_tiles = -(-M // bm), -(-N // bn)
    if splits is None:
        splits = n_splits > 1 and m_tiles * n_tiles < GEMM_TARGET_PROGRAMS
    meta = dict(BLOCK_M=bm, BLOCK_N=bn, HAS_BIAS=bias is not None, DT=_DT[x.dtype], PDL=pdl(x.device),
                num_warps=warps)
    b = bias if bias is not None else out
    prec = "ieee" if x.dtype == torch.float32 else "tf32"
    strides = (a.stride(0), weight.stride(0), weight.stride(1), out.stride(0))
    if splits:
        part = torch.empty(n_splits, M, N, dtype=torch.float32, device=x.device)
        _launch(_linear_kernel, (m_tiles, n_tiles, n_splits), a, weight, b, out, part, M, N, K, steps, n_splits,
                *strides, BLOCK_K=bk, GROUP_M=GEMM_GROUP_M, PARTIAL=True, PREC=prec, INTERPRET=interpreting(),
                num_stages=stages, **meta)
        _launch(_linear_reduce_kernel, (m_tiles, n_tiles), part, b, out, M, N, n_splits, out.stride(0),
                num_stages=1, **meta)
    else:
        _launch(_linear_kernel, (m_tiles * n_tiles,), a, weight, b, out, out, M, N, K, steps, n_splits, *strides,
                BLOCK_K=bk, GROUP_M=GEMM_GROUP_M, PARTIAL=False, PREC=prec, INTERPRET=interpreting(),
                num_stages=stages, **meta)
    return out.view(*x.shape[:-1], N)


def row_sum(x: torch.Tensor) -> torch.Tensor:
    """x [..., W] -> [...] float32: each row summed by one program in a fixed order (trailing zeros change
    nothing)."""
    _check()
    W = x.shape[-1]
    rows = x.reshape(-1, W)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape[0], dtype=torch.float32, device=x.device)
    if rows.shape[0]:
        _launch(_row_sum_kernel, (rows.shape[0],), rows, out, W, rows.stride(0), BLOCK=min(1024, _pow2(W)))
    return out.view(x.shape[:-1])


def logsumexp(x: torch.Tensor, block: int = LSE_BLOCK) -> torch.Tensor:
    """logsumexp of each row of x [N, V] (float32 logits): the vocabulary in chunks of LSE_BLOCKS_PER_CHUNK blocks
    (core/sampling.py's kernel), the chunks merged in order."""
    _check()
    from .sampling import _lse_kernel, _split

    N, V = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    S, chunk = _split(V, block, -(-V // (block * LSE_BLOCKS_PER_CHUNK)))
    pm = torch.empty(N, S, dtype=torch.float32, device=x.device)
    ps = torch.empty(N, S, dtype=torch.float32, device=x.device)
    out = torch.empty(N, dtype=torch.float32, device=x.device)
    if N:
        _launch(_lse_kernel, (N, S), x, x.stride(0), pm, ps, V, chunk, S, BLOCK=block)
        _launch(_lse_finish_kernel, (N,), pm, ps, out, S, BLOCK_S=_pow2(S))
    return out


def attention_tiles(G: int, dk_pad: int, dv_pad: int, esize: int) -> tuple[int, int]:
    """(query rows per program, key tile) for G heads per kv head: ATTN_BLOCK_M rows (at least G), the key tile
    shrunk only where its K/V tiles would not fit shared memory (float32, wide heads): from the model alone."""
    block_m = max(ATTN_BLOCK_M, _pow2(G))
    return paged_attention._fit_shared_memory(block_m, ATTN_TILE_N, block_m, dk_pad, dv_pad, esize, ATTN_STAGES)


def decode_ranges(num_seqs: int, num_kv_heads: int, max_seq_len: int, device: torch.device) -> int:
    """The key ranges a decode step of ``num_seqs`` sequences splits over programs (0: none, every range in one
    program per query tile): while (sequence, kv head) programs are fewer than the GPU's SMs, one program per
    range of the longest context. Host ints only (CUDA graphs key on it); either way the same bits."""
    if num_seqs * num_kv_heads >= num_sms(device):
        return 0
    return max(1, -(-max_seq_len // ATTN_CHUNK))


def attention(
    q: torch.Tensor,  # [T, Hq, Dk]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, Dk]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, Dv]
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    cu_seqlens_q: torch.Tensor,  # [B+1] int32
    seq_lens: torch.Tensor,  # [B] int32
    *,
    max_query_len: int,
    max_seq_len: int,  # host upper bound of seq_lens (a decode step's range count; a graph's key bucket)
    scale: float,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    split: bool | None = None,  # tests: force or forbid the per-range programs of a decode step
) -> torch.Tensor:  # [T, Hq, Dv]
    """Causal attention of a step's queries over their sequences' paged keys, as paged_attention.paged_attention
    (same arguments and layout), batch-invariant (see the module docstring)."""
    _check()
    paged_attention._check_attention_args(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, sinks,
                                          sliding_window)
    T, Hq, Dk = q.shape
    Hkv, block_size, Dv = k_cache.shape[2], k_cache.shape[1], v_cache.shape[3]
    B, G = seq_lens.shape[0], Hq // Hkv
    q = q if q.stride(-1) == 1 else q.contiguous()
    if out is None:
        out = torch.empty(T, Hq, Dv, dtype=q.dtype, device=q.device)
    if T == 0 or B == 0:
        return out
    dk_pad, dv_pad = max(_pow2(Dk), 16), max(_pow2(Dv), 16)
    block_m, tile_n = attention_tiles(G, dk_pad, dv_pad, q.element_size())
    block_q = block_m // G
    chunks = decode_ranges(B, Hkv, max_seq_len, q.device) if max_query_len == 1 else 0
    if split is not None:
        if split and max_query_len != 1:
            raise ValueError("per-range programs are for decode steps (one query per sequence)")
        chunks = max(1, -(-max_seq_len // ATTN_CHUNK)) if split else 0
    tma = (paged_attention.DEFAULT_CONFIG.prefill_tma and not interpreting()
           and paged_attention.tma_fits(q, k_cache, v_cache, tile_n))
    k_desc = paged_attention._cache_descriptor(k_cache, tile_n) if tma else None
    v_desc = paged_attention._cache_descriptor(v_cache, tile_n) if tma else None
    meta = dict(
        Hq=Hq, G=G, BLOCK_Q=block_q, BLOCK_M=block_m, TILE_N=tile_n, CHUNK=ATTN_CHUNK, BLOCK_SIZE=block_size,
        DK=Dk, DV=Dv, DK_PAD=dk_pad, DV_PAD=dv_pad, HAS_WINDOW=sliding_window is not None,
        HAS_SINKS=sinks is not None, KROW=True, TMA=tma, IEEE=q.dtype == torch.float32, INTERPRET=interpreting(),
        PDL=pdl(q.device), num_warps=ATTN_WARPS, num_stages=ATTN_STAGES,
    )
    args = (q, k_cache, v_cache, k_desc, v_desc, sinks if sinks is not None else q, block_tables, cu_seqlens_q,
            seq_lens, B, max(chunks, 1), float(scale) * _LOG2E, int(sliding_window or 0),
            q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1),
            v_cache.stride(2))
    grid = (T // block_q + B, Hkv)
    if chunks:
        pm = torch.empty(T, Hq, chunks, dtype=torch.float32, device=q.device)
        pl = torch.empty_like(pm)
        pacc = torch.empty(T, Hq, chunks, dv_pad, dtype=torch.float32, device=q.device)
        _launch(_attn_kernel, (*grid, chunks), out, pm, pl, pacc, *args, SPLIT=True, **meta)
        _launch(_attn_merge_kernel, (B, Hq), out, pm, pl, pacc, sinks if sinks is not None else pm, cu_seqlens_q,
                seq_lens, chunks, out.stride(0), out.stride(1), Hq=Hq, CHUNK=ATTN_CHUNK, DV=Dv, DV_PAD=dv_pad,
                HAS_SINKS=sinks is not None, PDL=meta["PDL"], num_warps=4, num_stages=1)
    else:
        _launch(_attn_kernel, grid, out, out, out, out, *args, SPLIT=False, **meta)
    return out


DENSE_BLOCK = 64  # attention_dense's cache blocks (one key tile)


def attention_dense(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, batch, scale: float) -> torch.Tensor:
    """``attention`` over dense per-sequence keys [B, H, Lk, Dk] and values [B, H, Lk, Dv] (MLA's expanded latents):
    each sequence's keys laid out as consecutive cache blocks of DENSE_BLOCK keys."""
    B, H, Lk, Dk = keys.shape
    nb = -(-Lk // DENSE_BLOCK)
    kc = keys.new_zeros(B, nb * DENSE_BLOCK, H, Dk)
    kc[:, :Lk] = keys.transpose(1, 2)
    vc = values.new_zeros(B, nb * DENSE_BLOCK, H, values.shape[-1])
    vc[:, :Lk] = values.transpose(1, 2)
    tables = torch.arange(B * nb, dtype=torch.int32, device=q.device).view(B, nb)
    return attention(q, kc.view(B * nb, DENSE_BLOCK, H, Dk), vc.view(B * nb, DENSE_BLOCK, H, -1), tables,
                     batch.int32("cu_seqlens_q"), batch.int32("seq_lens"), max_query_len=batch.max_query_len,
                     max_seq_len=batch.max_seq_len, scale=scale)
