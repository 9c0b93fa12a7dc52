"""POST /v1/completions."""

from __future__ import annotations

from collections.abc import Iterable

from fastapi import Request
from starlette.responses import Response

from .errors import BadRequestError
from .generation import ChoiceDelta
from .http_utils import sse_event
from .logprobs_format import completion_logprobs
from .protocol import (
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionResponseStreamChoice,
    CompletionStreamResponse,
    UsageInfo,
    now,
    random_id,
)
from .serving import Payloads, Plan, PromptInput, ServingContext, json_response


def _prompts(ctx: ServingContext, req: CompletionRequest) -> list[PromptInput]:
    out = []
    for p in req.prompt:
        if isinstance(p, str):
            ids = ctx.tokenizer.encode(p, add_special_tokens=req.add_special_tokens)
            prompt = PromptInput(ids=ids, text=p)
        else:
            prompt = PromptInput(ids=list(p))
        if req.truncate_prompt_tokens is not None:
            prompt.ids = prompt.ids[-req.truncate_prompt_tokens :]
        out.append(prompt)
    return out


def _check(ctx: ServingContext, req: CompletionRequest) -> None:
    ctx.check_model(req.model)
    if req.stream_options is not None and not req.stream:
        raise BadRequestError("stream_options can only be set when stream is true.", param="stream_options")
    if req.echo and req.logprobs is not None:
        raise BadRequestError("echo together with logprobs needs prompt logprobs, which are not supported.",
                              param="echo")
    ctx.check_logprobs(req.logprobs, "logprobs")
    ctx.check_choice_count(req.n, len(req.prompt))  # before tokenizing anything


async def create_completion(ctx: ServingContext, req: CompletionRequest, raw: Request) -> Response:
    _check(ctx, req)
    ctx.model_info()
    prompts = _prompts(ctx, req)
    plan = Plan(
        prompts=prompts,
        sampling=req,
        max_tokens=req.max_tokens,
        stream=req.stream,
        logprobs=req.logprobs,
        skip_special_tokens=req.skip_special_tokens,
        prompt_param="prompt",
    )
    request_id = random_id("cmpl")
    created = now()
    model_name = ctx.cfg.served_model_name
    group = ctx.build_group(plan, request_id, n=req.n)
    n = req.n
    token_ids_on = bool(req.return_token_ids)
    as_ids = bool(req.return_tokens_as_token_ids)

    def echo_text(p: PromptInput) -> str:
        if p.text is not None:
            return p.text
        return ctx.tokenizer.decode(p.ids, skip_special_tokens=req.skip_special_tokens)

    usage_prompt = sum(len(p.ids) for p in prompts)
    payloads = Payloads()

    if not req.stream:
        results = await ctx.run_to_end(group, raw)
        choices = []
        for r in results:
            prompt = prompts[r.index // n]
            prefix = echo_text(prompt) if req.echo else ""
            logprobs = None
            if r.logprobs is not None:
                logprobs, _ = completion_logprobs(r.logprobs, ctx.tokenizer, req.logprobs or 0, len(prefix),
                                                  as_ids=as_ids)
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
                )
            )
        completion_tokens = sum(len(r.token_ids) for r in results)
        return json_response(
            CompletionResponse(
                id=request_id,
                created=created,
                model=model_name,
                choices=choices,
                usage=UsageInfo.of(usage_prompt, completion_tokens),
            ),
            payloads,
        )

    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    continuous = bool(req.stream_options and req.stream_options.continuous_usage_stats)
    offsets: dict[int, int] = {}
    generated: dict[int, int] = {}

    def render(d: ChoiceDelta) -> Iterable[str | bytes]:
        prompt = prompts[d.index // n]
        text = d.text
        if d.first and req.echo:
            text = echo_text(prompt) + text
        generated[d.index] = generated.get(d.index, 0) + len(d.token_ids)
        if not (text or d.last or d.logprobs or (token_ids_on and d.token_ids) or (d.first and token_ids_on)):
            return ()
        logprobs = None
        if d.logprobs is not None:
            start = offsets.get(d.index, len(text) - len(d.text))
            logprobs, offsets[d.index] = completion_logprobs(d.logprobs, ctx.tokenizer, req.logprobs or 0, start,
                                                             as_ids=as_ids)
        chunk = CompletionStreamResponse(
            id=request_id,
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
                )
            ],
        )
        if continuous:
            c = generated[d.index]
            chunk.usage = UsageInfo.of(len(prompt.ids), c)
        return (payloads.sse(chunk),)

    def finish() -> Iterable[str]:
        if not include_usage:
            return ()
        c = sum(generated.values())
        chunk = CompletionStreamResponse(
            id=request_id, created=created, model=model_name, choices=[],
            usage=UsageInfo.of(usage_prompt, c),
        )
        return (sse_event(chunk.model_dump_json()),)

    return await ctx.stream(group, raw, render, finish)
