"""Errors in OpenAI's format from the real server: 401, 404, 400 naming the field, context overflow."""
from __future__ import annotations

import asyncio

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
