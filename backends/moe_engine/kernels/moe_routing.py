"""MoE routing kernels: the router's softmax + top-k (``softmax_topk``, with the grouping for one token in
``softmax_topk_route``), the grouping of a step's (token, slot) pairs by expert with the copy of the ids into the
routing capture buffer (``route``), and the weighted sum of the expert outputs in HF's order (``combine``, with the
next RMSNorm in ``combine_rms_norm``).
"""
from __future__ import annotations

import torch

from .support import _DT, _launch, _pow2, pdl, triton

# Fused routing bookkeeping in one launch that compares every (token, slot) pair with every other: for steps of up
# to this many pairs (decode batches; 4096 = 512 tokens x top-8); larger steps (prefill) count per chunk of pairs.
ROUTE_MAX_PAIRS = 4096

# Columns per program of ``combine`` in small steps: this latency-bound kernel finishes sooner in more, smaller
# programs when a step has few tokens. On the H200 at the real shape (48 calls per CUDA graph,
# ``loadtest/bench/bench_decode_kernels.py --kernels combine``): 1024 -> 256 columns 2.85 -> 1.81 us at 1 token,
# 5.52 -> 3.54 us at 64.
COMBINE_BLOCK = 256

# Larger steps are the other way round: a program per 256 columns of each of hundreds or thousands of tokens spends
# its time starting. combine's columns per program by step size, (fewest tokens, columns), first match; the same
# benchmark with ``--tokens 128,256,512,1024,2048,8192``: 256 -> 512 columns 7.27 -> 6.57 us at 128 tokens, 9.73 ->
# 8.47 at 256, 14.7 -> 12.1 at 512; 512 -> 1024 21.6 -> 20.3 at 1,024; 256 -> 1024 46.5 -> 30.9 at 2,048; 1024 ->
# 2048 82.2 -> 78.3 us at 8,192.
COMBINE_BLOCKS = ((8192, 2048), (1024, 1024), (128, 512), (0, COMBINE_BLOCK))

# Steps of at least this many tokens run a MoE layer's combine in the next norm's launch (combine_rms_norm: one
# program per token's whole row, the [T, H] combine output never stored); smaller ones keep combine's narrower
# programs and the norm's own launch. H200, 48 layers per CUDA graph, us per layer two launches -> one
# (``loadtest/bench/bench_decode_kernels.py --kernels combine_norm``): 1 token 2.33 -> 2.65, 64: 7.07 -> 8.58,
# 256: 9.32 -> 9.77, 1,024: 20.6 -> 16.5, 8,192: 111.6 -> 94.6.
COMBINE_NORM_MIN_TOKENS = 512


from .norm import _rows

