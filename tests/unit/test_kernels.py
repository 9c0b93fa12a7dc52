"""Fused Triton kernels (moe_engine/kernels.py): the fused forward returns the same bits as the op-by-op one;
the fusions equal to it within rounding (one-pass norms, the fused router, one q/k/v GEMM) keep its expert ids.

The op-by-op forward is what matches Hugging Face transformers (test_hf_parity.py), so bit-identical here
means the fused GPU path keeps that parity. On CPU (CI) the kernels run under Triton's interpreter
(tests/conftest.py sets ``TRITON_INTERPRET=1`` when there is no GPU); ``MOE_TEST_DEVICE=cuda`` runs the
same checks with the compiled kernels on a GPU.
"""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from moe_engine.checkpoint import load_model
from moe_engine.config import load_config
from moe_engine.engine import Engine, EngineConfig
from moe_engine.kernels import moe_routing as routing_kernels
from moe_engine.kernels import norm as norm_kernels
from moe_engine.kernels import rotary as rotary_kernels
from moe_engine.kernels import small_linear as linear_kernels
from moe_engine.kernels import support as kernel_support
from moe_engine.models.decoder import reference_forward

from .hf_checkpoints import ARCHS, make_hf_model, save_hf_checkpoint
from .test_engine import run_all, submit

DEVICE = os.environ.get("MOE_TEST_DEVICE", "cpu")


def prompt_of(n: int, seed: int) -> list[int]:
    return torch.randint(3, 250, (n,), generator=torch.Generator().manual_seed(seed)).tolist()  # vocab 256


@pytest.fixture(scope="module")
def bf16_checkpoints(tmp_path_factory):
    out, cache = tmp_path_factory.mktemp("fused"), {}

    def get(arch: str):
        if arch not in cache:
            # OLMoE's test config clips q/k/v (which keeps the op-by-op attention); the benchmark's OLMoE
            # shape does not clip, so take that one here.
            overrides = {"clip_qkv": None} if arch == "olmoe" else {}
            model = make_hf_model(arch, seed=0, dtype=torch.bfloat16, **overrides)
            cache[arch] = save_hf_checkpoint(model, out / arch)
        return cache[arch]

    return get


KERNEL_MODULES = (kernel_support, norm_kernels, rotary_kernels, routing_kernels, linear_kernels)


def module_of(name: str):
    """The kernels module that defines ``name`` (where the forward looks it up, hence where to patch it)."""
    return next(m for m in KERNEL_MODULES if name in vars(m))


class LaunchCounter:
    """Counts calls of the kernels' Python entry points (which fused paths a forward took)."""

    NAMES = ("add_square", "rms_norm_tail", "qk_norm_rope", "route", "_route_chunks", "combine", "store_kv")

    def __init__(self, monkeypatch):
        self.calls: dict[str, int] = {}
        for name in self.NAMES:
            fn = getattr(module_of(name), name)

            def counted(*args, _fn=fn, _name=name, **kw):
                result = _fn(*args, **kw)
                self.calls[_name] = self.calls.get(_name, 0) + 1
                return result

            monkeypatch.setattr(module_of(name), name, counted)


OWN_EXPERTS = ("gpt_oss", "nemotron_h")  # experts off the fused route / GEMM / combine path


def num_norms(cfg) -> int:
    """The decoder's RMSNorms: 2 per layer (Nemotron-H's blocks: 1) and the final one."""
    return (2 if cfg.block_style == "pair" else 1) * cfg.num_hidden_layers + 1


def forward_both_ways(model, ids, within_rounding: bool = False, expert_gemms: bool = True):
    """(op-by-op, fused) forwards. ``expert_gemms=False`` keeps torch's expert GEMMs on a GPU: fused_moe.py sums
    in its own order (bit-identical in bf16 on the H200, not in float32; test_fused_moe.py bounds it)."""
    model.use_fused_kernels(False)
    expected = reference_forward(model, ids)
    assert model.use_fused_kernels(True, within_rounding=within_rounding)
    if not expert_gemms:
        for m in model.modules():
            if hasattr(m, "triton_gemm_max_pairs"):
                m.triton_gemm_max_pairs = 0
    try:
        return expected, reference_forward(model, ids)
    finally:
        model.use_fused_kernels(False)


