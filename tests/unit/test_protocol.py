"""Request validation: OpenAI + vLLM fields, neutral-only knobs, 400s that name the field."""
from __future__ import annotations

import pytest
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from openai_frontend.errors import validation_error_to_openai
from openai_frontend.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DeltaMessage,
    GenerateRequest,
)


def openai_error(model, body):
    """What the API answers for this body (FastAPI prefixes locations with "body")."""
    with pytest.raises(ValidationError) as e:
        model.model_validate(body)
    errors = [{**err, "loc": ("body", *err["loc"])} for err in e.value.errors()]
    return validation_error_to_openai(RequestValidationError(errors, body=body))


@pytest.mark.parametrize(
    "prompt,expected",
    [
        ("hi", ["hi"]),
        (["a", "b"], ["a", "b"]),
        ([1, 2, 3], [[1, 2, 3]]),
        ([[1], [2, 3]], [[1], [2, 3]]),
    ],
)
def test_prompt_forms(prompt, expected):
    assert CompletionRequest(prompt=prompt).prompt == expected


@pytest.mark.parametrize("prompt", [[], [[]], [1, "a"], [[1], "a"], [-1], [[0, -5]], 3, None, {"a": 1}, [True]])
def test_bad_prompts_name_the_field(prompt):
    err = openai_error(CompletionRequest, {"prompt": prompt})
    assert err.status_code == 400
    assert err.param == "prompt"


def test_defaults_follow_openai_and_vllm():
    r = CompletionRequest(prompt="x")
    assert r.max_tokens == 16 and r.n == 1 and r.stream is False and r.return_routed_experts is None
    c = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}])
    assert c.max_tokens is None and c.max_completion_tokens is None and c.add_special_tokens is False
    g = GenerateRequest(token_ids=[1])
    assert g.sampling_params.max_tokens is None and g.stream is False


def test_unknown_fields_are_ignored():
    r = CompletionRequest(prompt="x", some_vllm_only_knob=3, vllm_xargs={"a": 1})
    assert not hasattr(r, "some_vllm_only_knob")


@pytest.mark.parametrize(
    "field,value",
    [
        ("presence_penalty", 0.5),
        ("frequency_penalty", -1.0),
        ("repetition_penalty", 1.2),
        ("min_p", 0.1),
        ("use_beam_search", True),
        ("logit_bias", {"5": 1.0}),
        ("prompt_logprobs", -1),
        ("replay_routed_experts", "not base64!"),
        ("replay_routed_experts", 3),
        ("return_routed_weights", "maybe"),
        ("guided_json", {"type": "object"}),
        ("suffix", "x"),
        ("best_of", 3),
        ("response_format", {"type": "json_object"}),
        ("top_k", -2),
        ("temperature", -0.1),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("n", 0),
        ("max_tokens", 0),
        ("max_tokens", 1.5),
        ("logprobs", -1),
        ("seed", 2**64),
        ("min_tokens", -1),
        ("stop", ["ok", ""]),
        ("stop_token_ids", [-1]),
        ("routed_experts_prompt_start", -1),
        ("temperature", "hot"),
    ],
)
def test_invalid_or_unsupported_values_are_400_naming_the_field(field, value):
    err = openai_error(CompletionRequest, {"prompt": "x", field: value})
    assert err.status_code == 400
    assert err.param == field, err.message
    assert err.error_type == "invalid_request_error"


@pytest.mark.parametrize("field,value", [("presence_penalty", 0.0), ("repetition_penalty", 1.0), ("top_k", -1),
                                         ("top_k", 0), ("best_of", 1), ("response_format", {"type": "text"}),
                                         ("logit_bias", {})])
def test_neutral_values_of_unsupported_knobs_are_accepted(field, value):
    CompletionRequest(prompt="x", **{field: value})


def test_stop_is_normalised_to_a_list():
    assert CompletionRequest(prompt="x", stop="END").stop == ["END"]
    assert CompletionRequest(prompt="x", stop=["a", "b"]).stop_list() == ["a", "b"]
    assert CompletionRequest(prompt="x").stop_list() == []


def test_chat_message_errors_point_into_the_list():
    err = openai_error(ChatCompletionRequest, {"messages": [{"role": "user", "content": "a"}, {"content": "b"}]})
    assert err.param == "messages[1].role"
    assert "Missing" in err.message
    err = openai_error(ChatCompletionRequest, {"messages": []})
    assert err.param == "messages"
    err = openai_error(ChatCompletionRequest, {"messages": [{"role": "user", "content": 5}]})
    assert err.param == "messages[0].content"


def test_missing_required_field():
    err = openai_error(ChatCompletionRequest, {"model": "m"})
    assert err.param == "messages"
    assert "Missing" in err.message
    err = openai_error(GenerateRequest, {"sampling_params": {}})
    assert err.param == "token_ids"


def test_chat_rejects_unsupported_tool_choice_and_echo():
    base = {"messages": [{"role": "user", "content": "a"}]}
    assert openai_error(ChatCompletionRequest, {**base, "tool_choice": "required"}).param == "tool_choice"
    assert openai_error(ChatCompletionRequest, {**base, "echo": True}).param == "echo"
    ChatCompletionRequest(**base, tool_choice="auto", tools=[{"type": "function", "function": {"name": "f"}}])


def test_chat_content_parts():
    r = ChatCompletionRequest(messages=[{"role": "user", "content": [{"type": "text", "text": "a"}]}])
    assert r.messages[0].content[0].text == "a"


def test_generate_request_like_vllm():
    r = GenerateRequest(token_ids=[1, 2, 3], sampling_params={"max_tokens": 10, "temperature": 0.0,
                                                              "routed_experts_prompt_start": 1, "n": 2})
    assert r.sampling_params.routed_experts_prompt_start == 1 and r.sampling_params.n == 2
    assert openai_error(GenerateRequest, {"token_ids": []}).param == "token_ids"
    assert openai_error(GenerateRequest, {"token_ids": [1, -2]}).param == "token_ids"
    err = openai_error(GenerateRequest, {"token_ids": [1], "sampling_params": {"temperature": -1}})
    assert err.param == "sampling_params.temperature"
    assert openai_error(GenerateRequest, {"token_ids": [1], "priority": 3}).param == "priority"
    assert openai_error(GenerateRequest, {"token_ids": [1], "kv_transfer_params": {"a": 1}}).param == \
        "kv_transfer_params"


def test_malformed_json_and_non_object_bodies():
    err = validation_error_to_openai(RequestValidationError(
        [{"type": "json_invalid", "loc": ("body", 1), "msg": "JSON decode error", "ctx": {"error": "Expecting value"}}],
        body="{x"))
    assert err.status_code == 400 and err.code == "invalid_json" and "Malformed JSON" in err.message
    err = validation_error_to_openai(RequestValidationError(
        [{"type": "model_attributes_type", "loc": ("body",), "msg": "Input should be a valid dictionary"}],
        body=b"{bad"))
    assert "Malformed JSON" in err.message
    err = validation_error_to_openai(RequestValidationError(
        [{"type": "model_attributes_type", "loc": ("body",), "msg": "Input should be a valid dictionary"}],
        body=b'{"prompt": "x"}'))
    assert "Content-Type" in err.message


def test_delta_message_leaves_out_unset_fields():
    assert DeltaMessage().model_dump_json() == "{}"
    assert DeltaMessage(role="assistant", content="").model_dump_json() == '{"role":"assistant","content":""}'
