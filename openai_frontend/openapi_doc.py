"""The OpenAPI schema with the statuses the API really answers.

FastAPI documents 422 for every route with a body; this server answers 400
for invalid requests (OpenAI's convention), so 422 is replaced by the
statuses each route can return, all in the OpenAI error format.
"""
from __future__ import annotations

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
    400: "Invalid request (the field is named in `param`), or prompt over the context (`context_length_exceeded`)",
    401: "Missing or wrong API key (when the server has one)",
    404: "Unknown model (`model_not_found`)",
    413: "Body over --max-request-bytes (`request_too_large`)",
    503: "Cannot take it now; retry after `Retry-After` seconds (`overloaded`, `backend_unavailable`, "
         "`shutting_down`, `model_not_ready`)",
    504: "Ran past --request-timeout and was cancelled (`request_timeout`)",
}

_GENERATION = (400, 401, 404, 413, 503, 504)
_STATUSES: dict[str, tuple[int, ...]] = {
    "/v1/completions": _GENERATION,
    "/v1/chat/completions": _GENERATION,
    "/inference/v1/generate": _GENERATION,
    "/v1/models": (401, 503),
    "/v1/models/{model_id}": (401, 404, 503),
    "/health": (503,),
}


def documented_openapi(app: FastAPI) -> dict[str, Any]:
    if app.openapi_schema is not None:
        return app.openapi_schema
    schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
    schemas = schema.setdefault("components", {}).setdefault("schemas", {})
    schemas["ErrorResponse"] = _ERROR_SCHEMA
    for path, operations in schema.get("paths", {}).items():
        for op in operations.values():
            responses = op.setdefault("responses", {})
            responses.pop("422", None)
            for status in _STATUSES.get(path, ()):
                responses[str(status)] = {
                    "description": _DESCRIPTIONS[status],
                    "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}},
                }
    for unused in ("HTTPValidationError", "ValidationError"):
        schemas.pop(unused, None)
    app.openapi_schema = schema
    return schema
