"""GPT-OSS on the fast path (the GPU's: fused kernels with the Triton expert GEMMs of kernels/fused_moe_gpt_oss.py,
grouping on the device) against Hugging Face transformers, on a checkpoint transformers wrote: float32 logits and
routed ids in HF's slot order, greedy generation through the engine, routing replay, routed weights and prompt
logprobs equal to the op-by-op engine's.

On CPU the kernels run under Triton's interpreter; the GPU's switch (``triton_gemm_max_pairs``, set by
``use_fused_kernels`` on CUDA only) is set by hand, so the same code path runs. ``MOE_TEST_DEVICE=cuda`` runs it on a
GPU with the compiled kernels.
"""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest
import torch

from moe_engine.checkpoint import load_model
from moe_engine.config import load_config
from moe_engine.core.sequence import Request, SamplingParams
from moe_engine.engine import Engine, EngineConfig
from moe_engine.kernels import fused_moe_gpt_oss
from moe_engine.kernels import moe_routing as routing_kernels
from moe_engine.kernels import support as kernel_support
from moe_engine.layers.experts import GptOssExperts, StepRouting
from moe_engine.models.decoder import reference_forward

from .hf_checkpoints import hf_forward_with_routing, load_hf, make_hf_model, save_hf_checkpoint
from .test_engine import Collector, run_all

DEVICE = os.environ.get("MOE_TEST_DEVICE", "cpu")

pytestmark = pytest.mark.skipif(not kernel_support.available(DEVICE), reason="Triton not available for this device")


def prompt_of(n: int, seed: int) -> list[int]:
    return torch.randint(3, 250, (n,), generator=torch.Generator().manual_seed(seed)).tolist()  # vocab 256


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """GPT-OSS's tiny config (hf_checkpoints.py: sinks, sliding window 8, swiglu_limit 0.1, expert biases), with a
    larger limit too so that the clamp is not the whole story: written by transformers in float32."""
    out = tmp_path_factory.mktemp("gpt_oss_fast")
    return save_hf_checkpoint(make_hf_model("gpt_oss", seed=0, dtype=torch.float32, swiglu_limit=3.0), out)


def fast_path(model) -> list[GptOssExperts]:
    """Switch the fused kernels on as on a GPU: the within-rounding set (the fused router, small_linear, one-pass
    norms) and the experts' Triton GEMMs for every step size."""
    assert model.use_fused_kernels(True, within_rounding=True)
    experts = [m for m in model.modules() if isinstance(m, GptOssExperts)]
    for m in experts:
        m.triton_gemm_max_pairs = sys.maxsize
    assert model.graph_unsafe_reason() is None and model.prefill_graph_unsafe_reason() is None
    return experts


def count_expert_gemms(monkeypatch) -> dict:
    """Counts the fused experts' GEMM calls ("n") and the fused router's launches by name."""
    calls = {"n": 0}

    def counting(module, name, key):
        fn = getattr(module, name)

        def counted(*a, **kw):
            calls[key] = calls.get(key, 0) + 1
            return fn(*a, **kw)

        monkeypatch.setattr(module, name, counted)

    counting(fused_moe_gpt_oss, "expert_mlp", "n")
    for name in ("topk_softmax", "topk_softmax_route", "combine_rms_norm"):
        counting(routing_kernels, name, name)
    return calls


def test_float32_logits_and_routing_match_hf_on_the_fast_path(checkpoint, monkeypatch):
    hf = load_hf(checkpoint, torch.float32, attn_implementation="eager")
    model = load_model(checkpoint, dtype="auto", device=DEVICE, progress=False)
    fast_path(model)
    calls = count_expert_gemms(monkeypatch)
    # steps of 4+ tokens sum a MoE layer's expert outputs in the next norm's launch (a GPU does it from 512)
    monkeypatch.setattr(routing_kernels, "COMBINE_NORM_MIN_TOKENS", 4)
    for n, seed in ((23, 1), (1, 2), (40, 3)):
        ids = prompt_of(n, seed)
        hf_logits, hf_routed = hf_forward_with_routing(hf, torch.tensor([ids]))
        logits, routed = reference_forward(model, ids)
        # the GEMMs sum in their own float32 order: float32 rounding, not HF's bits
        torch.testing.assert_close(logits.cpu(), hf_logits[0], atol=1e-4, rtol=1e-4)
        for layer, ref in hf_routed.items():
            assert torch.equal(routed[:, layer].long().cpu(), ref), (n, layer)  # ids and HF's slot order
    L = model.config.num_hidden_layers
    assert calls["n"] == 3 * L
    # the router in one launch; the one-token step's also grouped the pairs (no route launch of its own)
    assert calls["topk_softmax"] == 2 * L and calls["topk_softmax_route"] == L
    assert calls["combine_rms_norm"] == 2 * L  # every layer's output of the two long prompts, in the next norm


