"""POST /inference/v1/generate: tokens in, tokens out (vLLM's disaggregated-serving API).

``sampling_params.prompt_logprobs`` fills the response's top-level
``prompt_logprobs`` (as vLLM; one prompt, so one list for every choice); when
streaming, it rides once on the first chunk that has it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import Request
from starlette.responses import Response

from .bounded import dump_list, off_loop
from .generation import ChoiceDelta, ChoiceResult, PromptScores, TokenLogprob
from .logprobs_format import PROMPT_LOGPROBS, chat_logprobs, prompt_logprobs
from .prompts import TokenIdsPrompt
from .protocol import (
    ChatCompletionLogProbs,
    GenerateRequest,
    GenerateResponse,
    GenerateResponseChoice,
    GenerateSamplingParams,
    GenerateStreamResponse,
    PromptLogprobs,
    UsageInfo,
    now,
    random_id,
)
from .responses import Responder
from .serving import ChoiceStream, Finished, GenerationPlan, ServingContext


async def create_generate(ctx: ServingContext, req: GenerateRequest, raw: Request) -> Response:
    """Prepare -> plan -> run -> respond."""
    replay_param = _adopt_top_level_fields(req)
    plan = _plan(req, replay_param)
    outcome = await ctx.generate(plan, raw)
    return await _GenerateResponder(ctx, plan, outcome, req.sampling_params).respond()


def _adopt_top_level_fields(req: GenerateRequest) -> str:
    """Move the top-level routing and cache fields into ``sampling_params`` where it has none (vLLM puts some at
    the top level, others in sampling_params: both are read). Returns the name that errors about the replayed
    routing give it: where it was found."""
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
    return replay_param


def _plan(req: GenerateRequest, replay_param: str) -> GenerationPlan:
    sp = req.sampling_params
    return GenerationPlan(
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


class _GenerateResponder(Responder):
    """vLLM's generate objects: token ids, no text; the prompt logprobs once, at the top level (streamed, on the
    first chunk that has them)."""

    def __init__(self, ctx: ServingContext, plan: GenerationPlan, outcome: Finished | ChoiceStream,
                 sp: GenerateSamplingParams) -> None:
        super().__init__(ctx, plan, outcome)
        self.sp = sp
        self.heavy = sp.logprobs is not None or sp.prompt_logprobs is not None
        self.top_n = max(sp.logprobs or 0, 1)
        self.prompt_ids = outcome.prompts[0].ids
        self.prompt_sent = False  # streaming: the prompt logprobs went out

    def _logprobs(self, lps: list[TokenLogprob] | None) -> ChatCompletionLogProbs | None:
        return chat_logprobs(lps, self.ctx.tokenizer, self.top_n, as_ids=True) if lps is not None else None

    def _scores(self, s: PromptScores | None) -> PromptLogprobs | None:
        if self.sp.prompt_logprobs is None:
            return None
        tokenizer = self.ctx.tokenizer if self.sp.detokenize else None
        return prompt_logprobs(self.prompt_ids, s, tokenizer, self.sp.prompt_logprobs)

    def _raw_scores(self, scores: PromptLogprobs | None) -> str | None:
        """The placeholder of the serialised prompt logprobs (spliced into the JSON as they are)."""
        return self.payloads.raw(None if scores is None else dump_list(PROMPT_LOGPROBS, scores))

    def _choice(self, x: ChoiceResult | ChoiceDelta, with_prompt_ids: bool) -> GenerateResponseChoice:
        return GenerateResponseChoice(
            index=x.index,
            logprobs=self._logprobs(x.logprobs),
            finish_reason=x.finish_reason,
            token_ids=x.token_ids,
            prompt_token_ids=self.prompt_ids if self.token_ids_on and with_prompt_ids else None,
            **self.end_fields(x),
        )

    def render(self, finished: Finished) -> list[bytes]:
        scores = self._scores(finished.results[0].prompt_logprobs) if finished.results else None
        response = GenerateResponse(
            request_id=self.plan.request_id,
            model=self.model_name,
            created=now(),
            choices=[self._choice(r, True) for r in finished.results],
            usage=finished.usage,
        )
        response.prompt_logprobs = self._raw_scores(scores)
        return self.payloads.dump_parts(response)

    async def chunks(self, d: ChoiceDelta) -> AsyncIterator[GenerateStreamResponse]:
        if not d.token_ids and not d.last and not (self.token_ids_on and d.first):
            return
        chunk = self.chunk([self._choice(d, d.first)])
        if d.prompt_logprobs is not None and not self.prompt_sent:
            chunk.prompt_logprobs = self._raw_scores(await off_loop(self._scores, d.prompt_logprobs))
            self.prompt_sent = True
        yield chunk

    def chunk(self, choices: list[GenerateResponseChoice], usage: UsageInfo | None = None) -> GenerateStreamResponse:
        return GenerateStreamResponse(request_id=self.plan.request_id, choices=choices, usage=usage)
