"""Errors in OpenAI's format from the real server: 401, 404, 400 naming the field, context overflow."""
from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest

MSG = [{"role": "user", "content": "hi"}]


def test_wrong_key_is_401(moe_server):
    client = openai.OpenAI(base_url=moe_server.base_url, api_key="wrong-key", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        client.completions.create(model=moe_server.model, prompt="x", max_tokens=1)
    assert set(e.value.body) >= {"message", "type", "param", "code"}
    with pytest.raises(openai.AuthenticationError):
        client.models.list()

    async def main():
        async with openai.AsyncOpenAI(base_url=moe_server.base_url, api_key="nope", max_retries=0) as c:
            await c.chat.completions.create(model=moe_server.model, messages=MSG, max_tokens=1)

    with pytest.raises(openai.AuthenticationError):
        asyncio.run(main())


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic abc"}])
def test_missing_or_malformed_key_is_401(moe_server, headers):
    for path, body in [("/inference/v1/generate", {"token_ids": [1]}), ("/v1/completions", {"prompt": "x"}),
                       ("/v1/chat/completions", {"messages": MSG})]:
        r = httpx.post(moe_server.root_url + path, json=body, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(moe_server.base_url + "/models", headers=headers).status_code == 401


def test_unknown_model_404_everywhere(openai_client):
    with pytest.raises(openai.NotFoundError) as e:
        openai_client.chat.completions.create(model="gpt-x", messages=MSG, max_tokens=1)
    assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"
    with pytest.raises(openai.NotFoundError):
        openai_client.models.retrieve("gpt-x")


@pytest.mark.parametrize("kw,param", [
    ({"temperature": -1}, "temperature"),
    ({"top_p": 2}, "top_p"),
    ({"n": 0}, "n"),
    ({"logprobs": 99}, "logprobs"),
    ({"extra_body": {"top_k": -5}}, "top_k"),
    ({"extra_body": {"routed_experts_prompt_start": 500}}, "routed_experts_prompt_start"),
    ({"presence_penalty": 0.5}, "presence_penalty"),
])
def test_invalid_field_is_400_naming_it(openai_client, moe_server, kw, param):
    with pytest.raises(openai.BadRequestError) as e:
        openai_client.completions.create(model=moe_server.model, prompt="hello", max_tokens=2, **kw)
    assert e.value.status_code == 400 and e.value.body["param"] == param
    assert e.value.body["type"] == "invalid_request_error"


def test_chat_validation_names_nested_fields(openai_client, moe_server):
    with pytest.raises(openai.BadRequestError) as e:
        openai_client.chat.completions.create(model=moe_server.model, messages=[{"content": "x"}], max_tokens=1)
    assert e.value.body["param"] == "messages[0].role"
    with pytest.raises(openai.BadRequestError) as e:
        openai_client.chat.completions.create(model=moe_server.model, messages=[], max_tokens=1)
    assert e.value.body["param"] == "messages"


def test_over_context_is_400(openai_client, moe_server):
    with pytest.raises(openai.BadRequestError) as e:
        openai_client.completions.create(model=moe_server.model, prompt=[1] * 1000, max_tokens=100)
    assert e.value.body["code"] == "context_length_exceeded" and e.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError) as e:
        openai_client.chat.completions.create(model=moe_server.model, messages=[{"role": "user", "content": "x"}],
                                              max_completion_tokens=5000)
    assert e.value.body["param"] == "max_completion_tokens"
    with pytest.raises(openai.BadRequestError) as e:
        openai_client.completions.create(model=moe_server.model, prompt=[1, 600], max_tokens=1)
    assert e.value.body["param"] == "prompt"
    # and the server still serves
    assert openai_client.completions.create(model=moe_server.model, prompt="ok", max_tokens=1).choices


# ---------------------------------------------------------------- hostile input (issue 14)

def post_raw(moe_server, path, body: bytes, **kw):
    headers = {"Authorization": f"Bearer {moe_server.api_key}", "Content-Type": "application/json"}
    return httpx.post(moe_server.root_url + path, content=body, headers=headers, timeout=60, **kw)


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", '{"prompt": "a\\ud800b", "max_tokens": 1}', "prompt"),
    ("/v1/completions", '{"prompt": ["ok", "\\udfff"], "max_tokens": 1}', "prompt[1]"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "\\ud83d"}], "max_tokens": 1}',
     "messages[0].content"),
    ("/v1/chat/completions", '{"messages": [{"role": "\\ud800", "content": "x"}], "max_tokens": 1}',
     "messages[0].role"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "x", "name": "\\udc00"}]}',
     "messages[0].name"),
    ("/v1/completions", '{"model": "\\ud800", "prompt": "x", "max_tokens": 1}', "model"),
    ("/inference/v1/generate", '{"request_id": "\\ud800", "token_ids": [1, 2]}', "request_id"),
    ("/inference/v1/generate", '{"token_ids": [1], "sampling_params": {"stop": ["\\ud800"]}}',
     "sampling_params.stop[0]"),
])
def test_lone_surrogates_are_400_naming_the_field(moe_server, path, body, param):
    r = post_raw(moe_server, path, body.encode())
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "invalid_unicode" and err["param"] == param and err["type"] == "invalid_request_error"


