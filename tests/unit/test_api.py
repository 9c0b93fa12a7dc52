"""The HTTP API over an in-process fake engine, through the official openai client.

Same app as production (uvicorn, real HTTP); only Triton is replaced (see
fake_engine.py).  The same behaviours against the real server are in
tests/integration/test_openai_*.py.
"""
from __future__ import annotations

import asyncio
import json
import time

import httpx
import numpy as np
import openai
import pytest

from openai_frontend.routing_codec import decode_routed_experts
from tests.unit.conftest import SCRIPT_TEXT, ServerThread, make_model_info
from tests.unit.fake_engine import FakeEngine, routing_rows

INFO = make_model_info()


@pytest.fixture(scope="module")
def client(fe_server):
    return openai.OpenAI(base_url=fe_server.base_url, api_key=fe_server.api_key, max_retries=0, timeout=30)


@pytest.fixture(scope="module")
def aclient_factory(fe_server):
    return lambda: openai.AsyncOpenAI(base_url=fe_server.base_url, api_key=fe_server.api_key, max_retries=0,
                                      timeout=30)


def post(srv, path, body, key="default", **kw):
    headers = {"Authorization": f"Bearer {srv.api_key if key == 'default' else key}"} if key else {}
    return httpx.post(srv.root_url + path, json=body, headers=headers, timeout=30, **kw)


# ---------------------------------------------------------------- models, auth, health, metrics


def test_models(client, fe_server):
    models = client.models.list().data
    assert [m.id for m in models] == [fe_server.model]
    m = client.models.retrieve(fe_server.model).model_dump()
    assert m["num_hidden_layers"] == 3 and m["moe_layers"] == [1, 2] and m["num_experts"] == 8
    assert m["top_k"] == 2 and m["routed_experts_dtype"] == "uint8" and m["max_model_len"] == 128
    assert m["quantization"] == {"weights": "none", "served_as": None, "kv_cache": None}  # (no engine state)
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("nope")
    assert e.value.body["code"] == "model_not_found"


@pytest.mark.parametrize("key", [None, "wrong"])
def test_auth(fe_server, key):
    for path, body in [("/v1/completions", {"prompt": "x"}), ("/inference/v1/generate", {"token_ids": [1]})]:
        r = post(fe_server, path, body, key=key)
        assert r.status_code == 401
        assert r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.get(fe_server.base_url + "/models", headers={"Authorization": f"Bearer {key}"} if key else {})
    assert r.status_code == 401
    bad = openai.OpenAI(base_url=fe_server.base_url, api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model=fe_server.model, prompt="x", max_tokens=1)


def test_health_and_metrics_need_no_key(fe_server):
    assert httpx.get(fe_server.root_url + "/health").status_code == 200
    text = httpx.get(fe_server.root_url + "/metrics").text
    assert "moe_serve_requests_total" in text


# ---------------------------------------------------------------- completions


def test_completion_vllm_style(client, fe_server, fe_tokenizer):
    r = client.completions.create(model=fe_server.model, prompt="Hello, world", max_tokens=10, temperature=0,
                                  extra_body={"return_token_ids": True})
    choice = r.model_dump()["choices"][0]
    prompt_ids = fe_tokenizer.encode("Hello, world")
    assert choice["prompt_token_ids"] == prompt_ids
    assert choice["token_ids"] == fe_server.engine.script[:10]
    assert choice["text"] == fe_tokenizer.decode(choice["token_ids"])
    arr = decode_routed_experts(choice["routed_experts"])
    assert arr.shape == (len(prompt_ids) + 10 - 1, 3, 2) and arr.dtype == np.uint8
    np.testing.assert_array_equal(arr, routing_rows(0, arr.shape[0], INFO))
    assert r.usage.prompt_tokens == len(prompt_ids) and r.usage.completion_tokens == 10
    assert choice["finish_reason"] == "length"


def test_completion_prompt_forms_and_indices(client, fe_server):
    r = client.completions.create(model=fe_server.model, prompt=[[5, 6, 7], [8, 9]], n=2, max_tokens=2)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert r.usage.prompt_tokens == 5 and r.usage.completion_tokens == 8
    shapes = [decode_routed_experts(c.routed_experts).shape[0] for c in r.choices]
    assert shapes == [3 + 2 - 1, 3 + 2 - 1, 2 + 2 - 1, 2 + 2 - 1]
    r = client.completions.create(model=fe_server.model, prompt=["a", "b"], max_tokens=1)
    assert len(r.choices) == 2


