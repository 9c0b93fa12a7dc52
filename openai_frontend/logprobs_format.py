"""Engine logprobs -> OpenAI's completion and chat logprob formats."""

from __future__ import annotations

import math

from .generation import TokenLogprob
from .protocol import ChatCompletionLogProb, ChatCompletionLogProbs, ChatCompletionLogProbsContent, CompletionLogProbs
from .tokenizer import Tokenizer

_FLOOR = -9999.0  # as vLLM: -inf / nan never reach JSON


def _clamp(x: float) -> float:
    if math.isnan(x):
        return _FLOOR
    return max(x, _FLOOR)


def _token_str(tokenizer: Tokenizer, token_id: int, as_ids: bool) -> str:
    return f"token_id:{token_id}" if as_ids else tokenizer.token_text(token_id)


def completion_logprobs(
    lps: list[TokenLogprob], tokenizer: Tokenizer, top_n: int, text_offset: int, *, as_ids: bool = False
) -> tuple[CompletionLogProbs, int]:
    """Returns the logprobs object and the text offset after these tokens."""
    out = CompletionLogProbs()
    for lp in lps:
        tok = _token_str(tokenizer, lp.token_id, as_ids)
        out.tokens.append(tok)
        out.token_logprobs.append(None if math.isnan(lp.logprob) else _clamp(lp.logprob))
        out.text_offset.append(text_offset)
        text_offset += len(tok)
        top: dict[str, float] = {}
        for tid, val in lp.top[:top_n]:
            top.setdefault(_token_str(tokenizer, tid, as_ids), _clamp(val))
        if not math.isnan(lp.logprob):  # OpenAI: "as well as the chosen token"
            top.setdefault(tok, _clamp(lp.logprob))
        out.top_logprobs.append(top)
    return out, text_offset


def chat_logprobs(
    lps: list[TokenLogprob], tokenizer: Tokenizer, top_n: int, *, as_ids: bool = False
) -> ChatCompletionLogProbs:
    content = []
    for lp in lps:
        tok = _token_str(tokenizer, lp.token_id, as_ids)
        content.append(
            ChatCompletionLogProbsContent(
                token=tok,
                logprob=_clamp(lp.logprob),
                bytes=list(tok.encode("utf-8", errors="replace")),
                top_logprobs=[
                    ChatCompletionLogProb(
                        token=(t := _token_str(tokenizer, tid, as_ids)),
                        logprob=_clamp(val),
                        bytes=list(t.encode("utf-8", errors="replace")),
                    )
                    for tid, val in lp.top[:top_n]
                ],
            )
        )
    return ChatCompletionLogProbs(content=content)
