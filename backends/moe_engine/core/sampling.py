"""Sampling parameters and token selection for a whole step at once, on the logits' device.

The runner's calls (one step):

    sampler = Sampler(vocab_size, device, max_rows=max_num_seqs)   # once
    batch = sampler.prepare(states, draw_index, pad_to=bucket)     # host: one host->device copy
    tokens = sampler.sample(logits, batch)                         # [B] long on the device, no host sync
    lp = sampler.logprobs(logits, tokens, batch)                   # None, or (chosen, top ids, top values)

``draw_index[i]``: which output token row i draws (0 for a request's first generated token, i.e. the sampled
token's position minus the prompt length). The noise of a draw is a function of (request seed, draw index,
vocabulary index) only -- a counter-based RNG (Philox4x32-10 keyed by the seed on CUDA) -- so a seeded request
gets the same tokens whatever else shares the batch, in whatever order, and a draw recomputed after a
preemption repeats. Requests without a seed get a random one at ``make_state``.

Selection, per row: greedy rows (temperature 0 or top_k 1) take the argmax (ties: the lowest index, as
``torch.argmax``). Other rows keep the tokens whose logit is >= a per-row threshold ``lo`` and race them:
token = argmax(x_i + T * G_i) over the kept tokens, G_i Gumbel noise -- the exponential race
argmax(p_i / E_i) of gpt-fast/vLLM written in log space, so no softmax is materialised. ``lo`` is:

* top-k (k > 0 and k < V): the k-th largest logit (tokens tied with it are all kept);
* top-p (p < 1), applied after top-k on the renormalised distribution softmax(x / T): keep token i iff the
  probability mass of the tokens strictly more likely than i is < p. Every token tied with a kept one is kept,
  so the nucleus does not depend on how a sort orders ties, and at least the most likely token is kept.

Paths (``SamplingBatch.kind``, chosen on the host in ``prepare``): "greedy" (one argmax), "sample" (no
filter: race only), "filter" (thresholds, then race). On CUDA the race is a Triton kernel split over the
vocabulary; the thresholds come from ``torch.topk`` candidates (``batch.candidates`` of them), with an exact
in-kernel bisection for a row whose nucleus extends past them. Nothing in ``sample`` reads device memory
from the host, and its kernel sequence depends only on ``batch.path`` and the batch's row count: a CUDA graph
captured for (rows, ``batch.path``) can be replayed for any later batch with the same key, since ``prepare``
rewrites the same device buffers (``max_rows`` of them, at fixed addresses). Call ``prepare`` and ``sample``
on the same stream. On CPU a pure-torch path is used (same filters, exact; noise from a torch.Generator
seeded per (seed, draw)), so CPU and CUDA need not draw the same tokens; each is deterministic.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch

from ..errors import InvalidRequestError
from ..layers import invariant as inv
from ..kernels.sampling import _pow2, triton_available, triton_filter_thresholds, triton_logsumexp, triton_race


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


_U64 = (1 << 64) - 1


# A request's row of a batch, packed once at make_state: prepare joins the rows' bytes (one numpy view).
_RECORD = np.dtype([
    ("temperature", "<f4"), ("top_p", "<f4"), ("top_k", "<i4"), ("greedy", "<i4"), ("logprobs", "<i4"),
    ("pad", "<i4"), ("seed", "<i8"),
])


@dataclass
class SamplingState:
    """Per-request sampler state that lives as long as the request."""

    params: SamplingParams
    seed: int = 0  # the request's seed, or a random one; 64-bit, stored as a signed int64
    record: bytes = field(default=b"", repr=False)  # this request's row of a batch (_RECORD)


def _as_int64(u: int) -> int:
    u &= _U64
    return u - (1 << 64) if u >> 63 else u


def make_state(params: SamplingParams, device: torch.device | str | None = None) -> SamplingState:
    """``device`` is accepted for the engine's call and unused: a state holds no device object."""
    if params.seed is not None:
        seed = _as_int64(params.seed)
    else:  # from torch's default CPU generator: torch.manual_seed makes unseeded runs repeatable too
        seed = int(torch.randint(-(2**63), 2**63 - 1, (1,), dtype=torch.long).item())
    greedy = params.greedy
    record = np.array([(
        # float32 and finite in every kernel's arithmetic: beyond these bounds the draw cannot tell the difference
        1.0 if greedy else min(max(params.temperature, 1e-30), 1e30),
        1.0 if greedy or params.top_p >= 1.0 else params.top_p,
        0 if greedy or params.top_k < 0 else min(params.top_k, 2**31 - 1),  # >= the vocabulary: off
        greedy,
        -1 if params.logprobs is None else params.logprobs,
        0,
        seed,
    )], dtype=_RECORD).tobytes()
    return SamplingState(params, seed, record)


