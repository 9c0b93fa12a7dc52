"""The OpenAPI schema with the statuses the API really answers.

FastAPI documents 422 for every route with a body; this server answers 400
for invalid requests (OpenAI's convention), so 422 is replaced by the
statuses each route can return, all in the OpenAI error format.
"""
from __future__ import annotations

import warnings
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

_ERROR_SCHEMA = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string", "examples": ["invalid_request_error", "server_error"]},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
        }
    },
}

_DESCRIPTIONS = {
    400: "Invalid request (the field is named in `param`). A body the schema allows is refused only for what JSON "
         "Schema cannot say, each with its `code`: `context_length_exceeded`, `response_too_large` (over "
         "--max-response-logprobs), `too_many_choices`, `empty_prompt`, `invalid_prompt_start`, `invalid_replay`, "
         "`chat_template_error`, `unsupported_combination`",
    401: "Missing or wrong API key (when the server has one)",
    404: "Unknown model (`model_not_found`); on the RL endpoints, no checkpoint at `model_path` "
         "(`checkpoint_not_found`) or no weight update group by that name (`weight_update_group_not_found`)",
    413: "Body over --max-request-bytes (`request_too_large`)",
    503: "Cannot take it now; retry after `Retry-After` seconds (`overloaded`, `backend_unavailable`, "
         "`shutting_down`, `model_not_ready`, `weights_lost`: a backend restart lost weights that came over a "
         "broadcast, push them again)",
    504: "Ran past --request-timeout and was cancelled (`request_timeout`)",
}

# The RL lifecycle endpoints (serving_weights.py): what a success looks like, and a refusal (400), which carries the
# same fields and the OpenAI error object.
_CONTROL_RESULT = {
    "type": "object",
    "required": ["success", "message", "weight_version"],
    "properties": {
        "success": {"type": "boolean"},
        "message": {"type": "string"},
        "weight_version": {"type": ["string", "null"], "description": "null while a restart lost the weights"},
        "num_paused_requests": {"type": "integer"},
    },
}
_CONTROL_REFUSAL = {
    "type": "object",
    "required": ["error"],
    "properties": {**_CONTROL_RESULT["properties"], "error": _ERROR_SCHEMA["properties"]["error"]},
}
_WEIGHT_VERSION = {
    "type": "object",
    "required": ["weight_version"],
    "properties": {
        "weight_version": {"type": ["string", "null"]},
        "weights_lost": {"type": "boolean", "description": "present (true) while generation is refused: a backend "
                                                           "restart could not bring the served weights back"},
        "lost_weight_version": {"type": ["string", "null"]},
        "message": {"type": "string"},
    },
}
_IS_SLEEPING = {"type": "object", "required": ["is_sleeping"], "properties": {"is_sleeping": {"type": "boolean"}}}

# With "stream": true, each server-sent event: `data:` a JSON chunk of the endpoint's stream format (an error object
# once the stream started and then failed), the last `data: [DONE]`.
_SSE_EVENT = {"type": "object", "required": ["data"],
              "properties": {"data": {"type": "string", "description": "a JSON chunk, or [DONE] at the end"},
                             "event": {"type": "string"}}}
_GENERATION = (400, 401, 404, 413, 503, 504)
_CONTROL = (400, 401, 404, 413, 503)
_STATUSES: dict[str, tuple[int, ...]] = {
    "/v1/completions": _GENERATION,
    "/v1/chat/completions": _GENERATION,
    "/inference/v1/generate": _GENERATION,
    "/v1/models": (401, 503),
    "/v1/models/{model_id}": (401, 404, 503),
    "/health": (503,),
}
_SUCCESS: dict[str, dict[str, Any]] = {
    "/health": {"description": "Serving: the backend is up and holds the weights it should serve (no body)"},
    "/metrics": {"description": "Prometheus text exposition: the API's metrics and the engine's gauges",
                 "content": {"text/plain": {"schema": {"type": "string"}}}},
}
# The expert load (serving_expert_load.py): SGLang's recorder (400: counting is off) and the dashboard's data.
_TEXT_ANSWER = {"content": {"text/plain": {"schema": {"type": "string"}}}}
_DUMP = {"type": "object", "required": ["mode", "dims", "layers", "experts", "logical_count", "num_steps"],
         "properties": {"mode": {"enum": ["stat", "per_pass"]}, "dims": {"type": "array", "items": {"type": "string"}},
                        "layers": {"type": "array", "items": {"type": "integer"}},
                        "experts": {"type": "array", "items": {"type": "integer"}},
                        "logical_count": {"type": "array"}, "num_steps": {"type": "integer"},
                        "num_tokens": {"type": "integer"}, "path": {"type": "string"}}}
