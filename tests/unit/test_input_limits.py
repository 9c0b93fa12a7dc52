"""Hostile input stopped early: invalid Unicode anywhere in a request, texts that cannot fit the context
(refused before tokenizing), chat templates that would render forever or without bound."""
from __future__ import annotations

import random
import time

import pytest
from pydantic import ValidationError

from openai_frontend.errors import PromptTooLongError
from openai_frontend.protocol import ChatCompletionRequest, GenerateRequest, InvalidUnicodeError, check_unicode
from openai_frontend.tokenizer import ChatTemplate, ChatTemplateError, Tokenizer


@pytest.mark.parametrize("value,param", [
    ({"prompt": "ok\ud800"}, "prompt"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "\udfff"}]}]}, "messages[0].content[0].text"),
    ({"chat_template_kwargs": {"\ud800": 1}}, "chat_template_kwargs"),
    ({"a": [1, 2, ["x", "\udc00"]]}, "a[2][1]"),
])
def test_check_unicode_names_the_first_bad_string(value, param):
    with pytest.raises(InvalidUnicodeError) as e:
        check_unicode(value)
    assert e.value.param == param
    check_unicode({"prompt": "Grüße 🚀 東京", "ids": list(range(1000))})  # valid Unicode passes


def test_request_models_reject_lone_surrogates_and_loose_token_ids():
    with pytest.raises(ValidationError):
        ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x", "name": "\ud800"}]})
    with pytest.raises(ValidationError):
        GenerateRequest.model_validate({"token_ids": [1], "request_id": "\ud800"})
    for ids in ([True], ["1"], [1.5]):
        with pytest.raises(ValidationError):
            GenerateRequest.model_validate({"token_ids": ids})
    assert GenerateRequest.model_validate({"token_ids": [1, 2]}).token_ids == [1, 2]
    # A whole number written 2.0 is the integer 2, as JSON Schema (the OpenAPI document) counts it (issue 47).
    assert GenerateRequest.model_validate({"token_ids": [1, 2.0]}).token_ids == [1, 2]


@pytest.fixture
def tok(fe_checkpoint_dir):
    t = Tokenizer.from_dir(fe_checkpoint_dir)
    t.set_max_model_len(128)
    return t


def test_the_character_bound_never_refuses_a_text_that_fits(tok, tiny_checkpoint):
    """The bound's premise: no token stands for more than max_token_chars characters of text."""
    rng = random.Random(0)
    alphabet = list("abc xyz  \n\t.,!?") + list("éüß東京🚀∑") + ["  ", "\n\n", "hello ", "world"]
    for t in (tok, Tokenizer.from_dir(str(tiny_checkpoint))):
        for _ in range(200):
            text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 400)))
            ids = t.hf.encode(text, add_special_tokens=False).ids
            assert len(ids) * t.max_token_chars >= len(text)


def test_a_text_longer_than_any_fitting_prompt_is_refused_before_tokenizing(tok):
    limit = tok.max_prompt_chars
    assert limit == 128 * tok.max_token_chars
    tok.encode("a" * limit)  # at the bound: tokenized (the engine checks the token count)
    huge = "a" * (50 * 2**20)
    t0 = time.monotonic()
    with pytest.raises(PromptTooLongError) as e:
        tok.encode(huge)
    assert time.monotonic() - t0 < 0.5 and e.value.code == "context_length_exceeded"
    with pytest.raises(PromptTooLongError):
        tok.chat_template.render([{"role": "user", "content": "a" * (limit + 1)}])


@pytest.mark.parametrize("source", [
    "{{ 'x' * 100000000 }}",
    "{{ 'ab' | center(1000000000) }}",
    "{{ 'a'.ljust(10 ** 9) }}",
    "{{ 2 ** 100000000 }}",
    "{{ '%099999999d' % 1 }}",
    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "{% for i in range(100000) %}{% for j in range(1000) %}xxxxxxxxxx{% endfor %}{% endfor %}",
])
def test_template_bombs_fail_fast_with_a_template_error(source):
    t0 = time.monotonic()
    with pytest.raises(ChatTemplateError):
        ChatTemplate(source, "<s>", "</s>").render([{"role": "user", "content": "hi"}])
    assert time.monotonic() - t0 < 5
