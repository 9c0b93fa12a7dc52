"""GPT-OSS's expert GEMMs reading MXFP4 experts (moe_engine/kernels/fused_moe_gpt_oss.py's ``MXFP4`` weight load):
the packed bytes and e8m0 scales decoded in registers must give exactly ``dequantize_mxfp4``'s weights, so with the
same tiles the packed kernel is bit-identical to the bf16 kernel run on the dequantised experts, and within the
bf16 kernel's GEMM-rounding bound of the op-by-op torch computation. Shapes: H and I multiples of 32 (the MXFP4
groups) but not of the 64-wide K tiles, a few experts, 1..40 tokens, biases on.

Runs under Triton's interpreter on CPU (tests/conftest.py); ``MOE_TEST_DEVICE=cuda`` runs the compiled kernels.
"""
from __future__ import annotations

import os

import pytest
import torch

from moe_engine.checkpoint import dequantize_mxfp4
from moe_engine.kernels import fused_moe_gpt_oss
from moe_engine.kernels import moe_routing as routing_kernels
from moe_engine.kernels import support as kernel_support
from moe_engine.kernels.fused_moe import TileConfig

from .test_fused_moe_gpt_oss import ALPHA, assert_like_torch, random_ids, torch_experts, y_bound

DEVICE = os.environ.get("MOE_TEST_DEVICE", "cpu")
H, I = 96, 96  # K = 96 for both GEMMs: one whole 64-wide K step, then a 32-wide tail
TILES = (TileConfig(16, 32, 64, GROUP_M=4), TileConfig(16, 32, 64))

pytestmark = pytest.mark.skipif(not kernel_support.available(DEVICE), reason="Triton not available for this device")


def random_mxfp4(E: int, rows: int, cols: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Hub-layout MXFP4 of an [E, cols, rows] weight: bytes [E, rows, cols/32, 16] (every e2m1 code, +-0 included)
    and scales [E, rows, cols/32] of 2^-10 .. 2^-5 (weights of |w| <= 0.2, as a trained model's), with 2^-127
    (s = 0) and 2^0 present too."""
    blocks = torch.randint(0, 256, (E, rows, cols // 32, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(117, 123, (E, rows, cols // 32), generator=g, dtype=torch.uint8)
    scales[0, 0, 0], scales[-1, -1, -1] = 0, 127
    return blocks.to(DEVICE), scales.to(DEVICE)


def packed_experts(E: int, dtype: torch.dtype, seed: int = 0):
    """(gate_up bytes, gate_up scales, gate_up_bias, down bytes, down scales, down_bias) as a gpt-oss checkpoint
    holds them, biases in the model dtype."""
    g = torch.Generator().manual_seed(seed)
    gu_b, gu_s = random_mxfp4(E, 2 * I, H, g)
    d_b, d_s = random_mxfp4(E, H, I, g)
    gu_bias = (torch.randn(E, 2 * I, generator=g) * 0.3).to(DEVICE, dtype)
    d_bias = (torch.randn(E, H, generator=g) * 0.3).to(DEVICE, dtype)
    return gu_b, gu_s, gu_bias, d_b, d_s, d_bias


def dequantised(p, dtype):
    """The same experts in HF GptOssExperts' layout: gate_up [E, H, 2I], bias, down [E, I, H], bias."""
    gu_b, gu_s, gu_bias, d_b, d_s, d_bias = p
    return dequantize_mxfp4(gu_b, gu_s, dtype), gu_bias, dequantize_mxfp4(d_b, d_s, dtype), d_bias


@pytest.mark.parametrize("T,K,E,limit", [(1, 1, 4, 7.0), (1, 4, 8, 7.0), (7, 2, 4, 0.5), (23, 4, 8, 7.0),
                                         (40, 2, 4, 7.0)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_packed_gemms_equal_the_bf16_gemms_on_dequantised_experts(T, K, E, limit, dtype):
    """Bit-identical to the bf16 variant on the dequantised weights (same tiles: same products, same summation
    order), and within the GEMM-rounding bound of the op-by-op torch computation."""
    p = packed_experts(E, dtype, seed=T + E)
    dense = dequantised(p, dtype)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(T)).to(DEVICE, dtype)
    pos, tok, offs = routing_kernels.route(random_ids(T, K, E, seed=T * K), E)
    gu_b, gu_s, gu_bias, d_b, d_s, d_bias = p
    y = fused_moe_gpt_oss.expert_mlp(x, gu_b, gu_bias, d_b, d_bias, pos, tok, offs, limit, ALPHA, TILES,
                                     scales=(gu_s, d_s))
    y_dense = fused_moe_gpt_oss.expert_mlp(x, *dense, pos, tok, offs, limit, ALPHA, TILES)
    assert y.shape == (T * K, H) and y.dtype == dtype and torch.isfinite(y).all()
    assert torch.equal(y, y_dense)
    y_ref, r = torch_experts(x, dense, tok, offs, limit)
    assert_like_torch(y, y_ref, None if dtype == torch.float32 else y_bound(r, dense[2], offs, dtype), dtype)


def test_packed_gemms_with_the_default_tile_table():
    """The tile table's configs (whatever BLOCK_K; MXFP4 takes at least 32) give the bf16 variant's bits."""
    dtype, T, K, E = torch.bfloat16, 33, 4, 8
    p = packed_experts(E, dtype, seed=9)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(1)).to(DEVICE, dtype)
    pos, tok, offs = routing_kernels.route(random_ids(T, K, E, seed=2), E)
    y = fused_moe_gpt_oss.expert_mlp(x, p[0], p[2], p[3], p[5], pos, tok, offs, 7.0, ALPHA, scales=(p[1], p[4]))
    assert torch.equal(y, fused_moe_gpt_oss.expert_mlp(x, *dequantised(p, dtype), pos, tok, offs, 7.0, ALPHA))


def test_bad_packed_inputs_are_refused():
    dtype, E = torch.bfloat16, 4
    gu_b, gu_s, gu_bias, d_b, d_s, d_bias = packed_experts(E, dtype)
    x = torch.zeros(2, H, dtype=dtype, device=DEVICE)
    pos, tok, offs = routing_kernels.route(random_ids(2, 2, E, seed=0), E)
    with pytest.raises(ValueError, match="do not fit"):
        fused_moe_gpt_oss.expert_mlp(x, gu_b, gu_bias, d_b, d_bias, pos, tok, offs, 7.0, ALPHA,
                                     scales=(gu_s[:, :, :-1], d_s))
    with pytest.raises(ValueError, match="uint8"):
        fused_moe_gpt_oss.expert_mlp(x, gu_b, gu_bias, d_b, d_bias, pos, tok, offs, 7.0, ALPHA,
                                     scales=(gu_s.float(), d_s))