for _path, _answer in (("/start_expert_distribution_record", "Recording (SGLang's text)"),
                       ("/stop_expert_distribution_record", "Not recording (SGLang's text)")):
    _STATUSES[_path] = (400, 401, 503)
    _SUCCESS[_path] = {"description": _answer, **_TEXT_ANSWER}
_STATUSES["/dump_expert_distribution_record"] = (400, 401, 503)
_SUCCESS["/dump_expert_distribution_record"] = {
    "description": "The record, its axes named (then cleared); with format=npy the counts as .npy",
    "content": {"application/json": {"schema": _DUMP},
                "application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}}
_STATUSES["/dashboard/data"] = (400, 401, 503)
_SUCCESS["/dashboard/data"] = {
    "description": "The expert load over the window and since start, the timeline, the engine's gauges",
    "content": {"application/json": {"schema": {"type": "object"}}}}


# Refusals that depend on more than one field, or on the prompt's tokens, the chat template or the server's state:
# JSON Schema cannot say them, so each has its own error code (a schema-valid body is refused only with one of these).
SEMANTIC_CODES = frozenset({
    "context_length_exceeded",  # prompt tokens + max_tokens over the model's context
    "response_too_large",  # over --max-response-logprobs
    "too_many_choices",  # n x prompts over --max-pending-requests
    "empty_prompt",  # a text that tokenizes to nothing
    "invalid_prompt_start",  # routed_experts_prompt_start not inside the prompt
    "invalid_replay",  # replay_routed_experts that does not fit the prompt or the model
    "chat_template_error",  # the conversation as the chat template takes it (roles, order)
    "unsupported_combination",  # fields that exclude each other (stream_options without stream, best_of != n, ...)
})


def _nullable(schema: dict[str, Any]) -> dict[str, Any]:
    return {"anyOf": [schema, {"type": "null"}]}


_INT64_MAX = 2**63 - 1
_TEXT = {"type": "string", "minLength": 1}
_IDS = {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}}


def _generation_fields(limits: dict[str, int]) -> dict[str, Any]:
    """What the generation bodies' validators accept, as JSON Schema (protocol.py: knobs this server does not
    implement take their neutral value only; ids are in the vocabulary; top-N within --max-logprobs)."""
    ids = {**_IDS["items"], **({"maximum": limits["vocab"] - 1} if "vocab" in limits else {})}
    top_n = {"type": "integer", "minimum": 0, "maximum": limits["max_logprobs"]}
    return {
        "presence_penalty": _nullable({"const": 0}), "frequency_penalty": _nullable({"const": 0}),
        "repetition_penalty": _nullable({"const": 1}), "min_p": _nullable({"const": 0}),
        "use_beam_search": _nullable({"const": False}),
        "logit_bias": _nullable({"type": "object", "maxProperties": 0}),
        "allowed_token_ids": _nullable({"type": "array", "maxItems": 0}),
        "bad_words": _nullable({"type": "array", "maxItems": 0}),
        "response_format": _nullable({"type": "object", "properties": {"type": {"enum": ["text", None]}}}),
        "guided_json": {"type": "null"}, "guided_regex": {"type": "null"}, "guided_choice": {"type": "null"},
        "guided_grammar": {"type": "null"}, "structured_outputs": {"type": "null"},
        "stop": {"anyOf": [_TEXT, {"type": "array", "items": _TEXT}, {"type": "null"}]},
        "stop_token_ids": _nullable({"type": "array", "items": ids}),
        "top_k": _nullable({"type": "integer", "minimum": -1, "maximum": 2**31 - 1}),
        "prompt_logprobs": _nullable(top_n),
        "logprobs": _nullable(top_n),
        "top_logprobs": _nullable(top_n),
        "n": {"type": "integer", "minimum": 1, "maximum": limits["max_choices"], "default": 1},
        "cache_salt": _nullable({"type": "string", "minLength": 1, "maxLength": 1024}),
        "token_ids": {**_IDS, "items": ids},
        "prompt": {"anyOf": [{"type": "string"}, {"type": "array", "minItems": 1, "items": {"type": "string"}},
                             {"type": "array", "minItems": 1, "items": ids},
                             {"type": "array", "minItems": 1, "items": {"type": "array", "minItems": 1, "items": ids}}],
                   "description": "a text, texts, token ids or lists of token ids"},
        "priority": {"const": 0, "default": 0},
        "kv_transfer_params": {"type": "null"}, "features": {"type": "null"}, "suffix": {"type": "null"},
    }


def _tighten(schemas: dict[str, Any], limits: dict[str, int], trust_chat_template: bool) -> None:
    """Bodies as the validators accept them (positive fuzzing must be accepted, negative refused)."""
    fields = _generation_fields(limits)
    for name in ("CompletionRequest", "ChatCompletionRequest", "GenerateSamplingParams", "GenerateRequest"):
        props = schemas.get(name, {}).get("properties", {})
        for key, value in fields.items():
            if key in props:
                props[key] = {**value, "title": props[key].get("title", key)}
    chat = schemas.get("ChatCompletionRequest", {}).get("properties", {})
    if chat:
        chat["logprobs"] = {"type": "boolean", "default": False}
        chat["echo"] = {"const": False, "default": False}
        chat["prompt_logprobs"] = {"type": "null", "description": "on /v1/completions and /inference/v1/generate"}
        chat["tool_choice"] = {"enum": ["none", "auto", None]}
        if not trust_chat_template:
            chat["chat_template"] = {"type": "null", "description": "off on this server (--trust-request-chat-template)"}
    part = schemas.get("ChatContentPart")
    if part:
        part["properties"]["type"] = {"enum": ["text", "input_text"]}
        part["properties"]["text"] = {"type": "string"}
        part["required"] = ["type", "text"]
    disk = schemas.get("UpdateWeightsFromDiskRequest", {}).get("properties", {})
    for key, neutral in (("is_async", False), ("keep_pause", False)):
        if key in disk:
            disk[key] = {"const": neutral, "default": neutral}
    if "load_format" in disk:
        disk["load_format"] = _nullable({"const": "auto"})
    if "manifest" in disk:
        disk["manifest"] = {"type": "null"}
    dist = schemas.get("UpdateWeightsFromDistributedRequest", {}).get("properties", {})
    if "load_format" in dist:
        dist["load_format"] = _nullable({"const": "auto"})


def _json(schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _error(status: int) -> dict[str, Any]:
    return _json({"$ref": "#/components/schemas/ErrorResponse"}, _DESCRIPTIONS[status])


def documented_openapi(app: FastAPI) -> dict[str, Any]:
    if app.openapi_schema is not None:
        return app.openapi_schema
    from .serving_weights import RL_PATHS

    # Operation ids made unique here (a route answering GET and POST would otherwise share one).
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
    schemas = schema.setdefault("components", {}).setdefault("schemas", {})
    schemas["ErrorResponse"] = _ERROR_SCHEMA
    ctx = getattr(app.state, "ctx", None)
    if ctx is not None:
        limits = {"max_logprobs": ctx.cfg.max_logprobs, "max_choices": ctx.cfg.max_pending_requests}
        if ctx.model is not None:
            limits["vocab"] = ctx.model.vocab_size
        _tighten(schemas, limits, ctx.cfg.trust_request_chat_template)
    for path, operations in schema.get("paths", {}).items():
        for method, op in operations.items():
            op["operationId"] = f"{method}_{path.strip('/').replace('/', '_').replace('{', '').replace('}', '')}"
            responses = op.setdefault("responses", {})
            responses.pop("422", None)
            if path in _SUCCESS:
                responses["200"] = _SUCCESS[path]
            statuses = _STATUSES.get(path, ())
            if statuses is _GENERATION:  # "stream": true answers server-sent events
                responses.setdefault("200", {"description": "Successful Response"}).setdefault("content", {})[
                    "text/event-stream"] = {"schema": _SSE_EVENT}
            if path in RL_PATHS:
                statuses = _CONTROL if method == "post" or "requestBody" in op else (401, 503)
                if path in ("/get_weight_version", "/weight_version"):
                    responses["200"] = _json(_WEIGHT_VERSION, "The weights the engine serves")
                elif path == "/is_sleeping":
                    responses["200"] = _json(_IS_SLEEPING, "Whether memory is released")
                else:
                    responses["200"] = _json(_CONTROL_RESULT, "Done")
            for status in statuses:
                if path in RL_PATHS and status == 400:
                    responses["400"] = _json(_CONTROL_REFUSAL, "Refused, nothing changed (a checkpoint of another "
                                             "shape or with NaN, an unknown tensor, an invalid body): the message "
                                             "and the OpenAI error object")
                else:
                    responses[str(status)] = _error(status)
    for unused in ("HTTPValidationError", "ValidationError"):
        schemas.pop(unused, None)
    if ctx is None or ctx.model is not None:  # the model's limits known: the document is final
        app.openapi_schema = schema
    return schema
