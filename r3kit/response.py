"""One choice of a moe-serve (or vLLM) response, decoded and aligned: :class:`Turn`.

Works on ``/v1/completions``, ``/v1/chat/completions`` and ``/inference/v1/generate`` responses, as dicts, JSON or
openai SDK objects, and on streams (:class:`StreamCollector` puts the chunks back together first).

Alignment (the server's contract): with ``P`` prompt tokens, ``G`` generated tokens and the request's
``routed_experts_prompt_start = s``, ``routed_experts`` has ``P + G - 1 - s`` rows; row ``i`` is the routing of
the token at absolute position ``s + i``. The last sampled token has no row: it was never forwarded.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import numpy as np

from .card import ModelCard, as_dict
from .errors import (AbortedChoiceError, DenseLayerError, MissingRoutedExpertsError, MissingTokenIdsError,
                     MultipleChoicesError, R3Error, RowMismatchError, TruncatedChoiceError)
from .wire import decode_array


@dataclass
class Turn:
    """One choice: its tokens, the routing rows it returned, and what the rollout needs beside them."""

    prompt_token_ids: list[int]
    token_ids: list[int]
    routed_experts: np.ndarray  # [rows, num_hidden_layers, top_k]; row i = position prompt_start + i
    prompt_start: int = 0
    routed_weights: np.ndarray | None = None  # float32, same shape (return_routed_weights)
    logprobs: list[float] | None = None  # one per generated token (the request asked for logprobs)
    finish_reason: str | None = None
    weight_version: str | None = None
    index: int = 0
    card: ModelCard | None = field(default=None, repr=False)

    @property
    def tokens(self) -> list[int]:
        """Prompt then generated tokens: the sequence the rows index."""
        return list(self.prompt_token_ids) + list(self.token_ids)

    @property
    def first_position(self) -> int:
        return self.prompt_start

    @property
    def end_position(self) -> int:
        """One past the last position with a row (= len(tokens) - 1)."""
        return self.prompt_start + len(self.routed_experts)

    def moe_routed_experts(self) -> np.ndarray:
        """``[rows, len(moe_layers), top_k]``: the dense layers dropped by the model card."""
        return select_moe_layers(self.routed_experts, self.card)


def select_moe_layers(arr: np.ndarray, card: ModelCard | None) -> np.ndarray:
    if card is None:
        raise DenseLayerError(
            "no model card: the layer axis counts every decoder layer, dense ones included (their rows hold 0, "
            "which looks like expert 0). Pass card=ModelCard.fetch(base_url) (GET /v1/models lists moe_layers) "
            "so that dense layers are dropped, never replayed")
    return arr[:, list(card.moe_layers)]


def check_against_card(arr: np.ndarray, card: ModelCard, what: str = "routed_experts") -> None:
    """Layers, top-k, expert ids and dense columns of a full-layer array against the card."""
    if arr.ndim != 3 or arr.shape[1:] != (card.num_hidden_layers, card.top_k):
        raise RowMismatchError(
            f"`{what}` has shape {tuple(arr.shape)}; model {card.id!r} needs (rows, {card.num_hidden_layers} "
            f"layers, top_k {card.top_k}): a response of another model, or a card of another model")
    if not len(arr):
        return
    dense = list(card.dense_layers)
    if dense and np.any(arr[:, dense]):
        bad = [d for d in dense if np.any(arr[:, d])]
        raise DenseLayerError(
            f"`{what}` has expert ids in layers {bad}, which the model card lists as dense (moe_layers = "
            f"{list(card.moe_layers)}): the card does not describe the model that served this response")
    moe = arr[:, list(card.moe_layers)]
    if moe.size and int(moe.max()) >= card.num_experts:
        raise RowMismatchError(f"`{what}` holds expert id {int(moe.max())}; model {card.id!r} has "
                               f"{card.num_experts} experts")


# ----------------------------------------------------------------------------- extraction


def _choices(response) -> tuple[dict, list[dict]]:
    resp = as_dict(response)
    if "error" in resp and "choices" not in resp:
        err = resp["error"]
        raise R3Error(f"the response is an error: {err.get('message', err) if isinstance(err, dict) else err}")
    choices = resp.get("choices")
    if not choices:
        raise R3Error("the response has no choices")
    return resp, [as_dict(c) for c in choices]


def _generated_logprobs(choice: dict, num_prompt: int, num_generated: int) -> list[float] | None:
    lp = choice.get("logprobs")
    if not lp:
        return None
    if lp.get("content") is not None:  # chat and generate: [{token, logprob, ...}]
        values = [c["logprob"] for c in lp["content"]]
    elif lp.get("token_logprobs") is not None:  # completions (with echo: the prompt's first)
        values = lp["token_logprobs"]
        if len(values) == num_prompt + num_generated:
            values = values[num_prompt:]
    else:
        return None
    if len(values) != num_generated:
        raise RowMismatchError(f"the choice has {len(values)} logprobs for {num_generated} generated tokens")
    return [float("nan") if v is None else float(v) for v in values]


def turns_from_response(response, *, prompt_start: int = 0, prompt_token_ids: list[int] | None = None,
                        card: ModelCard | None = None, allow_truncated: bool = False,
                        allow_aborted: bool = False) -> list[Turn]:
    """Every choice of a response, decoded and checked (see :func:`turn_from_response`)."""
    resp, choices = _choices(response)
    return [_turn(resp, c, prompt_start, prompt_token_ids, card, allow_truncated, allow_aborted) for c in choices]


def turn_from_response(response, *, choice: int | None = None, prompt_start: int = 0,
                       prompt_token_ids: list[int] | None = None, card: ModelCard | None = None,
                       allow_truncated: bool = False, allow_aborted: bool = False) -> Turn:
    """The one choice of a response (or choice ``choice``), decoded, aligned and checked.

    ``prompt_start``: the ``routed_experts_prompt_start`` the request sent (rows start there).
    ``prompt_token_ids``: for ``/inference/v1/generate`` without ``return_token_ids``, the request's ``token_ids``.
    ``card``: checks layers, top-k, ids and dense columns, and lets the turn drop dense layers.
    Raises :class:`MultipleChoicesError` for several choices without ``choice``, :class:`TruncatedChoiceError` /
    :class:`AbortedChoiceError` for ``finish_reason`` ``length`` / ``abort`` unless allowed,
    :class:`MissingRoutedExpertsError`, :class:`MissingTokenIdsError`, :class:`RowMismatchError`.
    """
    resp, choices = _choices(response)
    if choice is None:
        if len(choices) > 1:
            raise MultipleChoicesError(
                f"the response has {len(choices)} choices (n > 1, or several prompts); each carries its own tokens "
                "and its own copy of the prompt rows. Pick one with choice=i, or take all with turns_from_response()")
        picked = choices[0]
    else:
        found = [c for c in choices if c.get("index", 0) == choice]
        if len(found) != 1:
            raise MultipleChoicesError(f"no choice with index {choice} among {[c.get('index') for c in choices]}")
        picked = found[0]
    return _turn(resp, picked, prompt_start, prompt_token_ids, card, allow_truncated, allow_aborted)


def _turn(resp: dict, c: dict, prompt_start: int, prompt_token_ids, card, allow_truncated, allow_aborted) -> Turn:
    idx = c.get("index", 0)
    reason = c.get("finish_reason")
    if reason == "abort" and not allow_aborted:
        raise AbortedChoiceError(
            f"choice {idx} was aborted (finish_reason 'abort': a weight update or pause aborted it, or the client "
            "cancelled): its tokens stop early and later turns may come from other weights. Resume it (prompt = "
            "its tokens, replay_routed_experts = its rows) or drop it; allow_aborted=True keeps it as it is")
    if reason is None and not allow_aborted:
        raise AbortedChoiceError(f"choice {idx} has no finish_reason: the stream ended before the choice finished")
    if reason == "length" and not allow_truncated:
        raise TruncatedChoiceError(
            f"choice {idx} stopped at max_tokens (finish_reason 'length'). Its rows do align with its tokens, but a "
            "truncated rollout is usually masked or dropped by the trainer; allow_truncated=True keeps it (cut "
            "tokens and rows together with Conversation.truncate, never one of them alone)")
    token_ids = c.get("token_ids")
    prompt_ids = c.get("prompt_token_ids") or resp.get("prompt_token_ids") or prompt_token_ids
    if token_ids is None or prompt_ids is None:
        which = "token_ids" if token_ids is None else "prompt_token_ids"
        raise MissingTokenIdsError(
            f"choice {idx} has no {which}: request with return_token_ids: true (rows align with tokens, not text); "
            "for /inference/v1/generate, or pass prompt_token_ids=<the request's token_ids>")
    if prompt_token_ids is not None and list(prompt_token_ids) != list(prompt_ids):
        raise RowMismatchError(f"choice {idx}: the response's prompt_token_ids differ from the prompt_token_ids given")
    encoded = c.get("routed_experts")
    if encoded is None:
        why = ("the field is absent: the server does not return routed experts (moe-serve, or vLLM >= 0.22 with "
               "--enable-return-routed-experts)" if "routed_experts" not in c else
               "it is null: the server runs with routed experts off (--disable-routed-experts), the request set "
               "return_routed_experts: false, or the choice was aborted before its first forward")
        raise MissingRoutedExpertsError(f"choice {idx} has no routed_experts: {why}. Never train it as if routed "
                                        "by the live router: drop it or request it again")
    arr = decode_array(encoded, "routed_experts")
    P, G = len(prompt_ids), len(token_ids)
    if not 0 <= prompt_start < max(P, 1):
        raise RowMismatchError(f"routed_experts_prompt_start={prompt_start} must be in 0..{P - 1} "
                               f"(the prompt has {P} tokens)")
    want = P + G - 1 - prompt_start
    if arr.ndim != 3 or arr.shape[0] != want:
        rows = arr.shape[0] if arr.ndim else 0
        guess = P + G - 1 - rows
        hint = (f" (that many rows fit routed_experts_prompt_start={guess}: pass the value the request sent)"
                if arr.ndim == 3 and 0 <= guess < P else "")
        raise RowMismatchError(
            f"choice {idx}: routed_experts has shape {tuple(arr.shape)}; {P} prompt + {G} generated tokens with "
            f"routed_experts_prompt_start={prompt_start} need {want} rows (rows, layers, top_k): one per token "
            f"from position {prompt_start}, none for the last sampled token{hint}")
    weights = None
    if c.get("routed_weights") is not None:
        weights = decode_array(c["routed_weights"], "routed_weights")
        if weights.shape != arr.shape:
            raise RowMismatchError(f"choice {idx}: routed_weights {weights.shape} != routed_experts {arr.shape}")
    if card is not None:
        check_against_card(arr, card)
    return Turn(prompt_token_ids=[int(t) for t in prompt_ids], token_ids=[int(t) for t in token_ids],
                routed_experts=arr, prompt_start=prompt_start, routed_weights=weights,
                logprobs=_generated_logprobs(c, P, G), finish_reason=reason, weight_version=c.get("weight_version"),
                index=idx, card=card)


# ----------------------------------------------------------------------------- streaming


class StreamCollector:
    """Puts a streamed response back together, per choice, as the non-streamed response would be.

    ``add`` takes chunks as the openai SDK yields them, dicts, JSON, or raw SSE lines (``data: {...}``,
    ``data: [DONE]``). ``response()`` gives a dict that :func:`turn_from_response` reads. The routed experts of a
    choice arrive once, on its final chunk; the prompt's token ids on its first.
    """

    _ONCE = ("prompt_token_ids", "routed_experts", "routed_weights", "weight_version", "finish_reason")

    def __init__(self):
        self._choices: dict[int, dict] = {}
        self._top: dict = {}

    def add(self, chunk) -> None:
        if isinstance(chunk, (bytes, bytearray)):
            chunk = chunk.decode()
        if isinstance(chunk, str):
            line = chunk.strip()
            if not line or line.startswith(":"):
                return
            if line.startswith("data:"):
                line = line[5:].strip()
            if line == "[DONE]":
                return
            chunk = json.loads(line)
        d = as_dict(chunk)
        if "error" in d and not d.get("choices"):
            err = d["error"]
            raise R3Error(f"the stream failed: {err.get('message', err) if isinstance(err, dict) else err}")
        for key in ("prompt_token_ids", "prompt_logprobs"):
            if d.get(key) is not None:
                self._top[key] = d[key]
        for ch in d.get("choices") or []:
            ch = as_dict(ch)
            out = self._choices.setdefault(ch.get("index", 0), {"index": ch.get("index", 0), "token_ids": [],
                                                                 "text": ""})
            for key in self._ONCE:
                if ch.get(key) is not None:
                    if key in ("routed_experts", "routed_weights") and out.get(key) is not None:
                        raise R3Error(f"choice {out['index']}: `{key}` arrived twice in the stream")
                    out[key] = ch[key]
            out["token_ids"] += ch.get("token_ids") or []
            out["text"] += ch.get("text") or (ch.get("delta") or {}).get("content") or ""
            lp = ch.get("logprobs")
            if lp:
                acc = out.setdefault("logprobs", {})
                for key in ("content", "token_logprobs"):
                    if lp.get(key) is not None:
                        acc.setdefault(key, []).extend(lp[key])

    def response(self) -> dict:
        """``{"choices": [...]}`` (plus ``prompt_token_ids`` / ``prompt_logprobs`` when the stream had them)."""
        if not self._choices:
            raise R3Error("the stream had no choices")
        return {**self._top, "choices": [self._choices[i] for i in sorted(self._choices)]}


def collect_stream(chunks) -> dict:
    """A whole stream (an iterable of chunks) as one response dict."""
    col = StreamCollector()
    for chunk in chunks:
        col.add(chunk)
    return col.response()

