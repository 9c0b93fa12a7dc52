"""What the three generation endpoints share.

:class:`ServingContext` holds the engine, tokenizer, model metadata, metrics
and the admission counter; it turns validated request fields into one
:class:`~.generation.ChoiceSpec` per choice and runs them, either to the end
(JSON) or as a server-sent-event stream.
"""

from __future__ import annotations

import json
import logging
import secrets
import time
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass

from fastapi import Request
from starlette.responses import Response

from .config import FrontendConfig
from .errors import (
    BadRequestError,
    InternalServerError,
    OpenAIError,
    ServiceUnavailableError,
    model_not_found,
)
from .generation import ChoiceDelta, ChoiceGroup, ChoiceResult, ChoiceRunner, ChoiceSpec
from .http_utils import SSE_DONE, SSEResponse, run_with_cancellation, sse_event
from .metrics import Metrics
from .protocol import INT64_MAX, INT64_MIN, SamplingFields
from .tokenizer import Tokenizer
from .triton_client import EngineError, EngineRequest, ModelInfo

logger = logging.getLogger(__name__)


def engine_error_to_openai(e: EngineError, retry_after_s: int = 1) -> OpenAIError:
    if e.kind == EngineError.INVALID:
        return BadRequestError(e.message)
    if e.kind == EngineError.UNAVAILABLE:
        return ServiceUnavailableError(e.message, retry_after_s=retry_after_s)
    if e.kind == EngineError.CANCELLED:
        return ServiceUnavailableError(f"request cancelled by the server: {e.message}", retry_after_s=retry_after_s,
                                       code="cancelled")
    return InternalServerError(f"engine error: {e.message}")


@dataclass
class PromptInput:
    ids: list[int]
    text: str | None = None  # the prompt text, when the client sent text


@dataclass
class Plan:
    """How to run one HTTP request: its prompts and per-choice options."""

    prompts: list[PromptInput]
    sampling: SamplingFields
    max_tokens: int | None  # None = fill the context
    stream: bool
    logprobs: int | None  # top-N per token; None = no logprobs
    detokenize: bool = True
    skip_special_tokens: bool = True
    prompt_param: str = "prompt"
    max_tokens_param: str = "max_tokens"


