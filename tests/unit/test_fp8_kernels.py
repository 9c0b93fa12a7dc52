"""W8A8 block-FP8 kernels (kernels/fp8_linear.py, fp8_moe.py, fp8_quant.py) against their op-by-op references in
moe_engine/fp8.py (quantise activations in torch, dequantise both operands to float32, matmul, round once).

e4m3 x e4m3 products are exact in float32, so a kernel differs from its reference only in where the float32 sums and
scale products round: float32 outputs agree to 1e-5; bf16 outputs are bit-identical but for elements whose float32
values lie next to a rounding boundary (and, in the experts, what such an element of h carries through the down GEMM
after its own quantisation). The GEMMs run under Triton's interpreter on CPU (it multiplies e4m3 exactly); the
activation-quantisation kernel too (its e4m3 conversion rounds to the grid first there, kv_fp8.to_fp8).

On Hopper the 64-row tiles' FP8 dots run on wgmma, which keeps about 14 significant bits while it accumulates
within a K tile (the DeepSeek-V3 report, 3.3.2; Triton leaves ``max_num_imprecise_acc`` unbounded on sm_90); each
K tile of 128 (one scale group) is then added in float32, as DeepGEMM promotes. There a GEMM element may differ from
the float32 reference by a small multiple of 2^-14 of the sum of its products' magnitudes (``FP8_ACC_EPS``; the
magnitudes are the reference GEMM of |x| and |w|), and the experts' h, computed that way, can round to another e4m3
value before the down GEMM: their check on CUDA is the mean relative error.
"""
from __future__ import annotations

import os

import pytest
import torch

from moe_engine import fp8
from moe_engine.kernels import moe_routing as routing_kernels
from moe_engine.kernels import support as kernel_support
from moe_engine.kernels.fp8_linear import linear_fp8
from moe_engine.kernels.fp8_moe import expert_mlp_fp8
from moe_engine.kernels.fp8_quant import quantize_activations
from moe_engine.kernels.fused_moe import TileConfig

DEVICE = os.environ.get("MOE_TEST_DEVICE", "cpu")
pytestmark = pytest.mark.skipif(not kernel_support.available(DEVICE), reason="Triton not available for this device")
# small tiles keep the interpreter quick; the default tables run on GPUs
SMALL = (TileConfig(16, 32, 64, GROUP_M=2), TileConfig(16, 64, 64))
SMALL_LINEAR = TileConfig(16, 32, 64, GROUP_M=2)


def quantized(shape, seed, block=(128, 128), scale=1.0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=g) * scale
    q, s = fp8.quantize_fp8_blocks(w, block)
    return q.to(DEVICE), s.to(DEVICE)


def assert_close_to_reference(out, ref, dtype, min_same=0.97):
    if dtype == torch.float32:  # atol scaled to the outputs: cancellation leaves small sums of large products
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6 * ref.abs().max().item())
        return
    torch.testing.assert_close(out.float(), ref.float(), rtol=2**-7, atol=1e-3)  # one bf16 step at most
    same = (out == ref).float().mean().item()
    assert same >= min_same, f"only {same:.2%} of the elements bit-identical to the reference"


FP8_ACC_EPS = 2.0**-10  # on CUDA: an element's error against its products' magnitudes (module docstring)


def fp8_abs(q: torch.Tensor) -> torch.Tensor:
    """|q| of an e4m3 tensor: its sign bit cleared."""
    return (q.view(torch.uint8) & 0x7F).view(q.dtype)


def assert_within_fp8_accumulation(out, ref, magnitude, dtype):
    """CUDA: |out - ref| <= FP8_ACC_EPS * magnitude, plus one rounding of the output to ``dtype``."""
    err = (out.float() - ref.float()).abs()
    rounding = 2.0**-7 if dtype != torch.float32 else 2.0**-23
    allowed = FP8_ACC_EPS * magnitude.float() + rounding * ref.float().abs() + 1e-30
    worst = (err / allowed).max().item()
    assert worst <= 1, (f"{(err > allowed).sum().item()} of {err.numel()} elements past the FP8 accumulation bound "
                        f"(worst {worst:.2f}x; largest error {err.max().item():.3g})")


