"""POST /v1/completions: the body -> a plan; the outcome -> OpenAI's completion objects.

Prompt scoring: ``prompt_logprobs`` (vLLM's field and format, on each choice)
and ``echo`` with ``logprobs`` (OpenAI's legacy format: the prompt's tokens
first, the first with null logprobs) both come from the engine's prompt
logprobs, computed in the prefill; as in vLLM, echo + logprobs N asks for
prompt logprobs N too.  Streaming: the echoed prompt (text and logprobs) and
``prompt_logprobs`` go out on the chunk that carries the choice's first token.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator

from fastapi import Request
from starlette.responses import Response

from .bounded import dump_list, json_body, off_loop
from .logprobs_format import PROMPT_LOGPROBS, completion_logprobs, echo_logprobs, join_logprobs, prompt_logprobs
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
from .responses import sse_response
from .routing_codec import Payloads
from .serving import Finished, GenerationPlan, ServingContext


async def create_completion(ctx: ServingContext, req: CompletionRequest, raw: Request) -> Response:
    echo_lp = req.echo and req.logprobs is not None
    shown_prompt_n = req.prompt_logprobs if req.prompt_logprobs is not None else req.logprobs if echo_lp else None
    engine_prompt_n = max(req.prompt_logprobs or 0, req.logprobs or 0) if shown_prompt_n is not None else None
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
        prompt_logprobs=engine_prompt_n,
        prompt_logprobs_param="prompt_logprobs" if req.prompt_logprobs is not None else "logprobs",
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

    def scores(p: PromptInput, s):  # noqa: ANN001, ANN202 - PromptScores | None
        return prompt_logprobs(p.ids, s, ctx.tokenizer, shown_prompt_n) if shown_prompt_n is not None else None

    # vLLM's format repeats a prompt's logprobs on each of its choices: built and serialised once per prompt
    # (bounded.py), spliced into each.
    prompt_json: dict[int, bytes | None] = {}

    def scores_json(p_idx: int, s) -> bytes | None:  # noqa: ANN001 - PromptScores | None
        if p_idx not in prompt_json:
            value = scores(prompts[p_idx], s)
            prompt_json[p_idx] = None if value is None else dump_list(PROMPT_LOGPROBS, value)
        return prompt_json[p_idx]

    def render(outcome: Finished) -> list[bytes]:
        choices = []
        for r in outcome.results:
            prompt = prompts[r.index // n]
            prefix = echo_text(prompt) if req.echo else ""
            logprobs = None
            if r.logprobs is not None:
                logprobs, _ = completion_logprobs(r.logprobs, ctx.tokenizer, top_n, len(prefix), as_ids=as_ids)
                if echo_lp:
                    logprobs = join_logprobs(echo_logprobs(prompt.ids, r.prompt_logprobs, ctx.tokenizer, top_n,
                                                           as_ids=as_ids), logprobs)
            choice = CompletionResponseChoice(
                index=r.index,
                text=prefix + r.text,
                logprobs=logprobs,
                finish_reason=r.finish_reason,
                stop_reason=r.stop_reason,
                token_ids=r.token_ids if token_ids_on else None,
                prompt_token_ids=prompt.ids if token_ids_on else None,
                routed_experts=payloads.ref(r.routed_experts),
                routed_weights=payloads.ref(r.routed_weights),
                weight_version=r.weight_version,
            )
            choice.prompt_logprobs = payloads.raw(scores_json(r.index // n, r.prompt_logprobs))
            choices.append(choice)
        return payloads.dump_parts(CompletionResponse(id=plan.request_id, created=created, model=model_name,
                                                choices=choices, usage=outcome.usage))

    if isinstance(outcome, Finished):  # with logprobs: built in a worker (bounded.py)
        return await json_body(lambda: render(outcome), heavy=req.logprobs is not None or shown_prompt_n is not None)

    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    continuous = bool(req.stream_options and req.stream_options.continuous_usage_stats)
    offsets: dict[int, int] = {}  # text offset of each choice's next logprob token
    echoed: set[int] = set()  # choices whose prompt went out

    async def events() -> AsyncGenerator[bytes, None]:
        async for d in outcome:
            prompt = prompts[d.index // n]
            text = d.text
            echo_now = (req.echo and d.index not in echoed
                        and (engine_prompt_n is None or d.prompt_logprobs is not None or d.last))
            if echo_now:  # with prompt logprobs, on the delta that carries them (the first token's)
                echoed.add(d.index)
                text = echo_text(prompt) + text
            if not (text or d.last or d.logprobs or d.prompt_logprobs is not None
                    or (token_ids_on and d.token_ids) or (d.first and token_ids_on)):
                continue
            logprobs = None
            if d.logprobs is not None:
                start = offsets.get(d.index, 0) + len(text) - len(d.text)  # past the echoed prompt, if here
                logprobs, offsets[d.index] = completion_logprobs(d.logprobs, ctx.tokenizer, top_n, start,
                                                                 as_ids=as_ids)
                if echo_now and echo_lp:
                    logprobs = join_logprobs(echo_logprobs(prompt.ids, d.prompt_logprobs, ctx.tokenizer, top_n,
                                                           as_ids=as_ids), logprobs)
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
                        routed_weights=payloads.ref(d.routed_weights),
                        weight_version=d.weight_version,
                    )
                ],
            )
            if d.prompt_logprobs is not None:  # built once per prompt, in a worker
                p_json = await off_loop(scores_json, d.index // n, d.prompt_logprobs)
                chunk.choices[0].prompt_logprobs = payloads.raw(p_json)
            if continuous:
                chunk.usage = outcome.usage.choice(d.index)
            yield payloads.sse(chunk)
        if include_usage:
            yield payloads.sse(CompletionStreamResponse(id=plan.request_id, created=created, model=model_name,
                                                        choices=[], usage=outcome.usage.total()))

    return sse_response(events(), on_close=outcome.aclose, on_disconnect=outcome.client_disconnected,
                        preamble=outcome.preamble)