def _mix64(z: int) -> int:
    """SplitMix64's finaliser: a bijection of 64-bit ints that spreads every input bit over the output."""
    z = (z + 0x9E3779B97F4A7C15) & _U64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _U64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _U64
    return z ^ (z >> 31)


def draw_key(seed: int, draw: int) -> int:
    """The torch path's generator seed for (request seed, draw index)."""
    return _mix64((seed & _U64) ^ _mix64(draw & _U64))


# Columns of a batch, in the order of the staging buffer: (name, dtype). 4 x 4 + 2 x 8 bytes per row.
_COLUMNS = (
    ("temperature", np.float32),
    ("top_p", np.float32),  # 1: off
    ("top_k", np.int32),  # 0: off (already 0 when >= the vocabulary)
    ("greedy", np.int32),
    ("seed", np.int64),
    ("draw", np.int64),
)
_ROW_BYTES = sum(np.dtype(d).itemsize for _, d in _COLUMNS)


@dataclass
class SamplingBatch:
    """The per-row parameters of one step: device tensors [rows] (views of the sampler's fixed buffers) and
    their host copies, plus the host-side flags that pick the code path."""

    rows: int  # rows, padding included (the logits passed to ``sample`` have this many)
    kind: str  # "greedy" | "sample" | "filter"
    candidates: int  # "filter": logits per row taken by top-k as threshold candidates (0 otherwise)
    max_top_n: int  # -1: no row asked for logprobs; else the largest top-N asked
    tensors: dict[str, torch.Tensor]  # column name -> [rows] tensor on the sampler's device
    host: dict[str, np.ndarray]  # column name -> [rows] array

    @property
    def path(self) -> tuple[str, int, int]:
        """What ``sample`` and ``logprobs`` launch depends on this (and ``rows``) only: key CUDA graphs on it."""
        return self.kind, self.candidates, self.max_top_n

    @property
    def all_greedy(self) -> bool:
        return self.kind == "greedy"

    @property
    def any_top_k(self) -> bool:
        return bool((self.host["top_k"] > 0).any())

    @property
    def any_top_p(self) -> bool:
        return bool((self.host["top_p"] < 1).any())


