"""Request and response models: OpenAI's API plus vLLM's extensions.

Unknown request fields are ignored (as vLLM does), so clients that send
vLLM-only knobs keep working.  Known fields whose semantics this server does
not implement are accepted only at their neutral value; anything else is a
400 that names the field, never a silent no-op.

Requests and responses stay in this one file (about 450 lines, as vLLM keeps
its ``protocol.py``) so the whole wire format reads in one place.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, field_validator, model_serializer, model_validator

INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1
INT32_MAX = 2**31 - 1


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


class _Base(BaseModel):
    model_config = ConfigDict(extra="ignore", protected_namespaces=())


class InvalidUnicodeError(ValueError):
    """A string of the request holds a lone surrogate (JSON "\\ud800"): it cannot be tokenized nor encoded."""

    def __init__(self, param: str) -> None:
        super().__init__(f"`{param}` contains invalid Unicode (a lone surrogate)")
        self.param = param


def check_unicode(value: Any, path: str = "") -> None:
    """Raise :class:`InvalidUnicodeError` naming the first string (or key) that is not valid Unicode."""
    if isinstance(value, str):
        if not value.isascii():
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                raise InvalidUnicodeError(path) from None
    elif isinstance(value, dict):
        for k, v in value.items():
            if isinstance(k, str):
                check_unicode(k, path)
            check_unicode(v, f"{path}.{k}" if path else str(k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            if type(v) is not int:  # long token-id lists: skip the common case fast
                check_unicode(v, f"{path}[{i}]")


class _ValidUnicode(_Base):
    """Request bodies: every string, ids and names included, must be valid Unicode (400 otherwise)."""

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        check_unicode(data)
        return data


def _unsupported(name: str, neutral: Any):
    """A field validator accepting only the neutral value of an unimplemented knob."""

    def check(cls, v):  # noqa: ANN001
        if v is None or v == neutral:
            return v
        raise ValueError(f"`{name}` is not supported by this server (only {neutral!r} is accepted)")

    return field_validator(name)(check)


def _check_top_k(v: int | None) -> int | None:
    if v is None or v == -1 or v >= 0:
        return v
    raise ValueError("top_k must be -1 or 0 (disabled) or a positive integer")


class StreamOptions(_Base):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class GenerationRequestFields(_ValidUnicode):
    """Body fields shared by all three generation endpoints: sampling, stop rules, output and routing options.

    Serving turns them into a :class:`~.triton_client.BackendRequest`; the
    backend builds the engine's ``moe_engine.sampling.SamplingParams`` from that.
    """

    n: int = Field(1, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=1e4)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, le=INT32_MAX)
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    stop: str | list[str] | None = None
    stop_token_ids: list[StrictInt] | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0, le=INT32_MAX)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True  # accepted, no effect with fast tokenizers

    # Routed experts (vLLM + per-request opt-in as SGLang).
    return_routed_experts: bool | None = None
    routed_experts_prompt_start: int | None = Field(None, ge=0)
    return_token_ids: bool | None = False

    # Knobs the engine does not implement: neutral values only.
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    repetition_penalty: float | None = 1.0
    min_p: float | None = 0.0
    logit_bias: dict[str, float] | None = None
    use_beam_search: bool | None = False
    allowed_token_ids: list[StrictInt] | None = None
    bad_words: list[str] | None = None
    prompt_logprobs: int | None = None
    response_format: dict[str, Any] | None = None
    guided_json: Any = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: Any = None

    _v_presence = _unsupported("presence_penalty", 0.0)
    _v_frequency = _unsupported("frequency_penalty", 0.0)
    _v_repetition = _unsupported("repetition_penalty", 1.0)
    _v_min_p = _unsupported("min_p", 0.0)
    _v_beam = _unsupported("use_beam_search", False)
    _v_prompt_logprobs = _unsupported("prompt_logprobs", None)
    _v_guided_json = _unsupported("guided_json", None)
    _v_guided_regex = _unsupported("guided_regex", None)
    _v_guided_choice = _unsupported("guided_choice", None)
    _v_guided_grammar = _unsupported("guided_grammar", None)
    _v_structured = _unsupported("structured_outputs", None)

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, v):
        return _check_top_k(v)

    @field_validator("logit_bias", "allowed_token_ids", "bad_words")
    @classmethod
    def _empty_only(cls, v, info):
        if v:
            raise ValueError(f"`{info.field_name}` is not supported by this server")
        return v

    @field_validator("response_format")
    @classmethod
    def _response_format(cls, v):
        if v is None or v.get("type") in (None, "text"):
            return v
        raise ValueError("only response_format type 'text' is supported")

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        if v is None:
            return None
        stops = [v] if isinstance(v, str) else list(v)
        if any(s == "" for s in stops):
            raise ValueError("stop strings must not be empty")
        return stops

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_ids(cls, v):
        if v and any(t < 0 or t > INT64_MAX for t in v):
            raise ValueError("token ids must be non-negative")
        return v

    def stop_list(self) -> list[str]:
        return list(self.stop or [])  # normalised to a list by the validator


class CompletionRequest(GenerationRequestFields):
    model: str | None = None
    prompt: Any
    max_tokens: int | None = Field(16, ge=1, le=INT32_MAX)
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: int | None = Field(None, ge=0)
    echo: bool = False
    user: str | None = None
    suffix: str | None = None
    best_of: int | None = None
    add_special_tokens: bool = True
    truncate_prompt_tokens: int | None = Field(None, ge=1)
    return_tokens_as_token_ids: bool | None = False

    _v_suffix = _unsupported("suffix", None)

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v):
        return normalize_prompt(v)

    @field_validator("best_of")
    @classmethod
    def _best_of(cls, v, info):
        n = info.data.get("n", 1)
        if v is not None and v != n:
            raise ValueError("best_of is not supported (it must equal n)")
        return v


def normalize_prompt(v: Any) -> list[str | list[int]]:
    """str | list[str] | list[int] | list[list[int]] -> list of prompts (text or ids)."""
    if isinstance(v, str):
        return [v]
    if isinstance(v, list):
        if not v:
            raise ValueError("prompt must not be empty")
        if all(isinstance(p, str) for p in v):
            return list(v)
        if all(isinstance(t, int) and not isinstance(t, bool) for t in v):
            return [_check_ids(v)]
        if all(isinstance(p, list) for p in v):
            out = []
            for p in v:
                if not p or not all(isinstance(t, int) and not isinstance(t, bool) for t in p):
                    raise ValueError("each token-id prompt must be a non-empty list of integers")
                out.append(_check_ids(p))
            return out
    raise ValueError("prompt must be a string, a list of strings, a list of token ids or a list of token-id lists")


def _check_ids(ids: list[int]) -> list[int]:
    if not ids:
        raise ValueError("token ids must not be empty")
    if min(ids) < 0:
        raise ValueError("token ids must be non-negative")
    return ids


class ChatContentPart(_Base):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class ChatMessage(_Base):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[ChatContentPart] | None = None
    name: str | None = None


class ChatCompletionRequest(GenerationRequestFields):
    model: str | None = None
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    max_completion_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0)
    user: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    echo: bool = False
    return_tokens_as_token_ids: bool | None = False

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice(cls, v):
        if v in (None, "none", "auto"):
            return v
        raise ValueError("only tool_choice 'none' or 'auto' is supported (tool calls are returned as text)")

    @field_validator("echo")
    @classmethod
    def _echo(cls, v):
        if v:
            raise ValueError("`echo` is not supported for chat completions")
        return v


class GenerateSamplingParams(GenerationRequestFields):
    """vLLM ``SamplingParams`` as accepted by ``/inference/v1/generate``."""

    max_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    logprobs: int | None = Field(None, ge=0)
    detokenize: bool = True


class GenerateRequest(_ValidUnicode):
    request_id: str | None = None
    token_ids: list[StrictInt] = Field(..., min_length=1)
    sampling_params: GenerateSamplingParams = Field(default_factory=GenerateSamplingParams)
    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    cache_salt: str | None = None
    priority: int = 0
    kv_transfer_params: dict[str, Any] | None = None
    features: Any = None
    # Extension: per-request routing switch at top level too.
    return_routed_experts: bool | None = None

    _v_features = _unsupported("features", None)
    _v_kv = _unsupported("kv_transfer_params", None)

    @field_validator("token_ids")
    @classmethod
    def _ids(cls, v):
        return _check_ids(v)

    @field_validator("priority")
    @classmethod
    def _priority(cls, v):
        if v != 0:
            raise ValueError("priority scheduling is not supported (priority must be 0)")
        return v


# --------------------------------------------------------------------------
# Responses


class UsageInfo(_Base):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int) -> "UsageInfo":
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens)


class CompletionLogProbs(_Base):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionResponseChoice(_Base):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None
    routed_experts: str | None = None
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
    weight_version: str | None = None  # the weights that produced the choice (on its last chunk when streaming)


class GenerateResponse(_Base):
    request_id: str
    model: str
    created: int
    choices: list[GenerateResponseChoice]
    usage: UsageInfo
    prompt_logprobs: None = None
    kv_transfer_params: None = None


class GenerateStreamResponse(_Base):
    request_id: str
    choices: list[GenerateResponseChoice]
    usage: UsageInfo | None = None
