"""OpenAI error envelope and typed errors.

Every error leaves the server as
``{"error": {"message", "type", "param", "code"}}`` with a meaningful HTTP
status; handlers for FastAPI's own errors (validation, 404/405, malformed
JSON) are installed by :func:`install_error_handlers`.

Statuses: 400 invalid request (never 422), 401 key, 404 model/route, 413 body
over ``--max-request-bytes``, 503 + Retry-After when the server cannot take
the request now (code ``overloaded``: admission limit or engine queue full;
``backend_unavailable``: Triton or the model failed and is restarting;
``shutting_down``; ``model_not_ready``), 504 ``request_timeout`` past
``--request-timeout``. Error bodies are ASCII JSON, so no client input (a
lone surrogate, say) can break their encoding.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .protocol import InvalidUnicodeError

logger = logging.getLogger(__name__)


class OpenAIError(Exception):
    """An error that maps to one HTTP response in OpenAI's format."""

    status_code = 500
    error_type = "server_error"

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers

    def to_dict(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.error_type,
                "param": self.param,
                "code": self.code,
            }
        }

    def to_response(self) -> JSONResponse:
        return _AsciiJSONResponse(self.to_dict(), status_code=self.status_code, headers=self.headers)

    def to_json(self) -> str:
        return json.dumps(self.to_dict())  # ASCII: safe whatever the message holds


class _AsciiJSONResponse(JSONResponse):
    def render(self, content: Any) -> bytes:
        return json.dumps(content, separators=(",", ":")).encode("ascii")


class BadRequestError(OpenAIError):
    status_code = 400
    error_type = "invalid_request_error"


