"""Request models: OpenAI's API plus vLLM's extensions (responses: :mod:`.protocol_responses`, re-exported here).

Unknown request fields are ignored (as vLLM does), so clients that send
vLLM-only knobs keep working.  Known fields whose semantics this server does
not implement are accepted only at their neutral value; anything else is a
400 that names the field, never a silent no-op.

The wire format reads in two files: requests here, responses in
:mod:`.protocol_responses` (one file had grown past 500 lines).
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any

import numpy as np
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PlainValidator,
    StrictInt,
    WithJsonSchema,
    field_validator,
    model_validator,
)

from .protocol_responses import (  # noqa: F401 - re-exported: the wire format's responses
    ChatCompletionLogProb,
    ChatCompletionLogProbs,
    ChatCompletionLogProbsContent,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
    ChatResponseMessage,
    CompletionLogProbs,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionResponseStreamChoice,
    CompletionStreamResponse,
    DeltaMessage,
    GenerateResponse,
    GenerateResponseChoice,
    GenerateStreamResponse,
    PromptLogprob,
    PromptLogprobs,
    PromptTokenUsageInfo,
    UsageInfo,
)
from .routing_codec import decode_int_array

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


class CodedValueError(ValueError):
    """A validator's refusal with its error code (a rule JSON Schema cannot express: openapi_doc.SEMANTIC_CODES)."""

    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.code = code


def _integral_floats_to_int(value: Any) -> Any:
    """JSON has one number type, and JSON Schema (the OpenAPI document) counts 5.0 as the integer 5: an integer field
    takes it. 5.5, "5" and true stay what they are (refused where an integer is due)."""
    if type(value) is float and value.is_integer():
        return int(value)
    if isinstance(value, dict):
        return {k: _integral_floats_to_int(v) for k, v in value.items()}
    if isinstance(value, list) and not all(type(v) is int for v in value):  # long id lists: the common case fast
        return [_integral_floats_to_int(v) for v in value]
    return value


class _ValidUnicode(_Base):
    """Request bodies: every string, ids and names included, must be valid Unicode (400 otherwise). Types are
    strict, as the OpenAPI document states them: "5" and 5.5 are not integers (5.0 is, as JSON Schema counts), 1 is
    not a boolean."""

    model_config = ConfigDict(extra="ignore", protected_namespaces=(), strict=True)

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        check_unicode(data)
        return _integral_floats_to_int(data)


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


def _decode_routing(v: Any) -> np.ndarray | None:
    return None if v is None else decode_int_array(v, ndim=3)


# A routing array sent by the client: base64 ``.npy`` in, the decoded integer array (any integer dtype) out.
# Shape and ids are checked against the model and the prompt by serving (serving.check_replay).
RoutingArray = Annotated[
    Any,
    PlainValidator(_decode_routing),
    WithJsonSchema({"type": ["string", "null"], "contentEncoding": "base64",
                    "description": ".npy bytes of an integer array [rows, num_hidden_layers, top_k], base64, "
                                   "as the server returns routed_experts"}),
]


class StreamOptions(_Base):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class GenerationRequestFields(_ValidUnicode):
    """Body fields shared by all three generation endpoints: sampling, stop rules, output and routing options.

    Serving turns them into a :class:`~.triton_client.BackendRequest`; the
    backend builds the engine's ``moe_engine.core.sampling.SamplingParams`` from that.
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
    # Issue 19: forced routing (row i = the experts of prompt position i), the combine weights, prompt scoring.
    replay_routed_experts: RoutingArray = None
    return_routed_weights: bool | None = False
    prompt_logprobs: int | None = Field(None, ge=0)
    # vLLM's prefix-cache isolation: requests share cached KV blocks (and routing rows) only with the same salt.
    cache_salt: str | None = Field(None, min_length=1, max_length=1024)

    # Knobs the engine does not implement: neutral values only.
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    repetition_penalty: float | None = 1.0
    min_p: float | None = 0.0
    logit_bias: dict[str, float] | None = None
    use_beam_search: bool | None = False
    allowed_token_ids: list[StrictInt] | None = None
    bad_words: list[str] | None = None
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
            raise CodedValueError("best_of is not supported (it must equal n)", "unsupported_combination")
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
    cache_salt: str | None = Field(None, min_length=1, max_length=1024)
    priority: int = 0
    kv_transfer_params: dict[str, Any] | None = None
    features: Any = None
    # Extension: per-request routing options at top level too (used when sampling_params has none).
    return_routed_experts: bool | None = None
    return_routed_weights: bool | None = None
    replay_routed_experts: RoutingArray = None

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
