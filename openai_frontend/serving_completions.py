"""POST /v1/completions: the body -> a plan; the outcome -> OpenAI's completion objects."""

from __future__ import annotations

from collections.abc import AsyncGenerator

from fastapi import Request
from starlette.responses import Response

from .errors import BadRequestError
from .logprobs_format import completion_logprobs
from .prompts import CompletionPrompts, PromptInput
from .protocol import (
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionResponseStreamChoice,
    CompletionStreamResponse,
    now,
    random_id,
)
from .responses import json_response, sse_response
from .routing_codec import Payloads
from .serving import Finished, GenerationPlan, ServingContext


async def create_completion(ctx: ServingContext, req: CompletionRequest, raw: Request) -> Response:
    if req.echo and req.logprobs is not None:
        raise BadRequestError("echo together with logprobs needs prompt logprobs, which are not supported.",
                              param="echo")
    plan = GenerationPlan(
        request_id=random_id("cmpl"),
        model=req.model,
        prompts=CompletionPrompts(req),
        n=req.n,
        options=req,
        max_tokens=req.max_tokens,
        stream=req.stream,
        stream_options=req.stream_options,
        logprobs=req.logprobs,
    )
    created = now()
    model_name = ctx.cfg.served_model_name
    n = req.n
    token_ids_on = bool(req.return_token_ids)
    as_ids = bool(req.return_tokens_as_token_ids)
    top_n = req.logprobs or 0
    payloads = Payloads()
    outcome = await ctx.generate(plan, raw)
    prompts = outcome.prompts

    def echo_text(p: PromptInput) -> str:
        if p.text is not None:
            return p.text
        return ctx.tokenizer.decode(p.ids, skip_special_tokens=req.skip_special_tokens)

    if isinstance(outcome, Finished):
        choices = []
        for r in outcome.results:
            prompt = prompts[r.index // n]
            prefix = echo_text(prompt) if req.echo else ""
            logprobs = None
            if r.logprobs is not None:
                logprobs, _ = completion_logprobs(r.logprobs, ctx.tokenizer, top_n, len(prefix), as_ids=as_ids)
            choices.append(
                CompletionResponseChoice(
                    index=r.index,
                    text=prefix + r.text,
                    logprobs=logprobs,
                    finish_reason=r.finish_reason,
                    stop_reason=r.stop_reason,
                    token_ids=r.token_ids if token_ids_on else None,
                    prompt_token_ids=prompt.ids if token_ids_on else None,
                    routed_experts=payloads.ref(r.routed_experts),
                    weight_version=r.weight_version,
                )
            )
        return json_response(
            CompletionResponse(id=plan.request_id, created=created, model=model_name, choices=choices,
                               usage=outcome.usage),
            payloads,
        )

    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    continuous = bool(req.stream_options and req.stream_options.continuous_usage_stats)
    offsets: dict[int, int] = {}  # text offset of each choice's next logprob token

    async def events() -> AsyncGenerator[bytes, None]:
        async for d in outcome:
            prompt = prompts[d.index // n]
            text = d.text
            if d.first and req.echo:
                text = echo_text(prompt) + text
            if not (text or d.last or d.logprobs or (token_ids_on and d.token_ids) or (d.first and token_ids_on)):
                continue
            logprobs = None
            if d.logprobs is not None:
                start = offsets.get(d.index, len(text) - len(d.text))
                logprobs, offsets[d.index] = completion_logprobs(d.logprobs, ctx.tokenizer, top_n, start,
                                                                 as_ids=as_ids)
            chunk = CompletionStreamResponse(
                id=plan.request_id,
                created=created,
                model=model_name,
                choices=[
                    CompletionResponseStreamChoice(
                        index=d.index,
                        text=text,
                        logprobs=logprobs,
                        finish_reason=d.finish_reason,
                        stop_reason=d.stop_reason,
                        token_ids=d.token_ids if token_ids_on else None,
                        prompt_token_ids=prompt.ids if token_ids_on and d.first else None,
                        routed_experts=payloads.ref(d.routed_experts),
                        weight_version=d.weight_version,
                    )
                ],
            )
            if continuous:
                chunk.usage = outcome.usage.choice(d.index)
            yield payloads.sse(chunk)
        if include_usage:
            yield payloads.sse(CompletionStreamResponse(id=plan.request_id, created=created, model=model_name,
                                                        choices=[], usage=outcome.usage.total()))

    return sse_response(events(), on_close=outcome.aclose, on_disconnect=outcome.client_disconnected)
