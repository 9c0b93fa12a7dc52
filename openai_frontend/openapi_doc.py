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
    400: "Invalid request (the field is named in `param`), prompt over the context (`context_length_exceeded`), or a "
         "response over --max-response-logprobs (`response_too_large`)",
    401: "Missing or wrong API key (when the server has one)",
    404: "Unknown model (`model_not_found`)",
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

_GENERATION = (400, 401, 404, 413, 503, 504)
_CONTROL = (400, 401, 413, 503)
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
    for path, operations in schema.get("paths", {}).items():
        for method, op in operations.items():
            op["operationId"] = f"{method}_{path.strip('/').replace('/', '_').replace('{', '').replace('}', '')}"
            responses = op.setdefault("responses", {})
            responses.pop("422", None)
            if path in _SUCCESS:
                responses["200"] = _SUCCESS[path]
            statuses = _STATUSES.get(path, ())
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
    app.openapi_schema = schema
    return schema
