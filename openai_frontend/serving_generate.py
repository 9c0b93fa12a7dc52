"""POST /inference/v1/generate: tokens in, tokens out (vLLM's disaggregated-serving API).

``sampling_params.prompt_logprobs`` fills the response's top-level
``prompt_logprobs`` (as vLLM; one prompt, so one list for every choice); when
streaming, it rides once on the first chunk that has it.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator

from fastapi import Request
from starlette.responses import Response

from .bounded import dump_list, json_body, off_loop
from .logprobs_format import PROMPT_LOGPROBS, chat_logprobs, prompt_logprobs
from .prompts import TokenIdsPrompt
from .protocol import (
    GenerateRequest,
    GenerateResponse,
    GenerateResponseChoice,
    GenerateStreamResponse,
    now,
    random_id,
)
from .responses import sse_response
from .routing_codec import Payloads
from .serving import Finished, GenerationPlan, ServingContext


async def create_generate(ctx: ServingContext, req: GenerateRequest, raw: Request) -> Response:
    sp = req.sampling_params
    if sp.return_routed_experts is None and req.return_routed_experts is not None:
        sp.return_routed_experts = req.return_routed_experts  # the top-level switch, when sampling_params has none
    if not sp.return_routed_weights and req.return_routed_weights:
        sp.return_routed_weights = True
    if sp.cache_salt is None and req.cache_salt is not None:
        sp.cache_salt = req.cache_salt  # vLLM's place for it is the top level
    replay_param = "sampling_params.replay_routed_experts"
    if sp.replay_routed_experts is None and req.replay_routed_experts is not None:
        sp.replay_routed_experts, replay_param = req.replay_routed_experts, "replay_routed_experts"
    plan = GenerationPlan(
        request_id=req.request_id or random_id("gen"),
        model=req.model,
        prompts=TokenIdsPrompt(req.token_ids),
        n=sp.n,
        options=sp,
        max_tokens=sp.max_tokens,
        stream=req.stream,
        stream_options=req.stream_options,
        logprobs=sp.logprobs,
        detokenize=False,  # token ids only; text is decoded internally only to match stop strings
        prompt_logprobs=sp.prompt_logprobs,
        n_param="sampling_params.n",
        logprobs_param="sampling_params.logprobs",
        max_tokens_param="sampling_params.max_tokens",
        prompt_logprobs_param="sampling_params.prompt_logprobs",
        replay_param=replay_param,
        prompt_logprobs_per_choice=False,  # one top-level list (the response has one prompt)
    )
    model_name = ctx.cfg.served_model_name
    token_ids_on = bool(sp.return_token_ids)
    top_n = max(sp.logprobs or 0, 1)
    payloads = Payloads()
    outcome = await ctx.generate(plan, raw)
    prompt_ids = outcome.prompts[0].ids

    def logprobs(lps):  # noqa: ANN001, ANN202
        return chat_logprobs(lps, ctx.tokenizer, top_n, as_ids=True) if lps is not None else None

    def scores(s):  # noqa: ANN001, ANN202 - PromptScores | None
        tokenizer = ctx.tokenizer if sp.detokenize else None
        return prompt_logprobs(prompt_ids, s, tokenizer, sp.prompt_logprobs) if sp.prompt_logprobs is not None else None

    def render(outcome: Finished) -> list[bytes]:
        p_json = scores(outcome.results[0].prompt_logprobs) if outcome.results else None
        response = GenerateResponse(
            request_id=plan.request_id,
            model=model_name,
            created=now(),
            choices=[
                GenerateResponseChoice(
                    index=r.index,
                    logprobs=logprobs(r.logprobs),
                    finish_reason=r.finish_reason,
                    token_ids=r.token_ids,
                    prompt_token_ids=prompt_ids if token_ids_on else None,
                    routed_experts=payloads.ref(r.routed_experts),
                    routed_weights=payloads.ref(r.routed_weights),
                    weight_version=r.weight_version,
                )
                for r in outcome.results
            ],
            usage=outcome.usage,
        )
        response.prompt_logprobs = payloads.raw(None if p_json is None else dump_list(PROMPT_LOGPROBS, p_json))
        return payloads.dump_parts(response)

    if isinstance(outcome, Finished):  # with logprobs: built in a worker (bounded.py)
        return await json_body(lambda: render(outcome), heavy=sp.logprobs is not None or sp.prompt_logprobs is not None)

    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    continuous = bool(req.stream_options and req.stream_options.continuous_usage_stats)

    prompt_sent = False

    async def events() -> AsyncGenerator[bytes, None]:
        nonlocal prompt_sent
        async for d in outcome:
            if not d.token_ids and not d.last and not (token_ids_on and d.first):
                continue
            chunk = GenerateStreamResponse(
                request_id=plan.request_id,
                choices=[
                    GenerateResponseChoice(
                        index=d.index,
                        logprobs=logprobs(d.logprobs),
                        finish_reason=d.finish_reason,
                        token_ids=d.token_ids,
                        prompt_token_ids=prompt_ids if token_ids_on and d.first else None,
                        routed_experts=payloads.ref(d.routed_experts),
                        routed_weights=payloads.ref(d.routed_weights),
                        weight_version=d.weight_version,
                    )
                ],
            )
            if d.prompt_logprobs is not None and not prompt_sent:
                p_json = await off_loop(scores, d.prompt_logprobs)
                chunk.prompt_logprobs = payloads.raw(None if p_json is None else dump_list(PROMPT_LOGPROBS, p_json))
                prompt_sent = True
            if continuous:
                chunk.usage = outcome.usage.choice(d.index)
            yield payloads.sse(chunk)
        if include_usage:
            yield payloads.sse(GenerateStreamResponse(request_id=plan.request_id, choices=[],
                                                      usage=outcome.usage.total()))

    return sse_response(events(), on_close=outcome.aclose, on_disconnect=outcome.client_disconnected,
                        preamble=outcome.preamble)