@pytest.mark.parametrize("arch", ARCHS)
def test_fused_forward_is_bit_identical_for_every_architecture(arch, bf16_checkpoints, monkeypatch):
    """bf16 (the serving dtype): logits and routed ids (slot order) equal to the last bit, with the expert
    bookkeeping done by the `route` kernel (a decode-sized step) and by its per-chunk counting (larger)."""
    model = load_model(bf16_checkpoints(arch), device=DEVICE, progress=False)
    counter = LaunchCounter(monkeypatch)
    for n, max_pairs in ((6, routing_kernels.ROUTE_MAX_PAIRS), (20, 16)):  # 16: the per-chunk counting at 20 tokens
        monkeypatch.setattr(routing_kernels, "ROUTE_MAX_PAIRS", max_pairs)
        counter.calls.clear()
        (ref_logits, ref_routed), (logits, routed) = forward_both_ways(model, prompt_of(n, seed=n))
        assert torch.equal(logits, ref_logits), (arch, n, (logits - ref_logits).abs().max())
        assert torch.equal(routed, ref_routed), (arch, n)
        # every norm is fused (2 per layer + the final one; with the layer inputs' residual adds)
        assert counter.calls["rms_norm_tail"] >= num_norms(model.config)
        # MLA keeps its own attention (latent cache, complex/interleaved rope); Nemotron-H's has no rotary
        if model.config.attention.mla is None and model.config.attention.rotary:
            # k/v go into the cache inside qk_norm_rope's launch: no store_kv launch of its own
            assert counter.calls["qk_norm_rope"] == len(model.config.attention_layers)  # hybrids: attention layers
            assert "store_kv" not in counter.calls
        if arch not in OWN_EXPERTS:  # GPT-OSS's and Nemotron-H's experts keep their own path
            assert counter.calls["combine"] == len(model.config.moe_layers)
            assert counter.calls["route"] == len(model.config.moe_layers)
            assert counter.calls.get("_route_chunks", 0) == (0 if n == 6 else len(model.config.moe_layers))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fused_forward_is_bit_identical_in_other_dtypes(dtype, bf16_checkpoints):
    """float32 (no rounding between ops) and float16 (the other rounding); Qwen3: per-head q/k norm."""
    model = load_model(bf16_checkpoints("qwen3_moe"), dtype=dtype, device=DEVICE, progress=False)
    (ref_logits, ref_routed), (logits, routed) = forward_both_ways(model, prompt_of(12, seed=3), expert_gemms=False)
    assert torch.equal(logits, ref_logits) and torch.equal(routed, ref_routed)


def test_route_orders_pairs_like_a_stable_sort_by_expert():
    """pos/tok/offs of the `route` kernel against torch's stable argsort of the slot-major pairs."""
    g = torch.Generator().manual_seed(0)
    # several blocks of 64 pairs, experts beyond one block of 64, experts left without a pair
    for T, K, E in ((13, 4, 16), (45, 6, 150)):
        ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).to(DEVICE)
        pos, tok, offs = routing_kernels.route(ids, E)
        order = torch.argsort(ids.t().reshape(-1), stable=True)
        assert torch.equal(tok, order % T)
        assert torch.equal(offs.cpu().long(), torch.cumsum(torch.bincount(ids.reshape(-1).cpu(), minlength=E), 0))
        flat_pos = pos.t().reshape(-1)  # slot-major like the pairs
        assert torch.equal(order[flat_pos], torch.arange(T * K, device=ids.device))


