"""/inference/v1/generate (tokens in, tokens out) on the real server."""
from __future__ import annotations

import json

import httpx
import numpy as np

from .openai_helpers import assert_valid_routed_experts, decode


def post(moe_server, body, **kw):
    return httpx.post(moe_server.root_url + "/inference/v1/generate", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {moe_server.api_key}"}, **kw)


def test_generate_non_stream_and_stream_agree(moe_server):
    body = {"token_ids": [1, 17, 42, 99], "request_id": "gen-test-1",
            "sampling_params": {"max_tokens": 6, "temperature": 0.0, "ignore_eos": True, "logprobs": 2}}
    full = post(moe_server, body).json()
    assert full["request_id"] == "gen-test-1" and full["model"] == moe_server.model
    choice = full["choices"][0]
    assert len(choice["token_ids"]) == 6 and choice["finish_reason"] == "length"
    assert [x["token"] for x in choice["logprobs"]["content"]] == [f"token_id:{t}" for t in choice["token_ids"]]
    assert_valid_routed_experts(choice["routed_experts"], rows=4 + 6 - 1)
    assert full["usage"] == {"prompt_tokens": 4, "completion_tokens": 6, "total_tokens": 10}

    with httpx.stream("POST", moe_server.root_url + "/inference/v1/generate", json={**body, "stream": True},
                      headers={"Authorization": f"Bearer {moe_server.api_key}"}, timeout=60) as r:
        assert r.status_code == 200
        events = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    tokens = [t for c in chunks for ch in c["choices"] for t in ch["token_ids"]]
    assert tokens == choice["token_ids"]
    finals = [ch for c in chunks for ch in c["choices"] if ch["finish_reason"]]
    assert len(finals) == 1
    assert all(ch["routed_experts"] is None for c in chunks for ch in c["choices"] if not ch["finish_reason"])
    np.testing.assert_array_equal(decode(finals[0]["routed_experts"]), decode(choice["routed_experts"]))


def test_generate_n2_prompt_start_and_opt_out(moe_server):
    body = {"token_ids": [1, 2, 3, 4, 5], "sampling_params": {"max_tokens": 3, "n": 2, "seed": 5, "temperature": 1.0,
                                                              "routed_experts_prompt_start": 3, "ignore_eos": True}}
    data = post(moe_server, body).json()
    assert [c["index"] for c in data["choices"]] == [0, 1]
    for c in data["choices"]:
        assert_valid_routed_experts(c["routed_experts"], rows=5 + 3 - 1 - 3)
    data = post(moe_server, {"token_ids": [1, 2], "return_routed_experts": False,
                             "sampling_params": {"max_tokens": 2}}).json()
    assert data["choices"][0]["routed_experts"] is None


def test_generate_errors(moe_server):
    r = post(moe_server, {"token_ids": [1, 512], "sampling_params": {"max_tokens": 2}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "token_ids"
    r = post(moe_server, {"token_ids": [1], "sampling_params": {"max_tokens": 5000}})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    r = post(moe_server, {"token_ids": [1], "sampling_params": {"top_p": 0}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "sampling_params.top_p"
