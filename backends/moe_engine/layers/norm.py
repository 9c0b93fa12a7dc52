"""RMSNorm as Hugging Face transformers computes it (float32 statistics, the weight applied after the cast back;
GPT-OSS: in float32), with the residual add before it and, on the fused path, the MoE combine in its launch."""
from __future__ import annotations

import torch
from torch import Tensor, nn

from ..kernels import moe_routing as routing_kernels
from ..kernels import norm as norm_kernels
from . import invariant as inv
from .experts import ExpertOutputs


class RMSNorm(nn.Module):
    """``offset`` (Qwen3-Next / Qwen3.5, weights initialised to 0): ``(x_normed * (1 + weight)).to(dtype)`` with the
    product in float32; the kernels take it as weight mode 2 (``fp32_weight``: 0 HF's usual tail, 1 GPT-OSS's)."""

    batch_invariant = False  # deterministic inference (MoEForCausalLM.use_batch_invariant)

    def __init__(self, dim: int, eps: float, fp32_weight: bool = False, offset: bool = False):
        super().__init__()
        self.eps = eps
        self.fp32_weight = 2 if offset else fp32_weight
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.fused = False  # kernels/norm.py (set by MoEForCausalLM.use_fused_kernels)
        self.within_rounding = False  # one-pass kernel, equal within float32 summation order (ditto)

    def forward(self, x: Tensor) -> Tensor:
        if self.fused and self.within_rounding:
            return norm_kernels.rms_norm(x, self.weight, self.eps, self.fp32_weight)[1]
        if self.fused and x.is_contiguous() and not self.batch_invariant:
            _, squares, _ = norm_kernels.add_square(x)
            return self._fused_tail(x, squares)
        if self.batch_invariant and not self.fused:
            return self._invariant(x)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.fp32_weight == 2:  # Qwen3-Next: normed * (1 + weight), in float32
            return (x * (1.0 + self.weight.float())).to(dtype)
        if self.fp32_weight:  # GPT-OSS: (weight * normed).to(input dtype), the product in float32
            return (self.weight * x).to(dtype)
        return self.weight * x.to(dtype)  # HF: weight * normed.to(input dtype)

    def add_forward(self, x: Tensor, delta: Tensor | ExpertOutputs | None) -> tuple[Tensor, Tensor]:
        """(x + delta, norm(x + delta)): the residual add before a norm (one kernel with it when fused; with the
        MoE combine too when delta is a MoE layer's ``ExpertOutputs``)."""
        if delta is None:
            return x, self(x)
        if isinstance(delta, ExpertOutputs):
            if self.fused and self.within_rounding:
                return routing_kernels.combine_rms_norm(delta.y, delta.ids, delta.pos, delta.weights, x, self.weight,
                                                self.eps, self.fp32_weight, add=delta.shared)
            delta = delta.combine(x.dtype)
        if self.fused and self.within_rounding:
            return norm_kernels.rms_norm(x, self.weight, self.eps, self.fp32_weight, delta)
        if self.fused and x.is_contiguous() and delta.is_contiguous() and not self.batch_invariant:
            s, squares, _ = norm_kernels.add_square(x, delta)
            return s, self._fused_tail(s, squares)
        s = x + delta
        return s, self(s)

    def _invariant(self, x: Tensor) -> Tensor:
        """The op-by-op norm with the mean of squares summed left to right and rsqrt computed alike for every row
        (layers/invariant.py); the rest is the same single roundings."""
        dtype = x.dtype
        x = x.float()
        var = inv.row_sum(x * x, keepdim=True) / x.shape[-1]
        x = x * inv.rsqrt(var + self.eps)
        if self.fp32_weight:
            return (self.weight * x).to(dtype)
        return self.weight * x.to(dtype)

    def _fused_tail(self, x: Tensor, squares: Tensor) -> Tensor:
        # torch's own mean over the same float32 squares: the summation order of the op-by-op path
        return norm_kernels.rms_norm_tail(x, squares.mean(-1, keepdim=True), self.weight, self.eps, self.fp32_weight)
