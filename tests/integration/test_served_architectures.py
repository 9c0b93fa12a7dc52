"""`moe-serve --model <dir>` on checkpoints written by transformers: the routed experts the API returns are
the ids the engine's own forward selects, dense-layer columns stay 0, and /v1/models lists only the MoE
layers. One server start per architecture."""
from __future__ import annotations

import base64
import io
import json

import numpy as np
import pytest

from moe_engine.checkpoint import load_model
from moe_engine.config import load_config
from moe_engine.models.decoder import reference_forward
from openai_frontend.server_process import start_server

from ..unit.hf_checkpoints import ARCHS, write_servable_checkpoint


def decode(s: str) -> np.ndarray:
    return np.load(io.BytesIO(base64.b64decode(s)))


# Every supported architecture, e.g. DeepSeek-V3: a dense first layer, grouped sigmoid router with a non-zero
# correction bias, MLA; Qwen2-MoE: 60 experts top-4, a sigmoid-gated shared expert, a dense middle layer.
SERVED = list(ARCHS)


@pytest.fixture(scope="module", params=SERVED)
def served(request, tmp_path_factory):
    arch = request.param
    ckpt = write_servable_checkpoint(arch, tmp_path_factory.mktemp("ckpt") / arch)
    server = start_server(
        tmp_path_factory.mktemp(f"moe_serve_{arch}"),
        ["--model", str(ckpt), "--served-model-name", arch, "--max-model-len", "256"],
        model_name=arch,
    )
    yield arch, server, ckpt
    code = server.stop()
    assert code == 0, f"moe-serve exited with {code} on SIGTERM:\n{server.log_tail()}"


def test_served_routed_experts_equal_the_engine_forward(served):
    import openai

    arch, server, ckpt = served
    cfg = load_config(ckpt)
    assert cfg.architecture == arch
    client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)

    cards = {m.id: m for m in client.models.list().data}
    card = cards[arch].model_dump()
    assert card["architecture"] == arch and card["num_hidden_layers"] == cfg.num_hidden_layers
    assert card["moe_layers"] == list(cfg.moe_layers)  # dense layers are not listed
    assert not set(card["moe_layers"]) & set(cfg.dense_layers)
    assert card["num_experts"] == cfg.num_experts and card["num_experts_per_tok"] == cfg.num_experts_per_tok

    r = client.completions.create(
        model=arch,
        prompt="The router picks the top-k experts",
        max_tokens=12,
        temperature=0,
        extra_body={"return_token_ids": True},
    )
    choice = r.choices[0]
    prompt_ids, token_ids = choice.prompt_token_ids, choice.token_ids
    assert prompt_ids and token_ids
    arr = decode(choice.routed_experts)
    assert arr.dtype == np.uint8
    assert arr.shape == (len(prompt_ids) + len(token_ids) - 1, cfg.num_hidden_layers, cfg.num_experts_per_tok)

    # The engine's own forward over the same tokens (one prefill) selects the same expert sets as the server's
    # chunked prefill + decode steps did (DeepSeek's top-k slot order is unsorted, so sets are compared).
    model = load_model(ckpt, progress=False)
    logits, ref = reference_forward(model, prompt_ids + token_ids[:-1])
    ref = ref.numpy()
    for layer in cfg.moe_layers:
        np.testing.assert_array_equal(np.sort(arr[:, layer], -1), np.sort(ref[:, layer], -1).astype(np.uint8))
        assert len({tuple(row) for row in np.sort(arr[:, layer], -1)}) > 1  # informative, not constant
    if cfg.dense_layers:
        assert not arr[:, list(cfg.dense_layers)].any()  # dense-layer columns are never written
    # greedy: each generated token is the argmax after its prefix (float32 checkpoint, float32 serving)
    assert logits[len(prompt_ids) - 1 :].argmax(-1).tolist() == token_ids


# The families added for issue 51: every endpoint, streaming and n > 1 on each one's own server (the older families
# get these through the tiny model's tests/integration/test_openai_*.py).
ALL_ENDPOINTS = ("glm4_moe", "glm4_moe_lite", "qwen3_next", "qwen3_5_moe", "nemotron_h")


