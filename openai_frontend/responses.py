"""HTTP bodies of the generation endpoints: JSON, server-sent events, the disconnect placeholder.

An SSE stream always ends with ``data: [DONE]``.  An error after the first
event (the status line has gone out by then) is sent as one event carrying
the OpenAI error object, just before ``[DONE]``.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable

from starlette.responses import Response

from .errors import InternalServerError, OpenAIError
from .http_utils import SSE_DONE, SSEResponse, sse_event
from .routing_codec import Payloads

logger = logging.getLogger(__name__)


def json_response(model, payloads: Payloads | None = None) -> Response:  # noqa: ANN001 - pydantic model
    body = payloads.dump(model) if payloads is not None else model.model_dump_json().encode()
    return Response(content=body, media_type="application/json")


def sse_response(
    events: AsyncGenerator[str | bytes, None],
    *,
    on_close: Callable[[], Awaitable[None]],
    on_disconnect: Callable[[], None],
    preamble: bytes | None = None,
) -> SSEResponse:
    """Stream ``events`` (each one ``data: ...`` event), then ``[DONE]``.

    ``on_close`` runs however the stream ends (it cancels the choices still
    running); ``on_disconnect`` when the client went away first.
    ``preamble`` (an SSE comment, which clients skip) goes first when no event
    is ready yet, so the client has bytes at once.
    """

    async def body() -> AsyncIterator[str | bytes]:
        if preamble:
            yield preamble
        try:
            async with contextlib.aclosing(events):
                async for event in events:
                    yield event
        except OpenAIError as err:
            logger.warning("stream failed: %s", err.message)
            yield sse_event(json.dumps(err.to_dict()))
        except Exception as e:  # noqa: BLE001 - a started stream must still end properly
            logger.exception("stream failed")
            yield sse_event(json.dumps(InternalServerError(f"Internal server error: {type(e).__name__}").to_dict()))
        yield SSE_DONE

    return SSEResponse(body(), on_close=on_close, on_disconnect=on_disconnect)


def disconnected_response() -> Response:
    """What a handler returns when its client went away (nobody reads it; 499 in metrics)."""
    return Response(status_code=499)
