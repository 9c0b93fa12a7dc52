"""``small_linear``: a GEMM of a few tokens against one weight in one launch that loads each program's weight rows at
once (the router's logits, o_proj and q/k/v of decode steps); equal to cuBLAS within float32 summation order.
"""
from __future__ import annotations

import torch

from .norm import _rows
from .support import _DT, _launch, _pow2, interpreting, pdl, triton

# small_linear: a weight slice of at most this many elements per program (64 float32 registers per thread at 4
# warps). Each token is one more pass over the slice, so it pays only for the first few tokens of a step; where it
# beats cuBLAS on the H200 (``loadtest/bench/bench_small_linear.py``, real-shape widths; a GEMM of 48 weights replayed in a
# CUDA graph): the router (128 x 2048) up to 4 tokens (4.9 -> 2.0 us at 1, 3.5 us at 4), o_proj (2048 x 4096)
# at 1 token (9.5 -> 7.7 us: cuBLAS splits it over K and adds a reduction launch). The fused q/k/v (5120 x 2048)
# alone is no faster (8.5 vs 8.3 us at 1 token), but in the forward, under programmatic dependent launch, its
# weight loads start while the norm before it runs: a batch-1 decode step 3.04 -> 2.99 ms
# (``loadtest/bench/ab_real_shape.py -- --cases a``, alternated twice).
_SMALL_LINEAR_TILE = 8192
ROUTER_SMALL_LINEAR_TOKENS = 4
O_PROJ_SMALL_LINEAR_TOKENS = 1
QKV_SMALL_LINEAR_TOKENS = 1


if triton is not None:
    import triton.language as tl

    from .support import _await_inputs, _round

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


def small_linear_fits(T: int, H: int, max_tokens: int) -> bool:
    return 0 < T <= max_tokens and _pow2(H) <= _SMALL_LINEAR_TILE


def small_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
    tile: int = _SMALL_LINEAR_TILE, num_warps: int = 4,  # bench_small_linear.py --sweep tries others
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
