"""Fused Triton kernels for the GPU forward: bit-identical to the op-by-op path in model.py, or (the second
table) equal to it within float32 summation order.

A decode step of a small MoE model is a few hundred tiny kernels (an RMSNorm alone is eight: cast,
square, mean, add, rsqrt, multiply, cast, weight), so on a GPU its time is the kernel count, not the
arithmetic. These kernels merge runs of elementwise ops without changing a single rounding:

* every intermediate that torch rounds to the model dtype is rounded here too, to nearest even
  (``_round``), and products are never contracted into FMAs (``enable_fp_fusion=False``);
* reductions stay torch's: a norm's mean of squares is ``torch.mean`` of the very float32 squares the
  op-by-op path builds, so its summation order is unchanged;
* the routed experts' outputs are weighted and summed one by one in ascending expert order, as HF's
  per-expert ``index_add_`` loop does.

So the fused path returns the same bits as the op-by-op one (tests/unit/test_kernels.py compares them), and
the op-by-op path is what agrees with Hugging Face transformers. What is merged:

==========================  =================================================================  ==========
kernel                      replaces                                                           launches
==========================  =================================================================  ==========
``add_square``              residual add, cast to float32, square (for one or two tensors)     3 -> 1
``rms_norm_tail``           + eps, rsqrt, scale, cast, weight (after torch's mean)             5 -> 1
``qk_norm_rope``            q/k norm tails + rotary (``x*cos + rotate_half(x)*sin``) of q and k  ~20 -> 1
``route``                   stable sort of (token, slot) pairs by expert, counts, offsets,     ~12 -> 1
                            and the copy of the ids into the routing capture buffer
``combine``                 routing weight x expert output, HF-order sum over the k experts    ~14 -> 1
``store_kv``                the step's k and v written into the paged cache at their slots      ~4 -> 1
==========================  =================================================================  ==========

With only the kernels above, a batch-1 decode step at real model widths is ~23 launches per layer, most of them
latency-bound (a few microseconds each for kilobytes of data; loadtest/reports/real_shape_h200.md). The kernels below sum inside the kernel, in their own
order, so their results equal the op-by-op path's within float32 rounding instead of bit for bit; the expert ids
they choose are the same (a router chooses on its logits, whose order rounding does not change). The model uses
them on GPUs unless ``--exact-kernels`` asks for the bit-identical set only (model.py ``use_fused_kernels``):

==========================  =================================================================  ==========
kernel                      replaces                                                           launches
==========================  =================================================================  ==========
``rms_norm``                residual add, squares, torch's mean, the tail                      3 -> 1
``qk_norm_rope`` (no var)   q/k squares, torch's means, the tail and rotary                    3 -> 1
``softmax_topk``            router softmax, top-k (sort + gather), sum, divide, cast           ~7 -> 1
``softmax_topk_route``      one token: ``softmax_topk`` and ``route`` (with the capture copy)    2 -> 1
``small_linear``            cuBLAS for the router logits (up to 4 tokens), o_proj and q/k/v    2 -> 1 (o)
                            (1 token)
==========================  =================================================================  ==========

Triton ships with CUDA builds of torch. Without it (CPU wheels) ``available()`` is False and the model
keeps the op-by-op path. Tests run the kernels on CPU tensors under Triton's interpreter
(``TRITON_INTERPRET=1``), which truncates float32 -> bfloat16 casts: there ``_round`` rounds with integer ops
(round to nearest even on the bits); on the GPU it is the hardware's conversion (``cvt.rn.bf16.f32``, the same
rounding: the same bits), two instructions instead of four, which matters where a kernel's elements are many and
its rounds per element are several (``combine`` rounds 16 times per output, ``qk_norm_rope`` 7).
"""
from __future__ import annotations

import functools
import os

import torch

try:
    import triton
    import triton.language as tl
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # CPU wheels of torch do not bring Triton
    triton = None