@pytest.mark.parametrize("T,K,E", [
    (600, 8, 128), (2049, 8, 128), (700, 6, 150), (700, 6, 300), (5000, 1, 64), (2100, 2, 10),
] + ([(8192, 8, 128), (2100, 8, 300)] if DEVICE == "cuda" else []))  # (the interpreter takes ~12 s for each of these)
def test_large_steps_group_their_pairs_like_a_stable_sort_by_expert(T, K, E):
    """Steps past the route kernel's size (prefill): ``route``'s per-chunk counting gives the one-launch kernel's
    outputs for a stable argsort of the slot-major pairs, experts without a pair included (the first ones unused),
    pair counts that are no multiple of a chunk, more experts than one block of counts holds (300), fewer than the
    counting's 16 columns (10), and writes the routing capture rows."""
    assert T * K > routing_kernels.ROUTE_MAX_PAIRS
    g = torch.Generator().manual_seed(T)
    unused = min(20, E // 2)
    ids = torch.stack([torch.randperm(E - unused, generator=g)[:K] + unused for _ in range(T)]).to(DEVICE)
    capture = torch.full((T, K), -1, dtype=torch.int32, device=DEVICE)
    pos, tok, ends = routing_kernels.route(ids, E, capture)
    order = torch.argsort(ids.t().reshape(-1), stable=True)
    assert torch.equal(tok, order % T)
    assert ends.dtype == torch.int32 and torch.equal(
        ends.cpu().long(), torch.cumsum(torch.bincount(ids.reshape(-1).cpu(), minlength=E), 0))
    assert pos.shape == (T, K) and torch.equal(order[pos.t().reshape(-1)], torch.arange(T * K, device=ids.device))
    assert torch.equal(capture, ids.int())


def test_engine_with_fused_kernels_hands_out_what_the_op_by_op_engine_does(bf16_checkpoints):
    """Four requests of different lengths arriving over time (prefill chunks mixed with decode steps,
    greedy and seeded sampling): the same tokens and routing rows with and without fused kernels."""
    path = bf16_checkpoints("olmoe")
    cfg, model = load_config(path), load_model(path, device=DEVICE, progress=False)

    def run(fused: bool):
        engine = Engine(model, cfg, EngineConfig(max_model_len=96, max_num_batched_tokens=16, fused_kernels=fused,
                                                 exact_kernels=True))
        assert engine.settings.fused_kernels is fused
        out = []
        for i in range(4):
            sampling = dict(max_tokens=3 + 2 * i, ignore_eos=True)
            if i % 2:
                sampling.update(temperature=0.9, top_p=0.9, seed=7 + i)
            out.append(submit(engine, prompt_of(4 + 5 * i, 20 + i), **sampling))
            engine.step()
        run_all(engine, out)
        return out

    for a, b in zip(run(False), run(True)):
        assert a.tokens == b.tokens and a.finish_reason == b.finish_reason
        np.testing.assert_array_equal(a.routing, b.routing)


# ------------------------------------------------------- fusions equal to the op-by-op path within rounding


def router_reference(logits, top_k, renorm, dtype, mask=None, given=None):
    """SoftmaxTopKRouter's op-by-op math (routing.py)."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    w, ids = torch.topk(probs, top_k, dim=-1)
    if mask is not None:
        ids = torch.where(mask[:, None], given, ids)
        w = probs.gather(1, ids)
    if renorm:
        w = w / w.sum(dim=-1, keepdim=True)
    return ids, w.to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_router_chooses_the_same_experts_with_weights_within_rounding(dtype):
    """softmax -> top-k -> renormalise -> cast in one kernel: the same ids in the same slot order, weights equal
    within float32 rounding; forced rows (replay) take the given ids and their weights, and the rows that are
    not forced come out bit for bit as in a step without replay."""
    g = torch.Generator().manual_seed(1)
    for T, E, K in ((9, 128, 8), (5, 60, 4), (3, 8, 2)):
        # distinct logits (torch.topk orders ties arbitrarily), steps of 0.05 are distinct in bf16 too
        logits = torch.stack([(torch.randperm(E, generator=g) - E / 2) * 0.05 for _ in range(T)]).to(dtype)
        logits = logits.to(DEVICE)
        for renorm, wdtype in ((True, torch.float32), (False, dtype), (True, dtype)):
            ids, w = routing_kernels.softmax_topk(logits, K, renorm, wdtype)
            ref_ids, ref_w = router_reference(logits, K, renorm, wdtype)
            assert torch.equal(ids, ref_ids), (T, E, K)
            assert w.dtype == wdtype
            torch.testing.assert_close(w, ref_w)
            mask = (torch.arange(T) % 2 == 0).to(DEVICE)
            given = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).to(DEVICE)
            f_ids, f_w = routing_kernels.softmax_topk(logits, K, renorm, wdtype, mask, given)
            ref_ids, ref_w = router_reference(logits, K, renorm, wdtype, mask, given)
            assert torch.equal(f_ids, ref_ids)
            torch.testing.assert_close(f_w, ref_w)
            assert torch.equal(f_ids[~mask], ids[~mask]) and torch.equal(f_w[~mask], w[~mask])
    # ties go to the lower expert id, in that order
    ids, w = routing_kernels.softmax_topk(torch.zeros(2, 16, dtype=dtype, device=DEVICE), 4, True, torch.float32)
    assert ids.tolist() == [[0, 1, 2, 3]] * 2
    torch.testing.assert_close(w, torch.full((2, 4), 0.25, device=DEVICE))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_one_token_router_launch_also_routes_exactly_as_route(dtype):
    """A one-token step's router kernel that also groups its pairs (softmax_topk_route) gives the bits of
    softmax_topk followed by route: ids, weights, grouped rows, tokens, expert ends and the captured ids, with
    and without a forced (replayed) token, for top-k of 8 over 128 experts and for smaller shapes."""
    g = torch.Generator().manual_seed(6)
    for E, K in ((128, 8), (60, 4), (8, 1)):
        logits = ((torch.randperm(E, generator=g) - E / 2) * 0.05)[None].to(dtype).to(DEVICE)
        given = torch.randperm(E, generator=g)[:K][None].to(DEVICE)
        for renorm, wdtype in ((True, torch.float32), (False, dtype)):
            for forced in (None, (torch.ones(1, dtype=torch.bool, device=DEVICE), given)):
                mask, fids = forced or (None, None)
                ids, w = routing_kernels.softmax_topk(logits, K, renorm, wdtype, mask, fids)
                cap_ref = torch.full((1, K), -1, dtype=torch.int32, device=DEVICE)
                grouped_ref = routing_kernels.route(ids, E, cap_ref)
                cap = torch.full((1, K), -1, dtype=torch.int32, device=DEVICE)
                f_ids, f_w, grouped = routing_kernels.softmax_topk_route(logits, K, renorm, wdtype, cap, mask, fids)
                assert torch.equal(f_ids, ids) and torch.equal(f_w, w), (E, K, forced is not None)
                assert all(torch.equal(a, b) for a, b in zip(grouped, grouped_ref)), (E, K)
                assert torch.equal(cap, cap_ref) and torch.equal(cap.long(), ids)
                if forced is not None:
                    assert torch.equal(f_ids, given)
        assert routing_kernels.softmax_topk_route(logits, K, True, torch.float32)[2][2][-1] == K  # no capture: still routed


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_small_linear_equals_f_linear_within_rounding(dtype):
    """linear_kernels.small_linear (decode steps' router and projections): F.linear's result within float32 summation
    order, rounded to the model dtype as F.linear rounds it; with and without a bias, widths not a power of two,
    a strided input (a view of a wider tensor); only for steps it is meant for."""
    g = torch.Generator().manual_seed(11)
    for T, N, H in ((1, 128, 256), (5, 60, 96), (16, 37, 200)):
        wide = torch.randn(T, H + 8, generator=g).to(dtype).to(DEVICE)
        x = wide[:, 4:H + 4]  # row stride H + 8
        w = (torch.randn(N, H, generator=g) / H**0.5).to(dtype).to(DEVICE)
        b = torch.randn(N, generator=g).to(dtype).to(DEVICE)
        for bias in (None, b):
            y = linear_kernels.small_linear(x, w, bias)
            assert y.shape == (T, N) and y.dtype == dtype
            torch.testing.assert_close(y, torch.nn.functional.linear(x, w, bias))
            exact = torch.nn.functional.linear(x.double(), w.double(), None if bias is None else bias.double())
            # float32 sums: within a few ulps of the exact result (bf16: the rounding of it)
            torch.testing.assert_close(y.double(), exact, rtol=1e-5 if dtype == torch.float32 else 8e-3,
                                       atol=1e-5 if dtype == torch.float32 else 8e-3)
    assert linear_kernels.small_linear_fits(4, 8192, 4) and not linear_kernels.small_linear_fits(5, 2048, 4)
    assert not linear_kernels.small_linear_fits(1, 8193, 4) and not linear_kernels.small_linear_fits(0, 64, 4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_one_pass_norms_equal_the_op_by_op_norms_within_rounding(dtype):
    """norm_kernels.rms_norm (the residual add, the mean of squares summed in the kernel, the tail) and qk_norm_rope
    summing its own means: the add bit for bit, the norms within float32 summation order."""
    from moe_engine.layers.norm import RMSNorm

    g = torch.Generator().manual_seed(2)
    x, delta = (torch.randn(7, 96, generator=g).to(dtype).to(DEVICE) for _ in range(2))
    for fp32_weight in (False, True):
        norm = RMSNorm(96, 1e-6, fp32_weight).to(DEVICE, torch.float32 if fp32_weight else dtype)
        with torch.no_grad():
            norm.weight.copy_(1 + 0.1 * torch.randn(96, generator=g))
        s, out = norm_kernels.rms_norm(x, norm.weight, 1e-6, fp32_weight, delta)
        assert torch.equal(s, x + delta)
        torch.testing.assert_close(out, norm(x + delta))
        torch.testing.assert_close(norm_kernels.rms_norm(x, norm.weight, 1e-6, fp32_weight)[1], norm(x))
    T, D, Hq, Hk = 5, 16, 4, 2
    q, k = torch.randn(T, Hq * D, generator=g).to(dtype).to(DEVICE), torch.randn(T, Hk * D, generator=g).to(dtype).to(DEVICE)
    angles = torch.randn(T, D // 2, generator=g).repeat(1, 2)
    cos, sin = angles.cos().to(dtype).to(DEVICE), angles.sin().to(dtype).to(DEVICE)
    for mode, shape_q, shape_k in (("head", (T, Hq, D), (T, Hk, D)), ("full", (T, Hq * D), (T, Hk * D))):
        wq = (1 + 0.1 * torch.randn(shape_q[-1], generator=g)).to(dtype).to(DEVICE)
        wk = (1 + 0.1 * torch.randn(shape_k[-1], generator=g)).to(dtype).to(DEVICE)
        q_var = q.float().view(shape_q).pow(2).mean(-1, keepdim=True)
        k_var = k.float().view(shape_k).pow(2).mean(-1, keepdim=True)
        exact = rotary_kernels.qk_norm_rope(q, k, cos, sin, D, mode, q_var, k_var, wq, wk, 1e-6)
        summed_here = rotary_kernels.qk_norm_rope(q, k, cos, sin, D, mode, q_weight=wq, k_weight=wk, eps=1e-6)
        for a, b in zip(summed_here, exact):
            torch.testing.assert_close(a, b)


@pytest.mark.parametrize("norm", ["none", "head", "full"])
def test_qk_norm_rope_writes_the_cache_exactly_as_store_kv(norm):
    """qk_norm_rope with ``kv_cache``: the same q/k outputs as without, and the cache holds exactly what store_kv
    writes for that k and v (v a view of a fused q/k/v GEMM's output, as the model passes it; scattered slots,
    slots of other tokens untouched)."""
    dtype, T, D, Hq, Hk, nb, bs = torch.bfloat16, 6, 16, 4, 2, 5, 4
    g = torch.Generator().manual_seed(7)
    qkv = torch.randn(T, (Hq + 2 * Hk) * D, generator=g).to(dtype).to(DEVICE)
    q, k, v = qkv.split([Hq * D, Hk * D, Hk * D], -1)
    angles = torch.randn(T, D // 2, generator=g).repeat(1, 2)
    cos, sin = angles.cos().to(dtype).to(DEVICE), angles.sin().to(dtype).to(DEVICE)
    wq = (1 + 0.1 * torch.randn(Hq * D if norm == "full" else D, generator=g)).to(dtype).to(DEVICE)
    wk = (1 + 0.1 * torch.randn(Hk * D if norm == "full" else D, generator=g)).to(dtype).to(DEVICE)
    args = (q, k, cos, sin, D, norm) + ((None, None, wq, wk, 1e-6) if norm != "none" else ())
    slots = torch.tensor([17, 2, 9, 10, 3, 0], device=DEVICE)
    fill = torch.randn(nb, bs, Hk, D, generator=g).to(dtype).to(DEVICE)  # what other tokens' slots hold
    expected_k, expected_v, cache_k, cache_v = (fill.clone() for _ in range(4))
    q_ref, k_ref = rotary_kernels.qk_norm_rope(*args)
    rotary_kernels.store_kv(k_ref, v.view(T, Hk, D), expected_k, expected_v, slots)
    # the heads split over programs (one q or k head per program .. all of them in one): the same bits
    for heads_per_program in (None, 1, 2, 8):  # 8: the large-step default (all 4 q heads here)
        cache_k, cache_v = fill.clone(), fill.clone()
        q_out, k_out = rotary_kernels.qk_norm_rope(*args, kv_cache=(v, cache_k, cache_v, slots),
                                            heads_per_program=heads_per_program)
        assert torch.equal(q_out, q_ref) and torch.equal(k_out, k_ref), heads_per_program
        assert torch.equal(cache_k, expected_k) and torch.equal(cache_v, expected_v), heads_per_program
    assert not torch.equal(cache_k, fill) and torch.equal(cache_k.view(-1, Hk, D)[1], fill.view(-1, Hk, D)[1])


@pytest.mark.parametrize("norm", ["none", "head"])
@pytest.mark.parametrize("rotary_dims", [4, 8])  # of head_dim 16: GLM-4.5's factor 0.5, Qwen3-Next's 0.25
def test_qk_norm_rope_rotates_only_the_first_dims_of_a_partial_rotary(norm, rotary_dims):
    """Partial rotary: the kernel rotates the first R dims of each head (cos/sin [T, R]) and passes the rest through
    (after the norm), bit for bit what the op-by-op norm and ``apply_rotary`` give, as HF's apply_rotary_pos_emb."""
    from moe_engine.layers.norm import RMSNorm
    from moe_engine.layers.rotary import apply_rotary

    dtype, T, D, Hq, Hk = torch.bfloat16, 5, 16, 4, 2
    g = torch.Generator().manual_seed(11)
    q = torch.randn(T, Hq * D, generator=g).to(dtype).to(DEVICE)
    k = torch.randn(T, Hk * D, generator=g).to(dtype).to(DEVICE)
    angles = torch.randn(T, rotary_dims // 2, generator=g).repeat(1, 2)
    cos, sin = angles.cos().to(dtype).to(DEVICE), angles.sin().to(dtype).to(DEVICE)
    qn, kn = q.view(T, Hq, D), k.view(T, Hk, D)
    extra = ()
    if norm == "head":
        nq, nk = RMSNorm(D, 1e-6).to(DEVICE, dtype), RMSNorm(D, 1e-6).to(DEVICE, dtype)
        with torch.no_grad():
            nq.weight.copy_(1 + 0.1 * torch.randn(D, generator=g))
            nk.weight.copy_(1 + 0.1 * torch.randn(D, generator=g))
        qn, kn = nq(qn), nk(kn)
        q_var = q.view(T, Hq, D).float().pow(2).mean(-1, keepdim=True)
        k_var = k.view(T, Hk, D).float().pow(2).mean(-1, keepdim=True)
        extra = (q_var, k_var, nq.weight, nk.weight, 1e-6)
    q_out, k_out = rotary_kernels.qk_norm_rope(q, k, cos, sin, D, norm, *extra)
    assert torch.equal(q_out, apply_rotary(qn, cos, sin)) and torch.equal(k_out, apply_rotary(kn, cos, sin))
    assert torch.equal(q_out[..., rotary_dims:], qn[..., rotary_dims:])  # passed through


def test_route_and_combine_give_the_same_bits_however_the_work_is_split(monkeypatch):
    """route's pairs per program and combine's columns per program (the launch granularity a decode step's
    latency depends on, and combine's defaults by step size) change nothing: combine equals the op-by-op weighted
    sum in ascending expert order."""
    from moe_engine.layers.experts import group_by_expert, sum_in_expert_order

    g = torch.Generator().manual_seed(3)
    T, K, E, N, dtype = 5, 4, 12, 96, torch.bfloat16
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).to(DEVICE)
    weights = torch.softmax(torch.randn(T, K, generator=g), -1).to(dtype).to(DEVICE)
    y = torch.randn(T * K, N, generator=g).to(dtype).to(DEVICE)  # grouped rows
    pos, tok, offs = routing_kernels.route(ids, E)
    for block_i in (4, 8, 32):
        assert all(torch.equal(a, b) for a, b in zip(routing_kernels.route(ids, E, block_i=block_i), (pos, tok, offs)))
    g_tok, g_slot = group_by_expert(ids)
    expected = sum_in_expert_order(y * weights[g_tok, g_slot][:, None], ids, g_tok, g_slot)
    for block in (None, 16, 32, 128):
        assert torch.equal(routing_kernels.combine(y, ids, pos, weights, dtype, block=block), expected), block
    # the defaults by step size, scaled down: 5 tokens take 64-column programs, 3 tokens 32-column ones
    monkeypatch.setattr(routing_kernels, "COMBINE_BLOCKS", ((T, 64), (3, 32), (0, 16)))
    assert torch.equal(routing_kernels.combine(y, ids, pos, weights, dtype), expected)
    assert torch.equal(routing_kernels.combine(y, ids[:3], pos[:3], weights[:3], dtype), expected[:3])  # rows of 3 tokens


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_combine_and_the_next_norm_in_one_launch_give_the_two_launches_bits(dtype):
    """combine_rms_norm (a MoE layer's combine, the residual add and the next one-pass norm in one launch) returns
    exactly what combine and then rms_norm with that output as delta return: the residual stream and the normed
    rows, for one expert per token and several, with the norm's weights in either precision."""
    from moe_engine.layers.norm import RMSNorm

    g = torch.Generator().manual_seed(11)
    E, N = 12, 96
    for T, K in ((1, 4), (5, 4), (3, 1)):
        ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).to(DEVICE)
        weights = torch.softmax(torch.randn(T, K, generator=g), -1).to(dtype).to(DEVICE)
        y = torch.randn(T * K, N, generator=g).to(dtype).to(DEVICE)  # grouped rows
        x = torch.randn(T, N, generator=g).to(dtype).to(DEVICE)  # the residual stream
        pos, _, _ = routing_kernels.route(ids, E)
        for fp32_weight in (False, True):
            norm = RMSNorm(N, 1e-6, fp32_weight).to(DEVICE, torch.float32 if fp32_weight else dtype)
            with torch.no_grad():
                norm.weight.copy_(1 + 0.1 * torch.randn(N, generator=g))
            delta = routing_kernels.combine(y, ids, pos, weights, dtype)
            s_ref, out_ref = norm_kernels.rms_norm(x, norm.weight, 1e-6, fp32_weight, delta)
            s, out = routing_kernels.combine_rms_norm(y, ids, pos, weights, x, norm.weight, 1e-6, fp32_weight)
            assert torch.equal(s, s_ref) and torch.equal(out, out_ref), (T, K, fp32_weight)
            assert not torch.equal(s, x)


@pytest.mark.parametrize("arch", ARCHS)
def test_fusions_within_rounding_keep_every_architectures_expert_ids(arch, bf16_checkpoints, monkeypatch):
    """The whole forward with the one-pass norms (after a MoE layer of a large enough step, with its combine in the
    same launch), the fused router, one q/k/v GEMM and, for decode-sized steps, small_linear's router logits and
    o_proj (what a GPU runs by default): float32, the routed ids equal the op-by-op forward's in slot order and the
    logits agree within rounding; bf16 (the serving dtype), the logits agree within bf16 rounding of the hidden
    states."""
    counter = LaunchCounter(monkeypatch)
    # the combine in the next norm's launch from 4 tokens here (the 10-token prompt; not the 1- and 3-token steps)
    monkeypatch.setattr(routing_kernels, "COMBINE_NORM_MIN_TOKENS", 4)
    for name in ("rms_norm", "softmax_topk", "small_linear", "softmax_topk_route", "combine_rms_norm"):
        fn = getattr(module_of(name), name)
        monkeypatch.setattr(module_of(name), name, lambda *a, _fn=fn, _name=name, **kw: (
            counter.calls.__setitem__(_name, counter.calls.get(_name, 0) + 1), _fn(*a, **kw))[1])
    for dtype in (torch.float32, torch.bfloat16):
        model = load_model(bf16_checkpoints(arch), dtype=dtype, device=DEVICE, progress=False)
        counter.calls.clear()
        (ref_logits, ref_routed), (logits, routed) = forward_both_ways(model, prompt_of(10, seed=5), True)
        # DeepSeek's routers (and those built like them) define no slot order (HF's top-k is unsorted): their fused
        # kernel (grouped_topk.py) fills the slots in descending order, so the sets are compared
        unsorted = model.config.router.kind in ("deepseek_v2", "deepseek_v3")
        if unsorted:
            routed, ref_routed = routed.sort(-1).values, ref_routed.sort(-1).values
        if dtype == torch.float32:
            assert torch.equal(routed, ref_routed), arch
            torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-4)
        else:
            assert (routed == ref_routed).float().mean() > 0.95, arch  # bf16 near-ties may flip an id
            torch.testing.assert_close(logits, ref_logits, rtol=0.05, atol=0.05)
        L = model.config.num_hidden_layers
        # every layer norm (and the final one) in one pass; after a MoE layer without shared experts, with its
        # combine in the same launch
        deferred = counter.calls.get("combine_rms_norm", 0)
        assert counter.calls["rms_norm"] + deferred >= num_norms(model.config)
        if arch not in OWN_EXPERTS:  # GPT-OSS's and Nemotron-H's experts keep their own path
            assert counter.calls.get("combine", 0) + deferred == len(model.config.moe_layers), arch
            # DeepSeek's blocks add their shared experts' output in the combine (so in the norm's launch too);
            # Qwen2-MoE's gated shared expert is added after it
            shared = model.config.experts.shared_intermediate_size and model.config.experts.block != "deepseek"
            assert deferred == (0 if shared else len(model.config.moe_layers)), arch
        if model.config.router.kind == "softmax_topk":
            assert counter.calls["softmax_topk"] == len(model.config.moe_layers)
        # decode-sized steps (one token; three): the routers' logits (and at one token o_proj) in small_linear
        for n in (1, 3):
            counter.calls.clear()
            (ref_logits, ref_routed), (logits, routed) = forward_both_ways(model, prompt_of(n, seed=n), True)
            if unsorted:
                routed, ref_routed = routed.sort(-1).values, ref_routed.sort(-1).values
            if dtype == torch.float32:
                assert torch.equal(routed, ref_routed), (arch, n)
                torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-4)
            else:
                torch.testing.assert_close(logits, ref_logits, rtol=0.05, atol=0.05)
            if model.config.router.kind == "softmax_topk":
                assert counter.calls["small_linear"] >= len(model.config.moe_layers), (arch, n)
                # one token: the router's launch also groups the pairs for the fused experts (no route launch)
                moe = len(model.config.moe_layers)
                assert counter.calls.get("softmax_topk_route", 0) == (moe if n == 1 else 0), (arch, n)
                assert counter.calls.get("route", 0) == (0 if n == 1 else moe), (arch, n)
            assert "combine_rms_norm" not in counter.calls, (arch, n)  # fewer tokens than the threshold
        if model.config.linear_attention is not None:  # Gated DeltaNet's input projections: one GEMM too
            model.use_fused_kernels(True, within_rounding=True)
            gdn = model.model.layers[model.config.recurrent_layers[0]].linear_attn
            assert gdn._joined_weight() is not None
            model.use_fused_kernels(False)
        if model.config.attention.mla is None:  # q/k/v weights laid out as one tensor: one GEMM
            attn = model.model.layers[model.config.attention_layers[0]].self_attn
            assert attn._qkv_weight() is not None
            assert attn.k_proj.weight.data_ptr() == attn.q_proj.weight.data_ptr() + attn.q_proj.weight.nbytes


