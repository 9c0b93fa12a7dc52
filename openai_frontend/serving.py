"""One generation request, from the endpoint's plan to finished choices or a stream of deltas.

An endpoint (``serving_*.py``) reads its body into a :class:`GenerationPlan`
and calls :meth:`ServingContext.generate` once, which, in this order:

1. checks what needs no tokenizer: the model name, ``stream_options``, the
   logprobs bound, the choice count (n x prompts, checked here only) and that
   the model is loaded (503 until it is);
2. tokenizes the prompts (:mod:`.prompts`) and checks them against the model
   (vocabulary, context length, ``routed_experts_prompt_start``, the shape and
   ids of ``replay_routed_experts``: :mod:`.replay`);
3. builds one :class:`~.triton_client.BackendRequest` per prompt (its choices
   differ only in their seed), reserves the choices (503 when the server is
   full) and starts them (:mod:`.generation`, which calls the backend through
   :mod:`.triton_client`);
4. returns :class:`Finished` (every result) or, when streaming, a
   :class:`ChoiceStream` once the first choice has produced its first delta or
   :data:`STREAM_PRIME_S` passed, whichever comes first; the other choices
   start then. So a backend error (an invalid request, which comes back at
   once and alike for every choice) still gets its HTTP status, and the stream
   starts at once whatever ``n`` (choices beyond ``--max-num-seqs`` stream as
   they are admitted, a paused engine sends nothing yet); a later error is an
   SSE event.

Usage (prompt and completion tokens) and the token counters of the metrics
are counted in one place, :class:`TokenUsage`, as the tokens pass.  The
endpoint then renders the outcome into its response objects
(:mod:`.responses` frames the JSON and SSE bodies).
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace

from fastapi import Request

from .bounded import check_response_budget, off_loop, response_entries
from .config import FrontendConfig
from .errors import (
    BadRequestError,
    InternalServerError,
    OpenAIError,
    ServiceUnavailableError,
    model_not_found,
)
from .generation import ChoiceDelta, ChoiceGroup, ChoiceResult, ChoiceRunner, ChoiceSpec
from .http_utils import run_with_cancellation
from .metrics import Metrics
from .prompts import ChatPrompt, CompletionPrompts, PromptInput, PromptSource
from .protocol import INT64_MAX, INT64_MIN, GenerationRequestFields, StreamOptions, UsageInfo
from .replay import check_replay
from .tokenizer import Tokenizer
from .triton_client import BackendClient, BackendError, BackendRequest, ModelInfo


def backend_error_to_openai(e: BackendError, retry_after_s: int = 1) -> OpenAIError:
    if e.kind == BackendError.INVALID:
        return BadRequestError(e.message)
    if e.kind == BackendError.UNAVAILABLE:
        return ServiceUnavailableError(e.message, retry_after_s=retry_after_s, code=e.code or "overloaded")
    if e.kind == BackendError.CANCELLED:
        return ServiceUnavailableError(f"request cancelled by the server: {e.message}", retry_after_s=retry_after_s,
                                       code="cancelled")
    return InternalServerError(f"engine error: {e.message}")


@dataclass
class GenerationPlan:
    """One HTTP request as serving runs it: what its endpoint read from the body."""

    request_id: str
    model: str | None  # the body's `model`; None = the served model
    prompts: PromptSource
    n: int  # choices per prompt
    options: GenerationRequestFields  # sampling, stop rules, routing opt-in, skip_special_tokens
    max_tokens: int | None  # None = fill the context
    stream: bool
    stream_options: StreamOptions | None
    logprobs: int | None  # top-N per token; None = no logprobs
    detokenize: bool = True  # False: token ids only
    prompt_logprobs: int | None = None  # top-N per prompt position the engine computes; None = none
    # The request fields that errors name (they differ per endpoint).
    n_param: str = "n"
    logprobs_param: str = "logprobs"
    max_tokens_param: str = "max_tokens"
    prompt_logprobs_param: str = "prompt_logprobs"
    replay_param: str = "replay_routed_experts"
    # Whether each choice repeats its prompt's logprobs (vLLM's /v1/completions) or the response has one list per
    # prompt (/inference/v1/generate): how often the response-size budget counts them (bounded.py).
    prompt_logprobs_per_choice: bool = True


class TokenUsage:
    """Token counts of one request, and the token counters of the metrics.

    Prompt tokens count each prompt once (not once per choice); completion
    tokens are the tokens returned, per choice.  The metrics' prompt counter
    moves when the request is admitted, its generation counter once, at
    :meth:`close`.

    With ``details`` (``--enable-prompt-tokens-details``), usage also says how
    many prompt tokens came from the prefix cache: per choice what the engine
    reported, per prompt the least over its choices (the n choices of a prompt
    share its blocks, so a later choice finds the first one's; the least is
    what the cache held for the request).
    """

    def __init__(self, prompt_lens: list[int], n: int, metrics: Metrics, details: bool = False) -> None:
        self._prompt_lens = prompt_lens
        self._n = n
        self._metrics = metrics
        self._generated = [0] * (len(prompt_lens) * n)  # per choice index
        self._cached: list[int | None] | None = [None] * (len(prompt_lens) * n) if details else None
        self._closed = False
        metrics.prompt_tokens.inc(sum(prompt_lens))

    def add(self, index: int, num_tokens: int) -> None:
        self._generated[index] += num_tokens

    def cached(self, index: int, num_tokens: int | None) -> None:
        """The prompt tokens choice ``index`` found in the prefix cache (the engine's count)."""
        if self._cached is not None and num_tokens is not None:
            self._cached[index] = num_tokens

    def choice(self, index: int) -> UsageInfo:
        """One choice so far: its prompt and its tokens (continuous_usage_stats)."""
        cached = None if self._cached is None else self._cached[index] or 0
        return UsageInfo.of(self._prompt_lens[index // self._n], self._generated[index], cached)

    def total(self) -> UsageInfo:
        cached = None
        if self._cached is not None:
            per_prompt = [self._cached[i * self._n : (i + 1) * self._n] for i in range(len(self._prompt_lens))]
            cached = sum(min((c for c in cs if c is not None), default=0) for cs in per_prompt)
        return UsageInfo.of(sum(self._prompt_lens), sum(self._generated), cached)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._metrics.generation_tokens.inc(sum(self._generated))


@dataclass
class Finished:
    """A non-streaming request after every choice ended."""

    results: list[ChoiceResult]  # in index order: prompt i's choices are i*n .. i*n+n-1
    prompts: list[PromptInput]
    usage: UsageInfo


class ChoiceStream:
    """A started streaming request: iterate for its deltas, in arrival order.

    Iterating counts usage; a backend error raises the matching
    :class:`~.errors.OpenAIError`.  :meth:`aclose` (the SSE response's
    ``on_close``) cancels the choices still running.
    """

    def __init__(self, group: ChoiceGroup, deltas: AsyncIterator[ChoiceDelta], primed: list[ChoiceDelta],
                 prompts: list[PromptInput], usage: TokenUsage, metrics: Metrics, retry_after_s: int,
                 next_delta: asyncio.Future | None = None) -> None:
        self.prompts = prompts
        self.usage = usage
        self._group = group
        self._deltas = deltas
        self._primed = primed
        self._next = next_delta  # the delta being awaited when the stream was handed over
        # An SSE comment to send first when no delta is ready yet: the client gets bytes at once.
        self.preamble: bytes | None = None if primed else b": waiting for the engine\n\n"
        self._metrics = metrics
        self._retry_after_s = retry_after_s

    def __aiter__(self) -> AsyncIterator[ChoiceDelta]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[ChoiceDelta]:
        # The other choices start now, once the response's headers went out (65 or 256 gRPC streams take a while).
        self._group.start()
        primed, self._primed = self._primed, []
        try:
            for d in primed:
                self.usage.add(d.index, len(d.token_ids))
                self.usage.cached(d.index, d.num_cached_tokens)
                yield d
            if self._next is not None:
                nxt, self._next = self._next, None
                try:
                    d = await nxt
                except StopAsyncIteration:
                    return
                self.usage.add(d.index, len(d.token_ids))
                self.usage.cached(d.index, d.num_cached_tokens)
                yield d
            async for d in self._deltas:
                self.usage.add(d.index, len(d.token_ids))
                self.usage.cached(d.index, d.num_cached_tokens)
                yield d
        except BackendError as e:
            raise backend_error_to_openai(e, self._retry_after_s) from e

    async def aclose(self) -> None:
        if self._next is not None and not self._next.done():
            self._next.cancel()
        await self._group.aclose()
        self.usage.close()

    def client_disconnected(self) -> None:
        self._metrics.disconnects.inc()


class ServingContext:
    def __init__(self, cfg: FrontendConfig, client: BackendClient | None, tokenizer: Tokenizer,
                 metrics: Metrics) -> None:
        self.cfg = cfg
        self.client = client
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.model: ModelInfo | None = None  # set once the backend's metadata is loaded
        self.created = int(time.time())
        self.pending = 0  # choices in flight
        # Set while the backend refuses generation because a restart lost the weights it served (a message saying
        # they must be pushed again); every control answer updates it (serving_weights.py).
        self.weights_lost: str | None = None

    def model_info(self) -> ModelInfo:
        """The model's metadata, or 503 while it is not loaded yet."""
        if self.model is None:
            raise ServiceUnavailableError("The model is not ready yet.", retry_after_s=self.cfg.retry_after_s,
                                          code="model_not_ready")
        return self.model

    async def generate(self, plan: GenerationPlan, raw_request: Request) -> Finished | ChoiceStream:
        """Check, admit and run one request (the module docstring lists the steps)."""
        self._check_request(plan)
        model = self.model_info()
        if _costly_prompts(plan.prompts):  # a chat template (up to its time cap), long texts: in a worker
            prompts = await off_loop(plan.prompts.tokenize, self.tokenizer)
        else:
            prompts = plan.prompts.tokenize(self.tokenizer)
        specs = self._choice_specs(plan, prompts, model)
        self._check_response_size(plan, prompts, specs)
        release = self._admit(len(specs))
        usage = TokenUsage([len(p.ids) for p in prompts], plan.n, self.metrics, self.cfg.enable_prompt_tokens_details)
        hooks = self.metrics.hooks()
        runners = [
            ChoiceRunner(s, self.client, self.tokenizer, model, plan.request_id, stream=plan.stream, hooks=hooks)
            for s in specs
        ]
        group = ChoiceGroup(runners, on_close=release)
        if plan.stream:
            return await self._start_stream(group, prompts, usage, raw_request)
        return await self._run_to_end(group, prompts, usage, raw_request)

    # -- checks ----------------------------------------------------------

    def _check_request(self, plan: GenerationPlan) -> None:
        if plan.model is not None and plan.model != self.cfg.served_model_name:
            raise model_not_found(plan.model)
        if plan.stream_options is not None and not plan.stream:
            raise BadRequestError("stream_options can only be set when stream is true.", param="stream_options",
                                  code="unsupported_combination")
        if plan.logprobs is not None and plan.logprobs > self.cfg.max_logprobs:
            raise BadRequestError(f"{plan.logprobs_param} must be at most {self.cfg.max_logprobs}.",
                                  param=plan.logprobs_param)
        if plan.prompt_logprobs is not None and plan.prompt_logprobs > self.cfg.max_logprobs:
            raise BadRequestError(f"{plan.prompt_logprobs_param} must be at most {self.cfg.max_logprobs}.",
                                  param=plan.prompt_logprobs_param)
        if plan.options.return_routed_weights and not self.cfg.enable_routed_experts:
            raise BadRequestError("return_routed_weights needs routed-experts capture, which this server has off "
                                  "(--disable-routed-experts).", param="return_routed_weights",
                                  code="unsupported_combination")
        if plan.options.replay_routed_experts is not None and plan.prompts.count > 1:
            raise BadRequestError(f"{plan.replay_param} forces the routing of one prompt; this request has "
                                  f"{plan.prompts.count}.", param=plan.replay_param, code="invalid_replay")
        # More choices than the server could ever run at once: 400 (not 503, retrying would not help).
        n, num_prompts, limit = plan.n, plan.prompts.count, self.cfg.max_pending_requests
        if n * num_prompts > limit:
            raise BadRequestError(
                f"The request asks for {n * num_prompts} choices (n={n} x {num_prompts} prompts); the server runs at "
                f"most {limit} at once.",
                param=plan.n_param, code="too_many_choices",
            )

    def _check_response_size(self, plan: GenerationPlan, prompts: list[PromptInput], specs: list[ChoiceSpec]) -> None:
        """400 before any work when the response could carry more logprobs than --max-response-logprobs."""
        if plan.logprobs is None and plan.prompt_logprobs is None:
            return
        copies = plan.n if plan.prompt_logprobs_per_choice else 1
        prompt_lens = [len(p.ids) for p in prompts]
        max_tokens = [s.request.max_tokens for s in specs]
        entries = response_entries(choices_max_tokens=max_tokens, logprobs=plan.logprobs, prompt_lens=prompt_lens,
                                   prompt_logprobs=plan.prompt_logprobs, prompt_copies=copies)
        parts = [f"{len(specs)} choice(s)"]
        token_part = prompt_part = 0
        if plan.logprobs is not None:
            token_part = sum(max_tokens) * (1 + plan.logprobs)
            parts.append(f"up to {max(max_tokens)} tokens each with {plan.logprobs} top logprobs")
        if plan.prompt_logprobs is not None:
            prompt_part = entries - token_part
            where = " in each choice" if copies > 1 else ""
            parts.append(f"{sum(prompt_lens)} prompt tokens with {plan.prompt_logprobs} prompt logprobs{where}")
        param = plan.prompt_logprobs_param if prompt_part > token_part else plan.logprobs_param
        check_response_budget(entries, self.cfg.max_response_logprobs, detail=", ".join(parts), param=param)

    @staticmethod
    def _check_prompt_ids(ids: list[int], param: str, model: ModelInfo) -> None:
        if not ids:
            raise BadRequestError("The prompt is empty (no tokens).", param=param, code="empty_prompt")
        bad = next((t for t in ids if t < 0 or t >= model.vocab_size), None)
        if bad is not None:
            raise BadRequestError(
                f"Token id {bad} is out of vocabulary (valid ids are 0..{model.vocab_size - 1}).", param=param
            )

    @staticmethod
    def _resolve_max_tokens(prompt_len: int, plan: GenerationPlan, model: ModelInfo) -> int:
        max_len = model.max_model_len
        if prompt_len >= max_len:
            raise BadRequestError(
                f"This model's maximum context length is {max_len} tokens. However, your prompt has "
                f"{prompt_len} tokens, which leaves no room for the completion. Please reduce the length of the "
                f"prompt.",
                param=plan.prompts.param, code="context_length_exceeded",
            )
        if plan.max_tokens is None:
            return max_len - prompt_len
        if prompt_len + plan.max_tokens > max_len:
            raise BadRequestError(
                f"This model's maximum context length is {max_len} tokens. However, you requested "
                f"{prompt_len + plan.max_tokens} tokens ({prompt_len} in the prompt, {plan.max_tokens} in the "
                f"completion). Please reduce the length of the prompt or completion.",
                param=plan.max_tokens_param, code="context_length_exceeded",
            )
        return plan.max_tokens

    # -- building choices ------------------------------------------------

    def _choice_specs(self, plan: GenerationPlan, prompts: list[PromptInput], model: ModelInfo) -> list[ChoiceSpec]:
        """Check each prompt against the model; one backend request per prompt, one spec per choice."""
        opts = plan.options
        want_routed = self.cfg.enable_routed_experts and opts.return_routed_experts is not False
        want_weights = bool(opts.return_routed_weights)  # checked against the server switch in _check_request
        prompt_start = (opts.routed_experts_prompt_start or 0) if want_routed or want_weights else 0
        stop = opts.stop_list()
        specs: list[ChoiceSpec] = []
        for p_idx, prompt in enumerate(prompts):
            self._check_prompt_ids(prompt.ids, plan.prompts.param, model)
            max_tokens = self._resolve_max_tokens(len(prompt.ids), plan, model)
            if opts.min_tokens and opts.min_tokens > max_tokens:
                raise BadRequestError(f"min_tokens ({opts.min_tokens}) must be at most max_tokens ({max_tokens}).",
                                      param="min_tokens", code="unsupported_combination")
            if prompt_start and prompt_start >= len(prompt.ids):
                raise BadRequestError(
                    f"routed_experts_prompt_start ({prompt_start}) must be smaller than the number of prompt "
                    f"tokens ({len(prompt.ids)}).",
                    param="routed_experts_prompt_start", code="invalid_prompt_start",
                )
            replay = None
            if opts.replay_routed_experts is not None:
                replay = check_replay(opts.replay_routed_experts, len(prompt.ids), model, plan.replay_param)
            request = BackendRequest(
                input_ids=prompt.ids,
                stream=plan.stream or bool(stop),  # stop strings: see tokens early, cancel early
                max_tokens=max_tokens,
                temperature=opts.temperature,
                top_p=opts.top_p,
                top_k=opts.top_k,
                stop_token_ids=opts.stop_token_ids or None,
                ignore_eos=True if opts.ignore_eos else None,
                min_tokens=opts.min_tokens or None,
                logprobs=plan.logprobs,
                return_routed_experts=want_routed,
                routed_experts_prompt_start=prompt_start or None,
                replay_routed_experts=replay,
                return_routed_weights=True if want_weights else None,
                prompt_logprobs=plan.prompt_logprobs,
                cache_salt=opts.cache_salt,
            )
            for i in range(plan.n):
                specs.append(
                    ChoiceSpec(
                        index=p_idx * plan.n + i,
                        request=replace(request, seed=_choice_seed(opts.seed, i, plan.n)),
                        detokenize=plan.detokenize,
                        skip_special_tokens=opts.skip_special_tokens,
                        stop=stop,
                        include_stop_str_in_output=opts.include_stop_str_in_output,
                    )
                )
        return specs

    def _admit(self, n: int) -> Callable[[], None]:
        """Reserve n in-flight choices or raise 503; returns the release callback."""
        limit = self.cfg.max_pending_requests
        if self.pending + n > limit:
            self.metrics.rejected.inc()
            raise ServiceUnavailableError(
                f"The server is overloaded ({self.pending} choices in flight, limit {limit}). Retry later.",
                retry_after_s=self.cfg.retry_after_s,
            )
        self.pending += n
        self.metrics.pending.set(self.pending)
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self.pending -= n
                self.metrics.pending.set(self.pending)

        return release

    # -- running ---------------------------------------------------------

    async def _run_to_end(self, group: ChoiceGroup, prompts: list[PromptInput], usage: TokenUsage,
                          raw_request: Request) -> Finished:
        try:
            results = await run_with_cancellation(raw_request, group.results())
        except BackendError as e:
            raise backend_error_to_openai(e, self.cfg.retry_after_s) from e
        finally:
            await group.aclose()
        for r in results:
            usage.add(r.index, len(r.token_ids))
            usage.cached(r.index, r.num_cached_tokens)
        usage.close()
        return Finished(results, prompts, usage.total())

    async def _start_stream(self, group: ChoiceGroup, prompts: list[PromptInput], usage: TokenUsage,
                            raw_request: Request) -> ChoiceStream:
        """Start the first choice, wait for its first delta (at most STREAM_PRIME_S), start the others, hand the
        stream over."""
        group.start(1)
        deltas = group.deltas()
        primed: list[ChoiceDelta] = []
        waiting: asyncio.Future | None = None  # never cancelled here: that would close the group

        async def prime() -> None:
            nonlocal waiting
            waiting = asyncio.ensure_future(deltas.__anext__())
            await asyncio.wait({waiting}, timeout=STREAM_PRIME_S)
            if waiting.done():  # else the engine is paused, or busy: start the stream now all the same
                d, waiting = waiting.result(), None
                primed.append(d)

        try:
            await run_with_cancellation(raw_request, prime())
        except BaseException as e:
            if waiting is not None:
                waiting.cancel()
            await group.aclose()
            if isinstance(e, BackendError):
                raise backend_error_to_openai(e, self.cfg.retry_after_s) from e
            raise
        return ChoiceStream(group, deltas, primed, prompts, usage, self.metrics, self.cfg.retry_after_s, waiting)


# How long a stream waits for its first choice's first delta before its headers go out. Errors of the backend come
# back within milliseconds and still get their HTTP status; a paused or busy engine does not hold the headers up.
STREAM_PRIME_S = 0.25
_LONG_TEXT_CHARS = 1 << 16  # completion prompts with more text than this are tokenized in a worker


def _costly_prompts(source: PromptSource) -> bool:
    if isinstance(source, ChatPrompt):
        return True
    if isinstance(source, CompletionPrompts):
        return sum(len(p) for p in source.request.prompt if isinstance(p, str)) > _LONG_TEXT_CHARS
    return False


def _choice_seed(seed: int | None, i: int, n: int) -> int | None:
    """Per-choice seed: seed + i (wrapping in int64); random when n > 1 and no seed."""
    if seed is None:
        return secrets.randbits(63) if n > 1 else None
    s = seed + i
    if s > INT64_MAX:
        s = s - INT64_MAX + INT64_MIN - 1
    return s