# dtype codes passed to the kernels (a constexpr int is simpler to branch on than a Triton dtype)
_DT = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
# Fused routing bookkeeping in one launch that compares every (token, slot) pair with every other: for steps of up
# to this many pairs (decode batches; 4096 = 512 tokens x top-8); larger steps (prefill) count per chunk of pairs.
ROUTE_MAX_PAIRS = 4096
# Launch granularity of latency-bound kernels (more, smaller programs finish sooner when a step has few tokens):
# columns per program of ``combine``, heads per program of ``qk_norm_rope`` (per-head or no norm). On the H200 at
# the real shape (loadtest/bench_decode_kernels.py, 48 calls per CUDA graph; run31_decode_kernels.txt): combine
# 2.85 -> 1.81 us at 1 token, 5.52 -> 3.54 us at 64 (1024 -> 256 columns); qk_norm_rope 4.39 -> 3.35 us at 1
# token, 6.11 -> 5.52 us at 64 (all 32 q heads in one program -> 4 heads per program); since ``_round`` is the
# hardware conversion, 8 heads (run79_round_kernels_new.txt, run81_qk_heads_1token.txt): 3.14 -> 2.88 us at 64
# tokens, 1.52 -> 1.48 at 1 (a batch-1 decode 2.82 -> 2.81 ms, run81_ab_a_qk8.txt).
COMBINE_BLOCK = 256
QK_HEADS_PER_PROGRAM = 8
# Larger steps are the other way round: a program per 256 columns of each of hundreds or thousands of tokens spends
# its time starting. combine's columns per program by step size, (fewest tokens, columns), first match; the same
# benchmark (run43_combine_large_T.txt, run44_combine_mid_T.txt): 256 -> 512 columns 7.27 -> 6.57 us at 128 tokens,
# 9.73 -> 8.47 at 256, 14.7 -> 12.1 at 512; 512 -> 1024 21.6 -> 20.3 at 1,024; 256 -> 1024 46.5 -> 30.9 at 2,048,
# 162 -> 100 at 8,192; with the hardware rounding, 1024 -> 2048 columns 82.2 -> 78.3 us at 8,192
# (run79_round_kernels_new.txt).
COMBINE_BLOCKS = ((8192, 2048), (1024, 1024), (128, 512), (0, COMBINE_BLOCK))
# Steps of at least this many tokens run a MoE layer's combine in the next norm's launch (combine_rms_norm: one
# program per token's whole row, the [T, H] combine output never stored); smaller ones keep combine's narrower
# programs and the norm's own launch. H200, 48 layers per CUDA graph, us per layer two launches -> one
# (reports/real_shape/run97_combine_norm.txt): 1 token 2.33 -> 2.65, 64: 7.07 -> 8.58, 256: 9.32 -> 9.77,
# 1,024: 20.6 -> 16.5, 8,192: 111.6 -> 94.6.
COMBINE_NORM_MIN_TOKENS = 512
# qk_norm_rope's heads per program by step size (same benchmark): 8 heads at every size (run71_qk_heads.txt, before
# the hardware rounding: 8 from 1,024 tokens; run79: 56.5 us at 8,192 tokens, 16 heads 60.7, 4 heads 92.6).
QK_HEADS_BLOCKS = ((0, QK_HEADS_PER_PROGRAM),)


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def available(device: torch.device | str) -> bool:
    """Whether the fused kernels can run on tensors of this device: Triton importable, and a CUDA device (or
    any device under the interpreter, which tests use)."""
    if triton is None:
        return False
    return interpreting() or torch.device(device).type == "cuda"


def supports(dtype: torch.dtype) -> bool:
    return dtype in _DT


# Programmatic dependent launch (PDL, Hopper and later): a kernel launched with it may start while the kernel
# before it in the stream is still finishing; it waits (``_await_inputs``) before touching anything an earlier
# kernel writes or reads, so results are unchanged, but its launch, its programs' start and any reads of
# constant data (small_linear's weights) overlap the previous kernel's tail. A batch-1 decode step is ~12
# launches per layer of a few microseconds each (loadtest/reports/real_shape_h200.md), which is what it
# shortens. MOE_PDL=0 in the environment turns it off (read at import).
PDL_ENV = "MOE_PDL"
_PDL_ON = os.environ.get(PDL_ENV, "1") != "0"