def test_forced_routing_and_routed_weights_on_the_fast_path(checkpoint):
    """Replay: tokens forced to other experts get the op-by-op path's weights and outputs (within float32
    rounding) and their forced ids captured; forcing the ids a token chose anyway changes no bit."""
    model = load_model(checkpoint, dtype="auto", device=DEVICE, progress=False)
    cfg = model.config
    ids = torch.tensor(prompt_of(12, 4), device=DEVICE)
    T, L, K = len(ids), cfg.num_hidden_layers, cfg.num_experts_per_tok
    forced_ids = torch.stack([torch.randperm(cfg.num_experts, generator=torch.Generator().manual_seed(t))[:K]
                              for t in range(T * L)]).view(T, L, K).to(DEVICE)
    mask = torch.arange(T, device=DEVICE) % 2 == 0

    def run(forced: bool):
        from moe_engine.core.kv_cache import KVCache
        from moe_engine.layers.attend import ForwardBatch

        cache = KVCache.for_sequences(model.kv_layout(), 1, T, model.dtype, DEVICE)
        batch = ForwardBatch.build([cache.sequence_blocks(0)], [0], [T], DEVICE, cache.block_size)
        cap = torch.zeros(T, L, K, dtype=torch.int32, device=DEVICE)
        wcap = torch.zeros(T, L, K, dtype=torch.float32, device=DEVICE)
        routing = StepRouting(ids=cap, weights=wcap, forced_mask=mask if forced else None,
                              forced_ids=forced_ids if forced else None)
        with torch.inference_mode():
            return model.compute_logits(model(ids, batch, cache, routing)), cap, wcap

    model.use_fused_kernels(False)
    ref = run(True)
    ref_free = run(False)
    fast_path(model)
    got = run(True)
    assert torch.equal(got[1], ref[1])  # captured ids: the forced ones on even tokens, the router's elsewhere
    assert torch.equal(got[1][mask].long(), forced_ids[mask])
    torch.testing.assert_close(got[2], ref[2], atol=1e-6, rtol=1e-5)  # weights
    torch.testing.assert_close(got[0], ref[0], atol=1e-4, rtol=1e-4)
    # forcing each token's own choice: the same bits as not forcing
    free = run(False)
    torch.testing.assert_close(free[0], ref_free[0], atol=1e-4, rtol=1e-4)
    forced_ids.copy_(free[1].long())
    again = run(True)
    assert torch.equal(again[0], free[0]) and torch.equal(again[1], free[1]) and torch.equal(again[2], free[2])


def test_engine_on_the_fast_path_hands_out_what_the_op_by_op_engine_does(checkpoint, monkeypatch):
    """Greedy generation with routed experts, routed weights and prompt logprobs (prefill chunks beside decode
    steps), and a replayed request: the same tokens and routing rows, weights and logprobs within float32 rounding."""
    path = checkpoint
    cfg, model = load_config(path), load_model(path, dtype="auto", device=DEVICE, progress=False)

    def run(fast: bool):
        # on a GPU: not 90% of its memory, and graphs for a few sequences only (each captured at start)
        gpu = {} if DEVICE == "cpu" else {"kv_cache_memory_bytes": 256 << 20, "max_num_seqs": 8}
        engine = Engine(model, cfg, EngineConfig(max_model_len=64, max_num_batched_tokens=16, fused_kernels=fast, **gpu))
        if fast:
            fast_path(model)
        else:
            model.use_fused_kernels(False)
        outs = []
        for i in range(3):
            out, c = [], Collector()
            c2 = lambda o, _c=c, _out=out: (_out.append(o), _c(o))  # noqa: E731
            engine.add_request(Request(
                request_id=engine.new_request_id(), prompt_token_ids=prompt_of(6 + 7 * i, 30 + i),
                sampling=SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), return_routed_experts=True,
                return_routed_weights=True, prompt_logprobs=2 if i != 1 else None, on_output=c2,
                replay_routed_experts=(np.tile(np.arange(cfg.num_experts_per_tok), (5, cfg.num_hidden_layers, 1))
                                       if i == 2 else None),
            ))
            outs.append((c, out))
            engine.step()
        run_all(engine, [c for c, _ in outs])
        return outs

    reference = run(False)
    calls = count_expert_gemms(monkeypatch)
    fast = run(True)
    assert calls["n"] > 0
    for (a, a_out), (b, b_out) in zip(reference, fast):
        assert a.tokens == b.tokens and a.finish_reason == b.finish_reason
        np.testing.assert_array_equal(a.routing, b.routing)
        wa = np.concatenate([o.routed_weights for o in a_out if o.routed_weights is not None])
        wb = np.concatenate([o.routed_weights for o in b_out if o.routed_weights is not None])
        np.testing.assert_allclose(wa, wb, atol=1e-6, rtol=1e-5)
        pa = [o.prompt_logprobs for o in a_out if o.prompt_logprobs is not None]
        pb = [o.prompt_logprobs for o in b_out if o.prompt_logprobs is not None]
        assert len(pa) == len(pb)
        for x, y in zip(pa, pb):
            np.testing.assert_allclose(x, y, atol=1e-4, rtol=1e-4)
    replayed = run(True)[2][0].routing
    assert (replayed[:5] == np.arange(cfg.num_experts_per_tok)).all()


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs")
def test_decode_and_prefill_steps_replay_cuda_graphs_as_eager_steps_compute(checkpoint):
    """GPT-OSS takes the graphs (decode and prefill steps) where it used to run eagerly (experts grouped on the
    host): greedy tokens and routed ids equal the eager engine's (float32, where padding's other tile configs only
    move the last bits)."""
    cfg = load_config(checkpoint)
    model = load_model(checkpoint, dtype="auto", device=DEVICE, progress=False)

    def run(eager: bool):
        engine = Engine(model, cfg, EngineConfig(max_model_len=96, max_num_batched_tokens=64, enforce_eager=eager,
                                                 kv_cache_memory_bytes=256 << 20, max_num_seqs=8))
        assert engine.runner.graphs_on is (not eager), engine.runner.describe_graphs()
        if not eager:
            assert engine.runner.prefill_graphs is not None, engine.runner.describe_graphs()
        outs = []
        for i in range(4):
            c = Collector()
            engine.add_request(Request(request_id=engine.new_request_id(), prompt_token_ids=prompt_of(5 + 9 * i, i),
                                       sampling=SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
                                       on_output=c))
            outs.append(c)
        run_all(engine, outs)
        return outs

    for a, b in zip(run(True), run(False)):
        assert a.tokens == b.tokens
        np.testing.assert_array_equal(a.routing, b.routing)


