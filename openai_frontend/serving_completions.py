"""POST /v1/completions: the body -> a plan; the outcome -> OpenAI's completion objects.

Prompt scoring: ``prompt_logprobs`` (vLLM's field and format, on each choice)
and ``echo`` with ``logprobs`` (OpenAI's legacy format: the prompt's tokens
first, the first with null logprobs) both come from the engine's prompt
logprobs, computed in the prefill; as in vLLM, echo + logprobs N asks for
prompt logprobs N too.  Streaming: the echoed prompt (text and logprobs) and
``prompt_logprobs`` go out on the chunk that carries the choice's first token.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import Request
from starlette.responses import Response

from .bounded import dump_list, off_loop
from .generation import ChoiceDelta, ChoiceResult, PromptScores, TokenLogprob
from .logprobs_format import PROMPT_LOGPROBS, completion_logprobs, echo_logprobs, join_logprobs, prompt_logprobs
from .prompts import CompletionPrompts, PromptInput
from .protocol import (
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionResponseStreamChoice,
    CompletionStreamResponse,
    PromptLogprobs,
    UsageInfo,
    now,
    random_id,
)
from .responses import Responder
from .serving import ChoiceStream, Finished, GenerationPlan, ServingContext


async def create_completion(ctx: ServingContext, req: CompletionRequest, raw: Request) -> Response:
    """Plan -> run -> respond (serving validates the body: nothing here is only the completions')."""
    plan = _plan(req)
    created = now()  # the response's timestamp: when the request came
    outcome = await ctx.generate(plan, raw)
    return await _CompletionResponder(ctx, plan, outcome, req, created).respond()


def _prompt_logprobs_n(req: CompletionRequest) -> tuple[int | None, int | None]:
    """(top-N of the prompt logprobs the response shows, top-N the engine computes); None: none.

    ``prompt_logprobs`` shows its own N; echo + logprobs N shows N in OpenAI's format. The engine computes the
    larger, once, for both.
    """
    echo_lp = req.echo and req.logprobs is not None
    shown = req.prompt_logprobs if req.prompt_logprobs is not None else req.logprobs if echo_lp else None
    engine = max(req.prompt_logprobs or 0, req.logprobs or 0) if shown is not None else None
    return shown, engine


def _plan(req: CompletionRequest) -> GenerationPlan:
    return GenerationPlan(
        request_id=random_id("cmpl"),
        model=req.model,
        prompts=CompletionPrompts(req),
        n=req.n,
        options=req,
        max_tokens=req.max_tokens,
        stream=req.stream,
        stream_options=req.stream_options,
        logprobs=req.logprobs,
        prompt_logprobs=_prompt_logprobs_n(req)[1],
        prompt_logprobs_param="prompt_logprobs" if req.prompt_logprobs is not None else "logprobs",
    )


class _CompletionResponder(Responder):
    """Completion objects: choice i is of prompt i // n; with ``echo`` its text (and logprobs) start with the
    prompt's. Streamed, the echoed prompt goes out on the choice's first chunk, or with prompt logprobs on the
    chunk that carries them (the first token's)."""

    def __init__(self, ctx: ServingContext, plan: GenerationPlan, outcome: Finished | ChoiceStream,
                 req: CompletionRequest, created: int) -> None:
        super().__init__(ctx, plan, outcome)
        self.req = req
        self.created = created
        self.shown_prompt_n, self.engine_prompt_n = _prompt_logprobs_n(req)
        self.heavy = req.logprobs is not None or self.shown_prompt_n is not None
        self.echo_lp = req.echo and req.logprobs is not None
        self.top_n = req.logprobs or 0
        self.as_ids = bool(req.return_tokens_as_token_ids)
        self.prompts = outcome.prompts
        # vLLM's format repeats a prompt's logprobs on each of its choices: built and serialised once per prompt
        # (bounded.py), spliced into each.
        self.prompt_json: dict[int, bytes | None] = {}
        # Streaming: the text offset of each choice's next logprob token; the choices whose prompt went out.
        self.offsets: dict[int, int] = {}
        self.echoed: set[int] = set()

    def _echo_text(self, p: PromptInput) -> str:
        if p.text is not None:
            return p.text
        return self.ctx.tokenizer.decode(p.ids, skip_special_tokens=self.req.skip_special_tokens)

    def _scores(self, p: PromptInput, s: PromptScores | None) -> PromptLogprobs | None:
        if self.shown_prompt_n is None:
            return None
        return prompt_logprobs(p.ids, s, self.ctx.tokenizer, self.shown_prompt_n)

    def _scores_json(self, p_idx: int, s: PromptScores | None) -> bytes | None:
        if p_idx not in self.prompt_json:
            value = self._scores(self.prompts[p_idx], s)
            self.prompt_json[p_idx] = None if value is None else dump_list(PROMPT_LOGPROBS, value)
        return self.prompt_json[p_idx]

    def _logprobs(self, lps: list[TokenLogprob], start: int, prompt: PromptInput, scores: PromptScores | None,
                  echo: bool) -> tuple[CompletionLogProbs, int]:
        """The tokens' logprobs from text offset ``start`` (after the offset past them); with ``echo`` (and
        logprobs asked with echo) the prompt's go first."""
        logprobs, end = completion_logprobs(lps, self.ctx.tokenizer, self.top_n, start, as_ids=self.as_ids)
        if echo and self.echo_lp:
            logprobs = join_logprobs(echo_logprobs(prompt.ids, scores, self.ctx.tokenizer, self.top_n,
                                                   as_ids=self.as_ids), logprobs)
        return logprobs, end

    def _choice(self, cls: type[CompletionResponseChoice | CompletionResponseStreamChoice],
                x: ChoiceResult | ChoiceDelta, prompt: PromptInput, text: str, logprobs: CompletionLogProbs | None,
                with_prompt_ids: bool) -> CompletionResponseChoice | CompletionResponseStreamChoice:
        return cls(
            index=x.index,
            text=text,
            logprobs=logprobs,
            finish_reason=x.finish_reason,
            stop_reason=x.stop_reason,
            token_ids=x.token_ids if self.token_ids_on else None,
            prompt_token_ids=prompt.ids if self.token_ids_on and with_prompt_ids else None,
            **self.end_fields(x),
        )

    def render(self, finished: Finished) -> list[bytes]:
        choices = []
        for r in finished.results:
            prompt = self.prompts[r.index // self.req.n]
            prefix = self._echo_text(prompt) if self.req.echo else ""
            logprobs = None
            if r.logprobs is not None:
                logprobs, _ = self._logprobs(r.logprobs, len(prefix), prompt, r.prompt_logprobs, echo=True)
            choice = self._choice(CompletionResponseChoice, r, prompt, prefix + r.text, logprobs, True)
            choice.prompt_logprobs = self.payloads.raw(self._scores_json(r.index // self.req.n, r.prompt_logprobs))
            choices.append(choice)
        return self.payloads.dump_parts(CompletionResponse(id=self.plan.request_id, created=self.created,
                                                           model=self.model_name, choices=choices,
                                                           usage=finished.usage))

    async def chunks(self, d: ChoiceDelta) -> AsyncIterator[CompletionStreamResponse]:
        prompt = self.prompts[d.index // self.req.n]
        text = d.text
        echo_now = (self.req.echo and d.index not in self.echoed
                    and (self.engine_prompt_n is None or d.prompt_logprobs is not None or d.last))
        if echo_now:  # with prompt logprobs, on the delta that carries them (the first token's)
            self.echoed.add(d.index)
            text = self._echo_text(prompt) + text
        if not (text or d.last or d.logprobs or d.prompt_logprobs is not None
                or (self.token_ids_on and d.token_ids) or (d.first and self.token_ids_on)):
            return
        logprobs = None
        if d.logprobs is not None:
            start = self.offsets.get(d.index, 0) + len(text) - len(d.text)  # past the echoed prompt, if here
            logprobs, self.offsets[d.index] = self._logprobs(d.logprobs, start, prompt, d.prompt_logprobs,
                                                             echo=bool(echo_now))
        chunk = self.chunk([self._choice(CompletionResponseStreamChoice, d, prompt, text, logprobs, d.first)])
        if d.prompt_logprobs is not None:  # built once per prompt, in a worker
            p_json = await off_loop(self._scores_json, d.index // self.req.n, d.prompt_logprobs)
            chunk.choices[0].prompt_logprobs = self.payloads.raw(p_json)
        yield chunk

    def chunk(self, choices: list[CompletionResponseStreamChoice],
               usage: UsageInfo | None = None) -> CompletionStreamResponse:
        return CompletionStreamResponse(id=self.plan.request_id, created=self.created, model=self.model_name,
                                        choices=choices, usage=usage)
