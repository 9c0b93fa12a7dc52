"""Hybrid models (Gated DeltaNet / Mamba-2 layers beside attention) in the engine: the per-sequence recurrent state.

On checkpoints transformers wrote (float32), through the engine API:
- a prompt longer than several of HF's 64-token delta-rule chunks, prefilled over several steps of a small token
  budget (the state carried across steps, chunk boundaries not aligned with HF's): its prompt logprobs equal HF's
  one-call forward to 1e-5, the expert sets of every prompt and generated token equal those HF's routers chose,
  and 20 greedy tokens equal HF's ``generate``;
- preemption (recompute from the prompt) under a small memory budget, sequential and overlapped steps: every
  request ends with exactly the tokens and routing rows of an idle engine with memory to spare;
- more requests than state slots run to the end, each slot back in the free list afterwards;
- the prefix cache is off for hybrid models (the reason is stated), and a repeated prompt gives the same results.
"""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from moe_engine.checkpoint import load_model
from moe_engine.config import load_config
from moe_engine.core.kv_cache import bytes_per_block, state_bytes
from moe_engine.core.sampling import SamplingParams
from moe_engine.engine import Engine, EngineConfig, Request

from .hf_checkpoints import HYBRID_ARCHS, hf_router_modules, load_hf
from .test_engine import Collector, run_all, submit
from .test_hf_parity import checkpoints, random_ids  # noqa: F401 (fixture)


class Result(Collector):
    def __init__(self):
        super().__init__()
        self.prompt_logprobs = None
        self.num_cached = 0

    def __call__(self, out):
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        self.num_cached = out.num_cached_tokens
        super().__call__(out)


DEVICE = os.environ.get("MOE_TEST_DEVICE", "cpu")  # `MOE_TEST_DEVICE=cuda`: the same checks on a GPU


def engine_for(path, **kw) -> Engine:
    kw.setdefault("max_model_len", 256)
    kw.setdefault("max_num_seqs", 4)
    if DEVICE != "cpu":  # not 90% of the GPU for each engine
        kw.setdefault("kv_cache_memory_bytes", 64 << 20)
    model = load_model(path, dtype="float32", device=DEVICE, progress=False)
    return Engine(model, load_config(path), EngineConfig(**kw))


@pytest.mark.parametrize("arch", HYBRID_ARCHS)
def test_chunked_prefill_over_steps_matches_hf(arch, checkpoints):
    path = checkpoints(arch, torch.float32)
    hf = load_hf(path, torch.float32)
    prompt, new = random_ids(150, seed=61), 20  # > 2 of HF's 64-token chunks
    engine = engine_for(path, max_num_batched_tokens=40)  # the prompt over 4 steps (40 + 40 + 40 + 30 tokens)
    r = Result()
    engine.add_request(Request(request_id="long", prompt_token_ids=prompt, on_output=r, prompt_logprobs=0,
                               sampling=SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)))
    run_all(engine, [r])
    assert r.error is None
    assert engine.stats()["steps"] >= 4 + new - 1

    rows: dict[int, list[torch.Tensor]] = {}
    hooks = [g.register_forward_hook(lambda _m, _i, out, l=l: rows.setdefault(l, []).append(out[2].clone()))
             for l, g in hf_router_modules(hf).items()]
    try:
        with torch.no_grad():
            logits = hf(torch.tensor([prompt])).logits[0].float()
            rows.clear()
            out = hf.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False, eos_token_id=None,
                              pad_token_id=0)
    finally:
        for h in hooks:
            h.remove()
    hf_lp = torch.log_softmax(logits[:-1], -1).gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
    np.testing.assert_allclose(r.prompt_logprobs, hf_lp.numpy(), rtol=1e-5, atol=1e-5)
    assert r.tokens == out[0, len(prompt):].tolist()
    cfg = engine.cfg
    assert r.routing.shape == (len(prompt) + new - 1, cfg.num_hidden_layers, cfg.num_experts_per_tok)
    for layer, calls in rows.items():  # HF generate: the prompt in one call, then one token per call
        ref = torch.cat(calls).sort(-1).values.numpy()
        np.testing.assert_array_equal(np.sort(r.routing[:, layer], -1), ref, err_msg=f"{arch} layer {layer}")


def _workload(engine, seed: int) -> list[Collector]:
    specs = [(90, 40), (130, 30), (60, 50), (110, 35)]
    out = []
    for i, (p, n) in enumerate(specs):
        sampling = dict(max_tokens=n, ignore_eos=True)
        if i == 3:
            sampling.update(temperature=0.8, seed=42)
        out.append(submit(engine, random_ids(p, seed + i), **sampling))
    run_all(engine, out, max_steps=50_000)
    return out