@functools.lru_cache(maxsize=None)
def _pdl_capable(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def pdl(device: torch.device) -> bool:
    """Whether kernels on ``device`` launch with programmatic dependent launch (their ``PDL`` constexpr)."""
    if not _PDL_ON or triton is None or interpreting() or device.type != "cuda":
        return False
    return _pdl_capable(device.index if device.index is not None else torch.cuda.current_device())


def _launch(kernel, grid, *args, **meta):
    # enable_fp_fusion=False: torch computes a*b + c as two roundings; an FMA would round once.
    if interpreting():
        return kernel[grid](*args, **meta)
    if meta.get("PDL"):
        meta["launch_pdl"] = True
    return kernel[grid](*args, enable_fp_fusion=False, **meta)


def _pow2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


if triton is not None:

    @triton.jit
    def _await_inputs(PDL: tl.constexpr):
        """Under programmatic dependent launch: let the next kernel in the stream launch (it waits for this one in
        turn), then wait until the kernel before this one has completed and its writes are visible. Every program
        of a PDL kernel calls it before it reads what an earlier kernel wrote or writes anything (an earlier kernel
        may still read it), and before returning early (so that the kernel completes after its predecessor)."""
        if PDL:
            gdc_launch_dependents()
            gdc_wait()

    # Whether _round may use the bfloat16 cast (read when a kernel compiles; the interpreter truncates the cast).
    _BF16_CAST = tl.constexpr(not interpreting())

    @triton.jit
    def _round(x, DT: tl.constexpr):
        """float32 -> the nearest value of the model dtype (ties to even, as torch's casts), kept in float32."""
        if DT == 1 and _BF16_CAST:  # the GPU's conversion rounds to nearest even
            return x.to(tl.bfloat16).to(tl.float32)
        elif DT == 1:  # bfloat16 by hand: keep the top 16 bits, rounding on the 17th
            bits = x.to(tl.uint32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
            return bits.to(tl.float32, bitcast=True)
        elif DT == 2:
            return x.to(tl.float16).to(tl.float32)
        else:
            return x

    @triton.jit
    def _add_square_kernel(
        x_ptr, d_ptr, s_ptr, sq_ptr, N, sx, sd, ss,  # first tensor
        x2_ptr, sq2_ptr, N2, sx2,  # optional second tensor (no residual add)
        BLOCK: tl.constexpr, HAS_ADD: tl.constexpr, DT: tl.constexpr,
    ):
        """Row r: s = x + d (rounded; when HAS_ADD), sq = float32(s)^2. program_id(1) == 1: the second tensor."""
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        if tl.program_id(1) == 0:
            m = cols < N
            x = tl.load(x_ptr + row * sx + cols, mask=m, other=0.0).to(tl.float32)
            if HAS_ADD:
                x = _round(x + tl.load(d_ptr + row * sd + cols, mask=m, other=0.0).to(tl.float32), DT)
                tl.store(s_ptr + row * ss + cols, x.to(s_ptr.dtype.element_ty), mask=m)
            tl.store(sq_ptr + row * N + cols, x * x, mask=m)
        else:
            m = cols < N2
            x = tl.load(x2_ptr + row * sx2 + cols, mask=m, other=0.0).to(tl.float32)
            tl.store(sq2_ptr + row * N2 + cols, x * x, mask=m)

    @triton.jit
    def _rms_norm_tail_kernel(
        x_ptr, var_ptr, w_ptr, out_ptr, N, sx, eps,
        BLOCK: tl.constexpr, DT: tl.constexpr, FP32_WEIGHT: tl.constexpr,
    ):
        """out = weight * (x * rsqrt(var + eps)).to(dtype)   (or (weight * x * rsqrt(..)).to(dtype))."""
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        m = cols < N
        x = tl.load(x_ptr + row * sx + cols, mask=m, other=0.0).to(tl.float32)
        rstd = tl.math.rsqrt(tl.load(var_ptr + row) + eps)
        _store_normed(out_ptr + row * N, x, rstd, w_ptr, cols, m, DT, FP32_WEIGHT)

    @triton.jit
    def _store_normed(out_ptr, x, rstd, w_ptr, cols, m, DT: tl.constexpr, FP32_WEIGHT: tl.constexpr):
        """The tail both norm kernels share: weight * (x * rstd).to(dtype) (GPT-OSS: the product in float32)."""
        w = tl.load(w_ptr + cols, mask=m, other=0.0).to(tl.float32)
        if FP32_WEIGHT:
            y = _round(w * (x * rstd), DT)
        else:
            y = _round(w * _round(x * rstd, DT), DT)
        tl.store(out_ptr + cols, y.to(out_ptr.dtype.element_ty), mask=m)

    @triton.jit
    def _rms_norm_kernel(
        x_ptr, d_ptr, s_ptr, w_ptr, out_ptr, N, sx, sd, ss, eps,
        BLOCK: tl.constexpr, HAS_ADD: tl.constexpr, DT: tl.constexpr, FP32_WEIGHT: tl.constexpr, PDL: tl.constexpr,
    ):
        """Row r in one pass: s = x + d (rounded; when HAS_ADD), var = mean(float32(s)^2) summed here, then the
        tail of ``_rms_norm_tail_kernel``. Equal to the op-by-op norm within float32 summation order."""
        _await_inputs(PDL)
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        m = cols < N
        x = tl.load(x_ptr + row * sx + cols, mask=m, other=0.0).to(tl.float32)
        if HAS_ADD:
            x = _round(x + tl.load(d_ptr + row * sd + cols, mask=m, other=0.0).to(tl.float32), DT)
            tl.store(s_ptr + row * ss + cols, x.to(s_ptr.dtype.element_ty), mask=m)
        rstd = tl.math.rsqrt(tl.sum(x * x, axis=0) / N + eps)
        _store_normed(out_ptr + row * N, x, rstd, w_ptr, cols, m, DT, FP32_WEIGHT)

    @triton.jit
    def _softmax_topk_kernel(
        logits_ptr, ids_ptr, w_ptr, E, sl, fmask_ptr, fids_ptr,
        pos_ptr, tok_ptr, offs_ptr, cap_ptr,  # GROUP: what ``_route_kernel`` writes, for a one-token step
        K: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, RENORM: tl.constexpr, DT: tl.constexpr,
        FORCED: tl.constexpr, GROUP: tl.constexpr, CAPTURE: tl.constexpr, PDL: tl.constexpr,
    ):
        """Token t: p = softmax(float32 logits); the K largest, in descending order (chosen on the logits, which
        order exactly as p does; ties to the lower expert id), or, for a FORCED token (routing replay), the given
        ids; weights p at those ids, divided by their sum when RENORM; rounded to the model dtype when DT says
        so. One launch for softmax, top-k, gather, sum, divide, cast; a token not forced computes the same bits
        whether or not others in its step are. GROUP (a step of one token, grid (1,)): the same launch also
        writes ``_route_kernel``'s outputs for the token's K pairs (their expert-grouped rows, their token, the
        experts' end rows; CAPTURE: the ids into the routing capture row), from the ids in registers: the
        expert GEMMs then wait on this kernel instead of on a route launch after it."""
        _await_inputs(PDL)
        t = tl.program_id(0)
        e = tl.arange(0, BLOCK_E)
        m = e < E
        x = tl.load(logits_ptr + t * sl + e, mask=m, other=float("-inf")).to(tl.float32)
        ex = tl.exp(x - tl.max(x, axis=0))
        p = ex / tl.sum(ex, axis=0)
        kk = tl.arange(0, BLOCK_K)
        ids = tl.zeros([BLOCK_K], dtype=tl.int64)
        w = tl.zeros([BLOCK_K], dtype=tl.float32)
        cand = x
        km = kk < K
        if FORCED:
            forced = tl.load(fmask_ptr + t) != 0
            given = tl.load(fids_ptr + t * K + kk, mask=km, other=0)
        ends = tl.zeros([BLOCK_E], dtype=tl.int32)  # GROUP: pairs with an id <= e (route's offs)
        for j in tl.static_range(K):
            best = tl.max(cand, axis=0)
            idx = tl.minimum(tl.min(tl.where(cand == best, e, BLOCK_E), axis=0), E - 1)  # E - 1: NaN logits
            if FORCED:
                idx = tl.where(forced, tl.sum(tl.where(kk == j, given, 0), axis=0).to(idx.dtype), idx)
            ids = tl.where(kk == j, idx.to(tl.int64), ids)
            w = tl.where(kk == j, tl.sum(tl.where(e == idx, p, 0.0), axis=0), w)
            cand = tl.where(e == idx, float("-inf"), cand)
            if GROUP:  # counted here, elementwise: no reduction across the lanes
                ends += (e >= idx).to(tl.int32)
        if RENORM:
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
    def _normed_rotated(
        x_ptr, var_ptr, w_ptr, cos_ptr, sin_ptr, row, sx, H, h0, eps,
        HEAD_NORM: tl.constexpr, HAS_NORM: tl.constexpr, D: tl.constexpr,
        BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, DT: tl.constexpr, VAR_HERE: tl.constexpr,
    ):
        """[BLOCK_H, BLOCK_D] of one token, heads h0..h0+BLOCK_H-1 of its H: RMSNorm tail (full width: h0 = 0 and
        every head in the block; or per head), then rotary (half style). VAR_HERE: the mean of squares is summed
        here instead of read from var_ptr (torch's mean)."""
        h = h0 + tl.arange(0, BLOCK_H)[:, None]
        d = tl.arange(0, BLOCK_D)[None, :]
        m = (h < H) & (d < D)
        half: tl.constexpr = D // 2
        partner = tl.where(d < half, d + half, d - half)  # rotate_half: [-x2, x1]
        x = tl.load(x_ptr + row * sx + h * D + d, mask=m, other=0.0).to(tl.float32)
        xp = tl.load(x_ptr + row * sx + h * D + partner, mask=m, other=0.0).to(tl.float32)
        if HAS_NORM:
            if VAR_HERE:
                if HEAD_NORM:
                    var = (tl.sum(x * x, axis=1) / D)[:, None]  # [BLOCK_H, 1]
                else:
                    var = tl.sum(tl.sum(x * x, axis=1), axis=0) / (H * D)
            if HEAD_NORM:
                if not VAR_HERE:
                    var = tl.load(var_ptr + row * H + h, mask=h < H, other=1.0)  # [BLOCK_H, 1]
                rstd = tl.math.rsqrt(var + eps)
                w = tl.load(w_ptr + d, mask=d < D, other=0.0).to(tl.float32)
                wp = tl.load(w_ptr + partner, mask=d < D, other=0.0).to(tl.float32)
            else:
                if not VAR_HERE:
                    var = tl.load(var_ptr + row)
                rstd = tl.math.rsqrt(var + eps)
                w = tl.load(w_ptr + h * D + d, mask=m, other=0.0).to(tl.float32)
                wp = tl.load(w_ptr + h * D + partner, mask=m, other=0.0).to(tl.float32)
            x = _round(w * _round(x * rstd, DT), DT)
            xp = _round(wp * _round(xp * rstd, DT), DT)
        cos = tl.load(cos_ptr + row * D + d, mask=d < D, other=0.0).to(tl.float32)
        sin = tl.load(sin_ptr + row * D + d, mask=d < D, other=0.0).to(tl.float32)
        rot = tl.where(d < half, -xp, xp)
        return _round(_round(x * cos, DT) + _round(rot * sin, DT), DT), h, d, m

    @triton.jit
    def _qk_norm_rope_kernel(
        q_ptr, qvar_ptr, qw_ptr, qout_ptr, sq, Hq,
        k_ptr, kvar_ptr, kw_ptr, kout_ptr, sk, Hk,
        cos_ptr, sin_ptr, eps,
        v_ptr, sv, ck_ptr, cv_ptr, slot_ptr, sck, sck_h, scv, scv_h,
        HEAD_NORM: tl.constexpr, HAS_NORM: tl.constexpr, D: tl.constexpr,
        BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, DT: tl.constexpr, VAR_HERE: tl.constexpr,
        STORE_KV: tl.constexpr, PDL: tl.constexpr,
    ):
        """Token program_id(0), heads block program_id(1): the first cdiv(Hq, BLOCK_H) blocks are q's, the rest
        k's -> normed (optional) and rotated, [BLOCK_H, D] out. A full-width norm (not HEAD_NORM) needs every head
        of q (of k) in one block. STORE_KV: the k programs also write the rotated k and the token's v ([Hk, D] at
        v_ptr + row * sv) into the paged cache at the token's slot, as _store_kv_kernel would (the same values: k
        as the k output holds it, cast to the cache's dtype), saving that kernel's launch and its reads."""
        _await_inputs(PDL)
        row = tl.program_id(0)
        q_blocks = tl.cdiv(Hq, BLOCK_H)
        blk = tl.program_id(1)
        if blk < q_blocks:
            y, h, d, m = _normed_rotated(q_ptr, qvar_ptr, qw_ptr, cos_ptr, sin_ptr, row, sq, Hq, blk * BLOCK_H, eps,
                                         HEAD_NORM, HAS_NORM, D, BLOCK_H, BLOCK_D, DT, VAR_HERE)
            tl.store(qout_ptr + row * Hq * D + h * D + d, y.to(qout_ptr.dtype.element_ty), mask=m)
        else:
            y, h, d, m = _normed_rotated(k_ptr, kvar_ptr, kw_ptr, cos_ptr, sin_ptr, row, sk, Hk,
                                         (blk - q_blocks) * BLOCK_H, eps,
                                         HEAD_NORM, HAS_NORM, D, BLOCK_H, BLOCK_D, DT, VAR_HERE)
            k_out = y.to(kout_ptr.dtype.element_ty)
            tl.store(kout_ptr + row * Hk * D + h * D + d, k_out, mask=m)
            if STORE_KV:
                slot = tl.load(slot_ptr + row)
                tl.store(ck_ptr + slot * sck + h * sck_h + d, k_out.to(ck_ptr.dtype.element_ty), mask=m)
                v = tl.load(v_ptr + row * sv + h * D + d, mask=m)
                tl.store(cv_ptr + slot * scv + h * scv_h + d, v.to(cv_ptr.dtype.element_ty), mask=m)

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
                  DT: tl.constexpr):
        """Token t's MoE output at ``cols`` (float32 holding model-dtype values): the sum over its experts in
        ascending id order of round(y[row] * weight), rounding after every add (HF's per-expert index_add_
        loop). y: [pairs, N] expert outputs in grouped order."""
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
        return acc

    @triton.jit
    def _combine_kernel(
        y_ptr, ids_ptr, pos_ptr, w_ptr, out_ptr, N,
        K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK: tl.constexpr, DT: tl.constexpr, PDL: tl.constexpr,
    ):
        """out[t] = token t's MoE output (``_combined``), ``BLOCK`` columns per program."""
        _await_inputs(PDL)
        t = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = cols < N
        acc = _combined(y_ptr, ids_ptr, pos_ptr, w_ptr, t, N, cols, m, K, BLOCK_K, DT)
        tl.store(out_ptr + t * N + cols, acc.to(out_ptr.dtype.element_ty), mask=m)

    @triton.jit
    def _combine_rms_norm_kernel(
        y_ptr, ids_ptr, pos_ptr, cw_ptr, x_ptr, s_ptr, w_ptr, out_ptr, N, sx, ss, eps,
        K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK: tl.constexpr, DT: tl.constexpr,
        FP32_WEIGHT: tl.constexpr, PDL: tl.constexpr,
    ):
        """Row t: the MoE output d (``_combined``, as ``_combine_kernel`` stores it), s = round(x + d), then
        ``_rms_norm_kernel``'s one-pass norm of s: the two launches' arithmetic in one, d never stored."""
        _await_inputs(PDL)
        t = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        m = cols < N
        d = _combined(y_ptr, ids_ptr, pos_ptr, cw_ptr, t, N, cols, m, K, BLOCK_K, DT)
        x = _round(tl.load(x_ptr + t * sx + cols, mask=m, other=0.0).to(tl.float32) + d, DT)
        tl.store(s_ptr + t * ss + cols, x.to(s_ptr.dtype.element_ty), mask=m)
        rstd = tl.math.rsqrt(tl.sum(x * x, axis=0) / N + eps)
        _store_normed(out_ptr + t * N, x, rstd, w_ptr, cols, m, DT, FP32_WEIGHT)

    @triton.jit
    def _store_kv_kernel(
        k_ptr, v_ptr, ck_ptr, cv_ptr, slot_ptr,
        sk_t, sk_h, sv_t, sv_h,  # source strides (token, head); last dim contiguous
        sck, sck_h, scv, scv_h,  # cache strides (slot, head): [num_blocks * block_size, H, D] views
        H, DK: tl.constexpr, DV: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr,
    ):
        t = tl.program_id(0)
        slot = tl.load(slot_ptr + t)
        h = tl.arange(0, BLOCK_H)[:, None]
        dk = tl.arange(0, BLOCK_DK)[None, :]
        mk = (h < H) & (dk < DK)
        k = tl.load(k_ptr + t * sk_t + h * sk_h + dk, mask=mk)
        tl.store(ck_ptr + slot * sck + h * sck_h + dk, k.to(ck_ptr.dtype.element_ty), mask=mk)
        dv = tl.arange(0, BLOCK_DV)[None, :]
        mv = (h < H) & (dv < DV)
        v = tl.load(v_ptr + t * sv_t + h * sv_h + dv, mask=mv)
        tl.store(cv_ptr + slot * scv + h * scv_h + dv, v.to(cv_ptr.dtype.element_ty), mask=mv)

    # T unspecialised: one compiled variant serves every decode batch (a batch size first seen mid-serving
    # would otherwise compile inside its step)
    @triton.jit(do_not_specialize=["T"])
    def _small_linear_kernel(
        x_ptr, w_ptr, b_ptr, y_ptr, T, N, H, sx, sw, sy,
        BLOCK_N: tl.constexpr, BLOCK_H: tl.constexpr, HAS_BIAS: tl.constexpr, DT: tl.constexpr, PDL: tl.constexpr,
    ):
        """y[t, n] = x[t, :] . w[n, :] (+ b[n]) for every token t, rows n of this program's BLOCK_N: the weight
        slice is loaded once, in one go (one memory latency, not one per K chunk; a step of a few tokens reads
        every weight byte once, so the load is the whole cost), then each token is one multiply and one float32
        sum over H, rounded to the model dtype as F.linear's output is. Under PDL the weights (constant during a
        step) are loaded before waiting for the previous kernel: their latency overlaps its tail."""
        n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        h = tl.arange(0, BLOCK_H)
        w = tl.load(w_ptr + n[:, None] * sw + h[None, :], mask=(n[:, None] < N) & (h[None, :] < H),
                    other=0.0).to(tl.float32)  # [BLOCK_N, BLOCK_H]
        if HAS_BIAS:
            b = tl.load(b_ptr + n, mask=n < N, other=0.0).to(tl.float32)
        _await_inputs(PDL)
        for t in range(T):
            x = tl.load(x_ptr + t * sx + h, mask=h < H, other=0.0).to(tl.float32)  # [BLOCK_H]
            y = tl.sum(w * x[None, :], axis=1)  # [BLOCK_N]
            if HAS_BIAS:
                y = y + b  # in float32 before the one rounding, as cuBLAS's bias epilogue
            tl.store(y_ptr + t * sy + n, _round(y, DT).to(y_ptr.dtype.element_ty), mask=n < N)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """A 2-D view [rows, N] with a unit last stride (no copy for the layouts the model produces)."""
    x = x.reshape(-1, x.shape[-1])
    return x if x.stride(-1) == 1 else x.contiguous()


def _with_residual(x: torch.Tensor, delta: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows of x, rows of delta (x's when there is none: the kernel then never reads them) and where the kernel
    writes x + delta (x itself when there is no add)."""
    xr = _rows(x)
    if delta is None:
        return xr, xr, xr
    return xr, _rows(delta), torch.empty_like(xr)


def add_square(
    x: torch.Tensor, delta: torch.Tensor | None = None, x2: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(s, s.float()**2, x2.float()**2) with s = x + delta (or x): the inputs of torch's mean in RMSNorm, for
    one tensor (plus the residual add) or two (q and k). Squares are [..., N] float32, contiguous."""
    xr, dr, s = _with_residual(x, delta)
    R, N = xr.shape
    sq = torch.empty(R, N, dtype=torch.float32, device=x.device)
    sq2, N2, x2r = None, 1, xr
    if x2 is not None:
        x2r = _rows(x2)
        N2 = x2r.shape[1]
        sq2 = torch.empty(R, N2, dtype=torch.float32, device=x.device)
    if R:
        _launch(
            _add_square_kernel, (R, 2 if x2 is not None else 1),
            xr, dr, s, sq, N, xr.stride(0), dr.stride(0), s.stride(0),
            x2r, sq2 if sq2 is not None else sq, N2, x2r.stride(0),
            BLOCK=_pow2(max(N, N2)), HAS_ADD=delta is not None, DT=_DT[x.dtype],
        )
    return s.view(x.shape), sq.view(*x.shape[:-1], N), None if sq2 is None else sq2.view(*x2.shape[:-1], N2)


def rms_norm_tail(x: torch.Tensor, var: torch.Tensor, weight: torch.Tensor, eps: float, fp32_weight: bool) -> torch.Tensor:
    """RMSNorm after the mean: x [..., N], var [..., 1] float32 (torch's mean of add_square's squares)."""
    xr = _rows(x)
    R, N = xr.shape
    out = torch.empty(R, N, dtype=x.dtype, device=x.device)
    if R:
        _launch(
            _rms_norm_tail_kernel, (R,), xr, var.contiguous(), weight, out, N, xr.stride(0), eps,
            BLOCK=_pow2(N), DT=_DT[x.dtype], FP32_WEIGHT=fp32_weight,
        )
    return out.view(x.shape)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, fp32_weight: bool, delta: torch.Tensor | None = None,
    num_warps: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(s, RMSNorm(s)) with s = x + delta (or x) in one launch, the mean of squares summed in the kernel: equal to
    the op-by-op norm within float32 summation order (not bit for bit, unlike add_square + rms_norm_tail)."""
    xr, dr, s = _with_residual(x, delta)
    R, N = xr.shape
    out = torch.empty(R, N, dtype=x.dtype, device=x.device)
    if R:
        _launch(
            _rms_norm_kernel, (R,), xr, dr, s, weight, out, N, xr.stride(0), dr.stride(0), s.stride(0), eps,
            BLOCK=_pow2(N), HAS_ADD=delta is not None, DT=_DT[x.dtype], FP32_WEIGHT=fp32_weight, PDL=pdl(x.device),
            **({} if interpreting() or num_warps is None else {"num_warps": num_warps}),
        )
    return s.view(x.shape), out.view(x.shape)


# small_linear: a weight slice of at most this many elements per program (64 float32 registers per thread at 4
# warps). Each token is one more pass over the slice, so it pays only for the first few tokens of a step; where it
# beats cuBLAS on the H200 (loadtest/bench_small_linear.py, real-shape widths; a GEMM of 48 weights replayed in a
# CUDA graph): the router (128 x 2048) up to 4 tokens (4.9 -> 2.0 us at 1, 3.5 us at 4), o_proj (2048 x 4096)
# at 1 token (9.5 -> 7.7 us: cuBLAS splits it over K and adds a reduction launch). The fused q/k/v (5120 x 2048)
# alone is no faster (8.5 vs 8.3 us at 1 token), but in the forward, under programmatic dependent launch, its
# weight loads start while the norm before it runs: a batch-1 decode step 3.04 -> 2.99 ms
# (reports/real_shape/run35_a_ab.txt, alternated twice).
_SMALL_LINEAR_TILE = 8192
ROUTER_SMALL_LINEAR_TOKENS = 4
O_PROJ_SMALL_LINEAR_TOKENS = 1
QKV_SMALL_LINEAR_TOKENS = 1


def small_linear_fits(T: int, H: int, max_tokens: int) -> bool:
    return 0 < T <= max_tokens and _pow2(H) <= _SMALL_LINEAR_TILE


def small_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
    tile: int = _SMALL_LINEAR_TILE, num_warps: int = 4,  # loadtest/bench_small_linear.py --sweep tries others
) -> torch.Tensor:
    """F.linear(x, weight, bias) for a step of a few tokens (``decode_linear`` says which): x [T, H], weight [N, H]
    -> [T, N] in x's dtype, each output a float32 sum in this kernel's order (equal to cuBLAS's within float32
    summation order, then the same rounding to the model dtype). The programs split the N outputs, each
    reading its whole weight rows at once: a decode step's router (0.5 MB) reads at the bandwidth of many SMs
    instead of cuBLAS's few programs of a tall-skinny GEMM."""
    xr = _rows(x)
    T, H = xr.shape
    N = weight.shape[0]
    assert 0 < T and _pow2(H) <= tile and weight.shape[1] == H and weight.stride(-1) == 1, (x.shape, weight.shape)
    y = torch.empty(T, N, dtype=x.dtype, device=x.device)
    block_h = _pow2(H)
    block_n = max(1, min(tile // block_h, _pow2(N)))
    _launch(_small_linear_kernel, (triton.cdiv(N, block_n),), xr, weight, weight if bias is None else bias, y,
            T, N, H, xr.stride(0), weight.stride(0), y.stride(0),
            BLOCK_N=block_n, BLOCK_H=block_h, HAS_BIAS=bias is not None, DT=_DT[x.dtype], PDL=pdl(x.device),
            **({} if interpreting() else {"num_warps": num_warps}))
    return y.view(*x.shape[:-1], N)


def decode_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, within_rounding: bool, max_tokens: int
) -> torch.Tensor:
    """F.linear, or for a step of at most ``max_tokens`` tokens under ``within_rounding`` ``small_linear``
    (equal within float32 summation order): at decode sizes cuBLAS runs some tall-skinny GEMMs on few programs,
    or splits them over K and adds a reduction launch."""
    if within_rounding and small_linear_fits(x.shape[0], x.shape[-1], max_tokens):
        return small_linear(x, weight, bias)
    return torch.nn.functional.linear(x, weight, bias)


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


def _softmax_topk(logits, top_k, renorm, weights_dtype, forced_mask, forced_ids, group=False, capture=None):
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
            GROUP=group, CAPTURE=capture is not None, PDL=pdl(logits.device),
            # One warp: a token's ~3K + 3 reductions over its E logits run one after another, and across 4 warps
            # each one goes through shared memory and barriers (sm_90 PTX, E=128, K=8: 74 bar.sync with 4 warps, none
            # with 1; `loadtest/kernel_ptx_stats.py`). The ids are the same either way (chosen with max/min); the
            # weights' float32 sums may round differently (this router is the within-rounding one).
            num_warps=1,
        )
    return ids, weights, grouped


def qk_norm_rope(
    q: torch.Tensor,  # [T, Hq*D] (or [T, Hq, D])
    k: torch.Tensor,  # [T, Hk*D]
    cos: torch.Tensor,  # [T, D] model dtype
    sin: torch.Tensor,  # [T, D]
    head_dim: int,
    norm: str = "none",  # "none", "full" (one norm over all heads) or "head" (per head)
    q_var: torch.Tensor | None = None,  # [T, 1] or [T, Hq, 1] float32: torch's mean of the squares
    k_var: torch.Tensor | None = None,
    q_weight: torch.Tensor | None = None,
    k_weight: torch.Tensor | None = None,
    eps: float = 0.0,
    kv_cache: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    heads_per_program: int | None = None,  # default by T (QK_HEADS_BLOCKS); a full-width norm: all heads
) -> tuple[torch.Tensor, torch.Tensor]:  # [T, Hq, D], [T, Hk, D]
    """Optional q/k RMSNorm tails, then half-style rotary, for q and k in one launch. Without ``q_var`` /
    ``k_var`` a norm sums its mean of squares in the kernel (equal within float32 summation order).
    ``kv_cache`` = (v [T, Hk*D] (or [T, Hk, D]), cache_k, cache_v [num_blocks, block_size, Hk, D], slot_mapping
    [T] long): the same launch also writes the rotated k and v into the cache at each token's slot, exactly what
    ``store_kv(k_out, v, ...)`` writes."""
    T, D = q.shape[0], head_dim
    qr, kr = q.reshape(T, -1), k.reshape(T, -1)
    if qr.stride(-1) != 1:
        qr = qr.contiguous()
    if kr.stride(-1) != 1:
        kr = kr.contiguous()
    Hq, Hk = qr.shape[1] // D, kr.shape[1] // D
    q_out = torch.empty(T, Hq, D, dtype=q.dtype, device=q.device)
    k_out = torch.empty(T, Hk, D, dtype=k.dtype, device=k.device)
    if kv_cache is not None:
        v, cache_k, cache_v, slots = kv_cache
        vr = v.reshape(T, -1)
        if vr.stride(-1) != 1:
            vr = vr.contiguous()
        assert vr.shape[1] == Hk * D and cache_k.shape[2:] == cache_v.shape[2:] == (Hk, D), "k/v/cache shapes"
        kv_args = (vr, vr.stride(0), cache_k, cache_v, slots,
                   cache_k.stride(1), cache_k.stride(2), cache_v.stride(1), cache_v.stride(2))
    else:
        kv_args = (kr, 0, kr, kr, kr, 0, 0, 0, 0)  # unused (STORE_KV off)
    if T:
        has_norm = norm != "none"
        var_here = has_norm and q_var is None
        if norm == "full":  # one norm over all heads: q's (k's) in one program
            block_h = _pow2(max(Hq, Hk))
        else:
            heads_per_program = heads_per_program or next(h for fewest, h in QK_HEADS_BLOCKS if T >= fewest)
            block_h = min(_pow2(heads_per_program), _pow2(max(Hq, Hk)))
        _launch(
            _qk_norm_rope_kernel, (T, triton.cdiv(Hq, block_h) + triton.cdiv(Hk, block_h)),
            qr, q_var.contiguous() if has_norm and not var_here else qr, q_weight if has_norm else qr, q_out,
            qr.stride(0), Hq,
            kr, k_var.contiguous() if has_norm and not var_here else kr, k_weight if has_norm else kr, k_out,
            kr.stride(0), Hk,
            cos.contiguous(), sin.contiguous(), eps, *kv_args,
            HEAD_NORM=norm == "head", HAS_NORM=has_norm, D=D,
            BLOCK_H=block_h, BLOCK_D=_pow2(D), DT=_DT[q.dtype], VAR_HERE=var_here,
            STORE_KV=kv_cache is not None, PDL=pdl(q.device),
        )
    return q_out, k_out


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
            block: int | None = None) -> torch.Tensor:
    """y [T*K, H] expert outputs in grouped order, ids/pos/weights [T, K] -> [T, H] in ``dtype``: each
    weighted output rounded to ``dtype``, then summed in ascending expert order, rounding after each add.
    Each program sums ``block`` columns of one token (default: by the step's size, COMBINE_BLOCKS; the split of
    the columns changes no result)."""
    T, K = ids.shape
    N = y.shape[1]
    out = torch.empty(T, N, dtype=dtype, device=y.device)
    if T:
        block = block or next(columns for fewest, columns in COMBINE_BLOCKS if T >= fewest)
        block = min(_pow2(N), _pow2(block))
        _launch(
            _combine_kernel, (T, triton.cdiv(N, block)),
            y.contiguous(), ids.contiguous(), pos.contiguous(), weights.contiguous(), out, N,
            K=K, BLOCK_K=_pow2(K), BLOCK=block, DT=_DT[dtype], PDL=pdl(y.device),
        )
    return out


def combine_rms_norm(
    y: torch.Tensor, ids: torch.Tensor, pos: torch.Tensor, weights: torch.Tensor,
    x: torch.Tensor, weight: torch.Tensor, eps: float, fp32_weight: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(s, RMSNorm(s)) with s = x + combine(y, ids, pos, weights, x.dtype), in one launch: ``combine`` then
    ``rms_norm(x, ..., delta=)`` (the same arithmetic and the same sum of squares: the bits of the two launches),
    without writing the MoE output to memory. x [T, H] residual stream; y, ids, pos, weights as ``combine``."""
    T, K = ids.shape
    xr = _rows(x)
    N = xr.shape[1]
    s = torch.empty_like(xr)
    out = torch.empty_like(xr)
    if T:
        _launch(
            _combine_rms_norm_kernel, (T,),
            y.contiguous(), ids.contiguous(), pos.contiguous(), weights.contiguous(), xr, s, weight, out, N,
            xr.stride(0), s.stride(0), eps,
            K=K, BLOCK_K=_pow2(K), BLOCK=_pow2(N), DT=_DT[x.dtype], FP32_WEIGHT=fp32_weight, PDL=pdl(x.device),
        )
    return s.view(x.shape), out.view(x.shape)


def store_kv(
    k: torch.Tensor,  # [T, H, Dk]
    v: torch.Tensor,  # [T, H, Dv]
    cache_k: torch.Tensor,  # [num_blocks, block_size, H, Dk]
    cache_v: torch.Tensor,  # [num_blocks, block_size, H, Dv]
    slot_mapping: torch.Tensor,  # [T] long: flat slot (block * block_size + offset) of each token
) -> None:
    T, H, DK = k.shape
    DV = v.shape[-1]
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    if T:
        _launch(
            _store_kv_kernel, (T,), k, v, cache_k, cache_v, slot_mapping,
            k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            cache_k.stride(1), cache_k.stride(2), cache_v.stride(1), cache_v.stride(2),
            H, DK=DK, DV=DV, BLOCK_H=_pow2(H), BLOCK_DK=_pow2(DK), BLOCK_DV=_pow2(DV),
        )
