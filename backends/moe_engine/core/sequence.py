"""What a request is inside the engine: the request, its outputs, and the sequence the scheduler runs.

``Request`` is what callers submit (``Engine.add_request``); ``RequestOutput`` is what its callback receives per
step; ``Sequence`` is the scheduler's state of one request (tokens, KV blocks, status, what was already sent).
"""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from .block_manager import BlockTable
from .sampling import SamplingParams, SamplingState


@dataclass
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    routed_experts: np.ndarray | None  # [rows, num_hidden_layers, top_k] uint16, rows since the last output
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | "error"
    num_prompt_tokens: int
    num_output_tokens: int
    logprobs: list[float] | None = None  # chosen tokens' logprobs, one per new token
    weight_version: str | None = None  # the weights that produced it (set by the engine)
    top_logprob_ids: np.ndarray | None = None  # [new tokens, N] int64
    top_logprobs: np.ndarray | None = None  # [new tokens, N] float32
    error: str | None = None
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    routed_weights: np.ndarray | None = None  # [rows, L, K] float32, the same rows as routed_experts
    # Prompt scoring, set once (on the output that completes the prompt): for prompt tokens 1..n-1, the logprob of
    # each given the tokens before it [n-1] float32, its rank in that distribution [n-1] int64 (1 = the most
    # likely), and the top N [n-1, N] (ids int64, logprobs float32).
    prompt_logprobs: np.ndarray | None = None
    prompt_logprob_ranks: np.ndarray | None = None
    prompt_top_logprob_ids: np.ndarray | None = None
    prompt_top_logprobs: np.ndarray | None = None


OutputCallback = Callable[[RequestOutput], None]


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int] | np.ndarray  # ids, or an integer array [n]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    return_routed_experts: bool = True
    routed_experts_prompt_start: int = 0
    on_output: OutputCallback | None = None
    # Routing replay: [R, num_hidden_layers, top_k] integer ids; row i forces the experts of the token at position i
    # (R <= prompt tokens; rows of dense layers ignored). Normalised to int64 by Engine.add_request.
    replay_routed_experts: np.ndarray | None = None
    return_routed_weights: bool = False  # the combine weights beside the routed experts
    prompt_logprobs: int | None = None  # None: off; N >= 0: every prompt token's logprob (after the first), top N
    # Prefix-cache isolation (vLLM's cache_salt): requests share cached blocks only with requests of the same salt.
    cache_salt: str | None = None

    @property
    def needs_full_prompt(self) -> bool:
        """Whether every prompt token must be forwarded by this request (no prefix-cache hits): the cache keeps
        KV and routing ids, not logits or combine weights."""
        return self.prompt_logprobs is not None or self.return_routed_weights


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # waiting again, to be recomputed
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    req: Request
    sampler: SamplingState
    tokens: list[int]  # prompt + generated
    num_prompt: int
    status: Status = Status.WAITING
    table: BlockTable = field(default_factory=BlockTable)
    num_computed: int = 0  # tokens whose KV is in the cache
    num_output: int = 0
    num_cached: int = 0  # prompt tokens that came from the prefix cache at the first admission
    rows_sent: int = 0  # routing rows handed out (or skipped) up to this absolute position
    # Rows of computed positions not yet in a registered block (prefix caching keeps them until the block fills).
    pending_rows: list = field(default_factory=list)
    pending_start: int = 0  # absolute position of pending_rows' first row
    claims: list = field(default_factory=list)  # prompt-block hashes this sequence is computing (n > 1 sharing)
    prompt_lp: list = field(default_factory=list)  # prompt-logprob chunks of the steps so far (until sent)
    prompt_lp_sent: bool = False
    arrival: float = field(default_factory=time.monotonic)
    prompt_ids: np.ndarray | None = None  # the prompt as int64 [num_prompt] (validated; what admission hashes)

    def __post_init__(self):
        self.rows_sent = self.req.routed_experts_prompt_start

    @property
    def request_id(self) -> str:
        return self.req.request_id

    def output(self) -> RequestOutput:
        """An empty output of this request as it stands (the scheduler fills in what a step produced)."""
        return RequestOutput(
            request_id=self.request_id,
            new_token_ids=[],
            routed_experts=None,
            finished=False,
            finish_reason=None,
            num_prompt_tokens=self.num_prompt,
            num_output_tokens=self.num_output,
            num_cached_tokens=self.num_cached,
        )

    @property
    def num_remaining(self) -> int:
        """Tokens to forward before the next sample (1 when decoding)."""
        return len(self.tokens) - self.num_computed

    @property
    def is_decoding(self) -> bool:
        return self.num_remaining == 1