def test_completion_echo_and_logprobs(client, fe_server):
    r = client.completions.create(model=fe_server.model, prompt="Say:", max_tokens=3, echo=True)
    assert r.choices[0].text.startswith("Say:")
    r = client.completions.create(model=fe_server.model, prompt="Say:", max_tokens=3, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 3
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset[0] == 0 and all(2 <= len(t) <= 3 for t in lp.top_logprobs)
    # echo + logprobs (prompt scoring) needs the engine's prompt logprobs: tests/integration/test_replay_and_scoring.py
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=fe_server.model, prompt="x", max_tokens=3, logprobs=21)
    assert e.value.body["param"] == "logprobs"


def test_routed_experts_opt_out_and_prompt_start(client, fe_server):
    r = client.completions.create(model=fe_server.model, prompt=[5, 6, 7, 8], max_tokens=3,
                                  extra_body={"return_routed_experts": False})
    assert r.choices[0].routed_experts is None
    r = client.completions.create(model=fe_server.model, prompt=[5, 6, 7, 8], max_tokens=3,
                                  extra_body={"routed_experts_prompt_start": 2})
    arr = decode_routed_experts(r.choices[0].routed_experts)
    np.testing.assert_array_equal(arr, routing_rows(2, 4 + 3 - 1, INFO))
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=fe_server.model, prompt=[5, 6], max_tokens=3,
                                  extra_body={"routed_experts_prompt_start": 2})
    assert e.value.body["param"] == "routed_experts_prompt_start"


def collect_stream(stream):
    texts, tokens, finals, routed, usage = {}, {}, {}, {}, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            extra = c.model_extra or {}
            texts.setdefault(c.index, []).append(getattr(c, "text", None) or
                                                 (getattr(c, "delta", None) and c.delta.content) or "")
            tokens.setdefault(c.index, []).extend(extra.get("token_ids") or [])
            if extra.get("routed_experts") is not None:
                assert c.finish_reason is not None  # only on a choice's last chunk
                routed[c.index] = extra["routed_experts"]
            if c.finish_reason is not None:
                finals[c.index] = c.finish_reason
    return {i: "".join(t) for i, t in texts.items()}, tokens, finals, routed, usage


def test_completion_stream_n2_routed_for_every_choice(client, fe_server):
    stream = client.completions.create(model=fe_server.model, prompt="Hello", max_tokens=8, n=2, stream=True,
                                       seed=3, stream_options={"include_usage": True},
                                       extra_body={"return_token_ids": True})
    texts, tokens, finals, routed, usage = collect_stream(stream)
    assert sorted(finals) == [0, 1] and sorted(routed) == [0, 1]
    full = client.completions.create(model=fe_server.model, prompt="Hello", max_tokens=8, n=2, seed=3,
                                     extra_body={"return_token_ids": True})
    for c in full.choices:
        assert texts[c.index] == c.text
        assert tokens[c.index] == c.token_ids
        assert routed[c.index] == c.routed_experts
    assert usage.completion_tokens == 16


def test_stop_strings(client, fe_server):
    r = client.completions.create(model=fe_server.model, prompt="Go", max_tokens=40, stop=["fox"],
                                  extra_body={"return_token_ids": True})
    c = r.choices[0]
    assert c.text == "Hello world. The quick brown " and c.finish_reason == "stop"
    assert c.model_extra["stop_reason"] == "fox"
    arr = decode_routed_experts(c.routed_experts)
    assert arr.shape[0] == len(c.prompt_token_ids) + len(c.token_ids) - 1
    texts, _, _, _, _ = collect_stream(client.completions.create(model=fe_server.model, prompt="Go", max_tokens=40,
                                                                 stop=["fox"], stream=True))
    assert texts[0] == c.text


def test_over_context_and_bad_ids(client, fe_server):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=fe_server.model, prompt=[5] * 100, max_tokens=50)
    assert e.value.body["code"] == "context_length_exceeded" and e.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=fe_server.model, prompt=[5] * 128, max_tokens=1)
    assert e.value.body["param"] == "prompt"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=fe_server.model, prompt=[5, 4000], max_tokens=1)
    assert e.value.body["param"] == "prompt" and "4000" in e.value.body["message"]


