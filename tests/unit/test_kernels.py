"""Fused Triton kernels (moe_engine/kernels.py): the fused forward returns the same bits as the op-by-op one.

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

from moe_engine import kernels
from moe_engine.checkpoint import load_model
from moe_engine.config import load_config
from moe_engine.engine import Engine, EngineConfig
from moe_engine.model import reference_forward

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


class LaunchCounter:
    """Counts calls of the kernels' Python entry points (which fused paths a forward took)."""

    NAMES = ("add_square", "rms_norm_tail", "qk_norm_rope", "route", "combine", "store_kv")

    def __init__(self, monkeypatch):
        self.calls: dict[str, int] = {}
        for name in self.NAMES:
            fn = getattr(kernels, name)

            def counted(*args, _fn=fn, _name=name, **kw):
                result = _fn(*args, **kw)
                key = _name if not (_name == "route" and result is None) else "route_fallback"
                self.calls[key] = self.calls.get(key, 0) + 1
                return result

            monkeypatch.setattr(kernels, name, counted)


def forward_both_ways(model, ids):
    model.use_fused_kernels(False)
    expected = reference_forward(model, ids)
    assert model.use_fused_kernels(True)
    try:
        return expected, reference_forward(model, ids)
    finally:
        model.use_fused_kernels(False)


@pytest.mark.parametrize("arch", ARCHS)
def test_fused_forward_is_bit_identical_for_every_architecture(arch, bf16_checkpoints, monkeypatch):
    """bf16 (the serving dtype): logits and routed ids (slot order) equal to the last bit, with the expert
    bookkeeping done by the `route` kernel (a decode-sized step) and by torch's sort (larger)."""
    model = load_model(bf16_checkpoints(arch), device=DEVICE, progress=False)
    counter = LaunchCounter(monkeypatch)
    for n, max_pairs in ((6, kernels.ROUTE_MAX_PAIRS), (20, 16)):  # 16: forces torch's sort at 20 tokens
        monkeypatch.setattr(kernels, "ROUTE_MAX_PAIRS", max_pairs)
        counter.calls.clear()
        (ref_logits, ref_routed), (logits, routed) = forward_both_ways(model, prompt_of(n, seed=n))
        assert torch.equal(logits, ref_logits), (arch, n, (logits - ref_logits).abs().max())
        assert torch.equal(routed, ref_routed), (arch, n)
        # every norm is fused (2 per layer + the final one; with the layer inputs' residual adds)
        assert counter.calls["rms_norm_tail"] >= 2 * model.config.num_hidden_layers + 1
        if model.config.attention.mla is None:  # MLA keeps its own attention (latent cache, complex/interleaved rope)
            assert counter.calls["qk_norm_rope"] == counter.calls["store_kv"] == model.config.num_hidden_layers
        if arch != "gpt_oss":  # GPT-OSS's biased clamped experts keep their own path
            assert counter.calls["combine"] == len(model.config.moe_layers)
            assert counter.calls["route" if n == 6 else "route_fallback"] == len(model.config.moe_layers)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fused_forward_is_bit_identical_in_other_dtypes(dtype, bf16_checkpoints):
    """float32 (no rounding between ops) and float16 (the other rounding); Qwen3: per-head q/k norm."""
    model = load_model(bf16_checkpoints("qwen3_moe"), dtype=dtype, device=DEVICE, progress=False)
    (ref_logits, ref_routed), (logits, routed) = forward_both_ways(model, prompt_of(12, seed=3))
    assert torch.equal(logits, ref_logits) and torch.equal(routed, ref_routed)


def test_route_orders_pairs_like_a_stable_sort_by_expert():
    """pos/tok/offs of the `route` kernel against torch's stable argsort of the slot-major pairs."""
    g = torch.Generator().manual_seed(0)
    # several blocks of 64 pairs, experts beyond one block of 64, experts left without a pair
    for T, K, E in ((13, 4, 16), (45, 6, 150)):
        ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).to(DEVICE)
        pos, tok, offs = kernels.route(ids, E)
        order = torch.argsort(ids.t().reshape(-1), stable=True)
        assert torch.equal(tok, order % T)
        assert torch.equal(offs.cpu().long(), torch.cumsum(torch.bincount(ids.reshape(-1).cpu(), minlength=E), 0))
        flat_pos = pos.t().reshape(-1)  # slot-major like the pairs
        assert torch.equal(order[flat_pos], torch.arange(T * K, device=ids.device))
    assert kernels.route(torch.zeros(4097, 1, dtype=torch.long, device=DEVICE), 64) is None  # too big: fallback


def test_engine_with_fused_kernels_hands_out_what_the_op_by_op_engine_does(bf16_checkpoints):
    """Four requests of different lengths arriving over time (prefill chunks mixed with decode steps,
    greedy and seeded sampling): the same tokens and routing rows with and without fused kernels."""
    path = bf16_checkpoints("olmoe")
    cfg, model = load_config(path), load_model(path, device=DEVICE, progress=False)

    def run(fused: bool):
        engine = Engine(model, cfg, EngineConfig(max_model_len=96, max_num_batched_tokens=16, fused_kernels=fused))
        assert engine.fused is fused
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
