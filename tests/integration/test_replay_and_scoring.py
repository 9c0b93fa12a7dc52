"""Issue 19 on the real server (tiny float32 Mixtral: 4 layers, all MoE, 8 experts, top-2): forced routing
(``replay_routed_experts``), the combine weights (``return_routed_weights``) and prompt scoring
(``prompt_logprobs``, ``echo`` + ``logprobs``). Validation errors: test_replay_validation.py.

Engine-level parity with transformers (forced ids with HF's router patched, weights equal to HF's) is in the
engine's own tests; here the server must keep what the engine computes exact and aligned end to end.
"""
from __future__ import annotations

import base64
import io
import json
import time

import httpx
import numpy as np

from ..tolerances import approx_across_batches, assert_close_across_batches
from .openai_helpers import NUM_EXPERTS_PER_TOK, NUM_HIDDEN_LAYERS, NUM_LOCAL_EXPERTS, decode, metric_value

PROMPT = "The quick brown fox jumps over the lazy dog, again and again."


def npy_b64(arr: np.ndarray) -> str:
    """What a client sends: np.save + base64, any integer dtype."""
    buf = io.BytesIO()
    np.save(buf, arr)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def complete(client, model, extra=None, **kw) -> dict:
    kw = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, **kw}
    extra = {"ignore_eos": True, "return_token_ids": True, **(extra or {})}
    return client.completions.create(model=model, extra_body=extra, **kw).model_dump()


def stream_choices(client, model, extra=None, **kw) -> dict[int, dict]:
    """A streamed completion, per choice: text, token ids, logprobs, and the fields that come once."""
    kw = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, **kw}
    extra = {"ignore_eos": True, "return_token_ids": True, **(extra or {})}
    out: dict[int, dict] = {}
    for chunk in client.completions.create(model=model, extra_body=extra, stream=True, **kw):
        for ch in chunk.model_dump()["choices"]:
            c = out.setdefault(ch["index"], {"text": "", "token_ids": [], "tokens": [], "token_logprobs": [],
                                             "seen": {}})
            c["text"] += ch["text"]
            c["token_ids"] += ch["token_ids"] or []
            if ch["logprobs"]:
                c["tokens"] += ch["logprobs"]["tokens"]
                c["token_logprobs"] += ch["logprobs"]["token_logprobs"]
            for once in ("prompt_token_ids", "prompt_logprobs", "routed_experts", "routed_weights"):
                if ch.get(once) is not None:
                    assert once not in c["seen"], f"{once} sent twice"
                    c["seen"][once] = ch[once]
    return out


def post_generate(server, body: dict) -> dict:
    r = httpx.post(server.root_url + "/inference/v1/generate", json=body, timeout=120,
                   headers={"Authorization": f"Bearer {server.api_key}"})
    assert r.status_code == 200, r.text
    return r.json()


def assert_same_prompt_logprobs(got: list, want: list) -> None:
    assert len(got) == len(want) and got[0] is None and want[0] is None
    for g, w in zip(got[1:], want[1:], strict=True):
        assert g.keys() == w.keys()
        for k in g:
            assert g[k]["rank"] == w[k]["rank"] and g[k]["decoded_token"] == w[k]["decoded_token"]
            assert g[k]["logprob"] == approx_across_batches(w[k]["logprob"])


def lp_values(prompt_logprobs: list, prompt_ids: list[int]) -> list[float | None]:
    """The prompt tokens' own logprobs out of vLLM's format (JSON keys are token ids as strings)."""
    out = []
    for pos, d in enumerate(prompt_logprobs):
        out.append(None if d is None else d[str(prompt_ids[pos])]["logprob"])
    return out


# ---------------------------------------------------------------- (1) replaying its own routing


def test_replaying_its_own_routing_reproduces_the_request(openai_client, moe_server):
    extra = {"prompt_logprobs": 2}
    base = complete(openai_client, moe_server.model, logprobs=2, extra=extra)["choices"][0]
    prompt_ids = base["prompt_token_ids"]
    P = len(prompt_ids)
    experts = decode(base["routed_experts"])
    assert experts.shape == (P + 6 - 1, NUM_HIDDEN_LAYERS, NUM_EXPERTS_PER_TOK)
    for dtype in (np.uint8, np.int64):  # the server's own dtype, and any other integer dtype
        again = complete(openai_client, moe_server.model, logprobs=2,
                         extra={**extra, "replay_routed_experts": npy_b64(experts[:P].astype(dtype))})["choices"][0]
        assert again["token_ids"] == base["token_ids"] and again["text"] == base["text"]
        np.testing.assert_array_equal(decode(again["routed_experts"]), experts)
        # Alone, same ids, same formula for their weights: the same float32 computation, bit for bit.
        assert again["logprobs"]["token_logprobs"] == base["logprobs"]["token_logprobs"]
        assert again["prompt_logprobs"] == base["prompt_logprobs"]