def test_errors_are_openai_shaped(client, fe_server):
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="other-model", prompt="x", max_tokens=1)
    assert e.value.body["param"] == "model"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=fe_server.model, prompt="x", max_tokens=1, temperature=-1)
    assert e.value.status_code == 400 and e.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=fe_server.model, prompt="x", max_tokens=1, presence_penalty=1.0)
    assert e.value.body["param"] == "presence_penalty"
    r = httpx.post(fe_server.base_url + "/completions", content=b'{"prompt": ',
                   headers={"Authorization": f"Bearer {fe_server.api_key}", "Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    r = httpx.post(fe_server.base_url + "/completions", content=b"[1, 2]",
                   headers={"Authorization": f"Bearer {fe_server.api_key}", "Content-Type": "application/json"})
    assert r.status_code == 400
    r = httpx.get(fe_server.root_url + "/v1/nothing", headers={"Authorization": f"Bearer {fe_server.api_key}"})
    assert r.status_code == 404 and "error" in r.json()
    r = httpx.get(fe_server.base_url + "/completions", headers={"Authorization": f"Bearer {fe_server.api_key}"})
    assert r.status_code == 405 and "error" in r.json()


# ---------------------------------------------------------------- chat


def test_chat(client, fe_server, fe_tokenizer):
    msgs = [{"role": "user", "content": "Hi"}]
    r = client.chat.completions.create(model=fe_server.model, messages=msgs, max_completion_tokens=6,
                                       logprobs=True, top_logprobs=2, extra_body={"return_token_ids": True})
    c = r.choices[0]
    assert c.message.role == "assistant" and c.message.content == fe_tokenizer.decode(c.model_extra["token_ids"])
    prompt_ids = fe_tokenizer.encode(fe_tokenizer.chat_template.render(msgs), add_special_tokens=False)
    assert c.model_extra["prompt_token_ids"] == prompt_ids == r.model_extra["prompt_token_ids"]
    assert len(c.logprobs.content) == 6 and len(c.logprobs.content[0].top_logprobs) == 2
    assert decode_routed_experts(c.model_extra["routed_experts"]).shape == (len(prompt_ids) + 5, 3, 2)
    assert r.usage.prompt_tokens == len(prompt_ids)


def test_chat_stream_matches_non_stream(client, fe_server):
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": [{"type": "text", "text": "Hi"}]}]
    full = client.chat.completions.create(model=fe_server.model, messages=msgs, max_tokens=12, n=2, stop=["lazy"])
    stream = client.chat.completions.create(model=fe_server.model, messages=msgs, max_tokens=12, n=2,
                                            stop=["lazy"], stream=True, stream_options={"include_usage": True})
    roles = []
    texts, finals, routed = {}, {}, {}
    usage = None
    for chunk in stream:
        usage = chunk.usage or usage
        for c in chunk.choices:
            if c.delta.role:
                roles.append(c.index)
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
            if c.finish_reason:
                finals[c.index] = c.finish_reason
                routed[c.index] = c.model_extra["routed_experts"]
    assert sorted(roles) == [0, 1]
    for c in full.choices:
        assert texts[c.index] == c.message.content
        assert finals[c.index] == c.finish_reason
        assert routed[c.index] == c.model_extra["routed_experts"] is not None
    assert usage.completion_tokens == full.usage.completion_tokens


def test_chat_errors(client, fe_server):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=fe_server.model, messages=[{"role": "robot", "content": "x"}])
    assert e.value.body["param"] == "messages" and "robot" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=fe_server.model, messages=[{"role": "user", "content": "x"}],
                                       max_completion_tokens=500)
    assert e.value.body["param"] == "max_completion_tokens"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=fe_server.model, messages=[{"role": "user", "content": "x"}],
                                       top_logprobs=2)
    assert e.value.body["param"] == "top_logprobs"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=fe_server.model,
            messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])
    assert e.value.body["param"] == "messages[0].content[0]"


def test_chat_default_max_tokens_fills_the_context(client, fe_server):
    r = client.chat.completions.create(model=fe_server.model, messages=[{"role": "user", "content": "x"}])
    assert r.usage.prompt_tokens + r.usage.completion_tokens == 128


# ---------------------------------------------------------------- generate


