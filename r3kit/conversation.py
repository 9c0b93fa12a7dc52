"""A multi-turn rollout stitched from turns requested with ``routed_experts_prompt_start``.

Turn ``n + 1``'s prompt is the conversation so far (every token of turn ``n``, its last sampled token included)
plus new tokens (the user's or a tool's). The conversation holds one row per position ``0 .. len(tokens) - 2``;
the next turn asks only for what it lacks (``routed_experts_prompt_start = conversation.prompt_start``) and its
first row is the **boundary row**: the routing of the previous turn's last sampled token, which only this turn
forwarded. Rows a turn returns for positions already held (a smaller ``prompt_start``) are checked against the
held ones and the held ones kept: they come from the forward that sampled the tokens after them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .card import ModelCard
from .errors import R3Error, RowMismatchError, StitchError
from .response import Turn, check_against_card, select_moe_layers, turn_from_response
from .wire import decode_array, encode_array


@dataclass
class Conversation:
    """Tokens, rows, rollout logprobs and the generated-token mask of one multi-turn rollout.

    ``card`` (``ModelCard.fetch(base_url)``) checks every turn against the model and lets the conversation drop
    dense layers. ``allow_mixed_weight_versions``: accept turns served by different weights (a partial rollout
    resumed across a weight update); by default that is a :class:`StitchError`.
    """

    card: ModelCard | None = None
    allow_mixed_weight_versions: bool = False
    tokens: list[int] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list, repr=False)
    overlap_differences: list[int] = field(default_factory=list)  # per turn: re-sent rows that differed
    _rows: list[np.ndarray] = field(default_factory=list, repr=False)
    _weights: list[np.ndarray] | None = field(default_factory=list, repr=False)
    _logprobs: list[float] = field(default_factory=list, repr=False)
    _generated: list[bool] = field(default_factory=list, repr=False)
    _saved_weight_version: str | None = field(default=None, repr=False)

    # ------------------------------------------------------------------ the next request

    @property
    def prompt_start(self) -> int:
        """The ``routed_experts_prompt_start`` for the next turn: the number of rows held."""
        return sum(len(r) for r in self._rows)

    def next_prompt(self, new_tokens: list[int]) -> list[int]:
        """Token ids of the next turn's prompt (the conversation, then ``new_tokens``), for ``/v1/completions``
        (``prompt``) or ``/inference/v1/generate`` (``token_ids``)."""
        return list(self.tokens) + [int(t) for t in new_tokens]

    def request_fields(self) -> dict:
        """What the next request needs beside its prompt (the openai SDK's ``extra_body``)."""
        return {"routed_experts_prompt_start": self.prompt_start, "return_token_ids": True}

    # ------------------------------------------------------------------ adding a turn

    def add(self, response, *, prompt_start: int | None = None, choice: int | None = None,
            prompt_token_ids: list[int] | None = None, allow_truncated: bool = False,
            allow_aborted: bool = False) -> Turn:
        """Stitch the next turn: a response (dict, JSON, SDK object, :func:`collect_stream`'s dict) or a
        :class:`Turn`. ``prompt_start``: what the request sent (default: :attr:`prompt_start`, what the
        conversation asked for). Raises :class:`StitchError` when the turn does not continue the conversation."""
        held = self.prompt_start
        if isinstance(response, Turn):
            turn = response
            if prompt_start is not None and prompt_start != turn.prompt_start:
                raise RowMismatchError(f"the turn starts at {turn.prompt_start}, not at prompt_start={prompt_start}")
            if self.card is not None:
                check_against_card(turn.routed_experts, self.card)
        else:
            turn = turn_from_response(response, choice=choice, prompt_start=held if prompt_start is None else
                                      prompt_start, prompt_token_ids=prompt_token_ids, card=self.card,
                                      allow_truncated=allow_truncated, allow_aborted=allow_aborted)
        n = len(self.tokens)
        prompt = turn.prompt_token_ids
        if list(prompt[:n]) != self.tokens or len(prompt) < n:
            diff = next((i for i, (a, b) in enumerate(zip(prompt, self.tokens)) if a != b), min(len(prompt), n))
            raise StitchError(
                f"turn {len(self.turns) + 1}'s prompt does not continue the conversation: it differs at position "
                f"{diff} of {n} (prompt has {len(prompt)} tokens). A chat template re-rendered the history or the "
                "text was tokenized again; send the conversation's own token ids (Conversation.next_prompt with "
                "/v1/completions or /inference/v1/generate), or start a new Conversation from that turn")
        if turn.prompt_start > held:
            raise StitchError(
                f"turn {len(self.turns) + 1} starts its rows at position {turn.prompt_start} but the conversation "
                f"holds rows only up to {held - 1}: positions {held}..{turn.prompt_start - 1} would have no routing. "
                f"Request with routed_experts_prompt_start={held} (Conversation.prompt_start)")
        if self.turns and not self.allow_mixed_weight_versions:
            before = self.turns[-1].weight_version
            if before is not None and turn.weight_version is not None and before != turn.weight_version:
                raise StitchError(
                    f"turn {len(self.turns) + 1} was served by weights {turn.weight_version!r}, the conversation so "
                    f"far by {before!r}: its rows and logprobs belong to another policy. Start the rollout again, or "
                    "pass allow_mixed_weight_versions=True if the trainer handles that")
        skip = held - turn.prompt_start  # rows this turn re-sent for positions already held
        rows = turn.routed_experts
        if skip:
            mine = self.routed_experts[turn.prompt_start:held]
            self.overlap_differences.append(int((mine != rows[:skip]).any(axis=(1, 2)).sum()))
        else:
            self.overlap_differences.append(0)
        self._rows.append(rows[skip:])
        if turn.routed_weights is None:
            self._weights = None  # weights only when every turn has them
        elif self._weights is not None:
            self._weights.append(turn.routed_weights[skip:])
        new_prompt = prompt[n:]
        lp = turn.logprobs if turn.logprobs is not None else [float("nan")] * len(turn.token_ids)
        self.tokens += list(new_prompt) + list(turn.token_ids)
        self._logprobs += [float("nan")] * len(new_prompt) + list(lp)
        self._generated += [False] * len(new_prompt) + [True] * len(turn.token_ids)
        self.turns.append(turn)
        assert self.prompt_start == len(self.tokens) - 1
        return turn

    # ------------------------------------------------------------------ what the trainer reads

    @property
    def routed_experts(self) -> np.ndarray:
        """``[len(tokens) - 1, num_hidden_layers, top_k]``: row p = the routing of position p (every layer)."""
        if not self._rows:
            raise R3Error("the conversation has no turns yet")
        return np.concatenate(self._rows) if len(self._rows) > 1 else self._rows[0]

    def moe_routed_experts(self) -> np.ndarray:
        """``[len(tokens) - 1, len(moe_layers), top_k]``: dense layers dropped (needs the card)."""
        return select_moe_layers(self.routed_experts, self.card)

    @property
    def routed_weights(self) -> np.ndarray | None:
        """The combine weights, when every turn asked for them (``return_routed_weights``)."""
        if not self._weights:
            return None
        return np.concatenate(self._weights)

    @property
    def logprobs(self) -> np.ndarray:
        """float32 per token: the rollout's logprob of each generated token, NaN elsewhere."""
        return np.asarray(self._logprobs, dtype=np.float32)

    @property
    def generated_mask(self) -> np.ndarray:
        """bool per token: True for tokens the model sampled (what RL trains on)."""
        return np.asarray(self._generated, dtype=bool)

    @property
    def weight_version(self) -> str | None:
        return self.turns[-1].weight_version if self.turns else self._saved_weight_version

    def truncate(self, num_tokens: int) -> "Conversation":
        """The first ``num_tokens`` tokens with their rows (``num_tokens - 1``), logprobs and mask: cut tokens and
        rows together (a trainer's max length), never one alone."""
        if not 1 <= num_tokens <= len(self.tokens):
            raise R3Error(f"cannot truncate {len(self.tokens)} tokens to {num_tokens}")
        out = Conversation(card=self.card, allow_mixed_weight_versions=self.allow_mixed_weight_versions,
                           tokens=self.tokens[:num_tokens], turns=list(self.turns),
                           overlap_differences=list(self.overlap_differences),
                           _saved_weight_version=self.weight_version)
        out._rows = [self.routed_experts[: num_tokens - 1]]
        w = self.routed_weights
        out._weights = None if w is None else [w[: num_tokens - 1]]
        out._logprobs = self._logprobs[:num_tokens]
        out._generated = self._generated[:num_tokens]
        return out

    # ------------------------------------------------------------------ saving

    def to_dict(self) -> dict:
        w = self.routed_weights
        return {
            "format": "r3kit.conversation/1",
            "tokens": self.tokens,
            "routed_experts": encode_array(self.routed_experts),
            "routed_weights": None if w is None else encode_array(w),
            "logprobs": [None if np.isnan(v) else v for v in self._logprobs],
            "generated": self._generated,
            "weight_version": self.weight_version,
            "card": None if self.card is None else {
                "id": self.card.id, "num_hidden_layers": self.card.num_hidden_layers,
                "moe_layers": list(self.card.moe_layers), "num_experts": self.card.num_experts,
                "num_experts_per_tok": self.card.top_k, "weight_version": self.card.weight_version},
        }

    @classmethod
    def from_dict(cls, d: dict) -> "Conversation":
        if d.get("format") != "r3kit.conversation/1":
            raise R3Error(f"not an r3kit conversation (format {d.get('format')!r})")
        card = None if d.get("card") is None else ModelCard.from_dict(d["card"])
        conv = cls(card=card, tokens=[int(t) for t in d["tokens"]])
        rows = decode_array(d["routed_experts"])
        if len(rows) != len(conv.tokens) - 1:
            raise RowMismatchError(f"{len(rows)} rows for {len(conv.tokens)} tokens (want len(tokens) - 1)")
        if card is not None:
            check_against_card(rows, card)
        conv._rows = [rows]
        conv._weights = None if d.get("routed_weights") is None else [decode_array(d["routed_weights"])]
        conv._logprobs = [float("nan") if v is None else float(v) for v in d["logprobs"]]
        conv._generated = [bool(g) for g in d["generated"]]
        conv._saved_weight_version = d.get("weight_version")
        if not len(conv._logprobs) == len(conv._generated) == len(conv.tokens):
            raise RowMismatchError("logprobs, generated and tokens differ in length")
        return conv

    def save(self, path) -> None:
        Path(path).write_text(json.dumps(self.to_dict()))

    @classmethod
    def load(cls, path) -> "Conversation":
        return cls.from_dict(json.loads(Path(path).read_text()))
