"""Bounded work per request: the response-size budget, and the heavy parts of a response built off the event loop.

One request must never stall the others. Two things grow with a request's knobs rather than with the model:

- **Logprobs.** Each token can carry its own logprob and up to ``--max-logprobs`` alternatives, for every choice;
  ``prompt_logprobs`` adds as many for every prompt position. A 19 KB request (``prompt_logprobs: 20``, ``n: 64``,
  a 4,000-token prompt) asks for a 372 MB response. :func:`check_response_budget` counts, before any work, the
  logprob entries the response could carry (each token's own logprob plus its top-N alternatives, over every
  choice's ``max_tokens``; the prompt's entries as many times as the response carries them: once per prompt where
  the format has one list per prompt, once per choice where each choice repeats it, as ``/v1/completions`` does in
  vLLM's format) and refuses past ``--max-response-logprobs`` with a 400 that names the limit.
- **Building the JSON.** A response with many logprobs takes Python work in proportion (objects, token texts, JSON),
  and a chat template may run up to its time cap. :func:`off_loop` runs such work in a small pool of worker threads
  (:data:`WORKERS`), so the event loop (``/health`` and every stream) keeps answering: the interpreter hands the
  loop its turn every few milliseconds. Prompt logprobs are built once per prompt and spliced into every choice that
  repeats them (:class:`~.routing_codec.Payloads`); large lists are serialised in slices, so no single call holds
  the interpreter for long.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import gc
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from pydantic import TypeAdapter
from starlette.responses import Response

from .errors import BadRequestError

T = TypeVar("T")

# Worker threads for rendering (responses, chat templates). Two: this work is bound by the interpreter lock, so more
# threads would not finish it sooner, only make each wait longer; requests beyond them queue.
WORKERS = 2
_POOL = ThreadPoolExecutor(max_workers=WORKERS, thread_name_prefix="moe-render")

# Below this many logprob entries a response is built on the loop (a thread hop costs more than the work).
OFF_LOOP_ENTRIES = 4096
# Items per slice when a large list is serialised (each slice is one short call into pydantic's serialiser).
SLICE_ITEMS = 256


_gc_lock = threading.Lock()
_gc_holds = 0


@contextlib.contextmanager
def no_gc_pauses() -> Iterator[None]:
    """While a worker builds a large response: no automatic garbage collection. The hundreds of thousands of objects
    it makes would trigger full collections, each of which stops every thread, the event loop included, for tens of
    milliseconds; they are freed by reference counting once the response is built, so nothing piles up."""
    global _gc_holds
    with _gc_lock:
        _gc_holds += 1
        if _gc_holds == 1:
            gc.disable()
    try:
        yield
    finally:
        with _gc_lock:
            _gc_holds -= 1
            if _gc_holds == 0:
                gc.enable()


def _in_worker(fn: Callable[..., T], *args: Any) -> T:
    with no_gc_pauses():
        return fn(*args)


async def off_loop(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` in the render pool (the caller's context variables go along)."""
    ctx = contextvars.copy_context()
    return await asyncio.get_running_loop().run_in_executor(_POOL, functools.partial(ctx.run, _in_worker, fn, *args))


def dump_list(adapter: TypeAdapter, items: Sequence[Any]) -> bytes:
    """A JSON list serialised in slices of :data:`SLICE_ITEMS` (the same bytes as one ``dump_json``)."""
    parts = []
    for i in range(0, len(items), SLICE_ITEMS):
        chunk = adapter.dump_json(list(items[i : i + SLICE_ITEMS]), warnings=False)
        parts.append(chunk[1:-1])
    return b"[" + b",".join(p for p in parts if p) + b"]"


def response_entries(*, choices_max_tokens: Sequence[int], logprobs: int | None, prompt_lens: Sequence[int],
                     prompt_logprobs: int | None, prompt_copies: int) -> int:
    """The logprob entries a response could carry at most (module docstring): per generated token its logprob and
    ``logprobs`` alternatives, per prompt position ``prompt_logprobs`` alternatives and the prompt token's own, the
    prompt's part ``prompt_copies`` times."""
    total = 0
    if logprobs is not None:
        total += sum(choices_max_tokens) * (1 + logprobs)
    if prompt_logprobs is not None:
        total += sum(prompt_lens) * (1 + prompt_logprobs) * prompt_copies
    return total


def check_response_budget(entries: int, limit: int | None, *, detail: str, param: str | None) -> None:
    """400 when the response could carry more than ``limit`` logprob entries (``--max-response-logprobs``)."""
    if limit is None or entries <= limit:
        return
    raise BadRequestError(
        f"This request could return up to {entries:,} logprobs ({detail}); the server returns at most {limit:,} "
        f"per response (--max-response-logprobs). Lower n, max_tokens, logprobs or prompt_logprobs, or split the "
        f"request.",
        param=param, code="response_too_large",
    )


SEND_CHUNK_BYTES = 1 << 18  # a large body goes out in pieces of this size (flow-controlled, never copied whole)


class PiecesResponse(Response):
    """A JSON response sent from a list of byte pieces (Payloads.dump_parts) in slices of at most
    :data:`SEND_CHUNK_BYTES`, with its Content-Length: a 70 MB body is neither joined nor copied on the loop."""

    media_type = "application/json"

    def __init__(self, pieces: list[bytes]) -> None:  # noqa: super().__init__ would want one body
        self.pieces = [p for p in pieces if p]
        self.status_code = 200
        self.background = None
        size = sum(len(p) for p in self.pieces)
        self.raw_headers = [(b"content-length", str(size).encode()), (b"content-type", b"application/json")]

    async def __call__(self, scope, receive, send) -> None:  # noqa: ANN001 - ASGI
        await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
        for piece in self.pieces:
            view = memoryview(piece)
            for i in range(0, len(view), SEND_CHUNK_BYTES):
                await send({"type": "http.response.body", "body": bytes(view[i : i + SEND_CHUNK_BYTES]),
                            "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def json_body(render: Callable[[], list[bytes]], heavy: bool):  # noqa: ANN201 - an ASGI response
    """The JSON response whose pieces ``render()`` builds: in a worker when ``heavy`` (logprobs), else right here."""
    return PiecesResponse(await off_loop(render) if heavy else render())