def test_generate_like_vllm_disagg_test(fe_server):
    r = post(fe_server, "/inference/v1/generate",
             {"model": fe_server.model, "token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 10,
                                                                                    "temperature": 0.0},
              "stream": False})
    r.raise_for_status()
    data = r.json()
    choice = data["choices"][0]
    assert choice["routed_experts"] is not None and choice["token_ids"] is not None
    arr = decode_routed_experts(choice["routed_experts"])
    assert arr.ndim == 3 and arr.shape == (3 + 10 - 1, 3, 2)
    assert (arr >= 0).all() and (arr < 8).all()
    assert data["usage"] == {"prompt_tokens": 3, "completion_tokens": 10, "total_tokens": 13}
    assert set(data) >= {"request_id", "model", "created", "choices", "usage"}


def test_generate_stream_n2_and_logprobs(fe_server):
    body = {"token_ids": [5, 6, 7], "request_id": "my-req", "stream": True,
            "sampling_params": {"max_tokens": 4, "n": 2, "logprobs": 1, "routed_experts_prompt_start": 1},
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", fe_server.root_url + "/inference/v1/generate", json=body,
                      headers={"Authorization": f"Bearer {fe_server.api_key}"}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["request_id"] == "my-req" for c in chunks)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 8
    tokens, routed = {0: [], 1: []}, {}
    for c in chunks[:-1]:
        for ch in c["choices"]:
            tokens[ch["index"]] += ch["token_ids"]
            assert ch["logprobs"]["content"][0]["token"].startswith("token_id:")
            if ch["routed_experts"] is not None:
                assert ch["finish_reason"] == "length"
                routed[ch["index"]] = decode_routed_experts(ch["routed_experts"])
    assert all(len(t) == 4 for t in tokens.values())
    for arr in routed.values():
        np.testing.assert_array_equal(arr, routing_rows(1, 3 + 4 - 1, INFO))


