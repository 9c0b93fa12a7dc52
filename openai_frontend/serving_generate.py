"""POST /inference/v1/generate: tokens in, tokens out (vLLM's disaggregated-serving API)."""

from __future__ import annotations

from collections.abc import Iterable

from fastapi import Request
from starlette.responses import Response

from .errors import BadRequestError
from .generation import ChoiceDelta
from .http_utils import sse_event
from .logprobs_format import chat_logprobs
from .protocol import (
    GenerateRequest,
    GenerateResponse,
    GenerateResponseChoice,
    GenerateStreamResponse,
    UsageInfo,
    now,
    random_id,
)
from .serving import Payloads, Plan, PromptInput, ServingContext, json_response


async def create_generate(ctx: ServingContext, req: GenerateRequest, raw: Request) -> Response:
    ctx.check_model(req.model)
    if req.stream_options is not None and not req.stream:
        raise BadRequestError("stream_options can only be set when stream is true.", param="stream_options")
    sp = req.sampling_params
    if sp.return_routed_experts is None and req.return_routed_experts is not None:
        sp.return_routed_experts = req.return_routed_experts
    ctx.check_logprobs(sp.logprobs, "sampling_params.logprobs")
    ctx.check_choice_count(sp.n, param="sampling_params.n")
    ctx.model_info()
    prompt = PromptInput(ids=req.token_ids)
    plan = Plan(
        prompts=[prompt],
        sampling=sp,
        max_tokens=sp.max_tokens,
        stream=req.stream,
        logprobs=sp.logprobs,
        detokenize=False,  # token ids only; text is decoded internally only to match stop strings
        skip_special_tokens=sp.skip_special_tokens,
        prompt_param="token_ids",
        max_tokens_param="sampling_params.max_tokens",
    )
    request_id = req.request_id or random_id("gen")
    model_name = ctx.cfg.served_model_name
    group = ctx.build_group(plan, request_id, n=sp.n)
    token_ids_on = bool(sp.return_token_ids)
    top_n = max(sp.logprobs or 0, 1)
    prompt_len = len(prompt.ids)
    payloads = Payloads()

    def logprobs(lps):
        return chat_logprobs(lps, ctx.tokenizer, top_n, as_ids=True) if lps is not None else None

    if not req.stream:
        results = await ctx.run_to_end(group, raw)
        completion_tokens = sum(len(r.token_ids) for r in results)
        return json_response(
            GenerateResponse(
                request_id=request_id,
                model=model_name,
                created=now(),
                choices=[
                    GenerateResponseChoice(
                        index=r.index,
                        logprobs=logprobs(r.logprobs),
                        finish_reason=r.finish_reason,
                        token_ids=r.token_ids,
                        prompt_token_ids=prompt.ids if token_ids_on else None,
                        routed_experts=payloads.ref(r.routed_experts),
                    )
                    for r in results
                ],
                usage=UsageInfo.of(prompt_len, completion_tokens),
            ),
            payloads,
        )

    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    continuous = bool(req.stream_options and req.stream_options.continuous_usage_stats)
    generated: dict[int, int] = {}

    def render(d: ChoiceDelta) -> Iterable[str | bytes]:
        generated[d.index] = generated.get(d.index, 0) + len(d.token_ids)
        if not d.token_ids and not d.last and not (token_ids_on and d.first):
            return ()
        chunk = GenerateStreamResponse(
            request_id=request_id,
            choices=[
                GenerateResponseChoice(
                    index=d.index,
                    logprobs=logprobs(d.logprobs),
                    finish_reason=d.finish_reason,
                    token_ids=d.token_ids,
                    prompt_token_ids=prompt.ids if token_ids_on and d.first else None,
                    routed_experts=payloads.ref(d.routed_experts),
                )
            ],
        )
        if continuous:
            g = generated[d.index]
            chunk.usage = UsageInfo.of(prompt_len, g)
        return (payloads.sse(chunk),)

    def finish() -> Iterable[str]:
        if not include_usage:
            return ()
        g = sum(generated.values())
        chunk = GenerateStreamResponse(
            request_id=request_id, choices=[],
            usage=UsageInfo.of(prompt_len, g),
        )
        return (sse_event(chunk.model_dump_json()),)

    return await ctx.stream(group, raw, render, finish)
