"""Per-token, per-128-channel FP8 (e4m3) quantisation of activations, computed on the fly before a W8A8 GEMM
(DeepSeek's ``act_quant``, vLLM's ``per_token_group_quant_fp8``).

    quantize_activations(x [T, K]) -> (q float8_e4m3fn [T, K], scales float32 [T, ceil(K / 128)])

One program per (token, group): max |x| of the group in float32, scale = max(amax, 1e-10) / 448, q = x / scale
clamped to +-448 and rounded to nearest even. Equal to ``moe_engine.fp8.quantize_activations`` bit for bit: the
divisions are IEEE (``div_rn``), as the reference's (``fp8._over_fp8_max``: a tensor divisor, since torch on CUDA
divides by a Python scalar as a product with its reciprocal), and the e4m3 conversion is the FP8 KV cache's
(``kv_fp8.to_fp8``): the GPU's ``cvt.rn.satfinite.e4m3x2``, or under Triton's interpreter, whose own cast is wrong at
binade edges, a rounding to the e4m3 grid first; so the kernel is tested on CPU too.
"""
from __future__ import annotations

import torch

from .. import fp8 as fp8_ref
from .support import _launch, interpreting, triton

if triton is not None:
    import triton.language as tl

    from . import kv_fp8

    @triton.jit
    def _quant_kernel(x_ptr, q_ptr, s_ptr, K, G, s_x, s_q, GROUP: tl.constexpr, FP8_MAX: tl.constexpr,
                      EPS: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        g = tl.program_id(1)
        cols = g * GROUP + tl.arange(0, GROUP)
        mask = cols < K
        x = tl.load(x_ptr + t * s_x + cols, mask=mask, other=0.0).to(tl.float32)
        scale = tl.math.div_rn(tl.maximum(tl.max(tl.abs(x), 0), EPS), FP8_MAX)
        tl.store(q_ptr + t * s_q + cols, kv_fp8.to_fp8(x, scale), mask=mask)  # the e4m3 conversion of the FP8 cache
        tl.store(s_ptr + t * G + g, scale)


def quantize_activations(x: torch.Tensor, group: int = fp8_ref.ACT_GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] (model dtype) -> (q e4m3 [T, K], scales float32 [T, ceil(K / group)]); the Triton kernel on GPUs."""
    if triton is None or (x.device.type != "cuda" and not interpreting()):
        return fp8_ref.quantize_activations(x, group)
    if x.stride(-1) != 1:
        x = x.contiguous()
    T, K = x.shape
    G = triton.cdiv(K, group)
    q = torch.empty(T, K, dtype=fp8_ref.FP8_DTYPE, device=x.device)
    s = torch.empty(T, G, dtype=torch.float32, device=x.device)
    if T:
        _launch(_quant_kernel, (T, G), x, q, s, K, G, x.stride(0), q.stride(0), GROUP=group,
                FP8_MAX=fp8_ref.FP8_MAX, EPS=fp8_ref._EPS, num_warps=1 if group <= 128 else 4)
    return q, s
