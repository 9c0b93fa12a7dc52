"""DeepSeek routers in one launch (kernels/grouped_topk.py) against the op-by-op routers of layers/routing.py (the ones
test_deepseek_gpt_oss.py holds to HF's router modules): the same expert ids (as sets: HF's top-k is unsorted; the
kernel's slots are in descending order), weights within float32 rounding, for V2 greedy and group-limited, V3 with
its correction bias and groups (some kept, all kept, one group; Kimi-K2's 384 experts), norm_topk_prob on and off,
routed_scaling_factor, replayed (forced) tokens, and the one-token launch that also groups the pairs as ``route``
does. Under Triton's interpreter on CPU; ``MOE_TEST_DEVICE=cuda`` compiles it."""
from __future__ import annotations

import os

import pytest
import torch

from moe_engine.config import RouterSpec
from moe_engine.kernels import grouped_topk as topk_kernels
from moe_engine.kernels import moe_routing as routing_kernels
from moe_engine.kernels import support as kernel_support
from moe_engine.layers.routing import Forced, make_router

DEVICE = os.environ.get("MOE_TEST_DEVICE", "cpu")
needs_kernels = pytest.mark.skipif(not kernel_support.available(DEVICE), reason="Triton (or its interpreter) unavailable")

# (kind, E, K, topk_method, n_group, topk_group, norm_topk_prob, scale)
SPECS = [
    ("deepseek_v2", 16, 4, "greedy", 1, 1, False, 1.0),
    ("deepseek_v2", 64, 6, "group_limited_greedy", 8, 3, False, 2.0),  # DeepSeek-V2-style groups
    ("deepseek_v3", 64, 6, "noaux_tc", 1, 1, True, 2.446),  # Moonlight-16B-A3B
    ("deepseek_v3", 256, 8, "noaux_tc", 8, 4, True, 2.5),  # DeepSeek-V3
    ("deepseek_v3", 16, 4, "noaux_tc", 4, 4, False, 2.5),  # every group kept, no renormalisation
    ("deepseek_v3", 384, 8, "noaux_tc", 1, 1, True, 2.827),  # Kimi-K2: 384 experts (not a power of two), one group
]


def router_pair(kind, E, K, method, n_group, topk_group, norm, scale, H=32, seed=0):
    spec = RouterSpec(kind=kind, num_experts=E, top_k=K, fp32=True, weights_fp32=True, topk_method=method,
                      n_group=n_group, topk_group=topk_group, routed_scaling_factor=scale, norm_topk_prob=norm)
    router = make_router(spec, H).to(DEVICE)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        router.weight.copy_(torch.randn(E, H, generator=g))
        if kind == "deepseek_v3":
            router.e_score_correction_bias.copy_(torch.randn(E, generator=g) * 0.05)
    return router


def both(router, x, forced=None):
    router.within_rounding = False
    ref = router(x, forced)
    router.within_rounding = True
    try:
        return ref, router(x, forced)
    finally:
        router.within_rounding = False


@needs_kernels
@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s[0]}-E{s[1]}-k{s[2]}-{s[3]}-g{s[4]}/{s[5]}")
def test_fused_deepseek_router_chooses_the_op_by_op_experts(spec):
    router = router_pair(*spec)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(37, 32, generator=g).to(DEVICE)
    (ref_ids, ref_w), (ids, w) = both(router, x)
    assert ids.dtype == torch.long and w.dtype == torch.float32 and ids.shape == ref_ids.shape
    order = ref_ids.sort(-1)
    assert torch.equal(ids.sort(-1).values, order.values)  # the same experts
    # the weights: the op-by-op weights of the same experts, within float32 rounding
    torch.testing.assert_close(w.gather(1, ids.sort(-1).indices), ref_w.gather(1, order.indices), atol=1e-6, rtol=1e-6)
    # slots in descending order of what chose them (the unbiased score for V2, the biased one for V3)
    logits = torch.nn.functional.linear(x.float(), router.weight.float())
    choice = logits if spec[0] == "deepseek_v2" else logits.sigmoid() + router.e_score_correction_bias
    picked = choice.gather(1, ids)
    assert (picked[:, :-1] >= picked[:, 1:]).all()
    # replay: forced tokens take the given ids with the op-by-op weights; the others are unchanged
    mask = (torch.arange(37) % 3 == 0).to(DEVICE)
    given = torch.stack([torch.randperm(spec[1], generator=g)[: spec[2]] for _ in range(37)]).to(DEVICE)
    (f_ref_ids, f_ref_w), (f_ids, f_w) = both(router, x, Forced(mask, given))
    assert torch.equal(f_ids[mask], given[mask]) and torch.equal(f_ref_ids[mask], given[mask])
    torch.testing.assert_close(f_w[mask], f_ref_w[mask], atol=1e-6, rtol=1e-6)
    assert torch.equal(f_ids[~mask], ids[~mask]) and torch.equal(f_w[~mask], w[~mask])


@needs_kernels
@pytest.mark.parametrize("spec", SPECS[1:4], ids=["v2-groups", "v3-moonlight", "v3-dsv3"])
def test_one_token_router_launch_also_routes_exactly_as_route(spec):
    """forward_grouped of a one-token step: the router's own launch writes route's outputs and the capture row,
    bit for bit what the router followed by ``route`` gives, with and without a replayed token."""
    router = router_pair(*spec)
    router.within_rounding = True
    E, K = spec[1], spec[2]
    g = torch.Generator().manual_seed(2)
    x = torch.randn(1, 32, generator=g).to(DEVICE)
    given = torch.randperm(E, generator=g)[:K][None].to(DEVICE)
    for forced in (None, Forced(torch.ones(1, dtype=torch.bool, device=DEVICE), given)):
        ids, w = router(x, forced)
        cap_ref = torch.full((1, K), -1, dtype=torch.int32, device=DEVICE)
        grouped_ref = routing_kernels.route(ids, E, cap_ref)
        cap = torch.full((1, K), -1, dtype=torch.int32, device=DEVICE)
        g_ids, g_w, grouped = router.forward_grouped(x, forced, cap)
        assert torch.equal(g_ids, ids) and torch.equal(g_w, w)
        assert all(torch.equal(a, b) for a, b in zip(grouped, grouped_ref))
        assert torch.equal(cap, cap_ref) and torch.equal(cap.long(), ids)
        if forced is not None:
            assert torch.equal(g_ids, given)


@needs_kernels
def test_ties_go_to_the_lower_expert_and_group():
    """Equal logits: the lowest expert ids (and groups) in order, where torch's top-k leaves the choice open."""
    logits = torch.zeros(2, 16, device=DEVICE)
    ids, w, _ = topk_kernels.grouped_topk(logits, 4, sigmoid=True, n_group=4, topk_group=2, grouped=True, renorm=True)
    assert ids.tolist() == [[0, 1, 2, 3]] * 2
    torch.testing.assert_close(w, torch.full((2, 4), 0.25, device=DEVICE))
    ids, _, _ = topk_kernels.grouped_topk(logits, 3, sigmoid=False, n_group=4, topk_group=1, grouped=True)
    assert ids.tolist() == [[0, 1, 2]] * 2
