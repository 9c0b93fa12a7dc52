"""HTTP bodies of the generation endpoints: JSON, server-sent events, the disconnect placeholder.

An SSE stream always ends with ``data: [DONE]``.  An error after the first
event (the status line has gone out by then) is sent as one event carrying
the OpenAI error object, just before ``[DONE]``.

:class:`Responder` is the last step of every generation endpoint (the
outcome of :meth:`~.serving.ServingContext.generate` -> the response), the
same for the three; each endpoint's subclass says what its objects look like.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any

from pydantic import BaseModel
from starlette.responses import Response

from .bounded import json_body
from .errors import InternalServerError, OpenAIError
from .generation import ChoiceDelta, ChoiceResult
from .http_utils import SSE_DONE, SSEResponse, sse_event
from .protocol import UsageInfo
from .routing_codec import Payloads
from .serving import ChoiceStream, Finished, GenerationPlan, ServingContext

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


class Responder:
    """The respond step of a generation endpoint: its outcome -> one JSON body, or an SSE stream.

    The three endpoints answer alike: a finished request is one JSON body
    (built in a worker when logprobs make it ``heavy``: bounded.py); a stream
    is one event per chunk, each chunk with the usage of its choice so far
    under ``continuous_usage_stats``, and a last chunk with the total usage
    under ``include_usage``.  A subclass (one per endpoint) says what its API's
    objects look like: :meth:`render`, :meth:`chunks`, :meth:`chunk`.
    """

    heavy: bool = False  # the JSON body holds logprobs: built in a worker

    def __init__(self, ctx: ServingContext, plan: GenerationPlan, outcome: Finished | ChoiceStream) -> None:
        self.ctx = ctx
        self.plan = plan
        self.outcome = outcome
        self.model_name = ctx.cfg.served_model_name
        self.token_ids_on = bool(plan.options.return_token_ids)
        self.payloads = Payloads()  # one per response: the large values spliced into its JSON

    def render(self, finished: Finished) -> list[bytes]:
        """The JSON body of a finished request, in pieces (``Payloads.dump_parts``)."""
        raise NotImplementedError

    def chunks(self, d: ChoiceDelta) -> AsyncIterator[BaseModel]:
        """The stream chunks of one delta (none, one or more), each a model with a ``usage`` field."""
        raise NotImplementedError

    def chunk(self, choices: list[Any], usage: UsageInfo | None = None) -> BaseModel:
        """One stream chunk of the endpoint's API (the last: no choices, the request's total usage)."""
        raise NotImplementedError

    def end_fields(self, r: ChoiceResult | ChoiceDelta) -> dict[str, Any]:
        """The fields of a choice's end, alike on every endpoint: the routing payloads (placeholders that
        :class:`Payloads` replaces by the base64 ``.npy``) and the version of the weights that produced it."""
        return {
            "routed_experts": self.payloads.ref(r.routed_experts),
            "routed_weights": self.payloads.ref(r.routed_weights),
            "weight_version": r.weight_version,
        }

    async def respond(self) -> Response:
        outcome = self.outcome
        if isinstance(outcome, Finished):  # with logprobs: built in a worker (bounded.py)
            return await json_body(lambda: self.render(outcome), heavy=self.heavy)
        return sse_response(self._events(outcome), on_close=outcome.aclose, on_disconnect=outcome.client_disconnected,
                            preamble=outcome.preamble)

    async def _events(self, outcome: ChoiceStream) -> AsyncGenerator[bytes, None]:
        options = self.plan.stream_options
        include_usage = bool(options and options.include_usage)
        continuous = bool(options and options.continuous_usage_stats)
        async for d in outcome:
            async for chunk in self.chunks(d):
                if continuous:
                    chunk.usage = outcome.usage.choice(d.index)
                yield self.payloads.sse(chunk)
        if include_usage:
            yield self.payloads.sse(self.chunk([], outcome.usage.total()))