def test_generate_errors(fe_server):
    r = post(fe_server, "/inference/v1/generate", {"token_ids": [1], "sampling_params": {"max_tokens": 500}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "sampling_params.max_tokens"
    r = post(fe_server, "/inference/v1/generate", {"token_ids": [], "sampling_params": {}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "token_ids"
    r = post(fe_server, "/inference/v1/generate", {"token_ids": [1], "model": "x"})
    assert r.status_code == 404


# ---------------------------------------------------------------- async client


def test_async_client_streaming_and_not(aclient_factory, fe_server):
    async def go():
        async with aclient_factory() as ac:
            r = await ac.completions.create(model=fe_server.model, prompt="Hi", max_tokens=5)
            stream = await ac.chat.completions.create(model=fe_server.model, stream=True, max_tokens=5,
                                                      messages=[{"role": "user", "content": "Hi"}])
            text = ""
            async for chunk in stream:
                for c in chunk.choices:
                    text += c.delta.content or ""
            many = await asyncio.gather(*[ac.completions.create(model=fe_server.model, prompt="Hi", max_tokens=3)
                                          for _ in range(6)])
            return r, text, many

    r, text, many = asyncio.run(go())
    assert r.choices[0].text and text
    assert len({m.choices[0].text for m in many}) == 1


# ---------------------------------------------------------------- overload, disconnects, engine errors


@pytest.fixture
def slow_server(fe_checkpoint_dir, fe_tokenizer):
    """A separate app whose engine takes 20 ms per token, with room for 4 choices."""
    from openai_frontend.app import create_app
    from openai_frontend.config import FrontendConfig

    engine = FakeEngine(info=INFO, script=fe_tokenizer.encode(SCRIPT_TEXT, add_special_tokens=False),
                        step_delay=0.02)
    cfg = FrontendConfig(triton_grpc_url="unused:0", served_model_name="m", checkpoint_dir=fe_checkpoint_dir,
                         max_pending_requests=4)
    with ServerThread(create_app(cfg, engine=engine)) as srv:
        srv.engine = engine
        yield srv


def wait_for(cond, timeout=5.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return False


def test_overload_is_503_with_retry_after(slow_server):
    client = openai.OpenAI(base_url=slow_server.base_url, api_key="x", max_retries=0)
    stream = client.completions.create(model="m", prompt="Hi", max_tokens=100, n=3, stream=True)
    next(iter(stream))  # 3 of 4 slots taken
    r = httpx.post(slow_server.base_url + "/completions", json={"prompt": "x", "n": 2, "max_tokens": 1})
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    assert r.json()["error"]["type"] == "server_error"
    r = httpx.post(slow_server.base_url + "/completions", json={"prompt": "x", "n": 5, "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"
    stream.close()
    assert wait_for(lambda: httpx.post(slow_server.base_url + "/completions",
                                       json={"prompt": "x", "n": 4, "max_tokens": 1}).status_code == 200)


def test_disconnect_cancels_streaming_choices(slow_server):
    engine = slow_server.engine
    client = openai.OpenAI(base_url=slow_server.base_url, api_key="x", max_retries=0)
    stream = client.completions.create(model="m", prompt="Hi", max_tokens=100, n=2, stream=True)
    it = iter(stream)
    next(it), next(it)
    stream.close()
    assert wait_for(lambda: len(engine.cancelled) == 2), engine.cancelled
    assert all(rid.startswith("cmpl-") for rid in engine.cancelled)
    # the server still serves, and the slots came back
    r = client.completions.create(model="m", prompt="Hi", max_tokens=2, n=4)
    assert len(r.choices) == 4
    metrics = httpx.get(slow_server.root_url + "/metrics").text
    assert "moe_serve_client_disconnects_total 1.0" in metrics


def test_disconnect_cancels_non_streaming_request(slow_server):
    engine = slow_server.engine
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(slow_server.base_url + "/chat/completions", timeout=0.3,
                   json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 100})
    assert wait_for(lambda: len(engine.cancelled) == 1)
    assert engine.cancelled[0].startswith("chatcmpl-")


def test_engine_errors_map_to_status(slow_server):
    from openai_frontend.triton_client import BackendError

    engine = slow_server.engine
    try:
        engine.fail_with = BackendError(BackendError.UNAVAILABLE, "the engine's waiting queue is full; retry later")
        r = httpx.post(slow_server.base_url + "/completions", json={"prompt": "x", "max_tokens": 1})
        assert r.status_code == 503 and "retry-after" in r.headers
        r = httpx.post(slow_server.base_url + "/completions", json={"prompt": "x", "max_tokens": 1, "stream": True})
        assert r.status_code == 503
        engine.fail_with = BackendError(BackendError.INVALID, "top_p: must be in (0, 1]")
        r = httpx.post(slow_server.base_url + "/chat/completions",
                       json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 1})
        assert r.status_code == 400 and "top_p" in r.json()["error"]["message"]
    finally:
        engine.fail_with = None


def test_health_503_when_engine_not_ready(slow_server):
    slow_server.engine.ready = False
    try:
        r = httpx.get(slow_server.root_url + "/health")
        assert r.status_code == 503 and r.json()["error"]["code"] == "not_ready"
    finally:
        slow_server.engine.ready = True


def test_metrics_after_traffic(client, fe_server):
    client.completions.create(model=fe_server.model, prompt="Hi", max_tokens=3, stream=False)
    list(client.completions.create(model=fe_server.model, prompt="Hi", max_tokens=3, stream=True))
    text = httpx.get(fe_server.root_url + "/metrics").text
    assert 'moe_serve_requests_total{endpoint="/v1/completions",status="200"}' in text
    assert 'moe_serve_requests_total{endpoint="/v1/completions",status="401"}' in text
    assert "moe_serve_time_to_first_token_seconds_count" in text
    assert "moe_serve_inter_token_latency_seconds_count" in text
    assert 'moe_serve_expert_selections_total{expert="0",layer="1"}' in text
    assert 'layer="0"' not in text  # dense layer: not a MoE layer in this model
    for line in text.splitlines():
        if line.startswith("moe_serve_routed_experts_bytes_total"):
            assert float(line.split()[-1]) > 0
        if line.startswith("moe_serve_prompt_tokens_total") or line.startswith("moe_serve_generation_tokens_total"):
            assert float(line.split()[-1]) > 0


def test_frontend_does_not_import_torch_or_transformers():
    import subprocess
    import sys

    code = "import sys, openai_frontend.app; print('torch' in sys.modules, 'transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


def test_absurd_n_is_400_not_a_hang(client, fe_server):
    t0 = time.monotonic()
    for kw in ({"n": 10**9}, {"n": 5, "prompt": ["a", "b"]}):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=fe_server.model, max_tokens=1, **{"prompt": "x", **kw})
        assert e.value.body["param"] == "n"
    r = post(fe_server, "/inference/v1/generate", {"token_ids": [1], "sampling_params": {"n": 10**9}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "sampling_params.n"
    assert time.monotonic() - t0 < 5