class ServingContext:
    def __init__(self, cfg: FrontendConfig, engine, tokenizer: Tokenizer, metrics: Metrics) -> None:
        self.cfg = cfg
        self.engine = engine
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.model: ModelInfo | None = None
        self.created = int(time.time())
        self.pending = 0

    # -- checks ----------------------------------------------------------

    def model_info(self) -> ModelInfo:
        if self.model is None:
            raise ServiceUnavailableError("The model is not ready yet.", retry_after_s=self.cfg.retry_after_s,
                                          code="model_not_ready")
        return self.model

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.cfg.served_model_name:
            raise model_not_found(name)

    def check_prompt_ids(self, ids: list[int], param: str) -> None:
        model = self.model_info()
        if not ids:
            raise BadRequestError("The prompt is empty (no tokens).", param=param)
        bad = next((t for t in ids if t < 0 or t >= model.vocab_size), None)
        if bad is not None:
            raise BadRequestError(
                f"Token id {bad} is out of vocabulary (valid ids are 0..{model.vocab_size - 1}).", param=param
            )

    def resolve_max_tokens(self, prompt_len: int, max_tokens: int | None, prompt_param: str,
                           max_tokens_param: str = "max_tokens") -> int:
        max_len = self.model_info().max_model_len
        if prompt_len >= max_len:
            raise BadRequestError(
                f"This model's maximum context length is {max_len} tokens. However, your prompt has "
                f"{prompt_len} tokens, which leaves no room for the completion. Please reduce the length of the "
                f"prompt.",
                param=prompt_param, code="context_length_exceeded",
            )
        if max_tokens is None:
            return max_len - prompt_len
        if prompt_len + max_tokens > max_len:
            raise BadRequestError(
                f"This model's maximum context length is {max_len} tokens. However, you requested "
                f"{prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} in the completion). "
                f"Please reduce the length of the prompt or completion.",
                param=max_tokens_param, code="context_length_exceeded",
            )
        return max_tokens

    def check_logprobs(self, value: int | None, param: str) -> None:
        if value is not None and value > self.cfg.max_logprobs:
            raise BadRequestError(f"{param} must be at most {self.cfg.max_logprobs}.", param=param)

    # -- admission -------------------------------------------------------

    def check_choice_count(self, n: int, num_prompts: int = 1, param: str = "n") -> None:
        """400 when a request has more choices than the server could ever run at once."""
        limit = self.cfg.max_pending_requests
        if n * num_prompts > limit:
            raise BadRequestError(
                f"The request asks for {n * num_prompts} choices (n={n} x {num_prompts} prompts); the server runs at "
                f"most {limit} at once.",
                param=param,
            )

    def admit(self, n: int) -> Callable[[], None]:
        """Reserve n in-flight choices or raise 503; returns the release callback."""
        limit = self.cfg.max_pending_requests
        self.check_choice_count(n)
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

    # -- building choices ------------------------------------------------

    def build_group(self, plan: Plan, request_id: str, *, n: int) -> ChoiceGroup:
        """Validate the prompts against the model and make one runner per choice."""
        model = self.model_info()
        sp = plan.sampling
        self.check_choice_count(n, len(plan.prompts))
        want_routed = self.cfg.enable_routed_experts and sp.return_routed_experts is not False
        prompt_start = sp.routed_experts_prompt_start or 0
        stop = sp.stop_list()
        specs: list[ChoiceSpec] = []
        for p_idx, prompt in enumerate(plan.prompts):
            self.check_prompt_ids(prompt.ids, plan.prompt_param)
            max_tokens = self.resolve_max_tokens(
                len(prompt.ids), plan.max_tokens, plan.prompt_param, plan.max_tokens_param
            )
            if want_routed and prompt_start and prompt_start >= len(prompt.ids):
                raise BadRequestError(
                    f"routed_experts_prompt_start ({prompt_start}) must be smaller than the number of prompt "
                    f"tokens ({len(prompt.ids)}).",
                    param="routed_experts_prompt_start",
                )
            for i in range(n):
                index = p_idx * n + i
                specs.append(
                    ChoiceSpec(
                        index=index,
                        prompt_ids=prompt.ids,
                        engine_request=EngineRequest(
                            input_ids=prompt.ids,
                            stream=plan.stream or bool(stop),  # stop strings: see tokens early, cancel early
                            max_tokens=max_tokens,
                            temperature=sp.temperature,
                            top_p=sp.top_p,
                            top_k=sp.top_k,
                            seed=_choice_seed(sp.seed, i, n),
                            stop_token_ids=sp.stop_token_ids or None,
                            ignore_eos=True if sp.ignore_eos else None,
                            min_tokens=sp.min_tokens or None,
                            logprobs=plan.logprobs,
                            return_routed_experts=want_routed,
                            routed_experts_prompt_start=prompt_start if want_routed and prompt_start else None,
                        ),
                        detokenize=plan.detokenize,
                        skip_special_tokens=plan.skip_special_tokens,
                        stop=stop,
                        include_stop_str_in_output=sp.include_stop_str_in_output,
                        want_logprobs=plan.logprobs is not None,
                        routed_experts=want_routed,
                        routed_experts_prompt_start=prompt_start if want_routed else 0,
                        stop_token_ids=frozenset(sp.stop_token_ids or ()),
                    )
                )
        release = self.admit(len(specs))
        hooks = self.metrics.hooks()
        runners = [
            ChoiceRunner(s, self.engine, self.tokenizer, model, request_id, stream=plan.stream, hooks=hooks)
            for s in specs
        ]
        self.metrics.prompt_tokens.inc(sum(len(p.ids) for p in plan.prompts))
        return ChoiceGroup(runners, on_close=release)

    # -- running ---------------------------------------------------------

    async def run_to_end(self, group: ChoiceGroup, raw_request: Request) -> list[ChoiceResult]:
        try:
            results = await run_with_cancellation(raw_request, group.results())
        except EngineError as e:
            raise engine_error_to_openai(e, self.cfg.retry_after_s) from e
        finally:
            await group.aclose()
        self.metrics.generation_tokens.inc(sum(len(r.token_ids) for r in results))
        return results

    async def stream(
        self,
        group: ChoiceGroup,
        raw_request: Request,
        render: Callable[[ChoiceDelta], Iterable[str | bytes]],
        finish: Callable[[], Iterable[str | bytes]],
    ) -> Response:
        """Start streaming once every choice produced its first delta.

        Waiting for the first response of each choice means engine errors
        (invalid request, queue full) still get a proper HTTP status; after
        that, errors are sent as an SSE ``error`` event before ``[DONE]``.
        """
        deltas = group.deltas()
        primed: list[ChoiceDelta] = []

        async def prime() -> None:
            seen: set[int] = set()
            while len(seen) < len(group.runners):
                d = await deltas.__anext__()
                primed.append(d)
                seen.add(d.index)

        try:
            await run_with_cancellation(raw_request, prime())
        except EngineError as e:
            await group.aclose()
            raise engine_error_to_openai(e, self.cfg.retry_after_s) from e
        except BaseException:
            await group.aclose()
            raise

        metrics = self.metrics

        async def body() -> AsyncIterator[str | bytes]:
            n_tokens = 0
            try:
                for d in primed:
                    n_tokens += len(d.token_ids)
                    for chunk in render(d):
                        yield chunk
                async for d in deltas:
                    n_tokens += len(d.token_ids)
                    for chunk in render(d):
                        yield chunk
                for chunk in finish():
                    yield chunk
            except (EngineError, OpenAIError) as e:
                err = engine_error_to_openai(e, self.cfg.retry_after_s) if isinstance(e, EngineError) else e
                logger.warning("stream failed: %s", err.message)
                yield sse_event(_error_json(err))
            except Exception as e:  # noqa: BLE001 - a started stream must still end properly
                logger.exception("stream failed")
                yield sse_event(_error_json(InternalServerError(f"Internal server error: {type(e).__name__}")))
            finally:
                metrics.generation_tokens.inc(n_tokens)
            yield SSE_DONE

        return SSEResponse(body(), on_close=group.aclose, on_disconnect=metrics.disconnects.inc)


