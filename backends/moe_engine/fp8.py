"""FP8 (e4m3) block scaling in torch: the published checkpoint layout, dequantisation, quantisation of weights and
activations, and the op-by-op W8A8 reference every FP8 kernel is tested against.

The layout (DeepSeek-V3/R1, Kimi-K2, Qwen3-*-FP8, GLM-*-FP8; transformers' ``FineGrainedFP8Config``, vLLM's
``Fp8LinearMethod`` with ``weight_block_size``):

- ``X.weight``            float8_e4m3fn [..., R, C]  (R = output features, C = input features)
- ``X.weight_scale_inv``  float32 [..., ceil(R / bm), ceil(C / bn)]  for ``weight_block_size`` [bm, bn] (128, 128)
- value = float32(weight) * weight_scale_inv[r // bm, c // bn], cast once to the model dtype (as transformers'
  ``Fp8Dequantize`` and vLLM's ``block_dequant``): the last block of a dim that is not a multiple of the block size
  is partial (DeepSeek-V3's kv_a_proj_with_mqa has 576 rows: 5 scale rows).
- fused 3-D experts (transformers v5's own save) keep one scale grid per expert: ``gate_up_proj_scale_inv``
  [E, SR, SC]; a grid whose rows do not match ceil(R / bm) (transformers keeps two scale rows for a gate_up
  projection narrower than a block, one per half) is read as R / SR rows per scale.
- ``weight_block_size`` null: one scale per tensor (``weight_scale_inv`` of one element).

Activations (W8A8): per token and per group of 128 input channels, scale = max|x| / 448 computed on the fly
(DeepSeek's ``act_quant``, vLLM's ``per_token_group_quant_fp8``). Products of e4m3 values are exact in float32, so
a kernel that accumulates in float32 and applies both scales per K block equals the reference below within
float32 summation order.
"""
from __future__ import annotations

import torch
from torch import Tensor

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
ACT_GROUP = 128  # input channels per activation scale
_EPS = 1e-10  # vLLM's per_token_group_quant_fp8: an all-zero group gets a tiny scale, not a division by zero


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def all_finite(t: Tensor) -> bool:
    """No NaN / infinity in ``t``; for e4m3 (no infinities, torch has no isfinite for it) no NaN code (S.1111.111)."""
    if t.dtype == FP8_DTYPE:
        return not bool(((t.view(torch.uint8) & 0x7F) == 0x7F).any())
    return bool(t.isfinite().all())


