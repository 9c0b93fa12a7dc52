"""The FP8 KV cache's format (``--kv-cache-dtype fp8``, vLLM's flag): how a key or value is stored and read back, in
torch (the reference path, tests) and as Triton helpers (the store and the paged attention kernels).

As vLLM's ``fp8`` / ``fp8_e4m3`` KV cache: one float8_e4m3fn byte per element and one float32 scale per layer for
the keys (``k_scale``) and one for the values (``v_scale``), the checkpoint's calibrated ones or 1.0.

- store: ``e4m3(clamp(float32(x) / scale, -448, 448))``, rounded to nearest even (vLLM's ``scaled_convert``);
- read: ``model_dtype(float32(cache) * scale)``, one rounding: every path (the kernels, the gather + SDPA
  reference, the dense prefill) attends over exactly these values.

The scales are float32 tensors of one element that the kernels load (not constants baked into a compiled kernel):
CUDA graphs capture their addresses, and a new scale is a ``copy_`` into them.
"""
from __future__ import annotations

import torch

from .support import interpreting, triton

FP8_KV_DTYPE = torch.float8_e4m3fn
FP8_KV_MAX = float(torch.finfo(FP8_KV_DTYPE).max)  # 448


def storage_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The cache tensors' dtype for a resolved ``kv_cache_dtype`` ("auto" or "fp8_e4m3", engine_config.py)."""
    return FP8_KV_DTYPE if kv_cache_dtype == "fp8_e4m3" else model_dtype


def quantize(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Keys or values as the FP8 cache stores them (``scale``: float32, one element)."""
    return (x.float() / scale).clamp(-FP8_KV_MAX, FP8_KV_MAX).to(FP8_KV_DTYPE)


def dequantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """FP8 cache contents as attention reads them: float32 times the scale, one cast to ``dtype``."""
    return (x.float() * scale).to(dtype)


def round_trip(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x`` as it reads back from the FP8 cache (the dense prefill attends a prompt's own k/v through this, so it
    sees the values a later step reads from the cache)."""
    return dequantize(quantize(x, scale), scale, x.dtype)


if triton is not None:
    import triton.language as tl

    from .support import _round

    # The interpreter's float32 -> fp8 cast truncates and drops the mantissa's carry (127.03 -> 64): there the
    # value is rounded to an e4m3 one by hand first, which it then converts exactly. Read when a kernel compiles.
    _FP8_CAST = tl.constexpr(not interpreting())

    @triton.jit
    def to_fp8(x, scale):
        """x (any float dtype) / scale, saturated to +-448, as float8e4nv rounded to nearest even."""
        y = tl.math.div_rn(x.to(tl.float32), scale)  # IEEE division, as torch's (``/`` compiles to an approximation)
        y = tl.minimum(tl.maximum(y, -448.0), 448.0)
        if not _FP8_CAST:  # RNE to e4m3's spacing 2^(e-3) (subnormals: 2^-9) by adding and removing 1.5 * 2^23 ulps
            a = tl.abs(y)
            e = tl.floor(tl.log2(tl.maximum(a, 0.015625)))
            magic = tl.exp2(e - 3.0) * 12582912.0
            r = (a + magic) - magic
            y = tl.where(y < 0, -r, r)
        return y.to(tl.float8e4nv)

    @triton.jit
    def from_fp8(x, scale, DT: tl.constexpr, dtype: tl.constexpr):
        """An FP8 cache tile as the model dtype ``dtype`` (DT: its support._DT code): float32 * scale, rounded once."""
        y = x.to(tl.float32) * scale
        if not _FP8_CAST:  # the interpreter's float32 -> bfloat16 cast truncates too
            y = _round(y, DT)
        return y.to(dtype)
