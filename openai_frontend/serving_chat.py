"""POST /v1/chat/completions: the body -> a plan; the outcome -> OpenAI's chat completion objects.

The messages become a prompt through the chat template in :mod:`.prompts`.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Any

from fastapi import Request
from starlette.responses import Response

from .errors import BadRequestError
from .logprobs_format import chat_logprobs
from .prompts import ChatPrompt
from .protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
    ChatResponseMessage,
    DeltaMessage,
    now,
    random_id,
)
from .bounded import json_body
from .responses import sse_response
from .routing_codec import Payloads
from .serving import Finished, GenerationPlan, ServingContext


async def create_chat_completion(ctx: ServingContext, req: ChatCompletionRequest, raw: Request) -> Response:
    if req.top_logprobs and not req.logprobs:
        raise BadRequestError("top_logprobs requires logprobs to be true.", param="top_logprobs", code="unsupported_combination")
    if req.prompt_logprobs is not None:
        raise BadRequestError("prompt_logprobs is supported on /v1/completions and /inference/v1/generate, not on "
                              "chat completions.", param="prompt_logprobs")
    if req.max_completion_tokens is not None:
        max_tokens, max_param = req.max_completion_tokens, "max_completion_tokens"
    else:
        max_tokens, max_param = req.max_tokens, "max_tokens"
    top_n = req.top_logprobs or 0
    plan = GenerationPlan(
        request_id=random_id("chatcmpl"),
        model=req.model,
        prompts=ChatPrompt(req),
        n=req.n,
        options=req,
        max_tokens=max_tokens,
        stream=req.stream,
        stream_options=req.stream_options,
        logprobs=top_n if req.logprobs else None,
        logprobs_param="top_logprobs",
        max_tokens_param=max_param,
    )
    created = now()
    model_name = ctx.cfg.served_model_name
    token_ids_on = bool(req.return_token_ids)
    as_ids = bool(req.return_tokens_as_token_ids)
    payloads = Payloads()
    outcome = await ctx.generate(plan, raw)
    prompt_ids = outcome.prompts[0].ids

    def logprobs(lps):  # noqa: ANN001, ANN202
        return chat_logprobs(lps, ctx.tokenizer, top_n, as_ids=as_ids)

    def render(outcome: Finished) -> list[bytes]:
        choices = [
            ChatCompletionResponseChoice(
                index=r.index,
                message=ChatResponseMessage(role="assistant", content=r.text),
                logprobs=logprobs(r.logprobs) if r.logprobs is not None else None,
                finish_reason=r.finish_reason,
                stop_reason=r.stop_reason,
                token_ids=r.token_ids if token_ids_on else None,
                prompt_token_ids=prompt_ids if token_ids_on else None,
                routed_experts=payloads.ref(r.routed_experts),
                routed_weights=payloads.ref(r.routed_weights),
                weight_version=r.weight_version,
            )
            for r in outcome.results
        ]
        return payloads.dump_parts(ChatCompletionResponse(id=plan.request_id, created=created, model=model_name,
                                                    choices=choices, usage=outcome.usage,
                                                    prompt_token_ids=prompt_ids if token_ids_on else None))

    if isinstance(outcome, Finished):  # with logprobs: built in a worker (bounded.py)
        return await json_body(lambda: render(outcome), heavy=bool(req.logprobs))

    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    continuous = bool(req.stream_options and req.stream_options.continuous_usage_stats)

    def chunk(choice: ChatCompletionResponseStreamChoice) -> bytes:
        c = ChatCompletionStreamResponse(id=plan.request_id, created=created, model=model_name, choices=[choice])
        if continuous:
            c.usage = outcome.usage.choice(choice.index)
        return payloads.sse(c)

    async def events() -> AsyncGenerator[bytes, None]:
        async for d in outcome:
            if d.first:  # the role comes alone, first (a choice still waiting for a running slot: when admitted)
                yield chunk(ChatCompletionResponseStreamChoice(
                    index=d.index,
                    delta=DeltaMessage(role="assistant", content=""),
                    logprobs=None,
                    finish_reason=None,
                    **({"prompt_token_ids": prompt_ids} if token_ids_on else {}),
                ))
            if d.text or d.last or d.logprobs or (token_ids_on and d.token_ids):
                fields: dict[str, Any] = {}
                if token_ids_on:
                    fields["token_ids"] = d.token_ids
                if d.last:
                    fields["stop_reason"] = d.stop_reason
                    fields["routed_experts"] = payloads.ref(d.routed_experts)
                    fields["routed_weights"] = payloads.ref(d.routed_weights)
                    fields["weight_version"] = d.weight_version
                yield chunk(ChatCompletionResponseStreamChoice(
                    index=d.index,
                    delta=DeltaMessage(content=d.text) if d.text else DeltaMessage(),
                    logprobs=logprobs(d.logprobs) if d.logprobs else None,
                    finish_reason=d.finish_reason,
                    **fields,
                ))
        if include_usage:
            yield payloads.sse(ChatCompletionStreamResponse(id=plan.request_id, created=created, model=model_name,
                                                            choices=[], usage=outcome.usage.total()))

    return sse_response(events(), on_close=outcome.aclose, on_disconnect=outcome.client_disconnected,
                        preamble=outcome.preamble)