def _error_json(err: OpenAIError) -> str:
    return json.dumps(err.to_dict())


def _choice_seed(seed: int | None, i: int, n: int) -> int | None:
    """Per-choice seed: seed + i (wrapping in int64); random when n > 1 and no seed."""
    if seed is None:
        return secrets.randbits(63) if n > 1 else None
    s = seed + i
    if s > INT64_MAX:
        s = s - INT64_MAX + INT64_MIN - 1
    return s


class Payloads:
    """Splices large base64 payloads (routed experts) into JSON bytes.

    Models carry a short placeholder string (with a per-request nonce) where
    the payload goes; :meth:`dump` serialises the small model and joins the
    payload bytes in at the placeholders in one pass.  The payload is never
    turned into a Python ``str`` nor scanned by a JSON encoder (base64 needs
    no escaping).
    """

    __slots__ = ("_prefix", "_parts", "_n")

    def __init__(self) -> None:
        self._prefix = f"@@routed-{secrets.token_hex(8)}:"
        self._parts: dict[bytes, bytes] = {}
        self._n = 0

    def ref(self, payload: bytes | None) -> str | None:
        if payload is None:
            return None
        key = f"{self._prefix}{self._n}@@"
        self._n += 1
        self._parts[key.encode()] = payload
        return key

    def dump(self, model, prefix: bytes = b"", suffix: bytes = b"") -> bytes:  # noqa: ANN001 - pydantic model
        body = model.model_dump_json().encode()
        if not self._parts:
            return prefix + body + suffix if prefix or suffix else body
        marker = b'"' + self._prefix.encode()
        pieces = [prefix]
        pos = 0
        while (i := body.find(marker, pos)) >= 0:
            end = body.find(b'@@"', i + len(marker))
            key = body[i + 1 : end + 2]
            pieces.append(body[pos : i + 1])  # up to and including the opening quote
            pieces.append(self._parts.pop(key))
            pos = end + 2  # the closing quote starts the next piece
        pieces.append(body[pos:])
        pieces.append(suffix)
        return b"".join(pieces)

    def sse(self, model) -> bytes:  # noqa: ANN001 - pydantic model
        return self.dump(model, b"data: ", b"\n\n")


def json_response(model, payloads: Payloads | None = None) -> Response:  # noqa: ANN001 - pydantic model
    body = payloads.dump(model) if payloads is not None else model.model_dump_json().encode()
    return Response(content=body, media_type="application/json")


def disconnected_response() -> Response:
    """What a handler returns when its client went away (nobody reads it; 499 in metrics)."""
    return Response(status_code=499)
