"""Issue 19: every bad replay / scoring request gets a 400 (API) or INVALID_ARG (Triton) naming the problem, and
the server keeps serving. Behaviour of good requests: test_replay_and_scoring.py."""
from __future__ import annotations

import base64
import io

import httpx
import numpy as np
import openai
import pytest

from .openai_helpers import NUM_EXPERTS_PER_TOK, NUM_HIDDEN_LAYERS
from .test_triton_backend import Stream, concat, inputs, tensor

PROMPT_IDS = [1, 400, 17, 466, 418, 22, 91]  # 7 tokens
P, L, K = len(PROMPT_IDS), NUM_HIDDEN_LAYERS, NUM_EXPERTS_PER_TOK


def npy_b64(arr: np.ndarray, **kw) -> str:
    buf = io.BytesIO()
    np.save(buf, arr, **kw)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def routing(rows: int = P, dtype=np.uint8) -> np.ndarray:
    """A valid routing: row r, layer l -> experts (r + l) % 8 and (r + l + 1) % 8."""
    r = np.arange(rows)[:, None, None] + np.arange(L)[None, :, None] + np.arange(K)[None, None, :]
    return (r % 8).astype(dtype)


def with_cell(value, dtype=np.int64, cell=(3, 2, 1)) -> np.ndarray:
    arr = routing(dtype=dtype)
    arr[cell] = value
    return arr


def repeated() -> np.ndarray:
    arr = routing()
    arr[4, 1] = [5, 5]
    return arr


BAD_REPLAYS = [
    ("not base64!!", "not valid base64"),
    (base64.b64encode(b"certainly not an npy file").decode(), "not a .npy file"),
    (npy_b64(routing().astype(np.float32)), "integer array"),
    (npy_b64(np.array([[[None, 1]]], dtype=object), allow_pickle=True), "integer array"),
    (npy_b64(routing()[:, :, 0]), "3-D"),
    (npy_b64(routing()[:, :, :1]), f"expected (rows, {L}, {K})"),
    (npy_b64(np.zeros((P, L + 1, K), np.uint8)), f"expected (rows, {L}, {K})"),
    (npy_b64(with_cell(8)), "expert id 8"),
    (npy_b64(with_cell(-1)), "expert id -1"),
    (npy_b64(repeated()), "repeats an expert id"),
    (npy_b64(routing(rows=P + 1)), f"at most {P} rows"),
]


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.root_url + path, json=body, timeout=60,
                      headers={"Authorization": f"Bearer {server.api_key}"})


def assert_400(r: httpx.Response, param: str, says: str) -> None:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error"
    assert says in err["message"], err["message"]


@pytest.mark.parametrize("replay, says", BAD_REPLAYS)
def test_bad_replay_is_400_naming_the_problem(moe_server, replay, says):
    body = {"model": moe_server.model, "prompt": PROMPT_IDS, "max_tokens": 2, "replay_routed_experts": replay}
    assert_400(post(moe_server, "/v1/completions", body), "replay_routed_experts", says)


def test_bad_replay_on_generate_and_chat_names_its_field(moe_server, openai_client):
    bad = npy_b64(with_cell(9))
    r = post(moe_server, "/inference/v1/generate",
             {"token_ids": PROMPT_IDS, "sampling_params": {"max_tokens": 2, "replay_routed_experts": bad}})
    assert_400(r, "sampling_params.replay_routed_experts", "expert id 9")
    r = post(moe_server, "/inference/v1/generate",
             {"token_ids": PROMPT_IDS, "replay_routed_experts": "%%%", "sampling_params": {"max_tokens": 2}})
    assert_400(r, "replay_routed_experts", "not valid base64")
    with pytest.raises(openai.BadRequestError) as e:
        openai_client.chat.completions.create(
            model=moe_server.model, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
            extra_body={"replay_routed_experts": npy_b64(routing(rows=500))})
    assert e.value.body["param"] == "replay_routed_experts" and "rows but the prompt has" in e.value.body["message"]


