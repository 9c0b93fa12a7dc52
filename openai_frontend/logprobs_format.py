"""Engine logprobs -> OpenAI's completion and chat logprob formats, and vLLM's ``prompt_logprobs``."""

from __future__ import annotations

import math

from pydantic import TypeAdapter

from .generation import PromptScores, TokenLogprob
from .protocol import (
    ChatCompletionLogProb,
    ChatCompletionLogProbs,
    ChatCompletionLogProbsContent,
    CompletionLogProbs,
    PromptLogprob,
    PromptLogprobs,
)
from .tokenizer import Tokenizer

PROMPT_LOGPROBS = TypeAdapter(PromptLogprobs)  # serialises a prompt_logprobs list on its own (bounded.dump_list)

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


def _prompt_position(scores: PromptScores, i: int, top_n: int) -> tuple[float, list[tuple[int, float]]]:
    """(logprob of prompt token i + 1, the top ``top_n`` at that position, best first)."""
    top: list[tuple[int, float]] = []
    if top_n and scores.top_ids is not None and scores.top_logprobs is not None:
        top = list(zip(scores.top_ids[i, :top_n].tolist(), scores.top_logprobs[i, :top_n].tolist(), strict=False))
    return float(scores.logprobs[i]), top


def prompt_logprobs(
    prompt_ids: list[int], scores: PromptScores | None, tokenizer: Tokenizer | None, top_n: int
) -> PromptLogprobs | None:
    """vLLM's ``prompt_logprobs``: None for the first token, then per token ``{token_id: Logprob}`` holding
    the prompt token first and the top ``top_n``.

    ``rank``: 1 = the most likely token (the engine's rank of the prompt token in
    the whole vocabulary; the top N are 1..N).
    ``decoded_token`` is None when ``tokenizer`` is None (token-ids-only
    requests).  None when the engine sent none for a prompt of several tokens.
    """
    out: PromptLogprobs = [None]
    if scores is None:
        return out if len(prompt_ids) <= 1 else None
    full_top = scores.top_ids.shape[1] if scores.top_ids is not None else 0

    def entry(tid: int, value: float, rank: int | None) -> PromptLogprob:
        return PromptLogprob(logprob=_clamp(value), rank=rank,
                             decoded_token=tokenizer.token_text(tid) if tokenizer is not None else None)

    for i, tid in enumerate(prompt_ids[1:]):
        value, top = _prompt_position(scores, i, full_top)
        if scores.ranks is not None:
            rank: int | None = int(scores.ranks[i])
        else:  # without the engine's ranks: the position in its top list, if there
            rank = next((j + 1 for j, (t, _) in enumerate(top) if t == tid), None)
        d = {tid: entry(tid, value, rank)}
        for j, (t, v) in enumerate(top[:top_n]):
            d.setdefault(t, entry(t, v, j + 1))
        out.append(d)
    return out


def echo_logprobs(
    prompt_ids: list[int], scores: PromptScores | None, tokenizer: Tokenizer, top_n: int, *, as_ids: bool = False
) -> CompletionLogProbs:
    """The prompt's part of completion logprobs with ``echo`` (OpenAI's legacy format): every prompt token, the
    first with a null logprob and null top_logprobs; text offsets from 0."""
    out = CompletionLogProbs()
    offset = 0
    for i, tid in enumerate(prompt_ids):
        tok = _token_str(tokenizer, tid, as_ids)
        out.tokens.append(tok)
        out.text_offset.append(offset)
        offset += len(tok)
        if i == 0 or scores is None:
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            continue
        value, top = _prompt_position(scores, i - 1, top_n)
        out.token_logprobs.append(_clamp(value))
        d: dict[str, float] = {}
        for t, v in top:
            d.setdefault(_token_str(tokenizer, t, as_ids), _clamp(v))
        d.setdefault(tok, _clamp(value))  # OpenAI: "as well as the chosen token"
        out.top_logprobs.append(d)
    return out


def join_logprobs(first: CompletionLogProbs, then: CompletionLogProbs | None) -> CompletionLogProbs:
    """``first`` followed by ``then`` (the prompt's logprobs, then the generated tokens')."""
    if then is None:
        return first
    return CompletionLogProbs(
        text_offset=first.text_offset + then.text_offset,
        token_logprobs=first.token_logprobs + then.token_logprobs,
        tokens=first.tokens + then.tokens,
        top_logprobs=first.top_logprobs + then.top_logprobs,
    )
