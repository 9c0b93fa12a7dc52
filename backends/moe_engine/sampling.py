"""Sampling parameters and token selection.

Each request that sets a seed owns a torch.Generator, so its random draws do
not depend on what else shares the batch (the logits themselves can differ in
the last bits with the batch's shape, which can flip a near-tie). Greedy rows are an argmax over
the whole batch at once; sampled rows use the exponential-race trick
(argmax(p / Exp(1)), as gpt-fast does), which needs no host sync.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from .errors import InvalidRequestError


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None  # None: off; 0: chosen token only; N: plus the top N

    MAX_LOGPROBS = 20

    def validate(self, vocab_size: int) -> None:
        def bad(param: str, msg: str):
            raise InvalidRequestError(f"{param}: {msg}", param=param)

        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            bad("max_tokens", f"must be a positive integer, got {self.max_tokens}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            bad("temperature", f"must be >= 0, got {self.temperature}")
        if not math.isfinite(self.top_p) or not 0 < self.top_p <= 1:
            bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            bad("top_k", f"must be -1, 0 (off) or positive, got {self.top_k}")
        if self.min_tokens < 0 or self.min_tokens > self.max_tokens:
            bad("min_tokens", f"must be in [0, max_tokens], got {self.min_tokens}")
        if self.logprobs is not None and not 0 <= self.logprobs <= self.MAX_LOGPROBS:
            bad("logprobs", f"must be in [0, {self.MAX_LOGPROBS}], got {self.logprobs}")
        for t in self.stop_token_ids:
            if not 0 <= t < vocab_size:
                bad("stop_token_ids", f"token id {t} is outside the vocabulary [0, {vocab_size})")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


@dataclass
class SamplingState:
    """Per-request sampler state that lives as long as the request."""

    params: SamplingParams
    generator: torch.Generator | None = field(default=None)


def make_state(params: SamplingParams, device: torch.device) -> SamplingState:
    gen = None
    if params.seed is not None and not params.greedy:
        gen = torch.Generator(device=device)
        gen.manual_seed(params.seed & 0xFFFF_FFFF_FFFF_FFFF)
    return SamplingState(params, gen)


def _filter_logits(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:  # [V] -> [V]
    logits = logits / p.temperature
    if p.top_k > 0 and p.top_k < logits.shape[-1]:
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cum = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
        drop_sorted = (cum - torch.softmax(sorted_logits, dim=-1)) >= p.top_p  # keeps at least one
        logits = logits.masked_fill(torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted), float("-inf"))
    return logits


def sample(logits: torch.Tensor, states: list[SamplingState]) -> torch.Tensor:
    """logits [N, V] float32 -> next tokens [N] long (on the logits' device)."""
    out = torch.argmax(logits, dim=-1)  # greedy for all; sampled rows are overwritten
    for i, st in enumerate(states):
        if st.params.greedy:
            continue
        probs = torch.softmax(_filter_logits(logits[i], st.params), dim=-1)
        race = torch.empty_like(probs).exponential_(generator=st.generator)
        out[i] = torch.argmax(probs / race)
    return out


def compute_logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, top_n: int
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Log-probabilities of the raw model distribution (before temperature), as vLLM reports them.

    Returns chosen [N], and when top_n > 0, top ids [N, top_n] and top values [N, top_n].
    """
    logp = torch.log_softmax(logits, dim=-1)
    chosen = logp.gather(1, tokens[:, None]).squeeze(1)
    if top_n <= 0:
        return chosen, None, None
    values, ids = torch.topk(logp, top_n, dim=-1)
    return chosen, ids, values
