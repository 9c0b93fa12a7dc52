"""/v1/completions on the real server through the official openai client (sync and async)."""
from __future__ import annotations

import asyncio

import numpy as np
import openai
import pytest

from .openai_helpers import assert_valid_routed_experts, decode, extra

PROMPT = "The quick brown fox"


def complete(client, model, **kw):
    kw.setdefault("max_tokens", 8)
    kw.setdefault("temperature", 0)
    return client.completions.create(model=model, prompt=kw.pop("prompt", PROMPT), **kw)


def test_rows_align_with_tokens(openai_client, moe_server):
    r = complete(openai_client, moe_server.model, extra_body={"return_token_ids": True})
    c = r.choices[0]
    prompt_ids, token_ids = extra(c, "prompt_token_ids"), extra(c, "token_ids")
    assert len(token_ids) == r.usage.completion_tokens and len(prompt_ids) == r.usage.prompt_tokens
    assert_valid_routed_experts(extra(c, "routed_experts"), rows=len(prompt_ids) + len(token_ids) - 1)
    assert c.finish_reason in ("length", "stop")


def test_token_prompts_n_and_indices(openai_client, moe_server):
    r = openai_client.completions.create(model=moe_server.model, prompt=[[1, 5, 9], [1, 7]], n=2, max_tokens=3,
                                         temperature=0, extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    rows = [decode(extra(c, "routed_experts")).shape[0] for c in r.choices]
    assert rows == [3 + 3 - 1] * 2 + [2 + 3 - 1] * 2
    assert r.usage.prompt_tokens == 5 and r.usage.completion_tokens == 12


def test_stream_equals_non_stream(openai_client, moe_server):
    kw = dict(max_tokens=12, extra_body={"return_token_ids": True, "ignore_eos": True})
    full = complete(openai_client, moe_server.model, **kw).choices[0]
    text, tokens, routed, finish = "", [], None, None
    for chunk in complete(openai_client, moe_server.model, stream=True, **kw):
        for c in chunk.choices:
            text += c.text
            tokens += extra(c, "token_ids") or []
            if c.finish_reason:
                finish, routed = c.finish_reason, extra(c, "routed_experts")
            else:
                assert extra(c, "routed_experts") is None
    assert text == full.text and tokens == extra(full, "token_ids") and finish == full.finish_reason
    np.testing.assert_array_equal(decode(routed), decode(extra(full, "routed_experts")))


def test_stream_n2_routed_experts_for_both_choices(openai_client, moe_server):
    stream = complete(openai_client, moe_server.model, stream=True, n=2, temperature=1.0, seed=7, max_tokens=6,
                      stream_options={"include_usage": True},
                      extra_body={"return_token_ids": True, "ignore_eos": True})
    tokens, routed, usage = {0: [], 1: []}, {}, None
    for chunk in stream:
        usage = chunk.usage or usage
        for c in chunk.choices:
            tokens[c.index] += extra(c, "token_ids") or []
            if c.finish_reason:
                routed[c.index] = extra(c, "routed_experts")
    assert sorted(routed) == [0, 1]
    for i in (0, 1):
        assert len(tokens[i]) == 6
        assert_valid_routed_experts(routed[i], rows=usage.prompt_tokens + 6 - 1)
    assert tokens[0] != tokens[1]  # per-choice seeds (seed + index)
    assert usage.completion_tokens == 12


def test_seed_is_reproducible(openai_client, moe_server):
    kw = dict(temperature=1.0, seed=1234, max_tokens=6, n=2, extra_body={"ignore_eos": True})
    a = complete(openai_client, moe_server.model, **kw)
    b = complete(openai_client, moe_server.model, **kw)
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert a.choices[0].text != a.choices[1].text


def test_stop_string_cuts_text_tokens_and_rows(openai_client, moe_server):
    kw = dict(max_tokens=24, extra_body={"return_token_ids": True, "ignore_eos": True})
    full = complete(openai_client, moe_server.model, **kw).choices[0]
    text = full.text
    # a stop string that first occurs in the middle of the greedy text
    p = next(i for i in range(len(text) // 3, len(text) - 2)
             if "\ufffd" not in text[i:i + 2] and text.find(text[i:i + 2]) == i)
    stop = text[p:p + 2]
    for stream in (False, True):
        if stream:
            got, tokens, routed, finish = "", [], None, None
            for chunk in complete(openai_client, moe_server.model, stop=[stop], stream=True, **kw):
                for c in chunk.choices:
                    got += c.text
                    tokens += extra(c, "token_ids") or []
                    if c.finish_reason:
                        finish, routed = c.finish_reason, extra(c, "routed_experts")
        else:
            c = complete(openai_client, moe_server.model, stop=[stop], **kw).choices[0]
            got, tokens, routed, finish = c.text, extra(c, "token_ids"), extra(c, "routed_experts"), c.finish_reason
        assert got == text[:p] and finish == "stop"
        full_tokens = extra(full, "token_ids")
        assert tokens == full_tokens[: len(tokens)] and len(tokens) < len(full_tokens)
        arr = decode(routed)
        n_prompt = len(extra(full, "prompt_token_ids"))
        assert arr.shape[0] == n_prompt + len(tokens) - 1
        np.testing.assert_array_equal(arr, decode(extra(full, "routed_experts"))[: arr.shape[0]])


def test_logprobs_and_echo(openai_client, moe_server):
    r = complete(openai_client, moe_server.model, logprobs=3, max_tokens=4, extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
        assert chosen <= 0 and 3 <= len(top) <= 4
        assert chosen == pytest.approx(max(top.values()), abs=1e-4)  # greedy: the chosen is the best
    r = complete(openai_client, moe_server.model, echo=True, max_tokens=2)
    assert r.choices[0].text.startswith(PROMPT)


def test_routed_experts_opt_out_and_prompt_start(openai_client, moe_server):
    r = complete(openai_client, moe_server.model, extra_body={"return_routed_experts": False})
    assert extra(r.choices[0], "routed_experts") is None
    base = complete(openai_client, moe_server.model, max_tokens=4, extra_body={"ignore_eos": True})
    start = complete(openai_client, moe_server.model, max_tokens=4,
                     extra_body={"routed_experts_prompt_start": 2, "ignore_eos": True})
    full, cut = decode(extra(base.choices[0], "routed_experts")), decode(extra(start.choices[0], "routed_experts"))
    np.testing.assert_array_equal(cut, full[2:])


def test_async_client(moe_server):
    async def main():
        async with openai.AsyncOpenAI(base_url=moe_server.base_url, api_key=moe_server.api_key,
                                      max_retries=0) as client:
            rs = await asyncio.gather(*[
                client.completions.create(model=moe_server.model, prompt=f"Request {i}", max_tokens=4, temperature=0)
                for i in range(4)
            ])
            stream = await client.completions.create(model=moe_server.model, prompt=PROMPT, max_tokens=4,
                                                     temperature=0, stream=True)
            finals = [c async for chunk in stream for c in chunk.choices if c.finish_reason]
            return rs, finals

    rs, finals = asyncio.run(main())
    for r in rs:
        assert_valid_routed_experts(extra(r.choices[0], "routed_experts"))
    assert len(finals) == 1 and extra(finals[0], "routed_experts") is not None
