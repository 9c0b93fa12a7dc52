"""/v1/chat/completions on the real server through the official openai client."""
from __future__ import annotations

import asyncio

import numpy as np
import openai

from .openai_helpers import assert_valid_routed_experts, decode, extra

MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say something."}]


def test_chat_routed_experts_and_token_ids(openai_client, moe_server):
    r = openai_client.chat.completions.create(model=moe_server.model, messages=MESSAGES, max_completion_tokens=6,
                                              temperature=0, extra_body={"return_token_ids": True})
    c = r.choices[0]
    assert c.message.role == "assistant" and isinstance(c.message.content, str)
    prompt_ids, token_ids = extra(c, "prompt_token_ids"), extra(c, "token_ids")
    assert prompt_ids == extra(r, "prompt_token_ids") and len(prompt_ids) == r.usage.prompt_tokens
    assert_valid_routed_experts(extra(c, "routed_experts"), rows=len(prompt_ids) + len(token_ids) - 1)


def test_chat_stream_n2_equals_non_stream(openai_client, moe_server):
    kw = dict(model=moe_server.model, messages=MESSAGES, max_tokens=8, n=2, temperature=0.8, seed=11,
              logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    full = openai_client.chat.completions.create(**kw)
    texts, lps, routed, roles = {0: "", 1: ""}, {0: [], 1: []}, {}, set()
    for chunk in openai_client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            roles.update([c.index] if c.delta.role == "assistant" else [])
            texts[c.index] += c.delta.content or ""
            if c.logprobs:
                lps[c.index] += c.logprobs.content
            if c.finish_reason:
                routed[c.index] = extra(c, "routed_experts")
    assert roles == {0, 1}
    for c in full.choices:
        assert texts[c.index] == c.message.content
        assert [x.token for x in lps[c.index]] == [x.token for x in c.logprobs.content]
        assert len(c.logprobs.content) == 8 and all(len(x.top_logprobs) == 2 for x in c.logprobs.content)
        np.testing.assert_array_equal(decode(routed[c.index]), decode(extra(c, "routed_experts")))


def test_chat_async_stream_with_usage(moe_server):
    async def main():
        async with openai.AsyncOpenAI(base_url=moe_server.base_url, api_key=moe_server.api_key,
                                      max_retries=0) as client:
            stream = await client.chat.completions.create(model=moe_server.model, messages=MESSAGES, max_tokens=5,
                                                          stream=True, stream_options={"include_usage": True},
                                                          extra_body={"ignore_eos": True})
            return [chunk async for chunk in stream]

    chunks = asyncio.run(main())
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5
    finals = [c for chunk in chunks for c in chunk.choices if c.finish_reason]
    assert [c.finish_reason for c in finals] == ["length"]
    assert_valid_routed_experts(extra(finals[0], "routed_experts"), rows=chunks[-1].usage.prompt_tokens + 5 - 1)
