"""Tensor and expert parallelism on CPU over gloo, with real processes: an engine split over 2 ranks (this test
process is rank 0 and starts rank 1, as a Triton model instance does) gives what the unsplit engine gives.

- float32, TP = 2 with and without expert parallelism vs TP = 1: the same greedy tokens, the same routed experts
  (logical ids, every row), combine weights within 1e-5 (atol and rtol, the project's float32 tolerance; the
  all-reduce adds partial sums in another order, so bits differ) and logprobs of the sampled and the prompt
  tokens within the across-batches bound (tests/tolerances.py: the all-reduce sums in another order); steps mix chunked prefills, decodes, prefix-cache hits and a routing replay;
- every architecture (checkpoints written by transformers: experts per expert, 3-D, or MXFP4): the sharded
  model's logits and routed experts equal the unsharded model's, with KV heads replicated (fewer KV heads than
  ranks) and a vocabulary that does not divide evenly;
- a rank killed mid-request: the request ends with an error, the engine is dead, nothing hangs, no process is
  left; shutdown stops the other ranks (exit code 0).
"""
from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import replace

import numpy as np
import pytest
import torch

from moe_engine.checkpoint import load_model
from moe_engine.config import load_config
from moe_engine.core.sampling import SamplingParams
from moe_engine.distributed.ranks import build_parallel_engine
from moe_engine.engine import Engine, EngineConfig, Request
from moe_engine.engine_config import check_parallel
from moe_engine.errors import EngineStoppedError
from moe_engine.models.decoder import reference_forward

from ..tolerances import assert_close_across_batches
from .hf_checkpoints import ARCHS, HYBRID_ARCHS, hf_config, make_hf_model, save_gpt_oss_mxfp4, save_hf_checkpoint
from .parallel_harness import rank_processes, two_ranks
from .test_replay import Result

TOL = dict(atol=1e-5, rtol=1e-5)


class Outputs(Result):
    """Everything a client gets back: tokens, routed experts, combine weights, logprobs, prompt logprobs."""

    def __init__(self):
        super().__init__()
        self.top: list[np.ndarray] = []

    def __call__(self, out):
        if out.top_logprobs is not None:
            self.top.append(out.top_logprobs)
        super().__call__(out)


def prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 500, (n,), generator=g).tolist()


def submit_mix(engine: Engine, cfg) -> list[Outputs]:
    """Four requests batched together: a prompt scored token by token, one sharing its first 32 tokens (prefix
    cache), one whose first 6 tokens' experts are replayed (combine weights asked), a short one. The first and
    the third return logprobs; the other two decode longer, alone at the end (overlapped when the engine may)."""
    shared = prompt(40, 1)
    replay = np.stack([np.arange(i, i + cfg.num_experts_per_tok) % cfg.num_experts
                       for i in range(6 * cfg.num_hidden_layers)]).reshape(6, cfg.num_hidden_layers, -1)
    asks = [
        (shared, 10, 3, dict(prompt_logprobs=2)),
        (shared[:32] + prompt(9, 2), 24, None, {}),
        (prompt(20, 3), 10, 3, dict(replay_routed_experts=replay, return_routed_weights=True)),
        (prompt(5, 4), 24, None, {}),
    ]
    outs = []
    for i, (ids, max_tokens, logprobs, extra) in enumerate(asks):
        o = Outputs()
        engine.add_request(Request(
            request_id=f"r{i}", prompt_token_ids=ids, on_output=o,
            sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=logprobs),
            **extra,
        ))
        outs.append(o)
    for _ in range(1000):
        if all(o.done.is_set() for o in outs):
            return outs
        engine.step()
    raise AssertionError("requests did not finish")


@pytest.fixture(scope="module")
def single_rank(tiny_checkpoint):
    cfg = load_config(tiny_checkpoint)
    model = load_model(tiny_checkpoint, dtype="float32", progress=False)
    return submit_mix(Engine(model, cfg, EngineConfig(max_model_len=256, max_num_batched_tokens=32)), cfg)


# The expert-parallel run also overlaps decode steps (the GPU default): the next step's token ids never leave rank
# 0's device and reach rank 1 by the device group's broadcast.
@pytest.mark.parametrize("expert_parallel", [False, True], ids=["tp2", "tp2-ep-overlapped"])
def test_two_ranks_give_what_one_gives(expert_parallel, tiny_checkpoint, single_rank):
    cfg = load_config(tiny_checkpoint)
    ecfg = EngineConfig(max_model_len=256, max_num_batched_tokens=32, tensor_parallel_size=2,
                        enable_expert_parallel=expert_parallel, async_scheduling=expert_parallel)
    engine = build_parallel_engine(tiny_checkpoint, "float32", "cpu", cfg, ecfg)
    publish, device_ids = engine.runner.publish, []

    def counting(step, input_ids):
        device_ids.append(step.ids is None)
        publish(step, input_ids)

    engine.runner.publish = counting
    try:
        split = submit_mix(engine, cfg)
        assert engine.blocks.hit_tokens >= 32  # the second request read the first one's blocks
        assert any(device_ids) == expert_parallel  # overlapped steps took their ids from rank 0's device
    finally:
        engine.shutdown()
    for one, two in zip(single_rank, split):
        assert two.error is None and two.finish_reason == "length"
        assert two.tokens == one.tokens
        np.testing.assert_array_equal(two.routing, one.routing)  # every row, logical ids
    for i in (0, 2):
        assert_close_across_batches(np.concatenate(split[i].top), np.concatenate(single_rank[i].top))
        assert_close_across_batches(split[i].logprobs, single_rank[i].logprobs)
    assert_close_across_batches(split[0].prompt_logprobs[0], single_rank[0].prompt_logprobs[0])
    np.testing.assert_array_equal(split[0].prompt_logprobs[2], single_rank[0].prompt_logprobs[2])
    np.testing.assert_allclose(split[2].routed_weights, single_rank[2].routed_weights, **TOL)
    np.testing.assert_array_equal(split[2].routing[:6], submit_replay_rows(cfg))
    procs = engine.parallel.procs
    assert [p.returncode for p in procs] == [0], "told to stop, rank 1 did not leave cleanly"
    assert not rank_processes()


