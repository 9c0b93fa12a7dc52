"""Response models: OpenAI's API plus vLLM's extensions (routed experts and weights, prompt logprobs).

Split from :mod:`.protocol` (the requests), which re-exports every name here,
so ``from .protocol import CompletionResponse`` keeps working.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_serializer


class _Base(BaseModel):
    model_config = ConfigDict(extra="ignore", protected_namespaces=())


class PromptTokenUsageInfo(_Base):
    """OpenAI's / vLLM's ``usage.prompt_tokens_details``: prompt tokens served from the prefix cache."""

    cached_tokens: int = 0


class UsageInfo(_Base):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    # with --enable-prompt-tokens-details only (vLLM's flag); left out of the JSON otherwise
    prompt_tokens_details: PromptTokenUsageInfo | None = None

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> "UsageInfo":
        details = None if cached_tokens is None else PromptTokenUsageInfo(cached_tokens=cached_tokens)
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens, prompt_tokens_details=details)

    @model_serializer(mode="wrap")
    def _details_only_when_set(self, handler):
        out = handler(self)
        if out.get("prompt_tokens_details") is None:
            out.pop("prompt_tokens_details", None)
        return out


class CompletionLogProbs(_Base):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class PromptLogprob(_Base):
    """vLLM's ``Logprob``: one token's entry in a ``prompt_logprobs`` position (rank: 1 = most likely)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# vLLM's format: None for the first prompt token; then {token_id: PromptLogprob} holding the prompt token and
# the top N at each position.
PromptLogprobs = list[dict[int, PromptLogprob] | None]


class CompletionResponseChoice(_Base):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None
    prompt_logprobs: PromptLogprobs | None = None
    prompt_token_ids: list[int] | None = None
    routed_experts: str | None = None
    routed_weights: str | None = None
    weight_version: str | None = None  # the weights that produced the choice (on its last chunk when streaming)


class CompletionResponse(_Base):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None


class CompletionResponseStreamChoice(CompletionResponseChoice):
    """A streamed choice carries the same fields (deltas; routed_experts on the choice's last chunk)."""


class CompletionStreamResponse(_Base):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionResponseStreamChoice]
    usage: UsageInfo | None = None


class ChatCompletionLogProb(_Base):
    token: str
    logprob: float = -9999.0
    bytes: list[int] | None = None


class ChatCompletionLogProbsContent(ChatCompletionLogProb):
    top_logprobs: list[ChatCompletionLogProb] = Field(default_factory=list)


class ChatCompletionLogProbs(_Base):
    content: list[ChatCompletionLogProbsContent] | None = None


class ChatResponseMessage(_Base):
    role: str = "assistant"
    content: str | None = None
    tool_calls: list[dict[str, Any]] = Field(default_factory=list)


class ChatCompletionResponseChoice(_Base):
    index: int
    message: ChatResponseMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None
    routed_experts: str | None = None
    routed_weights: str | None = None
    weight_version: str | None = None  # the weights that produced the choice


class ChatCompletionResponse(_Base):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo
    prompt_token_ids: list[int] | None = None
    system_fingerprint: str | None = None


class DeltaMessage(_Base):
    """A streamed chat delta; unset fields are left out (``{}`` on the last chunk)."""

    role: str | None = None
    content: str | None = None

    @model_serializer(mode="wrap")
    def _drop_none(self, handler):
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatCompletionResponseStreamChoice(_Base):
    index: int
    delta: DeltaMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None
    routed_experts: str | None = None
    routed_weights: str | None = None
    weight_version: str | None = None  # on the choice's last chunk


class ChatCompletionStreamResponse(_Base):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionResponseStreamChoice]
    usage: UsageInfo | None = None


class GenerateResponseChoice(_Base):
    index: int
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = "stop"
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None
    routed_experts: str | None = None
    routed_weights: str | None = None
    weight_version: str | None = None  # the weights that produced the choice (on its last chunk when streaming)


class GenerateResponse(_Base):
    request_id: str
    model: str
    created: int
    choices: list[GenerateResponseChoice]
    usage: UsageInfo
    prompt_logprobs: PromptLogprobs | None = None  # one prompt, shared by the choices (as vLLM)
    kv_transfer_params: None = None


class GenerateStreamResponse(_Base):
    request_id: str
    choices: list[GenerateResponseChoice]
    usage: UsageInfo | None = None
    prompt_logprobs: PromptLogprobs | None = None  # extension: once, on the first chunk that has them
