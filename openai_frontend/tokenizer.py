"""Hugging Face tokenizer (``tokenizers``), chat template (jinja2), detokenizer.

No ``transformers`` here: ``tokenizer.json`` is loaded with the Rust
``tokenizers`` library, the chat template is rendered the way transformers
renders it (sandboxed jinja2, ``trim_blocks``/``lstrip_blocks``, ``tojson``,
``raise_exception``, ``strftime_now``), and streaming text comes from an
incremental detokenizer that never emits a broken UTF-8 sequence.

Bounds (hostile input must not cost more than it can ever be worth):
- ``encode`` refuses, before tokenizing, a text longer than
  ``max_model_len * max_token_chars`` characters (``set_max_model_len``):
  every token covers at most ``max_token_chars`` characters of text (the
  longest vocabulary entry), so such a text cannot fit in the context.
- Rendering a chat template stops past ``max_chars`` characters of output or
  ``timeout_s`` seconds (checked at every output piece and every call the
  template makes); ``*``, ``**`` and ``%`` and integer arguments of calls and
  filters are capped, so one expression cannot allocate gigabytes. Best
  effort for templates from requests, which are off unless the operator
  trusts them (``--trust-request-chat-template``).
"""

from __future__ import annotations

import contextvars
import functools
import json
import os
import re
import time
from dataclasses import dataclass, field
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

from .errors import PromptTooLongError

# How many prompt tokens seed the detokenizer's context (as vLLM), so that
# the first generated token decodes with the right leading space.
_INITIAL_CONTEXT_TOKENS = 5


class ChatTemplateError(ValueError):
    """The chat template rejected the conversation (raise_exception) or failed."""


def _token_content(value: Any) -> str | None:
    """tokenizer_config stores special tokens as str or as AddedToken dicts."""
    if value is None:
        return None
    if isinstance(value, dict):
        return value.get("content")
    return str(value)


