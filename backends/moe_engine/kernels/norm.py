"""Fused RMSNorm kernels (the residual add, squares and the norm's tail; see support.py for the rounding rules):
``add_square`` and ``rms_norm_tail`` bit-identical to the op-by-op norm (torch's mean between them), ``rms_norm``
in one pass, equal within float32 summation order.
"""
from __future__ import annotations

import torch

from .support import _DT, _launch, _pow2, interpreting, pdl, triton

if triton is not None:
    import triton.language as tl

    from .support import _await_inputs, _round

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
        """The tail both norm kernels share: weight * (x * rstd).to(dtype) (GPT-OSS: the product in float32;
        FP32_WEIGHT == 2, Qwen3-Next's offset norm: (1 + weight) * (x * rstd) in float32)."""
        w = tl.load(w_ptr + cols, mask=m, other=0.0).to(tl.float32)
        if FP32_WEIGHT == 2:
            w = 1.0 + w
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
