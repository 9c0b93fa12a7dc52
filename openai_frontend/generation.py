"""One choice: Triton responses in, text/token/logprob/routing deltas out.

This is where tokens become text (incremental detokenizer), stop strings are
matched (the Triton request is cancelled at once, and the choice's token ids,
logprobs and routed rows are cut to the token that completed the match, so
they stay consistent with the returned text) and routed-experts chunks (and
routed-weights chunks, the same rows) are accumulated and encoded once, at the
end.  Prompt logprobs arrive once, with the first token, and ride on the delta
of that response.

Streaming and non-streaming requests run the same code, so their texts and
token ids are identical.  :class:`ChoiceGroup` runs the n choices of one HTTP
request concurrently and merges their deltas.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import NamedTuple, TypeVar

import numpy as np

from .routing_codec import RoutedExpertsAccumulator
from .tokenizer import IncrementalDetokenizer, Tokenizer
from .triton_client import BackendClient, BackendError, BackendRequest, ModelInfo

T = TypeVar("T")


class TokenLogprob(NamedTuple):
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # the engine's top-N alternatives, best first


class PromptScores(NamedTuple):
    """The engine's prompt logprobs: entry i is about prompt token i + 1 (given the tokens before it)."""

    logprobs: np.ndarray  # float32 [num_prompt - 1]
    top_ids: np.ndarray | None  # int64 [num_prompt - 1, N] (None when N = 0)
    top_logprobs: np.ndarray | None  # float32 [num_prompt - 1, N]
    ranks: np.ndarray | None = None  # int64 [num_prompt - 1]: the prompt token's rank (1 = the most likely)


@dataclass
class ChoiceSpec:
    """One choice: the backend request as sent, and what the frontend alone does with its tokens.

    Prompt ids, logprobs, routing and stop token ids are read from
    ``request`` (there is one copy of each).
    """

    index: int
    request: BackendRequest
    detokenize: bool = True  # False: token ids only (text is still decoded to match stop strings)
    skip_special_tokens: bool = True
    stop: list[str] = field(default_factory=list)
    include_stop_str_in_output: bool = False


@dataclass
class ChoiceDelta:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    routed_experts: bytes | None = None  # base64 .npy (ASCII bytes); only on the last delta
    routed_weights: bytes | None = None  # base64 .npy float32, the same rows; only on the last delta
    prompt_logprobs: PromptScores | None = None  # once, on the delta of the response with the first token
    first: bool = False
    weight_version: str | None = None  # the weights that produced the choice; only on the last delta
    num_cached_tokens: int | None = None  # prompt tokens from the prefix cache; on the first delta

    @property
    def last(self) -> bool:
        return self.finish_reason is not None