def test_weight_updates_reach_the_fused_qkv_gemm(bf16_checkpoints):
    """The q/k/v parameters are views of the one GEMM weight: an in-place update (what update_weights_from_disk
    does) changes what the fused forward computes, exactly as it changes the op-by-op forward."""
    model = load_model(bf16_checkpoints("qwen3_moe"), dtype=torch.float32, device=DEVICE, progress=False)
    model.use_fused_kernels(True, within_rounding=True)
    before = reference_forward(model, prompt_of(8, seed=9))[0]
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.v_proj.weight.mul_(-1.5)
    after = reference_forward(model, prompt_of(8, seed=9))[0]
    model.use_fused_kernels(False)
    torch.testing.assert_close(after, reference_forward(model, prompt_of(8, seed=9))[0], rtol=1e-4, atol=1e-4)
    assert not torch.allclose(after, before, atol=1e-3)


if kernel_support.triton is not None:
    import triton
    import triton.language as tl

    from moe_engine.kernels.support import _round

    @triton.jit
    def _round_bf16_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
        i = tl.arange(0, BLOCK)
        x = tl.load(x_ptr + i, mask=i < n, other=0.0)
        tl.store(y_ptr + i, _round(x, 1), mask=i < n)


def test_kernel_rounding_to_bfloat16_gives_torchs_cast_bits():
    """``_round`` (every fused kernel's rounding to bf16) equals torch's float32 -> bfloat16 cast bit for bit: ties
    to even both ways, values that round up into the next binade or to infinity, subnormals, signed zeros. Under the
    interpreter that is the integer formula; on a GPU (MOE_TEST_DEVICE=cuda) the hardware conversion."""
    if not kernel_support.available(DEVICE):
        pytest.skip("Triton not available")
    ulp_lo = torch.tensor([1.0, 1.0078125, -3.0, 3.0078125, 255.0, 256.0], dtype=torch.float32)  # bf16 values
    half_ulp = ulp_lo * 2.0**-8  # exactly between two bf16 values: ties (to the even neighbour)
    special = torch.tensor([0.0, -0.0, 1e-40, -1e-40, 1.1754944e-38, 3.3895e38, 3.4e38, -3.4e38, 65504.0,
                            1.0 + 2.0**-8 + 2.0**-20, 1.0 + 2.0**-8 - 2.0**-20], dtype=torch.float32)
    noise = torch.randn(4096, generator=torch.Generator().manual_seed(0)) * torch.logspace(-30, 30, 4096)
    x = torch.cat([ulp_lo + half_ulp, ulp_lo - half_ulp, special, noise]).to(DEVICE)
    y = torch.empty_like(x)
    kernel_support._launch(_round_bf16_kernel, (1,), x, y, x.numel(), BLOCK=triton.next_power_of_2(x.numel()))
    want = x.to(torch.bfloat16).float()
    assert torch.equal(y.view(torch.int32), want.view(torch.int32)), (x[y != want], y[y != want], want[y != want])