class Sampler:
    """Batched sampling on one device. ``max_rows``: the most rows a batch may have (padding included)
    for its device buffers to stay at fixed addresses; a larger batch reallocates them (graphs captured
    before then must be dropped).

    ``candidates``: on CUDA, the filter path's top-k candidates per row when a row has top-p without a
    top-k of at most that many (a larger nucleus is found by bisection, exactly but slower).
    ``use_triton``: None = on CUDA when Triton is importable; True also runs the Triton kernels on CPU
    tensors under ``TRITON_INTERPRET=1`` (tests); False = the torch path everywhere. ``block``: logits per
    kernel iteration (the Philox counter of a token depends on it, see ``_race_kernel``);
    ``rows_per_program``: rows of the row-wise kernels per program (1 on GPUs; more for many rows of a
    small vocabulary, as the interpreted tests draw). ``batch_invariant`` (deterministic inference): the logsumexp of
    logprobs over chunks of the vocabulary fixed by its size (kernels/batch_invariant.py), and on the torch path every
    exp, log and sum through layers/invariant.py; the race and the filters are batch-invariant as they are."""

    def __init__(
        self,
        vocab_size: int,
        device: torch.device | str,
        max_rows: int = 256,
        candidates: int = 1024,
        use_triton: bool | None = None,
        block: int = 1024,
        rows_per_program: int = 1,
        batch_invariant: bool = False,
    ):
        if not 16 <= block <= 4096 or block & (block - 1) or not 1 <= candidates <= 4096:
            raise ValueError("block: a power of two in [16, 4096]; candidates: in [1, 4096]")
        self.vocab_size = vocab_size
        self.batch_invariant = batch_invariant
        self.device = torch.device(device)
        self.candidates = candidates
        self.block = block
        self.rows_per_program = _pow2(rows_per_program)
        self.use_triton = triton_available(self.device) if use_triton is None else use_triton
        self._cuda = self.device.type == "cuda"
        self._cap = 0
        self._allocate(max_rows)

    # ---- host side -------------------------------------------------------------------------------------
    def _allocate(self, rows: int) -> None:
        cap = max(int(rows), 1)
        self._cap = cap
        self._dev = torch.zeros(cap * _ROW_BYTES, dtype=torch.uint8, device=self.device)
        if self._cuda:  # two pinned staging buffers, alternating; each reused only once its copy has run
            self._stage = [torch.zeros(cap * _ROW_BYTES, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
            self._copied = [None, None]
        else:  # CPU: the "device" buffer is host memory, written in place
            self._stage = [self._dev]
            self._copied = [None]
        self._parity = 0
        self._dev_cols = self._views(self._dev, torch)
        self._dev_rows: dict[int, dict[str, torch.Tensor]] = {}
        self._stage_cols = [self._views(s.numpy(), np) for s in self._stage]

    def _views(self, buf, lib) -> dict:
        out, off = {}, 0
        for name, dt in _COLUMNS:
            n = self._cap * np.dtype(dt).itemsize
            part = buf[off : off + n]
            out[name] = part.view(np.dtype(dt)) if lib is np else part.view(_TORCH_DTYPE[dt])
            off += n
        return out

    def prepare(
        self, states: Sequence[SamplingState], draw_index: Sequence[int], pad_to: int | None = None
    ) -> SamplingBatch:
        """Stage the rows of ``states`` (padding rows up to ``pad_to`` are greedy) and copy them to the device
        in one transfer. ``draw_index[i]``: the output index of the token row i draws."""
        n = len(states)
        rows = n if pad_to is None else max(pad_to, n)
        if rows > self._cap:
            self._allocate(max(rows, 2 * self._cap))
        self._parity = (self._parity + 1) % len(self._stage)
        if self._copied[self._parity] is not None:
            self._copied[self._parity].synchronize()  # the copy two steps ago: long done in practice
        stage = self._stage[self._parity]
        cols = self._stage_cols[self._parity]
        max_top_n = -1
        if n:
            rec = np.frombuffer(b"".join([st.record for st in states]), dtype=_RECORD)  # [n]
            cols["temperature"][:n] = rec["temperature"]
            cols["top_p"][:n] = rec["top_p"]
            cols["top_k"][:n] = np.where(rec["top_k"] >= self.vocab_size, 0, rec["top_k"])  # all kept: off
            cols["greedy"][:n] = rec["greedy"]
            cols["seed"][:n] = rec["seed"]
            cols["draw"][:n] = draw_index
            max_top_n = int(rec["logprobs"].max())
        if rows > n:
            for name, value in (("temperature", 1), ("top_p", 1), ("top_k", 0), ("greedy", 1), ("seed", 0), ("draw", 0)):
                cols[name][n:rows] = value
        if self._cuda:
            self._dev.copy_(stage, non_blocking=True)
            ev = self._copied[self._parity] = self._copied[self._parity] or torch.cuda.Event()
            ev.record()
        host = {name: cols[name][:rows].copy() for name, _ in _COLUMNS}  # the staging buffer is reused
        sampled = host["greedy"] == 0
        top_k, top_p = host["top_k"], host["top_p"]
        filtered = sampled & ((top_k > 0) | (top_p < 1))
        kind = "filter" if filtered.any() else "sample" if sampled.any() else "greedy"
        candidates = 0
        if kind == "filter":
            # top-k rows within the cap need their k candidates; any other filtered row needs the cap
            need = np.where((top_k > 0) & (top_k <= self.candidates), top_k, self.candidates)[filtered]
            candidates = min(self.vocab_size, max(min(16, self.candidates), _pow2(int(need.max()))))
        tensors = self._dev_rows.get(rows)
        if tensors is None:  # the same views for every batch of this many rows (slicing tensors costs us)
            tensors = self._dev_rows[rows] = {name: self._dev_cols[name][:rows] for name, _ in _COLUMNS}
        return SamplingBatch(rows, kind, candidates, max_top_n, tensors, host)

    # ---- device side -----------------------------------------------------------------------------------
    def sample(self, logits: torch.Tensor, batch: SamplingBatch, out: torch.Tensor | None = None) -> torch.Tensor:
        """logits [rows, V] float32 -> tokens [rows] long (into ``out`` when given), on the logits' device."""
        if logits.shape[0] != batch.rows:
            raise ValueError(f"logits have {logits.shape[0]} rows, the batch {batch.rows}")
        if batch.kind == "greedy" or logits.shape[0] == 0:
            return torch.argmax(logits, dim=-1) if out is None else torch.argmax(logits, dim=-1, out=out)
        if self.use_triton:
            x = logits if logits.stride(-1) == 1 else logits.contiguous()
            lo = None
            if batch.kind == "filter":
                lo = triton_filter_thresholds(
                    x, batch.tensors, batch.candidates, self.block, self.rows_per_program, _pow2(self.candidates)
                )
            return triton_race(x, batch.tensors, lo, self.block, out, self.rows_per_program)
        tokens = _sample_torch(logits, batch, self.candidates, self.batch_invariant)
        return tokens if out is None else out.copy_(tokens)

    def logprobs(
        self, logits: torch.Tensor, tokens: torch.Tensor, batch: SamplingBatch
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None] | None:
        """``compute_logprobs(logits, tokens, batch.max_top_n)`` for every row, or None when no row asked.
        On the Triton path without materialising log_softmax: log p = x - logsumexp(x)."""
        n = batch.max_top_n
        if n < 0:
            return None
        if not self.use_triton:
            return compute_logprobs(logits, tokens, n, self.batch_invariant)
        x = logits if logits.stride(-1) == 1 else logits.contiguous()
        lse = inv.logsumexp(x) if self.batch_invariant else triton_logsumexp(x, self.block)  # [N]
        chosen = logits.gather(1, tokens.view(-1, 1)).squeeze(1) - lse
        if n <= 0:
            return chosen, None, None
        values, ids = inv.top_n(logits, n) if self.batch_invariant else torch.topk(logits, n, dim=-1)
        return chosen, ids, values - lse[:, None]


_TORCH_DTYPE = {np.float32: torch.float32, np.int32: torch.int32, np.int64: torch.int64}


def _thresholds_torch(
    x: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, candidates: int,
    invariant: bool = False,
) -> torch.Tensor:
    """lo [M] for rows x [M, V] with k [M] (0 off), p [M] (1 off), T [M]: the exact rule of the module doc.
    As the Triton path: thresholds from the sorted top candidates; rows whose nucleus may extend past them
    (top-p without top-k) are done again over the whole sorted row."""
    M, V = x.shape
    need_p = top_p < 1
    nucleus_only = need_p & (top_k == 0)
    C = min(V, max(int(top_k.max()), candidates if bool(nucleus_only.any()) else 1))
    # [M, C] descending (a sort when every logit is a candidate: faster than topk of all of them)
    vals = torch.sort(x, dim=-1, descending=True).values if C == V else torch.topk(x, C, dim=-1).values
    ninf = torch.full((M,), float("-inf"), device=x.device)
    t_k = torch.where(top_k > 0, vals.gather(1, (top_k.long() - 1).clamp(0, C - 1)[:, None]).squeeze(1), ninf)
    if not bool(need_p.any()):
        return t_k
    m, T = vals[:, :1], temperature[:, None]
    kept = (x >= t_k[:, None]) & (x > float("-inf"))
    exp = inv.exp if invariant else torch.exp
    z = torch.where(kept, exp((x - m) / T), torch.zeros_like(x))  # [M, V]
    z = inv.row_sum(z) if invariant else z.sum(-1)  # [M] mass top-k keeps
    e = torch.where((vals >= t_k[:, None]) & (vals > float("-inf")), exp((vals - m) / T), torch.zeros_like(vals))
    incl = torch.cumsum(e, dim=-1)  # [M, C]; the mass before sorted position j is incl[j - 1]
    below = (incl < (top_p * z)[:, None]).sum(-1)  # sorted positions 0..below are kept
    t_p = vals.gather(1, below.clamp(max=C - 1)[:, None]).squeeze(1)
    lo = torch.where(need_p, torch.maximum(t_k, t_p), t_k)
    unsettled = nucleus_only & (below >= C)
    if C < V and bool(unsettled.any()):
        rows = torch.nonzero(unsettled).squeeze(1)
        lo[rows] = _thresholds_torch(x[rows], temperature[rows], top_k[rows], top_p[rows], V, invariant)
    return lo


def _sample_torch(logits: torch.Tensor, batch: SamplingBatch, candidates: int, invariant: bool = False) -> torch.Tensor:
    """The pure-torch path: filters batched; each sampled row's noise from a generator seeded per draw.
    ``invariant``: every exp, log and sum computed alike for every row (layers/invariant.py)."""
    x = logits.float()
    h = batch.host
    out = torch.argmax(x, dim=-1)  # greedy rows keep this
    rows = np.flatnonzero(h["greedy"] == 0)
    if rows.size == 0:
        return out
    idx = torch.from_numpy(rows).to(x.device)
    xs = x.index_select(0, idx)  # [M, V]
    dev = lambda a, dt=torch.float32: torch.from_numpy(np.ascontiguousarray(a[rows])).to(x.device, dt)  # noqa: E731
    temperature = dev(h["temperature"])
    lo = None
    if batch.kind == "filter":
        lo = _thresholds_torch(xs, temperature, dev(h["top_k"], torch.long), dev(h["top_p"]), candidates, invariant)
    gen = torch.Generator(device=x.device)
    noise = torch.empty_like(xs)  # [M, V]: exponential, then Gumbel, then the race's scores
    for j, r in enumerate(rows):
        gen.manual_seed(draw_key(int(h["seed"][r]), int(h["draw"][r])))
        noise[j].exponential_(generator=gen)  # CPU: drawn in double precision, so never 0 in practice
    noise = noise.clamp_min_(1e-38)
    noise = inv.log(noise) if invariant else noise.log_()
    score = noise.neg_().mul_(temperature[:, None]).add_(xs)  # x + T * Gumbel
    if lo is not None:
        score.masked_fill_(xs < lo[:, None], float("-inf"))
    out[idx] = torch.argmax(score, dim=-1)
    return out


def compute_logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, top_n: int, invariant: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Log-probabilities of the raw model distribution (before temperature), as vLLM reports them.

    Returns chosen [N], and when top_n > 0, top ids [N, top_n] and top values [N, top_n].
    ``invariant``: the log-softmax of layers/invariant.py (each row alike whatever the row count).
    """
    logp = inv.log_softmax(logits) if invariant else torch.log_softmax(logits, dim=-1)
    chosen = logp.gather(1, tokens[:, None]).squeeze(1)
    if top_n <= 0:
        return chosen, None, None
    values, ids = inv.top_n(logp, top_n) if invariant else torch.topk(logp, top_n, dim=-1)
    return chosen, ids, values