class AuthenticationError(OpenAIError):
    status_code = 401
    error_type = "invalid_request_error"

    def __init__(self, message: str = "Incorrect API key provided.") -> None:
        super().__init__(message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


class NotFoundError(OpenAIError):
    status_code = 404
    error_type = "invalid_request_error"


class ServiceUnavailableError(OpenAIError):
    """Overload or engine not ready; carries Retry-After."""

    status_code = 503
    error_type = "server_error"

    def __init__(self, message: str, *, retry_after_s: int = 1, code: str | None = "overloaded") -> None:
        super().__init__(message, code=code, headers={"Retry-After": str(int(retry_after_s))})


def backend_unavailable(retry_after_s: int = 1) -> ServiceUnavailableError:
    return ServiceUnavailableError(
        "The model backend failed and is being restarted; retry later.",
        retry_after_s=retry_after_s, code="backend_unavailable",
    )


def shutting_down(retry_after_s: int = 1) -> ServiceUnavailableError:
    err = ServiceUnavailableError("The server is shutting down; retry on another replica or later.",
                                  retry_after_s=retry_after_s, code="shutting_down")
    err.headers["Connection"] = "close"
    return err


class RequestTooLargeError(OpenAIError):
    status_code = 413
    error_type = "invalid_request_error"

    def __init__(self, limit: int) -> None:
        super().__init__(f"The request body is larger than the server's limit of {limit} bytes "
                         "(--max-request-bytes).", code="request_too_large", headers={"Connection": "close"})


class RequestTimeoutError(OpenAIError):
    """The request ran past --request-timeout; its engine work was cancelled."""

    status_code = 504
    error_type = "server_error"

    def __init__(self, timeout_s: float) -> None:
        super().__init__(f"The request did not finish within the server's limit of {timeout_s:g} s "
                         "(--request-timeout); it was cancelled.", code="request_timeout")


class PromptTooLongError(BadRequestError):
    """A text prompt longer than any prompt that fits the context (checked before tokenizing it)."""

    def __init__(self, num_chars: int, max_chars: int, max_model_len: int, at_least: bool = False) -> None:
        super().__init__(
            f"This model's maximum context length is {max_model_len} tokens, which no text longer than "
            f"{max_chars} characters fits in with this tokenizer; the prompt has {'at least ' * at_least}"
            f"{num_chars} characters. Please reduce the length of the prompt.",
            code="context_length_exceeded",
        )


class InternalServerError(OpenAIError):
    status_code = 500
    error_type = "server_error"


class ClientDisconnected(Exception):
    """Raised internally when the HTTP client went away."""


def model_not_found(model: str | None) -> NotFoundError:
    return NotFoundError(f"The model `{model}` does not exist.", param="model", code="model_not_found")


# --------------------------------------------------------------------------
# Validation errors -> 400 naming the field


def _param_from_loc(loc: tuple[Any, ...], body: Any) -> str | None:
    """Turn a pydantic location into an OpenAI ``param`` ("messages[0].content").

    The location is walked against the request body so that pydantic's union
    tags ("str", "list[int]", "function-after[...]") never leak into the name.
    """
    parts = list(loc)
    if parts and parts[0] in ("query", "path"):  # a URL parameter: its name (a list's index dropped)
        return ".".join(str(p) for p in parts[1:] if not isinstance(p, int)) or None
    if parts and parts[0] == "body":
        parts = parts[1:]
    name = ""
    node = body
    for i, part in enumerate(parts):
        if isinstance(part, int) and isinstance(node, list) and 0 <= part < len(node):
            name += f"[{part}]"
            node = node[part]
        elif isinstance(part, str) and isinstance(node, dict) and (part in node or i == len(parts) - 1):
            # a present key, or (last in the location) a required key that is missing
            name += f".{part}" if name else part
            if part not in node:
                break
            node = node[part]
        else:
            break
    return name or None


def _validation_message(err: dict[str, Any], param: str | None) -> str:
    msg = str(err.get("msg", "invalid value"))
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, ") :]
    if err.get("type") == "missing":
        return f"Missing required field `{param}`." if param else "Missing required field."
    return f"Invalid value for `{param}`: {msg}" if param else msg


def validation_error_to_openai(exc: RequestValidationError) -> BadRequestError:
    errors = exc.errors()
    body = getattr(exc, "body", None)
    if not errors:
        return BadRequestError("Invalid request.")
    err = errors[0]
    cause = (err.get("ctx") or {}).get("error")
    if isinstance(cause, InvalidUnicodeError):
        prefix = _param_from_loc(tuple(err.get("loc", ())), body)
        param = ".".join(p for p in (prefix, cause.param) if p) or None
        where = f"`{param}`" if param else "The request"
        return BadRequestError(f"{where} contains invalid Unicode (a lone surrogate).", param=param,
                               code="invalid_unicode")
    if err.get("type") == "json_invalid":
        ctx = err.get("ctx") or {}
        detail = ctx.get("error", "")
        return BadRequestError(f"Malformed JSON body: {detail}".rstrip(": "), code="invalid_json")
    loc = tuple(err.get("loc", ()))
    if loc == ("body",):
        # The body itself is missing, not JSON, or not an object.
        if isinstance(body, (bytes, bytearray, str)) and body:
            try:
                json.loads(body)
            except ValueError as e:
                return BadRequestError(f"Malformed JSON body: {e}", code="invalid_json")
            return BadRequestError("Request body must be JSON (Content-Type: application/json).",
                                   code="invalid_json")
        return BadRequestError("Request body must be a JSON object.", code="invalid_json")
    param = _param_from_loc(loc, body)
    # A validator's error may carry the code of a refusal the schema cannot express (openapi_doc.SEMANTIC_CODES).
    return BadRequestError(_validation_message(err, param), param=param, code=getattr(cause, "code", None))


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(OpenAIError)
    async def _openai_error(request: Request, exc: OpenAIError) -> JSONResponse:
        cause = exc.__cause__
        if isinstance(exc, ServiceUnavailableError) and getattr(cause, "kind", None) == "unavailable":
            # An engine-side 503 (queue full, backend down): the engine error knows which, and no
            # other layer counted it as a rejection (the admission limit counts its own).
            exc.code = getattr(cause, "code", None) or exc.code
            metrics = getattr(getattr(request.app.state, "ctx", None), "metrics", None)
            if metrics is not None:
                metrics.rejected.inc()
        return exc.to_response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error_to_openai(exc).to_response()

    @app.exception_handler(json.JSONDecodeError)
    async def _json_error(_: Request, exc: json.JSONDecodeError) -> JSONResponse:
        return BadRequestError(f"Malformed JSON body: {exc}", code="invalid_json").to_response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        cls: type[OpenAIError]
        if exc.status_code == 404:
            err: OpenAIError = NotFoundError(str(exc.detail) if exc.detail else "Not found.")
        else:
            cls = BadRequestError if 400 <= exc.status_code < 500 else InternalServerError
            err = cls(str(exc.detail))
            err.status_code = exc.status_code
        err.headers = dict(exc.headers) if exc.headers else None
        return err.to_response()

    @app.exception_handler(Exception)
    async def _unhandled(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error")
        return InternalServerError(f"Internal server error: {type(exc).__name__}").to_response()