# GPUs also run the default tiles of larger steps (the interpreter would take minutes)
GPU_ONLY = [pytest.param(*c, marks=pytest.mark.skipif(DEVICE != "cuda", reason="large: GPU only"))
            for c in [(300, 768, 2048), (2048, 1024, 2048)]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,N,K", [(1, 96, 200), (5, 256, 384), (33, 130, 256), *GPU_ONLY])
def test_linear_fp8_equals_reference(T, N, K, dtype):
    """Partial last blocks in N and K (96, 130; 200), K tails within a tile, one to 33 tokens, with a bias."""
    w_q, w_s = quantized((N, K), seed=N + K)
    g = torch.Generator().manual_seed(T)
    x = torch.randn(T, K, generator=g).to(DEVICE, dtype)
    bias = torch.randn(N, generator=g).to(DEVICE, dtype)
    for b in (None, bias):
        ref = fp8.w8a8_linear_reference(x, w_q, w_s, bias=b)
        out = linear_fp8(x, w_q, w_s, b, config=None if DEVICE == "cuda" else SMALL_LINEAR)
        assert out.shape == (T, N) and out.dtype == dtype
        if DEVICE == "cuda":
            magnitude = fp8.w8a8_linear_reference(x.float().abs(), fp8_abs(w_q), w_s)
            assert_within_fp8_accumulation(out, ref, magnitude, dtype)
        else:
            assert_close_to_reference(out, ref, dtype)


def random_ids(T, K, E, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,K,E,H,I", [
    (1, 2, 4, 256, 128), (7, 4, 8, 200, 256), (40, 2, 4, 256, 128),
    *[pytest.param(*c, marks=pytest.mark.skipif(DEVICE != "cuda", reason="large: GPU only"))
      for c in [(1, 8, 128, 2048, 768), (64, 8, 128, 2048, 768), (512, 8, 128, 2048, 768)]],  # Qwen3-30B-A3B experts
])
def test_expert_mlp_fp8_equals_reference(T, K, E, H, I, dtype):
    """The experts' gate_up (SwiGLU epilogue), h's quantisation and down against the per-expert reference; H 200
    leaves partial blocks and K tails; a 40-token step gives experts several row tiles. I is a multiple of the
    block (gate and up rows have blocks of their own, as DeepSeek-V3's and Qwen3's expert widths)."""
    gate_up_q, gate_up_s = quantized((E, 2 * I, H), seed=E + H, scale=H**-0.5)
    down_q, down_s = quantized((E, H, I), seed=E + I, scale=I**-0.5)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(T)).to(DEVICE, dtype)
    pos, tok, offs = routing_kernels.route(random_ids(T, K, E, seed=T * K), E)
    ref = fp8.w8a8_expert_mlp_reference(x, gate_up_q, gate_up_s, down_q, down_s, tok, offs)
    y = expert_mlp_fp8(x, gate_up_q, gate_up_s, down_q, down_s, pos, tok, offs,
                       configs=None if DEVICE == "cuda" else SMALL)
    assert y.shape == (T * K, H) and y.dtype == dtype
    if DEVICE == "cuda":  # h's e4m3 values may differ where the accumulation moved them (module docstring)
        rel = ((y.float() - ref.float()).abs().mean() / ref.float().abs().mean()).item()
        assert rel <= 2.0**-7, f"mean relative error {rel:.2e} against the reference"
        return
    # bf16: an element of h one rounding away changes its token group's quantisation; that spreads through down
    assert_close_to_reference(y, ref, dtype, min_same=0.9)


def test_expert_mlp_fp8_rejects_mismatched_scales():
    q, s = quantized((4, 256, 256), seed=0)
    dq, ds = quantized((4, 256, 128), seed=1)
    pos, tok, offs = routing_kernels.route(random_ids(2, 2, 4, seed=0), 4)
    with pytest.raises(ValueError, match="do not fit together"):
        expert_mlp_fp8(torch.zeros(2, 256, device=DEVICE), q, s[:, :1], dq, ds, pos, tok, offs)


def test_reference_scales_are_correctly_rounded_quotients():
    """The activation kernel divides with div_rn, and the reference must divide the same on every device: torch on
    CUDA divides by a Python scalar as x * (1 / 448), an ulp off the quotient for about half of all float32 values,
    which made the kernel's scales differ from the reference's on an H100 (the weights' block scales too)."""
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(64, 512, generator=g) * torch.logspace(-3, 3, 512)).to(DEVICE)
    _, s = fp8.quantize_activations(x)
    amax = x.float().view(64, 4, 128).abs().amax(-1)
    assert torch.equal(s, (amax.double() / fp8.FP8_MAX).float())  # float64 quotient rounded once: the IEEE one
    _, w_s = fp8.quantize_fp8_blocks(x, (32, 128))
    w_amax = x.float().view(2, 32, 4, 128).abs().amax(dim=(1, 3))
    assert torch.equal(w_s, (w_amax.double() / fp8.FP8_MAX).float())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_activations_kernel_equals_torch(dtype):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(37, 300, generator=g) * torch.logspace(-3, 3, 300)).to(DEVICE, dtype)
    x[3] = 0
    q, s = quantize_activations(x)
    q_ref, s_ref = fp8.quantize_activations(x)
    assert torch.equal(s, s_ref)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