@dataclass
class ChoiceResult:
    """Everything one finished choice produced (for non-streaming responses)."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None
    finish_reason: str
    stop_reason: int | str | None
    routed_experts: bytes | None  # base64 .npy (ASCII bytes)
    routed_weights: bytes | None = None  # base64 .npy float32
    prompt_logprobs: PromptScores | None = None
    weight_version: str | None = None  # the weights of the backend's last response
    num_cached_tokens: int | None = None  # prompt tokens the engine took from its prefix cache


class Hooks:
    """Observation points (metrics); all no-ops by default."""

    def on_first_token(self, seconds: float) -> None: ...

    def on_tokens(self, seconds_since_last: float, num_tokens: int) -> None: ...

    def on_routed(self, array: np.ndarray, encoded_len: int) -> None: ...


def _find_stop(text: str, search_from: int, stops: list[str]) -> tuple[int, str] | None:
    best: tuple[int, str] | None = None
    for s in stops:
        i = text.find(s, search_from)
        if i >= 0 and (best is None or i < best[0]):
            best = (i, s)
    return best


@dataclass
class _RunState:
    """What :meth:`ChoiceRunner.run` carries from one backend response to the next."""

    detok: IncrementalDetokenizer | None  # None: no text wanted and no stop string to match
    routed: RoutedExpertsAccumulator | None  # expert ids, [rows, num_hidden_layers, top_k]
    weights: RoutedExpertsAccumulator | None  # float32, the same rows
    stop_token_ids: frozenset[int]
    max_stop: int  # the longest stop string's length (0: none)
    holdback: int  # streamed text held back: it may be the start of a stop string
    timed: bool  # TTFT/ITL only mean something per engine step
    t_start: float
    t_last: float
    text: str = ""  # decoded so far (cut where a stop string matched)
    emitted: int = 0  # characters of text already on a delta
    first: bool = True  # no delta out yet
    prompt_scores: PromptScores | None = None  # received, not yet on a delta
    finish: str | None = None
    stop_reason: int | str | None = None


class ChoiceRunner:
    def __init__(
        self,
        spec: ChoiceSpec,
        client: BackendClient,
        tokenizer: Tokenizer,
        model: ModelInfo,
        request_id: str,
        *,
        stream: bool,
        hooks: Hooks | None = None,
    ) -> None:
        self.spec = spec
        self.client = client
        self.tokenizer = tokenizer
        self.model = model
        self.request_id = request_id
        self.stream = stream
        self.hooks = hooks or Hooks()
        # Results, readable after run() finished.
        self.text_parts: list[str] = []
        self.token_ids: list[int] = []
        self.logprobs: list[TokenLogprob] | None = [] if spec.request.logprobs is not None else None
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.routed_experts: bytes | None = None
        self.routed_weights: bytes | None = None
        self.prompt_logprobs: PromptScores | None = None
        self.weight_version: str | None = None
        self.num_cached_tokens: int | None = None

    def result(self) -> ChoiceResult:
        assert self.finish_reason is not None
        return ChoiceResult(
            index=self.spec.index,
            text="".join(self.text_parts),
            token_ids=self.token_ids,
            logprobs=self.logprobs,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
            routed_experts=self.routed_experts,
            routed_weights=self.routed_weights,
            prompt_logprobs=self.prompt_logprobs,
            weight_version=self.weight_version,
            num_cached_tokens=self.num_cached_tokens,
        )

    async def run(self) -> AsyncIterator[ChoiceDelta]:
        """Yield deltas; the last has a finish_reason (and the routed experts)."""
        st = self._start()
        gen = self.client.generate(self.spec.request, f"{self.request_id}-{self.spec.index}")
        async with contextlib.aclosing(gen):
            async for out in gen:
                self._account(st, out)
                new_ids, new_lps = self._take_tokens(st, out)
                if st.finish is None and out.finish_reason is not None:
                    self._engine_finished(st, out.finish_reason)
                if st.finish is not None:
                    break  # leaving the loop closes gen: a stop-string match cancels the Triton request
                # Non-streaming: all text goes out with the last delta (a stop string may still cut it).
                upto = max(st.emitted, len(st.text) - st.holdback) if self.stream else st.emitted
                yield self._delta(st, new_ids, new_lps, upto)
            else:
                # Stream ended without finish_reason (TritonClient.generate raises in that case).
                raise BackendError(BackendError.INTERNAL, "request ended without a finish reason")
        yield await self._last_delta(st, new_ids, new_lps)

    def _start(self) -> _RunState:
        """The run's state before the first response: the detokenizer, the routing accumulators, the stop rules."""
        spec, request, model = self.spec, self.spec.request, self.model
        detok = None
        if spec.detokenize or spec.stop:
            detok = self.tokenizer.detokenizer(request.input_ids, spec.skip_special_tokens)

        def accumulator(wanted: bool | None, dtype: np.dtype) -> RoutedExpertsAccumulator | None:
            if not wanted:
                return None
            return RoutedExpertsAccumulator(model.num_hidden_layers, model.num_experts_per_tok, dtype)

        max_stop = max((len(s) for s in spec.stop), default=0)
        t_start = time.monotonic()
        return _RunState(
            detok=detok,
            routed=accumulator(request.return_routed_experts, model.np_dtype),
            weights=accumulator(request.return_routed_weights, np.float32),
            stop_token_ids=frozenset(request.stop_token_ids or ()),
            max_stop=max_stop,
            holdback=0 if spec.include_stop_str_in_output else max(0, max_stop - 1),
            timed=request.stream,
            t_start=t_start,
            t_last=t_start,
        )

    def _account(self, st: _RunState, out) -> None:  # noqa: ANN001 - a GenerateOutput
        """What one response says besides its tokens: routing rows, prompt logprobs (once), the weight version, the
        cached prompt tokens (fixed at admission), and the timing hooks."""
        if st.routed is not None:
            st.routed.add(out.routed_experts)
        if st.weights is not None:
            st.weights.add(out.routed_weights)
        if out.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = st.prompt_scores = PromptScores(
                out.prompt_logprobs, out.prompt_top_logprob_ids, out.prompt_top_logprobs, out.prompt_logprob_ranks)
        self.weight_version = out.weight_version or self.weight_version
        if self.num_cached_tokens is None:  # fixed when the engine admits the request
            self.num_cached_tokens = out.num_cached_tokens
        n_new = int(out.output_ids.shape[0])
        now = time.monotonic()
        if n_new and st.timed:
            if not self.token_ids:
                self.hooks.on_first_token(now - st.t_start)
            else:
                self.hooks.on_tokens(now - st.t_last, n_new)
            st.t_last = now

    def _take_tokens(self, st: _RunState, out) -> tuple[list[int], list[TokenLogprob] | None]:  # noqa: ANN001
        """The response's tokens (and their logprobs), decoded as they come: up to its end, or up to the token that
        completed a stop string (``st.finish`` is then set). They join the choice's results."""
        new_ids: list[int] = []
        new_lps: list[TokenLogprob] | None = [] if self.logprobs is not None else None
        for k, tid in enumerate(out.output_ids.tolist()):
            new_ids.append(tid)
            if new_lps is not None:
                new_lps.append(_token_logprob(out, k, tid))
            if st.detok is not None:
                piece = st.detok.step(tid)
                if piece and self._append(st, piece):
                    break
        self.token_ids.extend(new_ids)
        if new_lps is not None:
            self.logprobs.extend(new_lps)
        return new_ids, new_lps

    def _engine_finished(self, st: _RunState, reason: str) -> None:
        """The engine ended the choice: name the stop token that ended it, if one did, and decode the text the
        detokenizer still held (it may yet complete a stop string, which then wins)."""
        st.finish = reason
        if reason == "stop" and self.token_ids and self.token_ids[-1] in st.stop_token_ids:
            st.stop_reason = self.token_ids[-1]
        if st.detok is not None:
            rest = st.detok.flush()
            if rest:
                self._append(st, rest)

    def _delta(self, st: _RunState, new_ids: list[int], new_lps: list[TokenLogprob] | None, upto: int,
               **last: object) -> ChoiceDelta:
        """The delta of one response: its tokens, the text from what went out so far up to ``upto``, the prompt
        logprobs if they just came; ``last`` holds the last delta's own fields."""
        delta = ChoiceDelta(
            index=self.spec.index,
            text=st.text[st.emitted : upto] if self.spec.detokenize else "",
            token_ids=new_ids,
            logprobs=new_lps,
            prompt_logprobs=st.prompt_scores,
            first=st.first,
            num_cached_tokens=self.num_cached_tokens if st.first else None,
            **last,
        )
        if self.spec.detokenize:
            self.text_parts.append(delta.text)
        st.emitted, st.first, st.prompt_scores = upto, False, None
        return delta

    async def _last_delta(self, st: _RunState, new_ids: list[int], new_lps: list[TokenLogprob] | None) -> ChoiceDelta:
        """The last delta: the remaining text, the finish reason, the routing of the kept tokens (encoded once)."""
        self.finish_reason = st.finish
        self.stop_reason = st.stop_reason
        request = self.spec.request
        keep_rows = len(request.input_ids) + len(self.token_ids) - 1 - (request.routed_experts_prompt_start or 0)
        if st.routed is not None:
            self.routed_experts = await _encode_off_loop_if_large(st.routed, self._encode_routed, st.routed, keep_rows)
        if st.weights is not None:  # the same rows as routed_experts, cut the same way
            self.routed_weights = (await _encode_off_loop_if_large(st.weights, st.weights.encode, keep_rows))[0]
        return self._delta(
            st, new_ids, new_lps, len(st.text),
            finish_reason=st.finish,
            stop_reason=st.stop_reason,
            routed_experts=self.routed_experts,
            routed_weights=self.routed_weights,
            weight_version=self.weight_version,
        )

    def _append(self, st: _RunState, piece: str) -> bool:
        """Append decoded text; on a stop-string match cut it there, finish the choice and say so."""
        before = len(st.text)
        st.text += piece
        if self.spec.stop:
            m = _find_stop(st.text, max(0, before - st.max_stop + 1), self.spec.stop)
            if m is not None:
                i, stop = m
                st.text = st.text[: i + len(stop)] if self.spec.include_stop_str_in_output else st.text[:i]
                st.finish, st.stop_reason = "stop", stop
                return True
        return False

    def _encode_routed(self, acc: RoutedExpertsAccumulator, keep_rows: int) -> bytes | None:
        encoded, array = acc.encode(keep_rows)
        if encoded is not None and array is not None:
            self.hooks.on_routed(array, len(encoded))
        return encoded