def test_bfloat16_fast_path_routes_as_the_op_by_op_path(tmp_path, record_property):
    """bf16 (the serving dtype): the fast path's ids equal the op-by-op forward's in slot order for every (token,
    layer) but (near) ties: where they differ, the router logits of the two choices are equal or a few bf16 ulps
    apart (exact ties: torch.topk leaves their order unspecified; near ties: the GEMMs' other summation order
    rounds a hidden state the other way). Tokens routed alike in every layer get logits within bf16 rounding."""
    path = save_hf_checkpoint(make_hf_model("gpt_oss", seed=1, dtype=torch.bfloat16, swiglu_limit=3.0), tmp_path)
    model = load_model(path, dtype="auto", device=DEVICE, progress=False)
    assert model.dtype == torch.bfloat16
    router_logits: list[dict[int, torch.Tensor]] = [{}, {}]  # op-by-op, fast: layer -> [T, E] float32

    def hook(layer: int):
        def keep(module, inputs, _output):
            x = inputs[0]
            logits = torch.nn.functional.linear(x, module.weight, module.bias)  # the router's logits (T > 4 tokens)
            router_logits[1 if module.within_rounding else 0][layer] = logits.float()
        return keep

    handles = [layer.mlp.router.register_forward_hook(hook(i)) for i, layer in enumerate(model.model.layers)]
    ids = prompt_of(48, 7)
    model.use_fused_kernels(False)
    ref_logits, ref_routed = reference_forward(model, ids)
    fast_path(model)
    logits, routed = reference_forward(model, ids)
    for h in handles:
        h.remove()
    layers = list(model.config.moe_layers)
    differs = (routed[:, layers] != ref_routed[:, layers]).any(-1)  # [T, L]
    same = 1 - differs.float().mean().item()
    record_property("bf16_fast_path_id_agreement", same)
    print(f"\n[gpt_oss] bf16 fast path: ids equal the op-by-op path's for {same:.2%} of (token, layer)")
    for t, j in differs.nonzero().tolist():
        layer = layers[j]
        for which, chosen in ((0, ref_routed), (1, routed)):
            lg = router_logits[which][layer][t]
            a, b = lg[ref_routed[t, layer].long()], lg[routed[t, layer].long()]
            # the two choices' logits in either forward: equal, or within 2 ulps of bf16 at their magnitude
            assert torch.all((a - b).abs() <= 2 * 2.0**-8 * torch.maximum(a.abs(), b.abs()) + 1e-6), (t, layer, a, b)
    assert same >= 0.95
    alike = ~differs.any(-1)
    torch.testing.assert_close(logits[alike], ref_logits[alike], rtol=0.05, atol=0.05)