def test_replay_streaming_with_n2_forces_every_choice(openai_client, moe_server):
    base = complete(openai_client, moe_server.model)["choices"][0]
    P = len(base["prompt_token_ids"])
    forced = decode(base["routed_experts"])[:P].copy()
    forced[1] = forced[1, :, ::-1]  # row 1 in the other slot order: still a valid routing, visibly forced
    chunks = stream_choices(openai_client, moe_server.model, n=2,
                            extra={"replay_routed_experts": npy_b64(forced.astype(np.int32))})
    assert sorted(chunks) == [0, 1]
    for c in chunks.values():
        got = decode(c["seen"]["routed_experts"])
        assert got.shape == (P + len(c["token_ids"]) - 1, NUM_HIDDEN_LAYERS, NUM_EXPERTS_PER_TOK)
        np.testing.assert_array_equal(got[:P], forced)


# ---------------------------------------------------------------- (2) forcing other ids


def _other_pair(pair: np.ndarray) -> list[int]:
    return [e for e in range(NUM_LOCAL_EXPERTS) if e not in pair.tolist()][:2][::-1]


def test_changed_ids_are_forced_and_the_rest_routes_normally(openai_client, moe_server):
    extra = {"prompt_logprobs": 1}
    base = complete(openai_client, moe_server.model, max_tokens=3, extra=extra)["choices"][0]
    prompt_ids = base["prompt_token_ids"]
    P = len(prompt_ids)
    assert P >= 6
    experts = decode(base["routed_experts"])
    R = P - 2  # rows 0..R-1 forced; the last two prompt rows and the generated ones route normally
    first_changed = 2
    forced = experts[:R].astype(np.int64)
    for row in (first_changed, R - 1):
        for layer in range(NUM_HIDDEN_LAYERS):
            forced[row, layer] = _other_pair(forced[row, layer])
    res = complete(openai_client, moe_server.model, max_tokens=3,
                   extra={**extra, "replay_routed_experts": npy_b64(forced)})["choices"][0]
    got = decode(res["routed_experts"])
    np.testing.assert_array_equal(got[:R], forced)
    # Layer 0's router sees only the tokens (embeddings, layer-0 attention), never routing: the unforced
    # prompt rows must route there exactly as without replay.
    np.testing.assert_array_equal(got[R:P, 0], experts[R:P, 0])
    # Prompt logprob of token t comes from positions < t: equal up to the first changed row, then not.
    got_lp, base_lp = lp_values(res["prompt_logprobs"], prompt_ids), lp_values(base["prompt_logprobs"], prompt_ids)
    # (Other experts run on other token counts, so even unaffected values may differ in the last float bits.)
    assert_close_across_batches(got_lp[1 : first_changed + 1], base_lp[1 : first_changed + 1])
    assert abs(got_lp[first_changed + 1] - base_lp[first_changed + 1]) > 1e-2
    # What the unforced rows got is what the model computes under that forcing: replaying all of them
    # (forced + chosen) reproduces the request exactly.
    again = complete(openai_client, moe_server.model, max_tokens=3,
                     extra={**extra, "replay_routed_experts": npy_b64(got[:P])})["choices"][0]
    assert again["token_ids"] == res["token_ids"]
    np.testing.assert_array_equal(decode(again["routed_experts"]), got)
    assert_close_across_batches(lp_values(again["prompt_logprobs"], prompt_ids)[1:], got_lp[1:])


# ---------------------------------------------------------------- (3) routed weights


