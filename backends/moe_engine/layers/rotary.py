"""Rotary position embedding: every value derived from ``RopeSpec`` and every rotation, as Hugging Face
transformers 5.24 computes them.

config.py stores what config.json says (type, theta, factor, rotary dims, style, the raw yarn parameters);
this module derives the rest where the model is built:

- ``yarn_correction_range``   the rotary dims that are interpolated (HF ``find_correction_range``);
- ``attention_factor``        the factor cos/sin are multiplied by (HF ``attention_scaling``; mscale for yarn);
- ``deepseek_softmax_scale``  DeepSeek's softmax scale, ``head_dim ** -0.5`` times ``mscale(factor,
                              mscale_all_dim) ** 2`` for scaled rope (HF ``DeepseekV2/V3Attention``);
- ``inv_freq``                [R/2] float32 for default / linear / yarn, computed on the CPU;
- ``RotaryEmbedding``         the cos/sin tables of a step's positions;
- ``apply_rotary``            q/k rotation in the three styles (half, interleave, complex).

R = rotary dims per head (``RopeSpec.dim``). The parameter math is plain Python floats in HF's operation order,
so the values are bit-identical to HF's.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from ..config import RopeSpec
from . import invariant as inv


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def attention_factor(spec: RopeSpec) -> float:
    """cos/sin multiplier: 1 except for yarn (HF ``_compute_yarn_parameters``: attention_factor as given, else
    mscale(factor, mscale) / mscale(factor, mscale_all_dim) when both are set, else mscale(factor))."""
    if spec.type != "yarn":
        return 1.0
    if spec.attention_factor is not None:
        return float(spec.attention_factor)
    if spec.mscale and spec.mscale_all_dim:
        return float(yarn_get_mscale(spec.factor, spec.mscale) / yarn_get_mscale(spec.factor, spec.mscale_all_dim))
    return float(yarn_get_mscale(spec.factor))


def yarn_correction_range(spec: RopeSpec) -> tuple[float, float]:
    """(low, high) rotary dims of yarn's interpolation ramp (HF ``find_correction_range``; floored / ceiled when
    ``truncate``), clamped to [0, dim - 1]."""
    dim, base, original_max = spec.dim, spec.theta, spec.original_max_position_embeddings

    def correction_dim(num_rotations):
        return (dim * math.log(original_max / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(spec.beta_fast), correction_dim(spec.beta_slow)
    if spec.truncate:
        low, high = math.floor(low), math.ceil(high)
    return float(max(low, 0)), float(min(high, dim - 1))


def deepseek_softmax_scale(spec: RopeSpec, head_dim: int) -> float:
    """DeepSeek-V2/V3's attention softmax scale (HF ``yarn_apply_mscale``): ``head_dim ** -0.5``, times
    mscale(factor, mscale_all_dim) squared when the rope is scaled and mscale_all_dim is set."""
    scale = head_dim ** (-0.5)
    if spec.type != "default" and spec.mscale_all_dim:
        mscale = yarn_get_mscale(spec.factor, spec.mscale_all_dim)
        scale = scale * mscale * mscale
    return scale


def inv_freq(spec: RopeSpec) -> Tensor:
    """[R/2] float32 on the CPU, as HF computes it at init (default / linear / yarn)."""
    dim, base = spec.dim, spec.theta
    if spec.type == "yarn":
        pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
        inv_freq_extrapolation = 1.0 / pos_freqs
        inv_freq_interpolation = 1.0 / (spec.factor * pos_freqs)
        low, high = yarn_correction_range(spec)
        if low == high:
            high += 0.001  # HF: prevent singularity
        ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
        extrapolation_factor = 1 - ramp.to(dtype=torch.float)
        return inv_freq_interpolation * (1 - extrapolation_factor) + inv_freq_extrapolation * extrapolation_factor
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    return freqs / spec.factor  # "linear" scaling; factor 1 for "default"


class RotaryEmbedding(nn.Module):
    """RoPE tables per step, as HF computes them: ``inv_freq``, tables multiplied by the attention factor in
    float32.

    forward -> (cos, sin) [T, R] in the model dtype (style "half" / "interleave"), or
    (freqs_cis [T, R/2] complex64, None) for "complex" (DeepSeek-V2)."""

    batch_invariant = False  # deterministic inference: cos / sin through layers/invariant.py's elementwise

    def __init__(self, spec: RopeSpec):
        super().__init__()
        self.spec = spec
        self.style = spec.style
        self.attention_factor = attention_factor(spec)
        self.register_buffer("inv_freq", self.compute_inv_freq(), persistent=False)  # [R/2] float32

    def compute_inv_freq(self, device: torch.device | str | None = None) -> Tensor:
        """[R/2] float32, computed on the CPU (as HF does at init) and then moved: a GPU ``pow`` can differ from
        the CPU's by an ulp, and the tables must not depend on the device."""
        freqs = inv_freq(self.spec)
        return freqs.to(device) if device is not None else freqs

    def forward(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor | None]:
        freqs = positions[:, None].float() * self.inv_freq[None, :]  # [T, R/2]
        if self.batch_invariant:
            if self.style == "complex":  # polar(1, freqs) = cos + i sin
                return torch.complex(inv.cos(freqs), inv.sin(freqs)) * self.attention_factor, None
            emb = torch.cat((freqs, freqs), dim=-1)
            return (inv.cos(emb) * self.attention_factor).to(dtype), (inv.sin(emb) * self.attention_factor).to(dtype)
        if self.style == "complex":
            return torch.polar(torch.ones_like(freqs), freqs) * self.attention_factor, None
        emb = torch.cat((freqs, freqs), dim=-1)  # [T, R]
        return (emb.cos() * self.attention_factor).to(dtype), (emb.sin() * self.attention_factor).to(dtype)


def rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor | None, style: str = "half", invariant: bool = False) -> Tensor:
    """x [T, heads, D]; (cos, sin) [T, R] or (freqs_cis [T, R/2] complex, None) for the "complex" style. R < D
    (partial rotary, GLM-4.5 / Qwen3-Next, half style): the first R dims rotate, the rest pass through, as HF's
    ``apply_rotary_pos_emb`` (rotate ``x[..., :R]``, then concatenate ``x[..., R:]``). ``invariant``: the complex
    product computed alike for every element (layers/invariant.py)."""
    if style != "complex" and cos.shape[-1] < x.shape[-1]:
        R = cos.shape[-1]
        return torch.cat([apply_rotary(x[..., :R], cos, sin, style, invariant), x[..., R:]], dim=-1)
    if style == "complex":  # DeepSeek-V2: consecutive pairs as complex numbers, rotated in float32
        xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
        rotated = inv.mul(xc, cos[:, None]) if invariant else xc * cos[:, None]
        return torch.view_as_real(rotated).flatten(-2).type_as(x)
    if style == "interleave":  # DeepSeek-V3 rope_interleave: even/odd pairs in, de-interleaved halves out
        half = cos.shape[-1] // 2
        cos, sin = cos[:, None, :half], sin[:, None, :half]
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    cos, sin = cos[:, None], sin[:, None]  # [T, 1, R]
    return (x * cos) + (rotate_half(x) * sin)
