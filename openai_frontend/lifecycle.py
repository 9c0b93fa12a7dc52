"""Request lifecycle: body limit, availability gate, deadline, aborts, graceful shutdown.

:class:`RequestGuard` (pure ASGI middleware) sits in front of the routes:

- A body over ``max_request_bytes`` gets 413 before it is read (Content-Length) or as soon as the
  running count passes the limit (chunked).
- A generation request that arrives while the backend is down gets 503 ``backend_unavailable``; while
  the server drains (SIGTERM), 503 ``shutting_down`` with ``Connection: close``.
- Each generation request runs in its own task, so the guard can end it from outside: at its deadline
  (504 ``request_timeout``), when the watchdog reports a backend failure (503 ``backend_unavailable``)
  or when the shutdown grace is over (503 ``shutting_down``). Cancelling the task cancels the request's
  Triton streams, which aborts them in the engine (its KV slots come back). The client then gets a
  proper end: the JSON error if nothing was sent yet, otherwise an SSE ``data: {"error": ...}`` event
  followed by ``data: [DONE]``.

:class:`ServerState` is what the watchdog thread and the signal handler change (from any thread);
``/health`` reads it.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .errors import OpenAIError, RequestTimeoutError, RequestTooLargeError, backend_unavailable, shutting_down
from .http_utils import SSE_DONE, sse_event
from .metrics import Metrics

logger = logging.getLogger(__name__)

GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/inference/v1/generate"})
CLEANUP_WAIT_S = 5.0  # how long an aborted request's own cleanup (cancelling its Triton streams) may take


class ServerState:
    """Backend health and draining, shared by the API, the watchdog and signal handlers."""

    def __init__(self, retry_after_s: int = 1) -> None:
        self.retry_after_s = retry_after_s
        self.backend_error: str | None = None  # None: the backend is up
        self.draining = False
        self.loop: asyncio.AbstractEventLoop | None = None
        self.guard: RequestGuard | None = None
        self.on_backend_up: Callable[[], Awaitable[None]] | None = None  # e.g. a fresh gRPC channel

    def _in_loop(self, fn: Callable[..., Any], *args: Any) -> None:
        if self.loop is not None and not self.loop.is_closed():
            self.loop.call_soon_threadsafe(fn, *args)

    def backend_down(self, reason: str) -> None:
        """Any thread: /health 503, new requests 503, every in-flight request ended with a 503 now."""
        self.backend_error = reason
        if self.guard is not None:
            self._in_loop(self.guard.abort_all, lambda: backend_unavailable(self.retry_after_s), "backend_failure")

    def backend_up(self, timeout_s: float = 30.0) -> None:
        """Any thread but the loop's: reconnect, then serve again."""
        if self.loop is not None and self.on_backend_up is not None and not self.loop.is_closed():
            asyncio.run_coroutine_threadsafe(self.on_backend_up(), self.loop).result(timeout_s)
        self.backend_error = None

    def begin_shutdown(self, grace_s: float) -> None:
        """Any thread (a signal handler): stop taking generation requests; end those left after ``grace_s``."""
        self.draining = True
        if self.guard is not None and self.loop is not None and not self.loop.is_closed():
            guard = self.guard
            self.loop.call_soon_threadsafe(
                lambda: guard.loop_call_later(grace_s, guard.abort_all, lambda: shutting_down(self.retry_after_s),
                                              "shutdown")
            )

    def end_now(self) -> None:
        """Any thread (a second signal): end every in-flight request at once."""
        self.draining = True
        if self.guard is not None:
            self._in_loop(self.guard.abort_all, lambda: shutting_down(self.retry_after_s), "shutdown")


class _Flight:
    """One supervised request: its task, and the error it was ended with (if any)."""

    __slots__ = ("task", "error", "started", "sse", "finished", "closed")

    def __init__(self) -> None:
        self.task: asyncio.Task | None = None
        self.error: OpenAIError | None = None
        self.started = False  # http.response.start went out
        self.sse = False  # ... as text/event-stream
        self.finished = False  # the last body message went out
        self.closed = False  # the guard answered itself: later messages of the app are dropped

    def abort(self, error: OpenAIError) -> bool:
        if self.error is not None or self.finished or self.task is None or self.task.done():
            return False
        self.error = error
        self.task.cancel()
        return True


