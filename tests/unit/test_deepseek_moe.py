"""DeepSeek's MoE block on the fused path (layers/moe.py ``DeepseekMoE``): the shared experts' output added inside the
routed experts' combine (``combine`` / ``combine_rms_norm`` with ``add``: the bits of HF's ``experts(x) +
shared_experts(x)`` and of the two launches), and the shared experts through fused_moe.py's kernels (one expert over
every token, gate and up laid out back to back as views) within rounding of the op-by-op MLP. Under Triton's
interpreter on CPU; ``MOE_TEST_DEVICE=cuda`` compiles the kernels."""
from __future__ import annotations

import os

import pytest
import torch

from moe_engine.config import ExpertsSpec, RouterSpec
from moe_engine.kernels import moe_routing as routing_kernels
from moe_engine.kernels import support as kernel_support
from moe_engine.layers.moe import DeepseekMoE

DEVICE = os.environ.get("MOE_TEST_DEVICE", "cpu")
needs_kernels = pytest.mark.skipif(not kernel_support.available(DEVICE), reason="Triton (or its interpreter) unavailable")


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_combine_adds_the_shared_output_as_the_op_by_op_add(dtype):
    g = torch.Generator().manual_seed(0)
    T, K, E, H = 5, 4, 16, 64
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).to(DEVICE)
    pos, _, _ = routing_kernels.route(ids, E)
    y = torch.randn(T * K, H, generator=g).to(dtype).to(DEVICE)
    w = torch.rand(T, K, generator=g).to(DEVICE)
    shared = torch.randn(T, H, generator=g).to(dtype).to(DEVICE)
    plain = routing_kernels.combine(y, ids, pos, w, dtype)
    assert torch.equal(routing_kernels.combine(y, ids, pos, w, dtype, add=shared), plain + shared)
    x = torch.randn(T, H, generator=g).to(dtype).to(DEVICE)
    weight = torch.rand(H, generator=g).to(dtype).to(DEVICE)
    s, out = routing_kernels.combine_rms_norm(y, ids, pos, w, x, weight, 1e-6, False, add=shared)
    s_ref, out_ref = routing_kernels.combine_rms_norm(y, ids, pos, w, x, weight, 1e-6, False)
    assert torch.equal(s, x + (plain + shared)) and not torch.equal(s, s_ref)
    from moe_engine.kernels import norm as norm_kernels

    assert torch.equal(out, norm_kernels.rms_norm(x, weight, 1e-6, False, plain + shared)[1])


def block(dtype, shared_width=32, H=64):
    router = RouterSpec(kind="deepseek_v3", num_experts=16, top_k=4, fp32=True, weights_fp32=True,
                        topk_method="noaux_tc", n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True)
    experts = ExpertsSpec(num_experts=16, intermediate_size=16, block="deepseek", shared_intermediate_size=shared_width)
    moe = DeepseekMoE(router, experts, H)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in moe.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)
    return moe.to(dtype).to(DEVICE)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_shared_experts_equal_the_mlp_within_rounding(dtype):
    """fuse_shared lays gate/up out as views of one weight (an in-place update reaches it); the block's output with
    the shared experts through fused_moe.py's kernels (small steps) or one gate/up GEMM (large ones) equals the
    op-by-op block within rounding."""
    moe = block(dtype)
    moe.gate.to(torch.float32)
    x = torch.randn(6, 64, generator=torch.Generator().manual_seed(4)).to(dtype).to(DEVICE)
    with torch.inference_mode():
        ref = moe(x)
        moe.fuse_shared()
        mlp = moe.shared_experts
        gu = moe._shared_gate_up()
        assert gu is not None and gu.data_ptr() == mlp.gate_proj.weight.data_ptr()
        assert torch.equal(moe(x), ref)  # views only: the op-by-op block unchanged
        moe.fused_shared = True
        tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(moe._shared(x), mlp(x), **tol)  # fused_moe's two kernels (6 tokens)
        torch.testing.assert_close(moe(x), ref, **tol)
        mlp.up_proj.weight.mul_(0.5)  # an in-place weight update reaches the joined weight
        assert torch.equal(moe._shared_gate_up()[32:], mlp.up_proj.weight)
        torch.testing.assert_close(moe._shared(x), mlp(x), **tol)