if triton is not None:
    import triton.language as tl

    from .norm import _store_normed
    from .support import _await_inputs, _round

    @triton.jit
    def _select_top_k(cand, vals, e, fmask_ptr, fids_ptr, t, E, K: tl.constexpr, BLOCK_E: tl.constexpr,
                      BLOCK_K: tl.constexpr, FORCED: tl.constexpr, GROUP: tl.constexpr):
        """Token t's K experts, best first: the largest ``cand`` (ties: the lowest id; NaN rows: E - 1), or the
        forced ids where the token is forced -> (ids [BLOCK_K] int64, their ``vals`` [BLOCK_K], ends [BLOCK_E]:
        GROUP: pairs with an id <= e, route's offsets for this token)."""
        kk = tl.arange(0, BLOCK_K)
        ids = tl.zeros([BLOCK_K], dtype=tl.int64)
        w = tl.zeros([BLOCK_K], dtype=tl.float32)
        if FORCED:
            forced = tl.load(fmask_ptr + t) != 0
            given = tl.load(fids_ptr + t * K + kk, mask=kk < K, other=0)
        ends = tl.zeros([BLOCK_E], dtype=tl.int32)
        for j in tl.static_range(K):
            best = tl.max(cand, axis=0)
            idx = tl.minimum(tl.min(tl.where(cand == best, e, BLOCK_E), axis=0), E - 1)  # E - 1: NaN logits
            if FORCED:
                idx = tl.where(forced, tl.sum(tl.where(kk == j, given, 0), axis=0).to(idx.dtype), idx)
            ids = tl.where(kk == j, idx.to(tl.int64), ids)
            w = tl.where(kk == j, tl.sum(tl.where(e == idx, vals, 0.0), axis=0), w)
            cand = tl.where(e == idx, float("-inf"), cand)
            if GROUP:  # counted here, elementwise: no reduction across the lanes
                ends += (e >= idx).to(tl.int32)
        return ids, w, ends

    @triton.jit
    def _softmax_topk_kernel(
        logits_ptr, ids_ptr, w_ptr, E, sl, fmask_ptr, fids_ptr,
        pos_ptr, tok_ptr, offs_ptr, cap_ptr,  # GROUP: what ``_route_kernel`` writes, for a one-token step
        K: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, RENORM: tl.constexpr, DT: tl.constexpr,
        FORCED: tl.constexpr, GROUP: tl.constexpr, CAPTURE: tl.constexpr, PDL: tl.constexpr,
        SOFTMAX_OF_TOPK: tl.constexpr = False,  # GPT-OSS: top-k of the logits, then a softmax over those k
    ):
        """Token t: p = softmax(float32 logits); the K largest, in descending order (chosen on the logits, which
        order exactly as p does; ties to the lower expert id), or, for a FORCED token (routing replay), the given
        ids; weights p at those ids, divided by their sum when RENORM; rounded to the model dtype when DT says
        so. One launch for softmax, top-k, gather, sum, divide, cast; a token not forced computes the same bits
        whether or not others in its step are. GROUP (a step of one token, grid (1,)): the same launch also
        writes ``_route_kernel``'s outputs for the token's K pairs (their expert-grouped rows, their token, the
        experts' end rows; CAPTURE: the ids into the routing capture row), from the ids in registers: the
        expert GEMMs then wait on this kernel instead of on a route launch after it. SOFTMAX_OF_TOPK (GPT-OSS):
        the same ids, weights softmax(float32 logits at those ids) over the K slots (RENORM unused)."""
        _await_inputs(PDL)
        t = tl.program_id(0)
        e = tl.arange(0, BLOCK_E)
        m = e < E
        x = tl.load(logits_ptr + t * sl + e, mask=m, other=float("-inf")).to(tl.float32)
        if SOFTMAX_OF_TOPK:
            p = x  # the weights gather the chosen logits; their softmax follows the loop
        else:
            ex = tl.exp(x - tl.max(x, axis=0))
            p = ex / tl.sum(ex, axis=0)
        kk = tl.arange(0, BLOCK_K)
        km = kk < K
        ids, w, ends = _select_top_k(x, p, e, fmask_ptr, fids_ptr, t, E, K, BLOCK_E, BLOCK_K, FORCED, GROUP)
        if SOFTMAX_OF_TOPK:  # torch.softmax over the K gathered logits (float32 inside, as torch's kernel)
            w = tl.where(km, w, float("-inf"))
            ew = tl.where(km, tl.exp(w - tl.max(w, axis=0)), 0.0)
            w = ew / tl.sum(ew, axis=0)
        elif RENORM:
            w = w / tl.sum(w, axis=0)
        tl.store(ids_ptr + t * K + kk, ids, mask=km)
        tl.store(w_ptr + t * K + kk, _round(w, DT).to(w_ptr.dtype.element_ty), mask=km)
        if GROUP:  # T = 1: pair i is slot i; its row = pairs with a smaller id, or the same id and a smaller i
            first = (ids[None, :] < ids[:, None]) | ((ids[None, :] == ids[:, None]) & (kk[None, :] < kk[:, None]))
            row = tl.sum((first & km[None, :]).to(tl.int32), axis=1)  # [BLOCK_K]
            tl.store(pos_ptr + kk, row.to(tl.int64), mask=km)
            tl.store(tok_ptr + row, tl.zeros([BLOCK_K], dtype=tl.int64), mask=km)
            if CAPTURE:
                tl.store(cap_ptr + kk, ids.to(tl.int32), mask=km)
            tl.store(offs_ptr + e, ends, mask=m)

    @triton.jit
    def _route_kernel(
        ids_ptr, pos_ptr, tok_ptr, offs_ptr, cap_ptr, cap_stride, T, K, E, PAIR_PROGRAMS,
        BLOCK_I: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_E: tl.constexpr, CAPTURE: tl.constexpr,
        PDL: tl.constexpr,
    ):
        """Pairs i = slot * T + token (slot-major, HF's order) sorted stably by expert id, by counting: a pair's
        row is the number of pairs with a smaller id, or the same id and a smaller i. Programs 0..PAIR_PROGRAMS-1
        place a block of BLOCK_I pairs each: pos[token, slot] = the pair's row in expert-grouped order, tok[row] =
        its token. The programs after them write offs[e] = end row of expert e (int32, the grouped GEMM's
        offsets), BLOCK_E experts each. CAPTURE: each pair's id is also written to the routing capture buffer
        (int32 [T, K] rows). Small row blocks and wide column blocks: a decode step's few hundred pairs spread
        over many programs, each with one or two passes over the pairs (latency, not work, sets the time)."""
        _await_inputs(PDL)
        pid = tl.program_id(0)
        N = T * K
        jj = tl.arange(0, BLOCK_J)
        if pid < PAIR_PROGRAMS:
            i = pid * BLOCK_I + tl.arange(0, BLOCK_I)
            vi = i < N
            ti = i % T
            id_i = tl.load(ids_ptr + ti * K + i // T, mask=vi, other=0)
            row = tl.zeros([BLOCK_I], dtype=tl.int32)
            for j0 in range(0, N, BLOCK_J):
                j = j0 + jj
                vj = j < N
                id_j = tl.load(ids_ptr + (j % T) * K + j // T, mask=vj, other=0)
                first = (id_j[None, :] < id_i[:, None]) | ((id_j[None, :] == id_i[:, None]) & (j[None, :] < i[:, None]))
                row += tl.sum((first & vj[None, :]).to(tl.int32), axis=1)
            tl.store(pos_ptr + ti * K + i // T, row.to(tl.int64), mask=vi)
            tl.store(tok_ptr + row, ti.to(tl.int64), mask=vi)
            if CAPTURE:
                tl.store(cap_ptr + ti * cap_stride + i // T, id_i.to(tl.int32), mask=vi)
        else:
            e = (pid - PAIR_PROGRAMS) * BLOCK_E + tl.arange(0, BLOCK_E)
            ends = tl.zeros([BLOCK_E], dtype=tl.int32)
            for j0 in range(0, N, BLOCK_J):
                j = j0 + jj
                vj = j < N
                id_j = tl.load(ids_ptr + (j % T) * K + j // T, mask=vj, other=0)
                ends += tl.sum(((id_j[None, :] <= e[:, None]) & vj[None, :]).to(tl.int32), axis=1)
            tl.store(offs_ptr + e, ends, mask=e < E)

    # Steps of more than ROUTE_MAX_PAIRS pairs (prefill): the same grouping by counting per chunk of pairs, in two
    # launches whose work grows as pairs x experts, not pairs^2. Sizes are runtime ints: one compiled variant
    # serves every step size (a size first seen mid-serving would otherwise compile inside its step).
    @triton.jit(do_not_specialize=["T", "chunk", "C"])
    def _count_chunks_kernel(
        ids_ptr, hist_ptr, cap_ptr, cap_stride, T, K, E, chunk, C,
        SUB: tl.constexpr, BLOCK_E: tl.constexpr, CAPTURE: tl.constexpr, PDL: tl.constexpr,
    ):
        """hist[c, e] = how many of chunk c's pairs (i = c * chunk .. c * chunk + chunk - 1, slot-major i =
        slot * T + token) expert e has; CAPTURE: each pair's id also into the routing capture buffer."""
        _await_inputs(PDL)
        c = tl.program_id(0)
        N = T * K
        e = tl.arange(0, BLOCK_E)
        counts = tl.zeros([BLOCK_E], dtype=tl.int32)
        for s in range(0, chunk, SUB):
            i = c * chunk + s + tl.arange(0, SUB)
            vi = i < N
            ti = i % T
            id_i = tl.load(ids_ptr + ti * K + i // T, mask=vi, other=-1)  # -1: no expert's
            counts += tl.sum((id_i[:, None] == e[None, :]).to(tl.int32), axis=0)
            if CAPTURE:
                tl.store(cap_ptr + ti * cap_stride + i // T, id_i.to(tl.int32), mask=vi)
        tl.store(hist_ptr + c * E + e, counts, mask=e < E)

    @triton.jit(do_not_specialize=["T", "chunk", "C"])
    def _place_chunks_kernel(
        ids_ptr, hist_ptr, pos_ptr, tok_ptr, offs_ptr, T, K, E, chunk, C,
        SUB: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_C: tl.constexpr, PDL: tl.constexpr,
    ):
        """Chunk c's pairs in expert-grouped order (``_route_kernel``'s outputs): expert e's rows start after all
        pairs of smaller experts and after e's pairs in chunks before c; within the chunk a pair follows its
        expert's pairs before it (a running count over SUB-pair blocks). Program 0 also writes offs."""
        _await_inputs(PDL)
        c = tl.program_id(0)
        N = T * K
        e = tl.arange(0, BLOCK_E)
        ve = e < E
        total = tl.zeros([BLOCK_E], dtype=tl.int32)  # pairs of expert e in the step
        before = tl.zeros([BLOCK_E], dtype=tl.int32)  # ... in chunks 0..c-1
        for c0 in range(0, C, BLOCK_C):
            cc = c0 + tl.arange(0, BLOCK_C)
            h = tl.load(hist_ptr + cc[:, None] * E + e[None, :], mask=(cc[:, None] < C) & ve[None, :], other=0)
            total += tl.sum(h, axis=0)
            before += tl.sum(tl.where(cc[:, None] < c, h, 0), axis=0)
        ends = tl.cumsum(total, 0)  # [BLOCK_E] end row of each expert
        tl.store(offs_ptr + e, ends, mask=ve & (c == 0))
        nxt = ends - total + before  # [BLOCK_E] the row of expert e's next pair in this chunk
        sub = tl.arange(0, SUB)
        # pairs of the block up to each pair, per expert: a lower-triangular [SUB, SUB] of ones times the block's
        # one-hot [SUB, BLOCK_E] on the tensor cores (0/1 products, sums <= SUB: exact in float32), not a scan
        tri = (sub[:, None] >= sub[None, :]).to(tl.float16)
        for s in range(0, chunk, SUB):
            i = c * chunk + s + sub
            vi = i < N
            ti = i % T
            id_i = tl.load(ids_ptr + ti * K + i // T, mask=vi, other=-1)
            hit = id_i[:, None] == e[None, :]  # [SUB, BLOCK_E]
            upto = tl.dot(tri, hit.to(tl.float16)).to(tl.int32)  # [SUB, BLOCK_E] inclusive counts
            row = tl.sum(tl.where(hit, upto - 1 + nxt[None, :], 0), axis=1)  # [SUB]
            tl.store(pos_ptr + ti * K + i // T, row.to(tl.int64), mask=vi)
            tl.store(tok_ptr + row, ti.to(tl.int64), mask=vi)
            nxt += tl.sum(hit.to(tl.int32), axis=0)

    @triton.jit
    def _combined(y_ptr, ids_ptr, pos_ptr, w_ptr, t, N, cols, m, K: tl.constexpr, BLOCK_K: tl.constexpr,
                  DT: tl.constexpr, add_ptr, HAS_ADD: tl.constexpr):
        """Token t's MoE output at ``cols`` (float32 holding model-dtype values): the sum over its experts in
        ascending id order of round(y[row] * weight), rounding after every add (HF's per-expert index_add_
        loop). y: [pairs, N] expert outputs in grouped order. HAS_ADD: plus add[t] (the shared experts' output
        [T, N], model dtype), rounded: HF's ``experts(x) + shared_experts(x)``."""
        j = tl.arange(0, BLOCK_K)
        jm = j < K
        ids = tl.load(ids_ptr + t * K + j, mask=jm, other=0)
        pos = tl.load(pos_ptr + t * K + j, mask=jm, other=0)
        w = tl.load(w_ptr + t * K + j, mask=jm, other=0.0).to(tl.float32)
        # rank of each slot's expert within the token's (distinct) experts
        rank = tl.sum(((ids[None, :] < ids[:, None]) & jm[None, :]).to(tl.int32), axis=1)
        rank = tl.where(jm, rank, BLOCK_K)
        for r in tl.static_range(K):
            row = tl.sum(tl.where(rank == r, pos, 0))
            wr = tl.sum(tl.where(rank == r, w, 0.0))
            p = _round(tl.load(y_ptr + row * N + cols, mask=m, other=0.0).to(tl.float32) * wr, DT)
            if r == 0:
                acc = p
            else:
                acc = _round(acc + p, DT)
        if K == 1:  # the op-by-op path adds its one term to zeros: -0.0 comes out as +0.0
            acc = acc + 0.0
        if HAS_ADD:
            acc = _round(acc + tl.load(add_ptr + t * N + cols, mask=m, other=0.0).to(tl.float32), DT)
        return acc

    @triton.jit
    def _combine_kernel(
        y_ptr, ids_ptr, pos_ptr, w_ptr, out_ptr, add_ptr, N,
        K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK: tl.constexpr, DT: tl.constexpr, HAS_ADD: tl.constexpr,
        PDL: tl.constexpr,
    ):
        """out[t] = token t's MoE output (``_combined``), ``BLOCK`` columns per program."""
        _await_inputs(PDL)
        t = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = cols < N
        acc = _combined(y_ptr, ids_ptr, pos_ptr, w_ptr, t, N, cols, m, K, BLOCK_K, DT, add_ptr, HAS_ADD)
        tl.store(out_ptr + t * N + cols, acc.to(out_ptr.dtype.element_ty), mask=m)

    @triton.jit
    def _combine_rms_norm_kernel(
        y_ptr, ids_ptr, pos_ptr, cw_ptr, x_ptr, s_ptr, w_ptr, out_ptr, add_ptr, N, sx, ss, eps,
        K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK: tl.constexpr, DT: tl.constexpr,
        FP32_WEIGHT: tl.constexpr, HAS_ADD: tl.constexpr, PDL: tl.constexpr,
    ):
        """Row t: the MoE output d (``_combined``, as ``_combine_kernel`` stores it), s = round(x + d), then
        ``_rms_norm_kernel``'s one-pass norm of s: the two launches' arithmetic in one, d never stored."""
        _await_inputs(PDL)
        t = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        m = cols < N
        d = _combined(y_ptr, ids_ptr, pos_ptr, cw_ptr, t, N, cols, m, K, BLOCK_K, DT, add_ptr, HAS_ADD)
        x = _round(tl.load(x_ptr + t * sx + cols, mask=m, other=0.0).to(tl.float32) + d, DT)
        tl.store(s_ptr + t * ss + cols, x.to(s_ptr.dtype.element_ty), mask=m)
        rstd = tl.math.rsqrt(tl.sum(x * x, axis=0) / N + eps)
        _store_normed(out_ptr + t * N, x, rstd, w_ptr, cols, m, DT, FP32_WEIGHT)


def softmax_topk(
    logits: torch.Tensor, top_k: int, renorm: bool, weights_dtype: torch.dtype,
    forced_mask: torch.Tensor | None = None, forced_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] -> (ids [T, K] int64 in descending order, weights [T, K] ``weights_dtype``): softmax in
    float32, top-k, optional renormalisation and the cast, in one launch. The ids are the op-by-op router's
    (the order of the logits is the order of the probabilities; ties go to the lower id, where torch.topk
    leaves the order unspecified); the weights equal it within float32 summation order. ``forced_mask`` [T]
    bool / ``forced_ids`` [T, K]: routing replay, the given ids (and their weights) for the masked tokens."""
    ids, weights, _ = _softmax_topk(logits, top_k, renorm, weights_dtype, forced_mask, forced_ids)
    return ids, weights


def softmax_topk_route(
    logits: torch.Tensor, top_k: int, renorm: bool, weights_dtype: torch.dtype,
    capture: torch.Tensor | None = None,
    forced_mask: torch.Tensor | None = None, forced_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """``softmax_topk`` and then ``route`` (ids, the capture copy) for a step of one token, in one launch: the
    same bits as the two calls. logits [1, E] -> (ids, weights, (pos, tok, offs))."""
    assert logits.shape[0] == 1, "softmax_topk_route: a step of one token"
    return _softmax_topk(logits, top_k, renorm, weights_dtype, forced_mask, forced_ids, group=True, capture=capture)


def topk_softmax(
    logits: torch.Tensor, top_k: int, forced_mask: torch.Tensor | None = None, forced_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GPT-OSS's router after its logits: logits [T, E] (model dtype) -> (ids [T, K] int64, the K largest in
    descending order, ties to the lower id; weights [T, K] in the logits' dtype, the softmax of those K logits
    computed in float32 and rounded), in one launch. The ids are the op-by-op router's (``torch.topk``, where it
    leaves the order of ties unspecified); the weights equal ``torch.softmax(top, dtype=logits.dtype)`` within
    rounding (the exponential's). Forced tokens: the given ids, the softmax of their logits."""
    ids, weights, _ = _softmax_topk(logits, top_k, False, logits.dtype, forced_mask, forced_ids, softmax_of_topk=True)
    return ids, weights


def topk_softmax_route(
    logits: torch.Tensor, top_k: int, capture: torch.Tensor | None = None,
    forced_mask: torch.Tensor | None = None, forced_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """``topk_softmax`` and ``route`` (with the capture copy) for a step of one token, in one launch: the same bits
    as the two calls. logits [1, E] -> (ids, weights, (pos, tok, offs))."""
    assert logits.shape[0] == 1, "topk_softmax_route: a step of one token"
    return _softmax_topk(logits, top_k, False, logits.dtype, forced_mask, forced_ids, group=True, capture=capture,
                         softmax_of_topk=True)


def _softmax_topk(logits, top_k, renorm, weights_dtype, forced_mask, forced_ids, group=False, capture=None,
                  softmax_of_topk=False):
    lr = _rows(logits)
    T, E = lr.shape
    ids = torch.empty(T, top_k, dtype=torch.long, device=logits.device)
    weights = torch.empty(T, top_k, dtype=weights_dtype, device=logits.device)
    forced = forced_mask is not None
    grouped = None
    if group:  # route's outputs (one token: its K pairs)
        grouped = (torch.empty(1, top_k, dtype=torch.long, device=logits.device),
                   torch.empty(top_k, dtype=torch.long, device=logits.device),
                   torch.empty(E, dtype=torch.int32, device=logits.device))
    if T:
        _launch(
            _softmax_topk_kernel, (T,), lr, ids, weights, E, lr.stride(0),
            forced_mask.contiguous() if forced else lr, forced_ids.contiguous() if forced else ids,
            *(grouped or (ids, ids, ids)), ids if capture is None else capture,
            K=top_k, BLOCK_E=_pow2(E), BLOCK_K=_pow2(top_k), RENORM=renorm, DT=_DT[weights_dtype], FORCED=forced,
            GROUP=group, CAPTURE=capture is not None, PDL=pdl(logits.device), SOFTMAX_OF_TOPK=softmax_of_topk,
            # One warp: a token's ~3K + 3 reductions over its E logits run one after another, and across 4 warps
            # each one goes through shared memory and barriers (sm_90 PTX, E=128, K=8: 74 bar.sync with 4 warps, none
            # with 1; `loadtest/probes/kernel_ptx_stats.py`). The ids are the same either way (chosen with max/min); the
            # weights' float32 sums may round differently (this router is the within-rounding one).
            num_warps=1,
        )
    return ids, weights, grouped


def route(
    ids: torch.Tensor, num_experts: int, capture: torch.Tensor | None = None, block_i: int = 16,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ids [T, K] -> (pos [T, K] long, tok [T*K] long, offs [E] int32) as described in ``_route_kernel``, and
    the ids copied into ``capture`` ([T, K] int32, unit last stride) when given. Up to ROUTE_MAX_PAIRS pairs (decode
    steps) in one launch that compares every pair with every other; larger steps in two that count per chunk of
    pairs (``_count_chunks_kernel``, ``_place_chunks_kernel``). No host sync either way (CUDA-graph capturable)."""
    T, K = ids.shape
    n = T * K
    ids = ids.contiguous()
    pos = torch.empty(T, K, dtype=torch.long, device=ids.device)
    tok = torch.empty(n, dtype=torch.long, device=ids.device)
    offs = torch.empty(num_experts, dtype=torch.int32, device=ids.device)
    cap = dict(cap_ptr=ids if capture is None else capture, cap_stride=0 if capture is None else capture.stride(0))
    if n > ROUTE_MAX_PAIRS:
        _route_chunks(ids, num_experts, pos, tok, offs, capture is not None, **cap)
    elif n:
        block_j, block_e = min(max(_pow2(n), 16), 256), 32  # [block_i x 256] or [32 x 256] per pass
        pair_programs = triton.cdiv(n, block_i)
        _launch(_route_kernel, (pair_programs + triton.cdiv(num_experts, block_e),), ids, pos, tok, offs,
                cap["cap_ptr"], cap["cap_stride"], T, K, num_experts, pair_programs, BLOCK_I=block_i,
                BLOCK_J=block_j, BLOCK_E=block_e, CAPTURE=capture is not None, PDL=pdl(ids.device))
    return pos, tok, offs


# A large step's pairs go in about this many chunks (one program each, in both launches): a chunk's program
# reads every chunk's expert counts ([chunks, E] int32, from L2), so fewer, longer chunks; enough to spread the
# counting over the SMs. ROUTE_CHUNK_ELEMENTS bounds a [pairs, experts] block of the counting (registers).
ROUTE_CHUNKS = 128


ROUTE_CHUNK_ELEMENTS = 16384


def _route_chunks(ids, num_experts: int, pos, tok, offs, capture: bool, cap_ptr, cap_stride) -> None:
    T, K = ids.shape
    n = T * K
    block_e = max(16, _pow2(num_experts))  # (a dot's dimensions are >= 16)
    sub = max(16, min(128, ROUTE_CHUNK_ELEMENTS // block_e))  # pairs per block of a chunk
    chunk = triton.cdiv(triton.cdiv(n, ROUTE_CHUNKS), sub) * sub
    C = triton.cdiv(n, chunk)  # <= ROUTE_CHUNKS
    hist = torch.empty(C, num_experts, dtype=torch.int32, device=ids.device)
    common = dict(SUB=sub, BLOCK_E=block_e, PDL=pdl(ids.device))
    _launch(_count_chunks_kernel, (C,), ids, hist, cap_ptr, cap_stride, T, K, num_experts, chunk, C,
            CAPTURE=capture, **common)
    _launch(_place_chunks_kernel, (C,), ids, hist, pos, tok, offs, T, K, num_experts, chunk, C,
            BLOCK_C=max(1, min(_pow2(ROUTE_CHUNKS), ROUTE_CHUNK_ELEMENTS // block_e)), **common)


def combine(y: torch.Tensor, ids: torch.Tensor, pos: torch.Tensor, weights: torch.Tensor, dtype: torch.dtype,
            block: int | None = None, add: torch.Tensor | None = None) -> torch.Tensor:
    """y [T*K, H] expert outputs in grouped order, ids/pos/weights [T, K] -> [T, H] in ``dtype``: each
    weighted output rounded to ``dtype``, then summed in ascending expert order, rounding after each add; ``add``
    [T, H] (``dtype``; DeepSeek's shared experts' output) added last, rounded, in the same launch. Each program sums
    ``block`` columns of one token (default: by the step's size, COMBINE_BLOCKS; the split of the columns changes no
    result)."""
    T, K = ids.shape
    N = y.shape[1]
    out = torch.empty(T, N, dtype=dtype, device=y.device)
    if T:
        block = block or next(columns for fewest, columns in COMBINE_BLOCKS if T >= fewest)
        block = min(_pow2(N), _pow2(block))
        _launch(
            _combine_kernel, (T, triton.cdiv(N, block)),
            y.contiguous(), ids.contiguous(), pos.contiguous(), weights.contiguous(), out,
            out if add is None else add.contiguous(), N,
            K=K, BLOCK_K=_pow2(K), BLOCK=block, DT=_DT[dtype], HAS_ADD=add is not None, PDL=pdl(y.device),
        )
    return out


def combine_rms_norm(
    y: torch.Tensor, ids: torch.Tensor, pos: torch.Tensor, weights: torch.Tensor,
    x: torch.Tensor, weight: torch.Tensor, eps: float, fp32_weight: bool, add: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(s, RMSNorm(s)) with s = x + combine(y, ids, pos, weights, x.dtype, add=add), in one launch: ``combine``
    then ``rms_norm(x, ..., delta=)`` (the same arithmetic and the same sum of squares: the bits of the two
    launches), without writing the MoE output to memory. x [T, H] residual stream; y, ids, pos, weights, add as
    ``combine``."""
    T, K = ids.shape
    xr = _rows(x)
    N = xr.shape[1]
    s = torch.empty_like(xr)
    out = torch.empty_like(xr)
    if T:
        _launch(
            _combine_rms_norm_kernel, (T,),
            y.contiguous(), ids.contiguous(), pos.contiguous(), weights.contiguous(), xr, s, weight, out,
            out if add is None else add.contiguous(), N, xr.stride(0), s.stride(0), eps,
            K=K, BLOCK_K=_pow2(K), BLOCK=_pow2(N), DT=_DT[x.dtype], FP32_WEIGHT=fp32_weight, HAS_ADD=add is not None,
            PDL=pdl(x.device),
        )
    return s.view(x.shape), out.view(x.shape)