def check_weights(experts_b64: str | None, weights_b64: str | None) -> tuple[np.ndarray, np.ndarray]:
    experts, weights = decode(experts_b64), decode(weights_b64)
    assert weights.dtype == np.float32 and weights.shape == experts.shape
    # Tiny Mixtral: softmax -> top-2 -> renormalise, slots in descending score: positive, sum 1, descending.
    assert (weights > 0).all()
    np.testing.assert_allclose(weights.sum(-1), 1.0, rtol=0, atol=1e-5)
    assert (weights[..., 0] >= weights[..., 1]).all()
    return experts, weights


def test_routed_weights_align_with_routed_experts(openai_client, moe_server):
    plain = complete(openai_client, moe_server.model, extra={"return_routed_weights": True})["choices"][0]
    e_full, w_full = check_weights(plain["routed_experts"], plain["routed_weights"])
    assert complete(openai_client, moe_server.model)["choices"][0]["routed_weights"] is None  # off by default
    alone = complete(openai_client, moe_server.model,
                     extra={"return_routed_weights": True, "return_routed_experts": False})["choices"][0]
    assert alone["routed_experts"] is None
    assert_close_across_batches(decode(alone["routed_weights"]), w_full)

    cut = complete(openai_client, moe_server.model,
                   extra={"return_routed_weights": True, "routed_experts_prompt_start": 2})["choices"][0]
    _, w_cut = check_weights(cut["routed_experts"], cut["routed_weights"])
    assert_close_across_batches(w_cut, w_full[2:])

    two = complete(openai_client, moe_server.model, n=2, extra={"return_routed_weights": True})["choices"]
    for ch in two:  # greedy: both choices are the plain request
        _, w = check_weights(ch["routed_experts"], ch["routed_weights"])
        assert_close_across_batches(w, w_full)

    streamed = stream_choices(openai_client, moe_server.model, n=2,
                              extra={"return_routed_weights": True, "routed_experts_prompt_start": 2})
    for c in streamed.values():
        _, w = check_weights(c["seen"]["routed_experts"], c["seen"]["routed_weights"])
        assert_close_across_batches(w, w_full[2:])


def test_weights_and_replay_on_chat_and_generate(openai_client, moe_server):
    chat_kw = {"model": moe_server.model, "messages": [{"role": "user", "content": "Hi there"}], "max_tokens": 4,
               "temperature": 0, "extra_body": {"return_routed_weights": True}}
    chat = openai_client.chat.completions.create(**chat_kw).model_dump()["choices"][0]
    _, w = check_weights(chat["routed_experts"], chat["routed_weights"])
    last = [ch for chunk in openai_client.chat.completions.create(stream=True, **chat_kw)
            for ch in chunk.model_dump()["choices"] if ch["finish_reason"]]
    assert len(last) == 1
    assert_close_across_batches(check_weights(last[0]["routed_experts"], last[0]["routed_weights"])[1], w)

    body = {"token_ids": [1, 17, 42, 99, 7], "return_routed_weights": True,
            "sampling_params": {"max_tokens": 4, "temperature": 0, "ignore_eos": True}}
    gen = post_generate(moe_server, body)["choices"][0]
    e, _ = check_weights(gen["routed_experts"], gen["routed_weights"])
    assert e.shape[0] == 5 + 4 - 1
    forced = e[:5, :, ::-1].copy()  # top level, as return_routed_experts
    again = post_generate(moe_server, {**body, "replay_routed_experts": npy_b64(forced)})["choices"][0]
    np.testing.assert_array_equal(decode(again["routed_experts"])[:5], forced)


def test_forced_ids_get_the_routers_weights_for_those_ids(openai_client, moe_server):
    extra = {"return_routed_weights": True}
    base = complete(openai_client, moe_server.model, extra=extra)["choices"][0]
    P = len(base["prompt_token_ids"])
    experts, weights = check_weights(base["routed_experts"], base["routed_weights"])
    swapped = experts[:P, :, ::-1].copy()  # every prompt row in the other slot order
    res = complete(openai_client, moe_server.model,
                   extra={**extra, "replay_routed_experts": npy_b64(swapped)})["choices"][0]
    got_e, got_w = decode(res["routed_experts"]), decode(res["routed_weights"])
    np.testing.assert_array_equal(got_e[:P], swapped)
    # Same experts, other slots: each weight follows its expert (the formula applied to the given ids).
    np.testing.assert_allclose(got_w[:P], weights[:P, :, ::-1], rtol=0, atol=1e-5)
    np.testing.assert_allclose(got_w.sum(-1), 1.0, rtol=0, atol=1e-5)


