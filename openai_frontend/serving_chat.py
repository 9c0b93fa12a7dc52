"""POST /v1/chat/completions: the body -> a plan; the outcome -> OpenAI's chat completion objects.

The messages become a prompt through the chat template in :mod:`.prompts`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from starlette.responses import Response

from .errors import BadRequestError
from .generation import ChoiceDelta, TokenLogprob
from .logprobs_format import chat_logprobs
from .prompts import ChatPrompt
from .protocol import (
    ChatCompletionLogProbs,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
    ChatResponseMessage,
    DeltaMessage,
    UsageInfo,
    now,
    random_id,
)
from .responses import Responder
from .serving import ChoiceStream, Finished, GenerationPlan, ServingContext


async def create_chat_completion(ctx: ServingContext, req: ChatCompletionRequest, raw: Request) -> Response:
    """Validate -> plan -> run -> respond."""
    _validate(req)
    plan = _plan(req)
    created = now()  # the response's timestamp: when the request came
    outcome = await ctx.generate(plan, raw)
    return await _ChatResponder(ctx, plan, outcome, req, created).respond()


def _validate(req: ChatCompletionRequest) -> None:
    """What only chat refuses (serving checks the rest, alike for every endpoint)."""
    if req.top_logprobs and not req.logprobs:
        raise BadRequestError("top_logprobs requires logprobs to be true.", param="top_logprobs",
                              code="unsupported_combination")
    if req.prompt_logprobs is not None:
        raise BadRequestError("prompt_logprobs is supported on /v1/completions and /inference/v1/generate, not on "
                              "chat completions.", param="prompt_logprobs")


def _plan(req: ChatCompletionRequest) -> GenerationPlan:
    """The body as serving runs it; OpenAI's ``max_completion_tokens`` wins over the older ``max_tokens``."""
    if req.max_completion_tokens is not None:
        max_tokens, max_param = req.max_completion_tokens, "max_completion_tokens"
    else:
        max_tokens, max_param = req.max_tokens, "max_tokens"
    return GenerationPlan(
        request_id=random_id("chatcmpl"),
        model=req.model,
        prompts=ChatPrompt(req),
        n=req.n,
        options=req,
        max_tokens=max_tokens,
        stream=req.stream,
        stream_options=req.stream_options,
        logprobs=(req.top_logprobs or 0) if req.logprobs else None,
        logprobs_param="top_logprobs",
        max_tokens_param=max_param,
    )


class _ChatResponder(Responder):
    """Chat completion objects: one assistant message per choice. Streamed, each choice's first chunk carries the
    role alone (sent when the choice is admitted), the next ones its content."""

    def __init__(self, ctx: ServingContext, plan: GenerationPlan, outcome: Finished | ChoiceStream,
                 req: ChatCompletionRequest, created: int) -> None:
        super().__init__(ctx, plan, outcome)
        self.created = created
        self.heavy = bool(req.logprobs)
        self.top_n = req.top_logprobs or 0
        self.as_ids = bool(req.return_tokens_as_token_ids)
        self.prompt_ids = outcome.prompts[0].ids
        self.shown_prompt_ids = self.prompt_ids if self.token_ids_on else None

    def _logprobs(self, lps: list[TokenLogprob]) -> ChatCompletionLogProbs:
        return chat_logprobs(lps, self.ctx.tokenizer, self.top_n, as_ids=self.as_ids)

    def render(self, finished: Finished) -> list[bytes]:
        choices = [
            ChatCompletionResponseChoice(
                index=r.index,
                message=ChatResponseMessage(role="assistant", content=r.text),
                logprobs=self._logprobs(r.logprobs) if r.logprobs is not None else None,
                finish_reason=r.finish_reason,
                stop_reason=r.stop_reason,
                token_ids=r.token_ids if self.token_ids_on else None,
                prompt_token_ids=self.shown_prompt_ids,
                **self.end_fields(r),
            )
            for r in finished.results
        ]
        return self.payloads.dump_parts(ChatCompletionResponse(
            id=self.plan.request_id, created=self.created, model=self.model_name, choices=choices,
            usage=finished.usage, prompt_token_ids=self.shown_prompt_ids))

    async def chunks(self, d: ChoiceDelta) -> AsyncIterator[ChatCompletionStreamResponse]:
        if d.first:  # the role comes alone, first (a choice still waiting for a running slot: when admitted)
            yield self.chunk([ChatCompletionResponseStreamChoice(
                index=d.index,
                delta=DeltaMessage(role="assistant", content=""),
                logprobs=None,
                finish_reason=None,
                prompt_token_ids=self.shown_prompt_ids,
            )])
        if d.text or d.last or d.logprobs or (self.token_ids_on and d.token_ids):
            fields: dict[str, Any] = {}
            if self.token_ids_on:
                fields["token_ids"] = d.token_ids
            if d.last:
                fields.update(stop_reason=d.stop_reason, **self.end_fields(d))
            yield self.chunk([ChatCompletionResponseStreamChoice(
                index=d.index,
                delta=DeltaMessage(content=d.text) if d.text else DeltaMessage(),
                logprobs=self._logprobs(d.logprobs) if d.logprobs else None,
                finish_reason=d.finish_reason,
                **fields,
            )])

    def chunk(self, choices: list[ChatCompletionResponseStreamChoice],
               usage: UsageInfo | None = None) -> ChatCompletionStreamResponse:
        return ChatCompletionStreamResponse(id=self.plan.request_id, created=self.created, model=self.model_name,
                                            choices=choices, usage=usage)
