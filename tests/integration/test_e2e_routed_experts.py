"""End to end: real moe-serve, official openai client, ids checked against the router itself."""
from __future__ import annotations

import base64
import io
import json

import numpy as np
import pytest
import torch

from moe_engine.checkpoint import load_model
from moe_engine.config import load_config
from moe_engine.models.decoder import reference_forward


def decode(s: str) -> np.ndarray:
    return np.load(io.BytesIO(base64.b64decode(s)))  # the one-liner clients use


@pytest.fixture(scope="module")
def reference(tiny_checkpoint):
    cfg = load_config(tiny_checkpoint)
    return cfg, load_model(tiny_checkpoint, dtype="float32", device="cpu", progress=False)


def test_completion_routed_experts_like_vllm_and_exact(openai_client, moe_server, reference):
    cfg, model = reference
    r = openai_client.completions.create(
        model=moe_server.model,
        prompt="Hello, world",
        max_tokens=10,
        temperature=0,
        extra_body={"return_token_ids": True},
    )
    choice = r.choices[0]
    prompt_ids, token_ids = choice.prompt_token_ids, choice.token_ids
    assert prompt_ids and token_ids and len(token_ids) <= 10
    arr = decode(choice.routed_experts)
    assert arr.ndim == 3
    assert arr.shape == (len(prompt_ids) + len(token_ids) - 1, cfg.num_hidden_layers, cfg.num_experts_per_tok)
    assert arr.dtype == np.uint8  # 8 experts <= 256
    assert int(arr.max()) < cfg.num_experts

    # The same ids the router computes, independently, for the same tokens in one forward.
    logits, ref_ids = reference_forward(model, prompt_ids + token_ids[:-1])
    np.testing.assert_array_equal(arr, ref_ids.numpy().astype(np.uint8))
    # And greedy decoding agrees: each generated token is the argmax after its prefix.
    assert torch.argmax(logits[len(prompt_ids) - 1 :], dim=-1).tolist() == token_ids


def test_models_lists_the_served_model(openai_client, moe_server):
    models = openai_client.models.list()
    assert [m.id for m in models.data] == [moe_server.model]


def test_unknown_model_is_404_in_openai_format(openai_client):
    import openai

    with pytest.raises(openai.NotFoundError) as err:
        openai_client.completions.create(model="no-such-model", prompt="hi", max_tokens=1)
    body = err.value.response.json()
    assert set(body["error"]) >= {"message", "type", "param", "code"}


def test_malformed_body_and_invalid_parameter_are_400(moe_server):
    import httpx

    headers = {"Authorization": f"Bearer {moe_server.api_key}", "Content-Type": "application/json"}
    url = moe_server.base_url + "/completions"
    r = httpx.post(url, content=b"{not json", headers=headers)
    assert r.status_code == 400 and "message" in r.json()["error"]
    r = httpx.post(url, content=json.dumps({"model": moe_server.model, "prompt": "x", "max_tokens": -3}), headers=headers)
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "max_tokens"