def block_rows_cols(shape, scale_shape, block: tuple[int, int] | None) -> tuple[int, int]:
    """Rows and columns each scale covers, for a weight [..., R, C] with a scale grid [..., SR, SC]. ``block``: the
    config's ``weight_block_size`` (None: per tensor). Raises ValueError when the grid fits neither."""
    R, C = int(shape[-2]), int(shape[-1])
    if len(scale_shape) < 2 or int(torch.Size(scale_shape).numel()) == 1:
        return R, C  # one scale for the tensor (per-tensor FP8, or a tensor within one block)
    SR, SC = int(scale_shape[-2]), int(scale_shape[-1])
    out = []
    for n, s, b in ((R, SR, block[0] if block else None), (C, SC, block[1] if block else None)):
        if b is not None and _cdiv(n, b) == s:
            out.append(b)
        elif s > 0 and n % s == 0:
            out.append(n // s)  # transformers' own fused save: the grid gives the block
        else:
            raise ValueError(f"weight [{R}, {C}] does not fit scale grid [{SR}, {SC}] with block size {block}")
    return out[0], out[1]


def expand_scales(scale_inv: Tensor, shape, bm: int, bn: int) -> Tensor:
    """Scale grid [..., SR, SC] -> one float32 scale per weight element [..., R, C]."""
    R, C = int(shape[-2]), int(shape[-1])
    s = scale_inv.float()
    if s.numel() == 1:
        return s.reshape([1] * len(shape)).expand(*shape)
    s = s.repeat_interleave(bm, dim=-2)[..., :R, :]
    return s.repeat_interleave(bn, dim=-1)[..., :C]


def dequantize_fp8(weight: Tensor, scale_inv: Tensor, block: tuple[int, int] | None,
                   dtype: torch.dtype = torch.float32) -> Tensor:
    """float8_e4m3fn weight [..., R, C] and its scales -> ``dtype`` [..., R, C]: float32 product, one cast."""
    bm, bn = block_rows_cols(weight.shape, scale_inv.shape, block)
    return (weight.float() * expand_scales(scale_inv, weight.shape, bm, bn)).to(dtype)


def _over_fp8_max(amax: Tensor) -> Tensor:
    """amax / 448 correctly rounded on every device: torch on CUDA divides by a Python scalar as amax * (1 / 448),
    which differs from the quotient by an ulp for about half of all float32 values; a tensor divisor is divided."""
    return amax / torch.full_like(amax, FP8_MAX)


def quantize_fp8_blocks(w: Tensor, block: tuple[int, int] = (128, 128)) -> tuple[Tensor, Tensor]:
    """w [..., R, C] -> (float8_e4m3fn [..., R, C], float32 weight_scale_inv [..., ceil(R/bm), ceil(C/bn)]), one
    scale per block = max|w| / 448 (DeepSeek's ``weight_quant``); a partial last block is scaled by its own max. A
    block of zeros gets scale 1. Used by the tests to write checkpoints and by online quantisation."""
    bm, bn = block
    *lead, R, C = w.shape
    SR, SC = _cdiv(R, bm), _cdiv(C, bn)
    padded = torch.zeros(*lead, SR * bm, SC * bn, dtype=torch.float32, device=w.device)
    padded[..., :R, :C] = w.float()
    tiles = padded.reshape(*lead, SR, bm, SC, bn)
    amax = tiles.abs().amax(dim=(-3, -1))  # [..., SR, SC]
    scale_inv = torch.where(amax > 0, _over_fp8_max(amax), torch.ones_like(amax))
    q = (tiles / scale_inv[..., :, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.reshape(*lead, SR * bm, SC * bn)[..., :R, :C].contiguous(), scale_inv


def quantize_activations(x: Tensor, group: int = ACT_GROUP) -> tuple[Tensor, Tensor]:
    """x [T, K] -> (float8_e4m3fn [T, K], float32 scales [T, ceil(K / group)]): per token and per ``group``
    channels, scale = max(max|x|, eps) / 448, q = clamp(x / scale) (vLLM's ``per_token_group_quant_fp8``)."""
    T, K = x.shape
    G = _cdiv(K, group)
    padded = torch.zeros(T, G * group, dtype=torch.float32, device=x.device)
    padded[:, :K] = x.float()
    groups = padded.view(T, G, group)
    scale = _over_fp8_max(groups.abs().amax(-1).clamp(min=_EPS))  # [T, G]: as the kernel's div_rn
    q = (groups / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(T, G * group)[:, :K].contiguous(), scale


def w8a8_linear_reference(x: Tensor, weight: Tensor, scale_inv: Tensor, block: tuple[int, int] = (128, 128),
                          bias: Tensor | None = None) -> Tensor:
    """The op-by-op W8A8 block-FP8 linear: x [T, K] quantised per token and 128-channel group, both operands
    dequantised to float32, matmul in float32, bias added, cast to x's dtype -> [T, N]. ``weight`` [N, K] e4m3."""
    xq, xs = quantize_activations(x, block[1])
    a = xq.float() * xs.repeat_interleave(block[1], dim=1)[:, : x.shape[1]]
    out = a @ dequantize_fp8(weight, scale_inv, block).t()
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


def w8a8_expert_mlp_reference(x: Tensor, gate_up_q: Tensor, gate_up_s: Tensor, down_q: Tensor, down_s: Tensor,
                              tok: Tensor, offs: Tensor, block: tuple[int, int] = (128, 128)) -> Tensor:
    """The op-by-op W8A8 routed experts on expert-grouped rows (kernels/fp8_moe.py's reference): per expert e with
    rows r, g|u = w8a8_linear(x[tok[r]], gate_up[e]) in the model dtype, h = silu(g) * u as torch rounds it,
    y = w8a8_linear(h, down[e]) -> [P, H]."""
    import torch.nn.functional as F

    P, H = tok.shape[0], x.shape[1]
    y = torch.zeros(P, H, dtype=x.dtype, device=x.device)
    start = 0
    for e, end in enumerate(offs.tolist()):
        if end > start:
            gate, up = w8a8_linear_reference(x[tok[start:end]], gate_up_q[e], gate_up_s[e], block).chunk(2, dim=-1)
            y[start:end] = w8a8_linear_reference(F.silu(gate) * up, down_q[e], down_s[e], block)
        start = end
    return y