# Routing arrays at least this big are encoded in a worker thread.
_ENCODE_IN_THREAD_BYTES = 1 << 21


async def _encode_off_loop_if_large(acc: RoutedExpertsAccumulator, encode: Callable[..., T], *args: object) -> T:
    """``encode(*args)``; for long sequences off the event loop (numpy and pybase64 release the GIL)."""
    if acc.nbytes >= _ENCODE_IN_THREAD_BYTES:
        return await asyncio.to_thread(encode, *args)
    return encode(*args)


def _token_logprob(out, k: int, tid: int) -> TokenLogprob:
    lp = float(out.logprobs[k]) if out.logprobs is not None and k < out.logprobs.shape[0] else float("nan")
    top: list[tuple[int, float]] = []
    if out.top_logprob_ids is not None and out.top_logprobs is not None and k < out.top_logprob_ids.shape[0]:
        top = list(zip(out.top_logprob_ids[k].tolist(), out.top_logprobs[k].tolist(), strict=False))
    return TokenLogprob(tid, lp, top)


# --------------------------------------------------------------------------
# n choices of one request


class ChoiceGroup:
    """Runs the choices of one HTTP request concurrently.

    ``results()`` waits for all (non-streaming); ``deltas()`` merges their
    deltas in arrival order (streaming).  Either way, leaving early (error,
    client disconnect, cancellation) cancels every choice still running, and
    with it its Triton request.
    """

    def __init__(self, runners: list[ChoiceRunner], on_close: Callable[[], None] | None = None) -> None:
        self.runners = runners
        self._on_close = on_close
        self._tasks: list[asyncio.Task] = []
        self._queue: asyncio.Queue = asyncio.Queue()
        self._closed = False

    async def results(self) -> list[ChoiceResult]:
        async for _ in self.deltas():
            pass
        return [r.result() for r in self.runners]

    def start(self, count: int | None = None) -> None:
        """Start the first ``count`` choices (None: all); those already started are left alone. A stream starts
        one, then the rest once the first answered (ServingContext._start_stream)."""
        end = len(self.runners) if count is None else min(count, len(self.runners))
        for r in self.runners[len(self._tasks) : end]:
            self._tasks.append(asyncio.create_task(self._pump(r)))

    async def _pump(self, runner: ChoiceRunner) -> None:
        try:
            async for delta in runner.run():
                self._queue.put_nowait(delta)
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            self._queue.put_nowait(e)
            return
        self._queue.put_nowait(None)

    async def deltas(self) -> AsyncIterator[ChoiceDelta]:
        if not self._tasks:
            self.start()
        remaining = len(self.runners)
        try:
            while remaining:
                item = await self._queue.get()
                if item is None:
                    remaining -= 1
                    continue
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            await self.aclose()

    async def aclose(self) -> None:
        """Cancel every choice still running (idempotent)."""
        if self._closed:
            return
        self._closed = True
        pending = [t for t in self._tasks if not t.done()]
        for t in pending:
            t.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
        if self._on_close is not None:
            self._on_close()