@pytest.mark.parametrize(
    "body, param, says",
    [
        ({"prompt": [PROMPT_IDS, PROMPT_IDS], "replay_routed_experts": npy_b64(routing())},
         "replay_routed_experts", "this request has 2"),
        ({"prompt_logprobs": 21}, "prompt_logprobs", "at most 20"),
        ({"prompt_logprobs": -1}, "prompt_logprobs", "greater than or equal to 0"),
        ({"echo": True, "logprobs": 21}, "logprobs", "at most 20"),
        ({"return_routed_weights": "sometimes"}, "return_routed_weights", "boolean"),
    ],
)
def test_bad_scoring_and_weights_fields_are_400(moe_server, body, param, says):
    full = {"model": moe_server.model, "prompt": PROMPT_IDS, "max_tokens": 2, **body}
    assert_400(post(moe_server, "/v1/completions", full), param, says)


def test_prompt_logprobs_is_refused_on_chat_not_ignored(moe_server):
    r = post(moe_server, "/v1/chat/completions", {"model": moe_server.model, "prompt_logprobs": 1,
                                                  "messages": [{"role": "user", "content": "hi"}]})
    assert_400(r, "prompt_logprobs", "/v1/completions")


def test_the_server_still_serves_after_bad_requests(moe_server):
    r = post(moe_server, "/v1/completions", {"model": moe_server.model, "prompt": PROMPT_IDS, "max_tokens": 2,
                                             "replay_routed_experts": npy_b64(routing())})
    assert r.status_code == 200, r.text
    experts = np.load(io.BytesIO(base64.b64decode(r.json()["choices"][0]["routed_experts"])))
    np.testing.assert_array_equal(experts[:P], routing())


# ---------------------------------------------------------------- Triton clients: the engine's own checks


def replay_tensor(arr: np.ndarray):
    return tensor("replay_routed_experts", arr, "INT32")


@pytest.mark.parametrize(
    "arr, says",
    [
        (routing(dtype=np.int32)[:, :, :1], f"[R, {L}, {K}] with 1 <= R <= {P}"),  # the expected shape
        (with_cell(8, np.int32), "expert id 8"),
        (with_cell(-1, np.int32), "expert id -1"),
        (repeated().astype(np.int32), "repeats an expert id"),
        (routing(rows=P + 1, dtype=np.int32), f"{P + 1} rows but the prompt has only {P} tokens"),
    ],
)
def test_triton_clients_get_invalid_arg_from_the_engine(moe_server, arr, says):
    s = Stream(moe_server.triton_grpc_url, moe_server.triton_grpc_headers)
    try:
        s.send("bad", [*inputs(PROMPT_IDS, max_tokens=2), replay_tensor(arr)])
        _, errors = s.collect(["bad"])
        msg = str(errors["bad"])
        assert "invalid request: " in msg and "replay_routed_experts" in msg and says in msg, msg
        s.send("good", [*inputs(PROMPT_IDS, max_tokens=2), replay_tensor(routing(dtype=np.int32))])
        out, errors = s.collect(["good"])
        assert not errors
        np.testing.assert_array_equal(concat(out["good"], "routed_experts")[:P], routing())
    finally:
        s.close()


def test_triton_prompt_logprobs_out_of_range_and_in_range(moe_server):
    s = Stream(moe_server.triton_grpc_url, moe_server.triton_grpc_headers)
    try:
        s.send("bad", [*inputs(PROMPT_IDS, max_tokens=1), tensor("prompt_logprobs", [21], "INT32")])
        _, errors = s.collect(["bad"])
        assert "invalid request: " in str(errors["bad"]) and "prompt_logprobs" in str(errors["bad"])
        s.send("ok", [*inputs(PROMPT_IDS, max_tokens=1), tensor("prompt_logprobs", [2], "INT32"),
                      tensor("return_routed_weights", [True], "BOOL")])
        out, errors = s.collect(["ok"])
        assert not errors
        assert concat(out["ok"], "prompt_logprobs").shape == (P - 1,)
        assert concat(out["ok"], "prompt_top_logprob_ids").shape == (P - 1, 2)
        assert concat(out["ok"], "routed_weights").shape == concat(out["ok"], "routed_experts").shape == (P, L, K)
    finally:
        s.close()