ROUND_PTX = r"""
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from moe_engine.kernels import moe_routing as routing_kernels, norm as norm_kernels, rotary as rotary_kernels, small_linear as linear_kernels, support as kernel_support

consts = dict(K=8, BLOCK_K=8, BLOCK=256, DT=1, PDL=True)
sig = {"y_ptr": "*bf16", "ids_ptr": "*i32", "pos_ptr": "*i64", "w_ptr": "*fp32", "out_ptr": "*bf16", "N": "i32",
       **{n: "constexpr" for n in consts}}
ck = triton.compile(ASTSource(routing_kernels._combine_kernel, sig, constexprs=consts), target=GPUTarget("cuda", 90, 32),
                    options={"num_warps": 4})
print(ck.asm["ptx"])
"""


def test_compiled_kernels_round_with_the_hardware_conversion(tmp_path):
    """Compiled for a GPU (sm_90 here, no GPU needed), ``_round`` is the hardware's round-to-nearest-even conversion,
    not the interpreter's integer formula: ``combine`` (16 roundings per output element) has no bit masking left."""
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("triton.backends.nvidia")
    repo = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=str(repo / "backends"), TRITON_CACHE_DIR=str(tmp_path))
    done = subprocess.run([sys.executable, "-c", ROUND_PTX], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    ptx = done.stdout
    assert ptx.count("cvt.rn.bf16.f32") >= 16, ptx.count("cvt.rn.bf16.f32")
    assert "-65536" not in ptx  # the integer formula's mask of the top 16 bits
