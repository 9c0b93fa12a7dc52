"""Rotary kernels: q/k norms + rotary of q and k in one launch (``qk_norm_rope``), the step's k and v written into the
paged cache by the same launch or by ``store_kv``. Bit-identical to the op-by-op path given torch's means, equal
within float32 summation order when the kernel sums them.
"""
from __future__ import annotations

import torch

from . import kv_fp8
from .support import _DT, _launch, _pow2, pdl, triton

# Heads per program of ``qk_norm_rope`` (per-head or no norm), by step size, (fewest tokens, heads), first match:
# more, smaller programs finish this latency-bound kernel sooner. On the H200 at the real shape (48 calls per CUDA
# graph, ``loadtest/bench/bench_decode_kernels.py --kernels qk``): all 32 q heads in one program -> 8 heads per
# program 4.39 -> 1.48 us at 1 token, 6.11 -> 2.88 us at 64; at 8,192 tokens 8 heads 56.5 us, 16 heads 60.7, 4 heads
# 92.6.
QK_HEADS_PER_PROGRAM = 8
QK_HEADS_BLOCKS = ((0, QK_HEADS_PER_PROGRAM),)


if triton is not None:
    import triton.language as tl

    from .support import _await_inputs, _round

    @triton.jit
    def _normed_rotated(
        x_ptr, var_ptr, w_ptr, cos_ptr, sin_ptr, row, sx, H, h0, eps,
        HEAD_NORM: tl.constexpr, HAS_NORM: tl.constexpr, D: tl.constexpr,
        BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, DT: tl.constexpr, VAR_HERE: tl.constexpr,
        R: tl.constexpr,
    ):
        """[BLOCK_H, BLOCK_D] of one token, heads h0..h0+BLOCK_H-1 of its H: RMSNorm tail (full width: h0 = 0 and
        every head in the block; or per head), then rotary (half style) of the first R dims of each head (partial
        rotary: the others pass through). VAR_HERE: the mean of squares is summed here instead of read from
        var_ptr (torch's mean)."""
        h = h0 + tl.arange(0, BLOCK_H)[:, None]
        d = tl.arange(0, BLOCK_D)[None, :]
        m = (h < H) & (d < D)
        half: tl.constexpr = R // 2
        partner = tl.where(d < half, d + half, tl.where(d < R, d - half, d))  # rotate_half: [-x2, x1]
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
        cos = tl.load(cos_ptr + row * R + d, mask=d < R, other=0.0).to(tl.float32)
        sin = tl.load(sin_ptr + row * R + d, mask=d < R, other=0.0).to(tl.float32)
        rot = tl.where(d < half, -xp, xp)
        y = _round(_round(x * cos, DT) + _round(rot * sin, DT), DT)
        if R < D:
            y = tl.where(d < R, y, x)
        return y, h, d, m

    @triton.jit
    def _qk_norm_rope_kernel(
        q_ptr, qvar_ptr, qw_ptr, qout_ptr, sq, Hq,
        k_ptr, kvar_ptr, kw_ptr, kout_ptr, sk, Hk,
        cos_ptr, sin_ptr, eps,
        v_ptr, sv, ck_ptr, cv_ptr, slot_ptr, sck, sck_h, scv, scv_h, k_scale_ptr, v_scale_ptr,
        HEAD_NORM: tl.constexpr, HAS_NORM: tl.constexpr, D: tl.constexpr,
        BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, DT: tl.constexpr, VAR_HERE: tl.constexpr,
        STORE_KV: tl.constexpr, PDL: tl.constexpr, R: tl.constexpr, KV_FP8: tl.constexpr,
    ):
        """Token program_id(0), heads block program_id(1): the first cdiv(Hq, BLOCK_H) blocks are q's, the rest
        k's -> normed (optional) and rotated, [BLOCK_H, D] out. A full-width norm (not HEAD_NORM) needs every head
        of q (of k) in one block. STORE_KV: the k programs also write the rotated k and the token's v ([Hk, D] at
        v_ptr + row * sv) into the paged cache at the token's slot, as _store_kv_kernel would (the same values: k
        as the k output holds it, cast to the cache's dtype, or KV_FP8: quantised with the layer's scales as
        kv_fp8.to_fp8), saving that kernel's launch and its reads."""
        _await_inputs(PDL)
        row = tl.program_id(0)
        q_blocks = tl.cdiv(Hq, BLOCK_H)
        blk = tl.program_id(1)
        if blk < q_blocks:
            y, h, d, m = _normed_rotated(q_ptr, qvar_ptr, qw_ptr, cos_ptr, sin_ptr, row, sq, Hq, blk * BLOCK_H, eps,
                                         HEAD_NORM, HAS_NORM, D, BLOCK_H, BLOCK_D, DT, VAR_HERE, R)
            tl.store(qout_ptr + row * Hq * D + h * D + d, y.to(qout_ptr.dtype.element_ty), mask=m)
        else:
            y, h, d, m = _normed_rotated(k_ptr, kvar_ptr, kw_ptr, cos_ptr, sin_ptr, row, sk, Hk,
                                         (blk - q_blocks) * BLOCK_H, eps,
                                         HEAD_NORM, HAS_NORM, D, BLOCK_H, BLOCK_D, DT, VAR_HERE, R)
            k_out = y.to(kout_ptr.dtype.element_ty)
            tl.store(kout_ptr + row * Hk * D + h * D + d, k_out, mask=m)
            if STORE_KV:
                slot = tl.load(slot_ptr + row)
                v = tl.load(v_ptr + row * sv + h * D + d, mask=m)
                if KV_FP8:
                    k_out = kv_fp8.to_fp8(k_out, tl.load(k_scale_ptr))
                    v = kv_fp8.to_fp8(v, tl.load(v_scale_ptr))
                tl.store(ck_ptr + slot * sck + h * sck_h + d, k_out.to(ck_ptr.dtype.element_ty), mask=m)
                tl.store(cv_ptr + slot * scv + h * scv_h + d, v.to(cv_ptr.dtype.element_ty), mask=m)

    @triton.jit
    def _store_kv_kernel(
        k_ptr, v_ptr, ck_ptr, cv_ptr, slot_ptr, k_scale_ptr, v_scale_ptr,
        sk_t, sk_h, sv_t, sv_h,  # source strides (token, head); last dim contiguous
        sck, sck_h, scv, scv_h,  # cache strides (slot, head): [num_blocks * block_size, H, D] views
        H, DK: tl.constexpr, DV: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr,
        KV_FP8: tl.constexpr,
    ):
        t = tl.program_id(0)
        slot = tl.load(slot_ptr + t)
        h = tl.arange(0, BLOCK_H)[:, None]
        dk = tl.arange(0, BLOCK_DK)[None, :]
        mk = (h < H) & (dk < DK)
        k = tl.load(k_ptr + t * sk_t + h * sk_h + dk, mask=mk)
        dv = tl.arange(0, BLOCK_DV)[None, :]
        mv = (h < H) & (dv < DV)
        v = tl.load(v_ptr + t * sv_t + h * sv_h + dv, mask=mv)
        if KV_FP8:  # quantised with the layer's scales (kv_fp8.py)
            k = kv_fp8.to_fp8(k, tl.load(k_scale_ptr))
            v = kv_fp8.to_fp8(v, tl.load(v_scale_ptr))
        tl.store(ck_ptr + slot * sck + h * sck_h + dk, k.to(ck_ptr.dtype.element_ty), mask=mk)
        tl.store(cv_ptr + slot * scv + h * scv_h + dv, v.to(cv_ptr.dtype.element_ty), mask=mv)


