"""POST /v1/chat/completions."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from fastapi import Request
from starlette.responses import Response

from .errors import BadRequestError
from .generation import ChoiceDelta
from .http_utils import sse_event
from .logprobs_format import chat_logprobs
from .protocol import (
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
from .serving import Payloads, Plan, PromptInput, ServingContext, json_response
from .tokenizer import ChatTemplate, ChatTemplateError


def _messages(req: ChatCompletionRequest) -> list[dict[str, Any]]:
    """Messages as the template sees them; text parts joined into one string."""
    out = []
    for i, m in enumerate(req.messages):
        msg = m.model_dump(exclude_none=True)
        if isinstance(m.content, list):
            texts = []
            for j, part in enumerate(m.content):
                if part.type not in ("text", "input_text") or part.text is None:
                    raise BadRequestError(
                        f"Content part type {part.type!r} is not supported (text only).",
                        param=f"messages[{i}].content[{j}]",
                    )
                texts.append(part.text)
            msg["content"] = "\n".join(texts)
        elif m.content is None:
            msg["content"] = ""
        out.append(msg)
    return out


def render_prompt(ctx: ServingContext, req: ChatCompletionRequest) -> PromptInput:
    tok = ctx.tokenizer
    template = tok.chat_template
    if req.chat_template is not None:
        try:
            template = ChatTemplate(req.chat_template, tok.bos_token, tok.eos_token)
        except ChatTemplateError as e:
            raise BadRequestError(str(e), param="chat_template") from e
    if template is None:
        raise BadRequestError("The model has no chat template; pass `chat_template` or use /v1/completions.",
                              param="messages")
    if req.continue_final_message and req.add_generation_prompt and "add_generation_prompt" in req.model_fields_set:
        raise BadRequestError("continue_final_message and add_generation_prompt cannot both be true.",
                              param="continue_final_message")
    try:
        text = template.render(
            _messages(req),
            add_generation_prompt=req.add_generation_prompt,
            continue_final_message=req.continue_final_message,
            tools=req.tools,
            extra=req.chat_template_kwargs,
        )
    except ChatTemplateError as e:
        raise BadRequestError(f"Chat template error: {e}", param="messages") from e
    return PromptInput(ids=tok.encode(text, add_special_tokens=req.add_special_tokens), text=text)


def _check(ctx: ServingContext, req: ChatCompletionRequest) -> None:
    ctx.check_model(req.model)
    if req.stream_options is not None and not req.stream:
        raise BadRequestError("stream_options can only be set when stream is true.", param="stream_options")
    if req.top_logprobs and not req.logprobs:
        raise BadRequestError("top_logprobs requires logprobs to be true.", param="top_logprobs")
    ctx.check_logprobs(req.top_logprobs, "top_logprobs")
    ctx.check_choice_count(req.n)


async def create_chat_completion(ctx: ServingContext, req: ChatCompletionRequest, raw: Request) -> Response:
    _check(ctx, req)
    ctx.model_info()
    prompt = render_prompt(ctx, req)
    if req.max_completion_tokens is not None:
        max_tokens, max_param = req.max_completion_tokens, "max_completion_tokens"
    else:
        max_tokens, max_param = req.max_tokens, "max_tokens"
    top_n = req.top_logprobs or 0
    plan = Plan(
        prompts=[prompt],
        sampling=req,
        max_tokens=max_tokens,
        stream=req.stream,
        logprobs=top_n if req.logprobs else None,
        skip_special_tokens=req.skip_special_tokens,
        prompt_param="messages",
        max_tokens_param=max_param,
    )
    request_id = random_id("chatcmpl")
    created = now()
    model_name = ctx.cfg.served_model_name
    group = ctx.build_group(plan, request_id, n=req.n)
    token_ids_on = bool(req.return_token_ids)
    as_ids = bool(req.return_tokens_as_token_ids)
    prompt_len = len(prompt.ids)
    payloads = Payloads()

    if not req.stream:
        results = await ctx.run_to_end(group, raw)
        choices = [
            ChatCompletionResponseChoice(
                index=r.index,
                message=ChatResponseMessage(role="assistant", content=r.text),
                logprobs=chat_logprobs(r.logprobs, ctx.tokenizer, top_n, as_ids=as_ids)
                if r.logprobs is not None else None,
                finish_reason=r.finish_reason,
                stop_reason=r.stop_reason,
                token_ids=r.token_ids if token_ids_on else None,
                prompt_token_ids=prompt.ids if token_ids_on else None,
                routed_experts=payloads.ref(r.routed_experts),
            )
            for r in results
        ]
        completion_tokens = sum(len(r.token_ids) for r in results)
        return json_response(
            ChatCompletionResponse(
                id=request_id,
                created=created,
                model=model_name,
                choices=choices,
                usage=UsageInfo.of(prompt_len, completion_tokens),
                prompt_token_ids=prompt.ids if token_ids_on else None,
            ),
            payloads,
        )

    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    continuous = bool(req.stream_options and req.stream_options.continuous_usage_stats)
    generated: dict[int, int] = {}

    def chunk(choice: ChatCompletionResponseStreamChoice, index: int) -> bytes:
        c = ChatCompletionStreamResponse(id=request_id, created=created, model=model_name, choices=[choice])
        if continuous:
            g = generated.get(index, 0)
            c.usage = UsageInfo.of(prompt_len, g)
        return payloads.sse(c)

    def render(d: ChoiceDelta) -> Iterable[bytes]:
        out = []
        generated[d.index] = generated.get(d.index, 0) + len(d.token_ids)
        if d.first:
            out.append(chunk(ChatCompletionResponseStreamChoice(
                index=d.index,
                delta=DeltaMessage(role="assistant", content=""),
                logprobs=None,
                finish_reason=None,
                **({"prompt_token_ids": prompt.ids} if token_ids_on else {}),
            ), d.index))
        if d.text or d.last or d.logprobs or (token_ids_on and d.token_ids):
            fields: dict[str, Any] = {}
            if token_ids_on:
                fields["token_ids"] = d.token_ids
            if d.last:
                fields["stop_reason"] = d.stop_reason
                fields["routed_experts"] = payloads.ref(d.routed_experts)
            out.append(chunk(ChatCompletionResponseStreamChoice(
                index=d.index,
                delta=DeltaMessage(content=d.text) if d.text else DeltaMessage(),
                logprobs=chat_logprobs(d.logprobs, ctx.tokenizer, top_n, as_ids=as_ids) if d.logprobs else None,
                finish_reason=d.finish_reason,
                **fields,
            ), d.index))
        return out

    def finish() -> Iterable[str]:
        if not include_usage:
            return ()
        g = sum(generated.values())
        c = ChatCompletionStreamResponse(
            id=request_id, created=created, model=model_name, choices=[],
            usage=UsageInfo.of(prompt_len, g),
        )
        return (sse_event(c.model_dump_json()),)

    return await ctx.stream(group, raw, render, finish)