# ---------------------------------------------------------------- (5) prompt logprobs


def test_prompt_logprobs_format_and_agreement_across_endpoints(openai_client, moe_server):
    scored = complete(openai_client, moe_server.model, max_tokens=1, extra={"prompt_logprobs": 3})["choices"][0]
    prompt_ids = scored["prompt_token_ids"]
    pl = scored["prompt_logprobs"]
    assert len(pl) == len(prompt_ids) and pl[0] is None
    for pos, d in enumerate(pl[1:], start=1):
        assert str(prompt_ids[pos]) in d  # the prompt token, whatever its rank
        ranks = sorted(e["rank"] for e in d.values() if e["rank"] is not None)
        assert ranks[:3] == [1, 2, 3] and len(d) in (3, 4)
        best = max(e["logprob"] for e in d.values())
        assert best <= 0 and next(e for e in d.values() if e["rank"] == 1)["logprob"] == best
        assert all(isinstance(e["decoded_token"], str) for e in d.values())
    values = lp_values(pl, prompt_ids)

    # echo + logprobs: OpenAI's legacy format, the prompt first with a null, then the generated token
    echo = complete(openai_client, moe_server.model, max_tokens=1, echo=True, logprobs=3)["choices"][0]
    lp = echo["logprobs"]
    assert echo["text"].startswith(PROMPT)
    assert len(lp["tokens"]) == len(prompt_ids) + 1
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert_close_across_batches(lp["token_logprobs"][1 : len(prompt_ids)], values[1:])
    # top 3 + the prompt token, keyed by token text (byte-level pieces may share one: fewer keys then)
    assert all(len(t) <= 4 and tok in t for tok, t in zip(lp["tokens"][1:], lp["top_logprobs"][1:]))
    assert echo["prompt_logprobs"] is not None  # as vLLM: echo + logprobs N computes prompt logprobs N

    gen_body = {"token_ids": prompt_ids, "sampling_params": {"max_tokens": 2, "temperature": 0, "prompt_logprobs": 3}}
    assert_same_prompt_logprobs(post_generate(moe_server, gen_body)["prompt_logprobs"], pl)
    with httpx.stream("POST", moe_server.root_url + "/inference/v1/generate", json={**gen_body, "stream": True},
                      headers={"Authorization": f"Bearer {moe_server.api_key}"}, timeout=60) as r:
        events = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {")]
    sent = [e["prompt_logprobs"] for e in events if e.get("prompt_logprobs") is not None]
    assert len(sent) == 1  # once, on the chunk of the first token
    assert_same_prompt_logprobs(sent[0], pl)


def test_prompt_logprobs_streaming_n2_and_echo_stream(openai_client, moe_server):
    full = complete(openai_client, moe_server.model, max_tokens=3, logprobs=1, echo=True,
                    extra={"prompt_logprobs": 2})["choices"][0]
    streamed = stream_choices(openai_client, moe_server.model, max_tokens=3, logprobs=1, echo=True, n=2,
                              extra={"prompt_logprobs": 2})
    for c in streamed.values():
        assert c["text"] == full["text"]
        assert c["tokens"] == full["logprobs"]["tokens"]
        assert c["token_logprobs"][0] is None
        assert_close_across_batches(c["token_logprobs"][1:], full["logprobs"]["token_logprobs"][1:])
        assert_same_prompt_logprobs(c["seen"]["prompt_logprobs"], full["prompt_logprobs"])


def _engine_steps(server) -> float:
    """moe_engine_steps once it has stopped moving (the backend refreshes it every 0.2 s)."""
    last = metric_value(server.triton_metrics_url, "moe_engine_steps")
    for _ in range(50):
        time.sleep(0.5)
        now = metric_value(server.triton_metrics_url, "moe_engine_steps")
        if now == last:
            return now
        last = now
    raise AssertionError("moe_engine_steps did not settle")


def test_scoring_with_max_tokens_1_costs_no_extra_forward(openai_client, moe_server):
    def steps_of(**kw) -> float:
        before = _engine_steps(moe_server)
        complete(openai_client, moe_server.model, max_tokens=1, **kw)
        return _engine_steps(moe_server) - before

    plain = steps_of()
    assert plain >= 1
    assert steps_of(extra={"prompt_logprobs": 5}) == plain
    assert steps_of(echo=True, logprobs=5) == plain