def qk_norm_rope(
    q: torch.Tensor,  # [T, Hq*D] (or [T, Hq, D])
    k: torch.Tensor,  # [T, Hk*D]
    cos: torch.Tensor,  # [T, R] model dtype, R <= D rotary dims (partial rotary: the rest pass through)
    sin: torch.Tensor,  # [T, R]
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
    [T] long[, k_scale, v_scale]): the same launch also writes the rotated k and v into the cache at each token's
    slot, exactly what ``store_kv(k_out, v, ...)`` writes (with the scales: into an FP8 cache, kv_fp8.py)."""
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
        v, cache_k, cache_v, slots, *scales = kv_cache
        vr = v.reshape(T, -1)
        if vr.stride(-1) != 1:
            vr = vr.contiguous()
        assert vr.shape[1] == Hk * D and cache_k.shape[2:] == cache_v.shape[2:] == (Hk, D), "k/v/cache shapes"
        kv_args = (vr, vr.stride(0), cache_k, cache_v, slots,
                   cache_k.stride(1), cache_k.stride(2), cache_v.stride(1), cache_v.stride(2), *(scales or (kr, kr)))
    else:
        scales = None
        kv_args = (kr, 0, kr, kr, kr, 0, 0, 0, 0, kr, kr)  # unused (STORE_KV off)
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
            STORE_KV=kv_cache is not None, PDL=pdl(q.device), R=cos.shape[-1], KV_FP8=bool(scales),
        )
    return q_out, k_out


def store_kv(
    k: torch.Tensor,  # [T, H, Dk]
    v: torch.Tensor,  # [T, H, Dv]
    cache_k: torch.Tensor,  # [num_blocks, block_size, H, Dk]
    cache_v: torch.Tensor,  # [num_blocks, block_size, H, Dv]
    slot_mapping: torch.Tensor,  # [T] long: flat slot (block * block_size + offset) of each token
    k_scale: torch.Tensor | None = None,  # float32 [1]: an FP8 cache's scales (kv_fp8.py), else None
    v_scale: torch.Tensor | None = None,
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
            k_scale if k_scale is not None else k, v_scale if v_scale is not None else v,
            k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            cache_k.stride(1), cache_k.stride(2), cache_v.stride(1), cache_v.stride(2),
            H, DK=DK, DV=DV, BLOCK_H=_pow2(H), BLOCK_DK=_pow2(DK), BLOCK_DV=_pow2(DV), KV_FP8=k_scale is not None,
        )