def test_invalid_utf8_and_loose_token_ids_are_400(moe_server):
    r = post_raw(moe_server, "/v1/completions", b'{"prompt": "\xff\xfe", "max_tokens": 1}')
    assert r.status_code == 400
    for body, param in [('{"token_ids": [true]}', "token_ids[0]"), ('{"token_ids": [1, "2"]}', "token_ids[1]"),
                        ('{"token_ids": [1.5]}', "token_ids[0]"),
                        ('{"prompt": "x", "stop_token_ids": [false]}', "stop_token_ids[0]")]:
        path = "/v1/completions" if "prompt" in body else "/inference/v1/generate"
        r = post_raw(moe_server, path, body.encode())
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)


def test_oversized_body_is_413_before_it_is_read(moe_server):
    big = b'{"prompt": "' + b"a" * (17 * 2**20) + b'"}'  # over the default --max-request-bytes (16 MiB)
    t0 = time.monotonic()
    r = post_raw(moe_server, "/v1/completions", big)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    assert time.monotonic() - t0 < 5

    def chunks():  # no Content-Length: counted as it arrives
        for _ in range(17):
            yield b"a" * 2**20

    r = post_raw(moe_server, "/v1/completions", chunks())
    assert r.status_code == 413
    assert httpx.get(moe_server.root_url + "/health", timeout=5).status_code == 200


def test_a_text_prompt_that_cannot_fit_is_refused_before_tokenizing(moe_server):
    body = json.dumps({"prompt": "word " * (2 * 2**20), "max_tokens": 1}).encode()  # 10 MB of text
    t0 = time.monotonic()
    r = post_raw(moe_server, "/v1/completions", body)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert time.monotonic() - t0 < 3  # tokenizing it would take far longer on this machine
    big_chat = json.dumps({"messages": [{"role": "user", "content": "word " * 2**20}]}).encode()
    r = post_raw(moe_server, "/v1/chat/completions", big_chat)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"


def test_request_chat_templates_are_off_unless_trusted(openai_client, moe_server):
    with pytest.raises(openai.BadRequestError) as e:
        openai_client.chat.completions.create(model=moe_server.model, messages=MSG, max_tokens=1,
                                              extra_body={"chat_template": "{{ messages[0].content * 10**7 }}"})
    assert e.value.body["param"] == "chat_template"


def test_openapi_documents_400_not_422_and_needs_the_key(moe_server):
    assert httpx.get(moe_server.root_url + "/openapi.json").status_code == 401
    assert httpx.get(moe_server.root_url + "/docs").status_code == 401
    spec = httpx.get(moe_server.root_url + "/openapi.json",
                     headers={"Authorization": f"Bearer {moe_server.api_key}"}).json()
    for path in ("/v1/completions", "/v1/chat/completions", "/inference/v1/generate"):
        responses = spec["paths"][path]["post"]["responses"]
        assert "422" not in responses
        assert {"200", "400", "401", "413", "503", "504"} <= set(responses)
    assert "422" not in json.dumps(spec["paths"])
