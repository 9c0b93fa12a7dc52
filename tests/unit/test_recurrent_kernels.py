"""The hybrid models' recurrent-layer kernels (kernels/gated_delta.py, kernels/mamba.py) against the op-by-op layers
they replace, on a varlen step that mixes every case: prompts from position 0 (short and longer than the
convolution), later chunks of prompts and decode tokens continuing from states at their slots. Outputs and the
states written back agree within float32 rounding (bf16: within bf16 rounding of the outputs); slots of sequences
not in the step are untouched. On CPU the kernels run under Triton's interpreter; ``MOE_TEST_DEVICE=cuda`` compiles
them on a GPU.
"""
from __future__ import annotations

import os

import pytest
import torch

from moe_engine.config import LinearAttentionSpec, MambaSpec
from moe_engine.kernels import support as kernel_support
from moe_engine.layers.attend import ForwardBatch
from moe_engine.layers.linear_attention import GatedDeltaNet
from moe_engine.layers.mamba import Mamba2Mixer
from moe_engine.layers.recurrent import LayerState

DEVICE = os.environ.get("MOE_TEST_DEVICE", "cpu")
pytestmark = pytest.mark.skipif(not kernel_support.available(DEVICE), reason="Triton kernels unavailable")

# (context before the step, tokens in the step): decode rows first, as the scheduler plans them
STEP = [(7, 1), (3, 1), (0, 1), (0, 2), (0, 9), (5, 6), (12, 3)]
SLOTS = [4, 0, 6, 2, 1, 5, 3]  # slot 7 holds a sequence not in the step; slot 8 is the null slot


def batch_of(step, slots) -> ForwardBatch:
    ctx, lens = [c for c, _ in step], [n for _, n in step]
    tables = [[0] * (-(-(c + n) // 16)) for c, n in step]
    return ForwardBatch.build(tables, ctx, lens, DEVICE, 16, state_slots=slots)


def random_state(layer_state: LayerState, g: torch.Generator) -> None:
    layer_state.conv.copy_(torch.randn(layer_state.conv.shape, generator=g).to(layer_state.conv.dtype))
    layer_state.ssm.copy_(torch.randn(layer_state.ssm.shape, generator=g) * 0.3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("projections, heads", [("qkvz", (2, 4)), ("split", (4, 4))])
def test_gated_delta_kernels_match_the_layer(dtype, projections, heads):
    g = torch.Generator().manual_seed(0)
    spec = LinearAttentionSpec(num_k_heads=heads[0], num_v_heads=heads[1], head_k_dim=16, head_v_dim=8,
                               conv_kernel=4, projections=projections)
    layer = GatedDeltaNet(spec, 32, 1e-6)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
        layer.A_log.copy_(torch.rand(heads[1], generator=g).log())
    layer = layer.to(DEVICE, dtype)
    T = sum(n for _, n in STEP)
    x = (torch.randn(T, 32, generator=g)).to(DEVICE, dtype)
    states = []
    for _ in range(2):
        st = LayerState.allocate(layer.state_spec(), 8, dtype, DEVICE)
        random_state(st, torch.Generator().manual_seed(1))
        states.append(st)
    batch = batch_of(STEP, SLOTS)
    outs = []
    for fused, st in zip((False, True), states):
        layer.fused = layer.within_rounding = fused
        with torch.inference_mode():
            outs.append(layer(x, batch, st))
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(outs[1], outs[0], **tol)
    stepped = SLOTS
    torch.testing.assert_close(states[1].ssm[stepped], states[0].ssm[stepped], **tol)
    torch.testing.assert_close(states[1].conv[stepped], states[0].conv[stepped], atol=0, rtol=0)
    for other in (7, 8):  # a sequence not in the step, and the null slot: untouched
        assert torch.equal(states[1].conv[other], states[0].conv[other])
        assert torch.equal(states[1].ssm[other], states[0].ssm[other])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mamba_kernels_match_the_layer(dtype):
    g = torch.Generator().manual_seed(2)
    spec = MambaSpec(num_heads=4, head_dim=8, state_size=16, n_groups=2, conv_kernel=4, conv_bias=True,
                     chunk_size=4, time_step_min=0.01)
    layer = Mamba2Mixer(spec, 32, 1e-5)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
        layer.A_log.copy_(torch.rand(4, generator=g).log())
        layer.dt_bias.copy_(torch.randn(4, generator=g) - 3)  # some dt below time_step_min: the clamp matters
    layer = layer.to(DEVICE, dtype)
    T = sum(n for _, n in STEP)
    x = torch.randn(T, 32, generator=g).to(DEVICE, dtype)
    states = []
    for _ in range(2):
        st = LayerState.allocate(layer.state_spec(), 8, dtype, DEVICE)
        random_state(st, torch.Generator().manual_seed(3))
        states.append(st)
    batch = batch_of(STEP, SLOTS)
    outs = []
    for fused, st in zip((False, True), states):
        layer.fused = layer.within_rounding = fused
        with torch.inference_mode():
            outs.append(layer(x, batch, st))
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(outs[1], outs[0], **tol)
    torch.testing.assert_close(states[1].ssm[SLOTS], states[0].ssm[SLOTS], **tol)
    torch.testing.assert_close(states[1].conv[SLOTS], states[0].conv[SLOTS], atol=0, rtol=0)
    for other in (7, 8):
        assert torch.equal(states[1].conv[other], states[0].conv[other])
        assert torch.equal(states[1].ssm[other], states[0].ssm[other])
