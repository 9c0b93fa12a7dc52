"""What each endpoint sends as its prompt -> token ids.

A request's prompts are described by a :class:`PromptSource` and turned into
ids only by :meth:`PromptSource.tokenize`, which serving calls after the
checks that need no tokenizer (model name, choice count, readiness), so a
request that fails those costs no tokenizing or template rendering.

- :class:`CompletionPrompts`: ``/v1/completions``' ``prompt`` (texts or id
  lists, optionally truncated from the left).
- :class:`ChatPrompt`: ``/v1/chat/completions``' ``messages`` through the
  chat template (the model's, or the request's ``chat_template``).
- :class:`TokenIdsPrompt`: ``/inference/v1/generate``'s ``token_ids``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from .errors import BadRequestError
from .protocol import ChatCompletionRequest, CompletionRequest
from .tokenizer import ChatTemplate, ChatTemplateError, Tokenizer


@dataclass
class PromptInput:
    ids: list[int]
    text: str | None = None  # the prompt text, when the client sent text


class PromptSource(Protocol):
    param: str  # the request field errors about the prompt name

    @property
    def count(self) -> int:
        """How many prompts (known before tokenizing)."""
        ...

    def tokenize(self, tokenizer: Tokenizer) -> list[PromptInput]: ...


@dataclass(frozen=True)
class CompletionPrompts:
    request: CompletionRequest
    param: str = "prompt"

    @property
    def count(self) -> int:
        return len(self.request.prompt)

    def tokenize(self, tokenizer: Tokenizer) -> list[PromptInput]:
        req = self.request
        out = []
        for p in req.prompt:
            if isinstance(p, str):
                prompt = PromptInput(ids=tokenizer.encode(p, add_special_tokens=req.add_special_tokens), text=p)
            else:
                prompt = PromptInput(ids=list(p))
            if req.truncate_prompt_tokens is not None:
                prompt.ids = prompt.ids[-req.truncate_prompt_tokens :]
            out.append(prompt)
        return out


@dataclass(frozen=True)
class ChatPrompt:
    request: ChatCompletionRequest
    param: str = "messages"

    @property
    def count(self) -> int:
        return 1

    def tokenize(self, tokenizer: Tokenizer) -> list[PromptInput]:
        req = self.request
        template = tokenizer.chat_template
        if req.chat_template is not None:
            try:
                template = ChatTemplate(req.chat_template, tokenizer.bos_token, tokenizer.eos_token)
            except ChatTemplateError as e:
                raise BadRequestError(str(e), param="chat_template", code="chat_template_error") from e
        if template is None:
            raise BadRequestError("The model has no chat template; pass `chat_template` or use /v1/completions.",
                                  param="messages")
        if req.continue_final_message and req.add_generation_prompt and "add_generation_prompt" in req.model_fields_set:
            raise BadRequestError("continue_final_message and add_generation_prompt cannot both be true.",
                                  param="continue_final_message", code="unsupported_combination")
        try:
            text = template.render(
                _template_messages(req),
                add_generation_prompt=req.add_generation_prompt,
                continue_final_message=req.continue_final_message,
                tools=req.tools,
                extra=req.chat_template_kwargs,
            )
        except ChatTemplateError as e:
            raise BadRequestError(f"Chat template error: {e}", param="messages", code="chat_template_error") from e
        return [PromptInput(ids=tokenizer.encode(text, add_special_tokens=req.add_special_tokens), text=text)]


@dataclass(frozen=True)
class TokenIdsPrompt:
    ids: list[int]
    param: str = "token_ids"

    @property
    def count(self) -> int:
        return 1

    def tokenize(self, tokenizer: Tokenizer) -> list[PromptInput]:  # noqa: ARG002 - already ids
        return [PromptInput(ids=self.ids)]


def _template_messages(req: ChatCompletionRequest) -> list[dict[str, Any]]:
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