# --------------------------------------------------------------------------
# Chat template


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` (transformers' assistant mask): render the body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False
) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


# Rendering limits (per render; ChatTemplate.max_chars / timeout_s override the defaults).
DEFAULT_MAX_RENDERED_CHARS = 4 * 2**20
DEFAULT_RENDER_TIMEOUT_S = 2.0
MAX_TEMPLATE_INT_ARG = 100_000  # a width, count or repeat factor a template may pass
_deadline: contextvars.ContextVar[float] = contextvars.ContextVar("chat_template_deadline", default=float("inf"))
_FORMAT_WIDTH = re.compile(r"%[-#0 +]*(\*|\d{6,})")


class _BoundedEnvironment(ImmutableSandboxedEnvironment):
    """jinja2's sandbox plus size and time caps on what a template's expressions may do."""

    intercepted_binops = frozenset({"*", "**", "%"})

    def call_binop(self, context, operator, left, right):  # noqa: ANN001 - jinja2's signature
        _check_deadline()
        if operator == "**" and isinstance(right, int) and isinstance(left, int) and abs(left) > 1:
            if right > 64:
                raise jinja2.exceptions.SecurityError("exponent too large in chat template")
        elif operator == "*":
            seq, n = (left, right) if isinstance(right, int) else (right, left)
            if isinstance(seq, (str, list, tuple)) and isinstance(n, int) and len(seq) * n > DEFAULT_MAX_RENDERED_CHARS:
                raise jinja2.exceptions.SecurityError("repeated sequence too long in chat template")
        elif operator == "%" and isinstance(left, str) and _FORMAT_WIDTH.search(left):
            raise jinja2.exceptions.SecurityError("format width too large in chat template")
        return super().call_binop(context, operator, left, right)

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: ANN001, N805 - jinja2's signature
        _check_deadline()
        _check_int_args(args, kwargs)
        return super().call(__context, __obj, *args, **kwargs)


def _check_deadline() -> None:
    if time.monotonic() > _deadline.get():
        raise jinja2.exceptions.SecurityError("chat template took too long to render")


def _check_int_args(args: tuple, kwargs: dict) -> None:
    for v in (*args, *kwargs.values()):
        if isinstance(v, int) and not isinstance(v, bool) and abs(v) > MAX_TEMPLATE_INT_ARG:
            raise jinja2.exceptions.SecurityError(f"integer argument {v} too large in chat template")


def _capped_filter(f):  # noqa: ANN001, ANN202
    @functools.wraps(f)  # keeps jinja2's pass_context / pass_environment marks
    def capped(*args, **kwargs):
        _check_deadline()
        _check_int_args(args, kwargs)
        return f(*args, **kwargs)

    return capped


@lru_cache(maxsize=16)
def _compile_template(source: str) -> jinja2.Template:
    env = _BoundedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.filters = {name: _capped_filter(f) for name, f in env.filters.items()}
    env.globals.pop("lipsum", None)  # lipsum(n) writes paragraphs of filler; no template needs it
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


class ChatTemplate:
    def __init__(self, source: str, bos_token: str | None, eos_token: str | None) -> None:
        self.source = source
        self.bos_token = bos_token or ""
        self.eos_token = eos_token or ""
        self.max_chars = DEFAULT_MAX_RENDERED_CHARS
        self.timeout_s = DEFAULT_RENDER_TIMEOUT_S
        self.max_model_len: int | None = None  # set when max_chars is the context's bound (Tokenizer)
        try:
            self._template = _compile_template(source)
        except jinja2.TemplateSyntaxError as e:
            raise ChatTemplateError(f"chat template does not compile: {e}") from e

    def render(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        extra: dict[str, Any] | None = None,
        template_override: str | None = None,
    ) -> str:
        template = self._template
        if template_override is not None:
            try:
                template = _compile_template(template_override)
            except jinja2.TemplateSyntaxError as e:
                raise ChatTemplateError(f"chat_template does not compile: {e}") from e
        ctx: dict[str, Any] = dict(extra or {})
        ctx.update(
            messages=messages,
            add_generation_prompt=add_generation_prompt and not continue_final_message,
            bos_token=self.bos_token,
            eos_token=self.eos_token,
        )
        if tools is not None:
            ctx["tools"] = tools
        try:
            rendered = self._bounded_render(template, ctx)
        except (ChatTemplateError, PromptTooLongError):
            raise
        except jinja2.TemplateError as e:
            raise ChatTemplateError(str(e)) from e
        except Exception as e:  # noqa: BLE001 - template code is user data
            raise ChatTemplateError(f"chat template failed: {type(e).__name__}: {e}") from e
        if continue_final_message:
            rendered = _cut_after_final_message(rendered, messages)
        return rendered

    def _bounded_render(self, template: jinja2.Template, ctx: dict[str, Any]) -> str:
        pieces: list[str] = []
        size = 0
        deadline = time.monotonic() + self.timeout_s
        token = _deadline.set(deadline)
        try:
            for piece in template.generate(**ctx):
                size += len(piece)
                if size > self.max_chars:
                    if self.max_model_len is not None:
                        raise PromptTooLongError(size, self.max_chars, self.max_model_len, at_least=True)
                    raise ChatTemplateError(f"the rendered prompt is longer than {self.max_chars} characters")
                if time.monotonic() > deadline:
                    raise ChatTemplateError(f"rendering took longer than {self.timeout_s:g} s")
                pieces.append(piece)
        finally:
            _deadline.reset(token)
        return "".join(pieces)


def _cut_after_final_message(rendered: str, messages: list[dict[str, Any]]) -> str:
    """Drop what the template appended after the last message (as transformers does)."""
    final = messages[-1].get("content") if messages else None
    if not isinstance(final, str) or not final.strip():
        return rendered
    loc = rendered.rfind(final.strip())
    if loc < 0:
        raise ChatTemplateError("continue_final_message: final message not found in the rendered prompt")
    if rendered[loc : loc + len(final.lstrip())] == final:
        return rendered[: loc + len(final.lstrip())]
    return rendered[: loc + len(final.strip())]


# --------------------------------------------------------------------------
# Tokenizer


@dataclass
class Tokenizer:
    """Wraps ``tokenizers.Tokenizer`` plus the bits of tokenizer_config.json we need."""

    hf: HFTokenizer
    bos_token: str | None
    eos_token: str | None
    chat_template: ChatTemplate | None
    _token_texts: dict[int, str] = field(default_factory=dict, repr=False)
    max_prompt_chars: int | None = None  # set_max_model_len; None = no check
    max_model_len: int | None = None

    @classmethod
    def from_dir(cls, checkpoint_dir: str) -> Tokenizer:
        tok_path = os.path.join(checkpoint_dir, "tokenizer.json")
        if not os.path.exists(tok_path):
            raise FileNotFoundError(f"{tok_path} not found (the frontend needs a fast tokenizer)")
        hf = HFTokenizer.from_file(tok_path)
        cfg: dict[str, Any] = {}
        cfg_path = os.path.join(checkpoint_dir, "tokenizer_config.json")
        if os.path.exists(cfg_path):
            with open(cfg_path, encoding="utf-8") as f:
                cfg = json.load(f)
        bos = _token_content(cfg.get("bos_token"))
        eos = _token_content(cfg.get("eos_token"))
        source = _load_chat_template_source(checkpoint_dir, cfg)
        template = ChatTemplate(source, bos, eos) if source else None
        return cls(hf=hf, bos_token=bos, eos_token=eos, chat_template=template)

    @property
    def vocab_size(self) -> int:
        return self.hf.get_vocab_size(with_added_tokens=True)

    @functools.cached_property
    def max_token_chars(self) -> int:
        """Characters of text one token can stand for at most: its vocabulary entry's length (byte-level
        and metaspace entries spell one character per character of text; escapes like <0x0A> are longer)."""
        return max((len(t) for t in self.hf.get_vocab(with_added_tokens=True)), default=1)

    def set_max_model_len(self, max_model_len: int) -> None:
        """Refuse texts that cannot fit ``max_model_len`` tokens before tokenizing them (and bound rendering)."""
        self.max_model_len = max_model_len
        self.max_prompt_chars = max_model_len * self.max_token_chars
        if self.chat_template is not None and self.max_prompt_chars < self.chat_template.max_chars:
            self.chat_template.max_chars = self.max_prompt_chars
            self.chat_template.max_model_len = max_model_len

    def _check_length(self, text: str) -> None:
        if self.max_prompt_chars is not None and len(text) > self.max_prompt_chars:
            raise PromptTooLongError(len(text), self.max_prompt_chars, self.max_model_len or 0)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self._check_length(text)
        return self.hf.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        for text in texts:
            self._check_length(text)
        return [e.ids for e in self.hf.encode_batch(texts, add_special_tokens=add_special_tokens)]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """Text of one token as logprobs show it (decoded, special tokens kept)."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self.hf.decode([int(token_id)], skip_special_tokens=False)
            if len(self._token_texts) < 262144:
                self._token_texts[token_id] = text
        return text

    def detokenizer(
        self, prompt_ids: list[int] | None = None, skip_special_tokens: bool = True
    ) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self, prompt_ids or [], skip_special_tokens)


def _load_chat_template_source(checkpoint_dir: str, cfg: dict[str, Any]) -> str | None:
    tmpl = cfg.get("chat_template")
    if isinstance(tmpl, list):  # [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in tmpl if isinstance(t, dict)}
        tmpl = named.get("default") or next(iter(named.values()), None)
    if isinstance(tmpl, str) and tmpl:
        return tmpl
    # transformers >= 4.43 may save the template next to the tokenizer.
    jinja_path = os.path.join(checkpoint_dir, "chat_template.jinja")
    if os.path.exists(jinja_path):
        with open(jinja_path, encoding="utf-8") as f:
            return f.read()
    json_path = os.path.join(checkpoint_dir, "chat_template.json")
    if os.path.exists(json_path):
        with open(json_path, encoding="utf-8") as f:
            data = json.load(f)
        if isinstance(data, dict) and isinstance(data.get("chat_template"), str):
            return data["chat_template"]
    return None


# --------------------------------------------------------------------------
# Incremental detokenization


class IncrementalDetokenizer:
    """Text deltas for a growing token sequence, never splitting a UTF-8 character.

    Keeps a small window ``ids[prefix:]``; the delta of a new token is
    ``decode(ids[prefix:]) - decode(ids[prefix:read])``, emitted only when it
    does not end in U+FFFD (an incomplete byte sequence).  ``flush`` emits
    whatever is left at the end.  Streaming and non-streaming both use it, so
    their texts are identical.
    """

    __slots__ = ("_decode", "_skip", "_ids", "_prefix", "_read")

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], skip_special_tokens: bool = True) -> None:
        self._decode = tokenizer.hf.decode
        self._skip = skip_special_tokens
        context = list(prompt_ids[-_INITIAL_CONTEXT_TOKENS:])
        self._ids: list[int] = context
        self._prefix = 0
        self._read = len(context)

    def step(self, token_id: int) -> str:
        self._ids.append(int(token_id))
        prefix_text = self._decode(self._ids[self._prefix : self._read], skip_special_tokens=self._skip)
        new_text = self._decode(self._ids[self._prefix :], skip_special_tokens=self._skip)
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            delta = new_text[len(prefix_text) :]
            self._prefix = self._read
            self._read = len(self._ids)
            self._trim()
            return delta
        return ""

    def flush(self) -> str:
        """Emit text withheld so far (possibly with U+FFFD for a truly broken sequence)."""
        if self._read == len(self._ids):
            return ""
        prefix_text = self._decode(self._ids[self._prefix : self._read], skip_special_tokens=self._skip)
        new_text = self._decode(self._ids[self._prefix :], skip_special_tokens=self._skip)
        self._prefix = self._read
        self._read = len(self._ids)
        self._trim()
        return new_text[len(prefix_text) :] if len(new_text) > len(prefix_text) else ""

    def _trim(self) -> None:
        # Drop ids before the window so memory stays O(window).
        if self._prefix > 64:
            del self._ids[: self._prefix]
            self._read -= self._prefix
            self._prefix = 0