def submit_replay_rows(cfg) -> np.ndarray:
    rows = np.stack([np.arange(i, i + cfg.num_experts_per_tok) % cfg.num_experts
                     for i in range(6 * cfg.num_hidden_layers)]).reshape(6, cfg.num_hidden_layers, -1)
    return rows.astype(np.uint16)


def test_a_rank_killed_mid_request_fails_the_request_and_leaves_no_process(tiny_checkpoint):
    cfg = load_config(tiny_checkpoint)
    engine = build_parallel_engine(tiny_checkpoint, "float32", "cpu", cfg,
                                   EngineConfig(max_model_len=4096, tensor_parallel_size=2))
    engine.start()
    try:
        first = threading.Event()
        out = Outputs()

        def on_output(o):
            first.set()
            out(o)

        engine.add_request(Request(request_id="long", prompt_token_ids=prompt(16, 5), on_output=on_output,
                                   sampling=SamplingParams(max_tokens=3000, temperature=0.0, ignore_eos=True)))
        assert first.wait(60)
        rank1 = engine.parallel.procs[0]
        os.kill(rank1.pid, signal.SIGKILL)
        assert out.done.wait(30), "the request did not end after its rank died"
        assert out.finish_reason == "error" and len(out.tokens) < 3000
        assert engine.dead is not None
        with pytest.raises(EngineStoppedError):
            engine.add_request(Request(request_id="after", prompt_token_ids=[5, 6, 7]))
    finally:
        t0 = time.monotonic()
        engine.shutdown()
        assert time.monotonic() - t0 < 20
    assert rank1.poll() is not None
    assert not rank_processes()


def test_parallel_sizes_are_checked_before_loading(tiny_checkpoint):
    cfg = load_config(tiny_checkpoint)  # 4 query heads, 2 KV heads, 8 experts of width 128
    check_parallel(cfg, 4, expert_parallel=True)  # KV heads replicated, 2 experts per rank
    with pytest.raises(ValueError, match="num_attention_heads"):
        check_parallel(cfg, 3, expert_parallel=False)
    six = replace(cfg, router=replace(cfg.router, num_experts=6), experts=replace(cfg.experts, num_experts=6))
    check_parallel(six, 2, expert_parallel=True)
    with pytest.raises(ValueError, match="number of experts"):
        check_parallel(six, 4, expert_parallel=True)


def test_hybrid_models_refuse_tensor_parallelism(tmp_path):
    for arch in HYBRID_ARCHS:
        hf_config(arch).save_pretrained(tmp_path / arch)
        cfg = load_config(tmp_path / arch)
        check_parallel(cfg, 1, expert_parallel=False)
        with pytest.raises(ValueError, match="hybrid"):
            check_parallel(cfg, 2, expert_parallel=True)


# ----------------------------------------------------------------------------- every architecture, model level

# (architecture, config overrides, how the checkpoint stores the experts): per expert as on the Hub by default
CASES = [(arch, {}, "hub") for arch in ARCHS if arch not in HYBRID_ARCHS] + [
    ("mixtral", dict(num_key_value_heads=1), "hub"),  # one KV head, replicated on both ranks
    ("qwen3_moe", dict(vocab_size=255), "fused"),  # vocabulary parts of 128 + 127 (zero-padded); 3-D experts
    ("gpt_oss", {}, "mxfp4"),  # experts as the Hub stores gpt-oss: MXFP4 blocks and scales
]


@pytest.fixture(scope="module")
def arch_checkpoints(tmp_path_factory):
    out = []
    for arch, overrides, layout in CASES:
        path = tmp_path_factory.mktemp(f"tp-{arch}-{layout}")
        model = make_hf_model(arch, seed=0, dtype=torch.float32, **overrides)
        if layout == "mxfp4":
            out.append(save_gpt_oss_mxfp4(model, path))
        else:
            out.append(save_hf_checkpoint(model, path, fused=layout == "fused"))
    return out


def test_every_architecture_split_over_two_ranks_matches_one_rank(arch_checkpoints):
    ids = prompt(24, 9)
    ids = [i % 250 + 3 for i in ids]
    cases = [dict(checkpoint=str(path), expert_parallel=ep, ids=ids)
             for path in arch_checkpoints for ep in (False, True)]
    with two_ranks() as run:
        results = run(cases)
    for case, (logits, routed) in zip(cases, results):
        full = load_model(case["checkpoint"], dtype="float32", progress=False)
        ref_logits, ref_routed = reference_forward(full, ids)
        what = f"{full.config.architecture} {os.path.basename(case['checkpoint'])} ep={case['expert_parallel']}"
        assert logits.shape == ref_logits.shape, what
        torch.testing.assert_close(logits, ref_logits, **TOL, msg=lambda m: f"{what}: {m}")
        assert torch.equal(routed, ref_routed), what
