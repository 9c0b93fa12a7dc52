"""HTTP plumbing: client-disconnect handling, SSE responses, auth.

``run_with_cancellation`` is vLLM's ``with_cancellation`` pattern: the handler
races a task that waits for ``http.disconnect`` (``request.is_disconnected``
does not work behind middleware).  :class:`SSEResponse` streams an async
iterator, always listens for the disconnect itself, and always runs its
``on_close`` callback (which cancels the request's Triton streams), however
the stream ends.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

from fastapi import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from .errors import AuthenticationError, ClientDisconnected

logger = logging.getLogger(__name__)

T = TypeVar("T")


async def _wait_for_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def run_with_cancellation(request: Request, coro: Awaitable[T]) -> T:
    """Await ``coro`` unless the client disconnects first (then cancel it).

    Raises :class:`ClientDisconnected` when the client went away.
    """
    handler = asyncio.ensure_future(coro)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request.receive))
    try:
        done, _ = await asyncio.wait({handler, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        handler.cancel()
        watcher.cancel()
        raise
    if handler in done:
        watcher.cancel()
        return handler.result()
    handler.cancel()
    await asyncio.gather(handler, return_exceptions=True)
    raise ClientDisconnected()


class SSEResponse(Response):
    """``text/event-stream`` from an async iterator of str/bytes chunks."""

    media_type = "text/event-stream"

    def __init__(
        self,
        body: AsyncIterator[str | bytes],
        *,
        on_close: Callable[[], Awaitable[None]] | None = None,
        on_disconnect: Callable[[], None] | None = None,
        status_code: int = 200,
        headers: dict[str, str] | None = None,
    ) -> None:
        self.body_iterator = body
        self._on_close = on_close
        self._on_disconnect = on_disconnect
        self.status_code = status_code
        self.background = None
        hdrs = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        hdrs.update(headers or {})
        self.init_headers(hdrs)

    async def _stream(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        async for chunk in self.body_iterator:
            if isinstance(chunk, str):
                chunk = chunk.encode("utf-8")
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        stream = asyncio.ensure_future(self._stream(send))
        watcher = asyncio.ensure_future(_wait_for_disconnect(receive))
        try:
            done, _ = await asyncio.wait({stream, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if stream in done:
                exc = stream.exception()
                if exc is not None and not isinstance(exc, OSError):
                    raise exc
            elif self._on_disconnect is not None:
                self._on_disconnect()
        finally:
            for t in (stream, watcher):
                t.cancel()
            await asyncio.gather(stream, watcher, return_exceptions=True)
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                try:
                    await aclose()
                except Exception:  # noqa: BLE001 - cleanup must go on
                    logger.exception("error closing the SSE body")
            if self._on_close is not None:
                await self._on_close()


def sse_event(data: str) -> str:
    return f"data: {data}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def check_api_key(expected: str | None, authorization: str | None) -> None:
    if expected is None:
        return
    if not authorization:
        raise AuthenticationError("Missing API key: send 'Authorization: Bearer <key>'.")
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), expected.encode()):
        raise AuthenticationError()