def _engine_rows(ckpt, ids: list[int]) -> np.ndarray:
    """The engine's own forward of ``ids`` in one step: routed ids [T, L, K], sorted within each row."""
    return np.sort(reference_forward(load_model(ckpt, progress=False), ids)[1].numpy(), -1)


def test_every_endpoint_streams_and_returns_n_choices(served):
    import httpx
    import openai

    arch, server, ckpt = served
    if arch not in ALL_ENDPOINTS:
        pytest.skip("covered by the tiny model's endpoint tests")
    cfg = load_config(ckpt)
    moe = list(cfg.moe_layers)
    client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)
    card = {m.id: m for m in client.models.list().data}[arch].model_dump()
    if cfg.is_hybrid:  # the prefix cache is off, and /v1/models says why; each layer's kind is listed
        assert card["prefix_caching_enabled"] is False and "recurrent state" in card["prefix_caching_disabled_reason"]
        assert card["layer_types"] == list(cfg.layer_types)
    else:
        assert card["prefix_caching_enabled"] is True and "layer_types" not in card

    # chat, n = 2 sampled with a seed: the stream's text and rows equal the non-streamed response's
    kw = dict(model=arch, messages=[{"role": "user", "content": "Route this."}], max_tokens=6, n=2,
              temperature=0.9, seed=7, extra_body={"ignore_eos": True, "return_token_ids": True})
    full = client.chat.completions.create(**kw)
    texts, rows = {0: "", 1: ""}, {}
    for chunk in client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            if c.finish_reason:
                rows[c.index] = (c.model_extra or {}).get("routed_experts")
    assert len(full.choices) == 2
    for c in full.choices:
        extra = c.model_extra
        assert texts[c.index] == c.message.content
        arr = decode(extra["routed_experts"])
        np.testing.assert_array_equal(decode(rows[c.index]), arr)
        ids = extra["prompt_token_ids"] + extra["token_ids"][:-1]
        assert arr.shape == (len(ids), cfg.num_hidden_layers, cfg.num_experts_per_tok)
        np.testing.assert_array_equal(np.sort(arr, -1)[:, moe], _engine_rows(ckpt, ids)[:, moe])

    # completions, streamed, n = 2 greedy: both choices equal the non-streamed one
    kw = dict(model=arch, prompt="Experts of every layer", max_tokens=5, temperature=0, n=2,
              extra_body={"return_token_ids": True, "ignore_eos": True})
    one = client.completions.create(**{**kw, "n": 1}).choices[0]
    got = {}
    for chunk in client.completions.create(stream=True, **kw):
        for c in chunk.choices:
            got.setdefault(c.index, []).append(c)
    assert sorted(got) == [0, 1]
    for parts in got.values():
        assert "".join(p.text for p in parts) == one.text
        last = [p for p in parts if p.finish_reason][-1]
        np.testing.assert_array_equal(decode(last.model_extra["routed_experts"]), decode(one.routed_experts))

    # /inference/v1/generate: tokens in, tokens out, streamed and not
    body = {"token_ids": [5, 17, 42, 99, 7], "sampling_params": {"max_tokens": 6, "temperature": 0.0,
                                                                  "ignore_eos": True}}
    url = server.root_url + "/inference/v1/generate"
    gen = httpx.post(url, json=body, timeout=120).json()["choices"][0]
    arr = decode(gen["routed_experts"])
    ids = body["token_ids"] + gen["token_ids"][:-1]
    np.testing.assert_array_equal(np.sort(arr, -1)[:, moe], _engine_rows(ckpt, ids)[:, moe])
    with httpx.stream("POST", url, json={**body, "stream": True}, timeout=120) as r:
        events = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert [t for c in chunks for ch in c["choices"] for t in ch["token_ids"]] == gen["token_ids"]
    final = [ch for c in chunks for ch in c["choices"] if ch["finish_reason"]][0]
    np.testing.assert_array_equal(decode(final["routed_experts"]), arr)
