"""A dense projection served in W8A8 block FP8: e4m3 ``weight`` [N, K] and float32 ``weight_scale_inv`` [ceil(N /
bm), ceil(K / bn)] as the checkpoint stores them (or as ``--quantization fp8`` quantised them at load).

On the fused path (GPUs with FP8 tensor cores) it runs ``kernels/fp8_linear.linear_fp8``; elsewhere the op-by-op
reference ``fp8.w8a8_linear_reference`` (the same activation quantisation, dequantised operands, float32 matmul).
The parameters keep the checkpoint's names, so a weight update by name writes them in place.
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from .. import fp8


class Fp8Linear(nn.Module):
    supports_fused = True  # MoEForCausalLM.use_fused_kernels switches ``fused`` on where Triton runs

    def __init__(self, in_features: int, out_features: int, bias: bool, block: tuple[int, int],
                 dtype: torch.dtype = torch.bfloat16, device: torch.device | str | None = None):
        super().__init__()
        self.in_features, self.out_features, self.block = in_features, out_features, tuple(block)
        bm, bn = self.block
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=fp8.FP8_DTYPE, device=device),
                                   requires_grad=False)
        self.weight_scale_inv = nn.Parameter(
            torch.empty(-(-out_features // bm), -(-in_features // bn), dtype=torch.float32, device=device),
            requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype, device=device),
                                 requires_grad=False) if bias else None
        self.fused = False

    def forward(self, x: Tensor) -> Tensor:  # [..., K] -> [..., N] in x's dtype
        return self.w8a8(x, self.weight, self.weight_scale_inv, self.bias)

    def w8a8(self, x: Tensor, weight: Tensor, scale_inv: Tensor, bias: Tensor | None) -> Tensor:
        """x [..., K] through e4m3 ``weight`` [N, K] (this module's, or q/k/v's joined: Attention.fuse_qkv)."""
        if self.fused and x.is_cuda:
            from ..kernels.fp8_linear import linear_fp8

            return linear_fp8(x, weight, scale_inv, bias, self.block)
        lead = x.shape[:-1]
        out = fp8.w8a8_linear_reference(x.reshape(-1, x.shape[-1]), weight, scale_inv, self.block, bias)
        return out.reshape(*lead, weight.shape[0])

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8 block={self.block}"