class RequestGuard:
    def __init__(
        self,
        app: ASGIApp,
        *,
        state: ServerState,
        metrics: Metrics,
        max_request_bytes: int | None,
        request_timeout_s: float | None,
    ) -> None:
        self.app = app
        self.state = state
        self.metrics = metrics
        self.max_request_bytes = max_request_bytes or None
        self.request_timeout_s = request_timeout_s or None
        self.flights: set[_Flight] = set()
        self._timers: list[asyncio.TimerHandle] = []
        state.guard = self

    # -- called in the loop by ServerState ----------------------------------

    def loop_call_later(self, delay: float, fn: Callable[..., Any], *args: Any) -> None:
        self._timers.append(asyncio.get_running_loop().call_later(delay, fn, *args))

    def abort_all(self, make_error: Callable[[], OpenAIError], reason: str) -> int:
        n = sum(1 for f in list(self.flights) if f.abort(make_error()))
        if n:
            logger.warning("ended %d in-flight request(s): %s", n, reason)
            self.metrics.aborted.labels(reason).inc(n)
        return n

    # -- ASGI ------------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.max_request_bytes
        if limit is not None and _content_length(scope) > limit:
            await _send_error(send, RequestTooLargeError(limit))
            return
        generation = scope["method"] == "POST" and scope["path"] in GENERATION_PATHS
        if generation and (self.state.draining or self.state.backend_error is not None):
            err = shutting_down(self.state.retry_after_s) if self.state.draining else \
                backend_unavailable(self.state.retry_after_s)
            self.metrics.rejected.inc()
            await _send_error(send, err)
            return
        if scope["method"] in ("POST", "PUT", "PATCH"):
            body = await _read_body(receive, limit)
            if body is None:
                return  # the client left while sending
            if body is _TOO_LARGE:
                await _send_error(send, RequestTooLargeError(limit))
                return
            receive = _replay(body, receive)
        if not generation:
            await self.app(scope, receive, send)
            return
        await self._supervised(scope, receive, send)

    async def _supervised(self, scope: Scope, receive: Receive, send: Send) -> None:
        flight = _Flight()

        async def tracked_send(message: Message) -> None:
            if flight.closed:
                return
            if message["type"] == "http.response.start":
                flight.started = True
                flight.sse = any(k.lower() == b"content-type" and v.startswith(b"text/event-stream")
                                 for k, v in message.get("headers", ()))
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                flight.finished = True
            await send(message)

        flight.task = asyncio.ensure_future(self.app(scope, receive, tracked_send))
        self.flights.add(flight)
        try:
            done, _ = await asyncio.wait({flight.task}, timeout=self.request_timeout_s)
            if not done and flight.abort(RequestTimeoutError(self.request_timeout_s)):
                self.metrics.aborted.labels("timeout").inc()
            if flight.error is None:
                await flight.task  # finished by itself: its result, or its exception for the outer handlers
                return
            await asyncio.wait({flight.task}, timeout=CLEANUP_WAIT_S)
            if not flight.task.done():
                logger.warning("an aborted request's cleanup takes more than %.0f s", CLEANUP_WAIT_S)
            elif not flight.task.cancelled() and flight.task.exception() is not None:
                logger.warning("an aborted request failed while stopping: %r", flight.task.exception())
            flight.closed = True
            await self._end(flight, send)
        except asyncio.CancelledError:
            flight.task.cancel()  # the server itself gave up on this connection
            raise
        finally:
            self.flights.discard(flight)

    @staticmethod
    async def _end(flight: _Flight, send: Send) -> None:
        err = flight.error
        try:
            if not flight.started:
                await _send_error(send, err)
            elif not flight.finished:
                if flight.sse:  # a stream always ends with an error event, then [DONE]
                    await send({"type": "http.response.body", "body": sse_event(err.to_json()).encode(),
                                "more_body": True})
                    await send({"type": "http.response.body", "body": SSE_DONE.encode(), "more_body": True})
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError:
            pass  # the client is gone too


_TOO_LARGE = object()  # what _read_body returns for a body over the limit


def _content_length(scope: Scope) -> int:
    for k, v in scope.get("headers", ()):
        if k == b"content-length":
            try:
                return int(v)
            except ValueError:
                return -1
    return -1


async def _read_body(receive: Receive, limit: int | None) -> bytes | object | None:
    """The whole body, None if the client disconnected, _TOO_LARGE past ``limit`` (chunked uploads)."""
    parts: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunk = message.get("body", b"")
        size += len(chunk)
        if limit is not None and size > limit:
            return _TOO_LARGE
        parts.append(chunk)
        if not message.get("more_body", False):
            return b"".join(parts)


def _replay(body: bytes, receive: Receive) -> Receive:
    """Hand the app the body already read, then the real channel (it carries http.disconnect)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


async def _send_error(send: Send, err: OpenAIError) -> None:
    response = err.to_response()
    await send({"type": "http.response.start", "status": response.status_code, "headers": response.raw_headers})
    await send({"type": "http.response.body", "body": response.body, "more_body": False})