@pytest.mark.parametrize("arch, overlapped", [("qwen3_next", False), ("qwen3_next", True), ("qwen3_5_moe", False),
                                               ("nemotron_h", True)])
def test_preemption_returns_exactly_what_an_idle_engine_returns(checkpoints, arch, overlapped):
    path = checkpoints(arch, torch.float32)
    roomy = engine_for(path, max_num_batched_tokens=64)
    want = _workload(roomy, seed=70)
    assert roomy.stats()["num_preemptions"] == 0

    cfg, model = roomy.cfg, roomy.model
    specs, bs = model.kv_layout(), roomy.settings.block_size
    # the four sequences' recurrent states, and blocks for about half of the 645 tokens they reach
    budget = state_bytes(specs, 4, model.dtype) + (-(-320 // bs) + 1) * bytes_per_block(specs, bs, model.dtype)
    tight = engine_for(path, max_num_batched_tokens=64, kv_cache_memory_bytes=budget, async_scheduling=overlapped)
    got = _workload(tight, seed=70)
    stats = tight.stats()
    assert stats["num_preemptions"] >= 2, stats
    for a, b in zip(got, want):
        assert a.tokens == b.tokens
        np.testing.assert_array_equal(a.routing, b.routing)
    assert sorted(tight.blocks.free_state_slots) == list(range(4))
    assert stats["free_blocks"] == stats["num_blocks"]


def test_more_requests_than_state_slots(checkpoints):
    path = checkpoints("qwen3_5_moe", torch.float32)
    alone = [_workload(engine_for(path, max_num_seqs=1), seed=80)]
    engine = engine_for(path, max_num_seqs=2)
    got = _workload(engine, seed=80)
    for a, b in zip(got, alone[0]):  # slots handed from one sequence to the next start from zeros
        assert a.tokens == b.tokens
        np.testing.assert_array_equal(a.routing, b.routing)
    assert sorted(engine.blocks.free_state_slots) == [0, 1]
    assert engine.runner.kv.num_state_slots == 2 and engine.runner.kv.state_nbytes > 0


def test_prefix_caching_is_off_for_hybrid_models(checkpoints):
    path = checkpoints("qwen3_next", torch.float32)
    cfg = load_config(path)
    assert cfg.is_hybrid and "recurrent state" in cfg.prefix_caching_off_reason
    assert cfg.metadata()["layer_types"] == list(cfg.layer_types)
    engine = engine_for(path, enable_prefix_caching=True)
    assert not engine.settings.enable_prefix_caching and not engine.blocks.enable_prefix_caching
    prompt = random_ids(70, seed=90)
    first, again = Result(), Result()
    for r in (first, again):
        engine.add_request(Request(request_id=engine.new_request_id(), prompt_token_ids=prompt, on_output=r,
                                   sampling=SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)))
        run_all(engine, [r])
    assert again.num_cached == 0 and again.tokens == first.tokens
    np.testing.assert_array_equal(again.routing, first.routing)


def test_start_up_warns_when_recurrent_states_crowd_out_the_kv_cache(checkpoints, caplog):
    """A hybrid model's per-sequence states come out of the KV budget before the blocks: when they take most of it
    (Qwen3.5-35B-A3B on an 80 GB H100: 64 sequences' states took 3.9 of a 4.0 GiB budget, leaving 2,432 KV tokens
    and two sequences at a time) the start-up log warns and says what each sequence fewer gives back."""
    path = checkpoints("qwen3_5_moe", torch.float32)
    small = engine_for(path, max_num_seqs=2)
    specs, block = small.runner.model.kv_layout(), small.settings.block_size
    per_seq = state_bytes(specs, 1, torch.float32) // 2
    blocks = bytes_per_block(specs, block, torch.float32) * (2 * 256 // block + 2)  # two sequences' KV, the null block
    many = blocks // per_seq + 2  # sequences whose states (and the null slot's) take more than half the budget
    budget = blocks + per_seq * (many + 1)
    logs = {}
    for seqs in (many, 2):
        caplog.clear()
        with caplog.at_level("INFO", logger="moe_engine"):
            engine = engine_for(path, max_num_seqs=seqs, kv_cache_memory_bytes=budget)
        logs[seqs] = (caplog.text, engine.blocks.num_blocks)
    warned, quiet = logs[many][0], logs[2][0]
    assert f"recurrent states of {many} sequences take" in warned
    assert f"each --max-num-seqs fewer gives the KV cache {per_seq / 2**20:.1f} MiB more" in warned
    assert "recurrent states of" not in quiet
    assert logs[2][1] > logs[many][1]  # the other sequences' states went to KV blocks
    assert "max_model_len (256) at once" in warned
