"""What a step's activations take (core/memory_plan.py) and the logits computed in chunks for large vocabularies.

The GPU's KV budget (core/kv_cache.py) reserves twice a profiled peak step; these tests bound, on CPU, what such a
step should hold at the real shapes (issue 49: a GPT-OSS step of 8,192 tokens had profiled ~25 GB, dense attention
scores and full-vocabulary logits), and check that computing logits and prompt logprobs in chunks of rows changes
no bit on CPU.
"""
from __future__ import annotations

import dataclasses
import os

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from moe_engine.checkpoint import load_model
from moe_engine.config import config_from_dict, load_config
from moe_engine.core import memory_plan
from moe_engine.core import runner as runner_module
from moe_engine.core.memory_plan import MemoryDivision, estimate_step_activations, logits_chunk_rows
from moe_engine.core.sequence import Request, SamplingParams
from moe_engine.engine import Engine, EngineConfig
from moe_engine.models import decoder

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from loadtest.bench import real_shape_model as rsm  # noqa: E402


def test_logits_chunk_rows_shrink_with_the_vocabulary():
    assert logits_chunk_rows(1024) == 512 and logits_chunk_rows(131072) == 512
    assert logits_chunk_rows(151936) == 441  # Qwen3
    assert logits_chunk_rows(201088) == 333  # GPT-OSS
    assert logits_chunk_rows(10**9) == memory_plan.MIN_LOGITS_CHUNK_ROWS
    for v in (151936, 201088, 248320):
        assert logits_chunk_rows(v) * v * 4 <= memory_plan.LOGITS_CHUNK_BYTES


@pytest.mark.parametrize("shape,limit_gib", [("gpt-oss-120b-8l", 1.5), ("qwen3-30b-a3b", 1.5), ("qwen3.5-35b-a3b", 1.5)])
def test_a_long_steps_activation_estimate_is_bounded(shape, limit_gib):
    """8,192 tokens (the default step on CUDA) with 256 sampled rows, bf16: the estimate stays far under what the
    dense attention scores alone would take (GPT-OSS: 64 heads x 8192^2 x 2 bytes = 8 GiB per layer), and the
    logits part is the sampled rows', not the step's (8192 x 201,088 x 4 bytes = 6.1 GiB)."""
    cfg = config_from_dict(rsm.SHAPES[shape])
    parts = estimate_step_activations(cfg, 8192, 256, torch.bfloat16)
    assert parts["total"] <= limit_gib * 2**30, {k: round(v / 2**30, 3) for k, v in parts.items()}
    assert parts["logits"] <= 256 * cfg.vocab_size * 8 + logits_chunk_rows(cfg.vocab_size) * cfg.vocab_size * 2
    assert parts["total"] == sum(v for k, v in parts.items() if k != "total")
    # the estimate grows with the step's tokens, not with their square
    double = estimate_step_activations(cfg, 16384, 256, torch.bfloat16)["total"]
    assert double < 2 * parts["total"]


def test_the_startup_account_of_memory_adds_up():
    gib = 2**30
    d = MemoryDivision(total=80 * gib, utilization=0.9, weights=50 * gib, other_in_use=gib, peak_activations=gib,
                       estimated_activations=gib, kv_cache=int(80 * gib * 0.9) - 51 * gib - 2 * gib)
    assert d.weights + d.other_in_use + 2 * d.peak_activations + d.kv_cache + d.kept_back == d.total
    text = d.describe()
    for part in ("weights 50.0 GiB", "KV cache 19.0 GiB", "kept free 8.0 GiB", "2 x 1.00 GiB"):
        assert part in text, text
    assert "MXFP4" not in text
    packed = dataclasses.replace(d, quantized_weights=40 * gib)  # e.g. GPT-OSS's experts kept as MXFP4
    assert "weights 50.0 GiB (40.0 GiB of it MXFP4 / FP8)" in packed.describe()


def test_logits_in_chunks_equal_one_gemm(tiny_checkpoint, monkeypatch):
    model = load_model(tiny_checkpoint, dtype="float32", progress=False)
    hidden = torch.randn(70, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    whole = model.compute_logits(hidden)
    monkeypatch.setattr(decoder, "logits_chunk_rows", lambda vocab: 16)
    assert torch.equal(model.compute_logits(hidden), whole)
    out = torch.full_like(whole, float("nan"))
    assert model.compute_logits(hidden, out=out) is out and torch.equal(out, whole)
    bf16 = load_model(tiny_checkpoint, dtype="bfloat16", progress=False)
    h16 = hidden.to(torch.bfloat16)
    assert torch.equal(bf16.compute_logits(h16), bf16.lm_head(h16).float())


def test_prompt_logprobs_in_chunks_equal_one_chunk(tiny_checkpoint, monkeypatch):
    """A 40-token prompt scored 7 rows at a time gives the bits of one chunk."""
    cfg = load_config(tiny_checkpoint)
    model = load_model(tiny_checkpoint, dtype="float32", progress=False)
    prompt = torch.randint(3, 250, (40,), generator=torch.Generator().manual_seed(1)).tolist()

    def score() -> tuple[np.ndarray, np.ndarray]:
        engine = Engine(model, cfg, EngineConfig(max_model_len=128))
        got = []
        engine.add_request(Request(request_id="r", prompt_token_ids=prompt, on_output=got.append, prompt_logprobs=3,
                                   sampling=SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)))
        while not (got and got[-1].finished):
            engine.step()
        out = next(o for o in got if o.prompt_logprobs is not None)
        return out.prompt_logprobs, out.prompt_top_logprobs

    one = score()
    monkeypatch.setattr(runner_module, "logits_chunk_rows", lambda vocab: 7)
    chunked = score()
    assert one[0].shape == (39,)
    for a, b in zip(one, chunked):
        np.testing.assert_array_equal(a, b)


@pytest.mark.skipif(os.environ.get("MOE_TEST_DEVICE", "cpu") != "cuda", reason="GPU memory: MOE_TEST_DEVICE=cuda")
def test_the_kv_budgets_profiled_step_runs_the_engines_attention():
    """The KV budget reserves twice the peak of a profiled 8,192-token prompt step; that step must run the attention
    the engine runs (paged kernels, dense causal prefill), not the reference path, whose score matrix (GPT-OSS-120B:
    64 heads x 8,192^2, 8 GiB a layer) made the 8-layer cut fail to start on an 80 GB H100, and whose batch-invariant
    form (key by key) held a deterministic engine's start-up for minutes."""
    from moe_engine.core.kv_cache import profile_peak_activation

    heads, tokens = 16, 8192
    model, cfg = rsm.build_engine_model({**rsm.SHAPES["tiny-gpt-oss"], "num_attention_heads": heads},
                                        torch.device("cuda"), torch.bfloat16, seed=0)
    model.use_fused_kernels(True)
    specs = model.kv_layout()
    scores = heads * tokens * tokens * 2  # one layer's bf16 score matrix: 2 GiB
    reference = profile_peak_activation(model, specs, 64, tokens, 256, use_kernels=False)
    kernels = profile_peak_activation(model, specs, 64, tokens, 256, use_kernels=True)
    assert reference >= scores  # what the test tells apart
    assert kernels < scores / 8, (kernels / 2**30, reference / 2**30)
