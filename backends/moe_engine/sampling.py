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

from .errors import InvalidRequestError

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU wheels of torch do not bring Triton
    triton = None


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
    draws: int = 0  # draws made through the legacy ``sample(logits, states)`` (its draw index)
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
    return SamplingState(params, seed, 0, record)


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
    small vocabulary, as the interpreted tests draw)."""

    def __init__(
        self,
        vocab_size: int,
        device: torch.device | str,
        max_rows: int = 256,
        candidates: int = 1024,
        use_triton: bool | None = None,
        block: int = 1024,
        rows_per_program: int = 1,
    ):
        if not 16 <= block <= 4096 or block & (block - 1) or not 1 <= candidates <= 4096:
            raise ValueError("block: a power of two in [16, 4096]; candidates: in [1, 4096]")
        self.vocab_size = vocab_size
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
        tokens = _sample_torch(logits, batch, self.candidates)
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
            return compute_logprobs(logits, tokens, n)
        lse = triton_logsumexp(logits if logits.stride(-1) == 1 else logits.contiguous(), self.block)  # [N]
        chosen = logits.gather(1, tokens.view(-1, 1)).squeeze(1) - lse
        if n <= 0:
            return chosen, None, None
        values, ids = torch.topk(logits, n, dim=-1)
        return chosen, ids, values - lse[:, None]


_TORCH_DTYPE = {np.float32: torch.float32, np.int32: torch.int32, np.int64: torch.int64}


def _thresholds_torch(
    x: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, candidates: int
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
    z = torch.where(kept, torch.exp((x - m) / T), torch.zeros_like(x)).sum(-1)  # [M] mass top-k keeps
    e = torch.where((vals >= t_k[:, None]) & (vals > float("-inf")), torch.exp((vals - m) / T), torch.zeros_like(vals))
    incl = torch.cumsum(e, dim=-1)  # [M, C]; the mass before sorted position j is incl[j - 1]
    below = (incl < (top_p * z)[:, None]).sum(-1)  # sorted positions 0..below are kept
    t_p = vals.gather(1, below.clamp(max=C - 1)[:, None]).squeeze(1)
    lo = torch.where(need_p, torch.maximum(t_k, t_p), t_k)
    unsettled = nucleus_only & (below >= C)
    if C < V and bool(unsettled.any()):
        rows = torch.nonzero(unsettled).squeeze(1)
        lo[rows] = _thresholds_torch(x[rows], temperature[rows], top_k[rows], top_p[rows], V)
    return lo


def _sample_torch(logits: torch.Tensor, batch: SamplingBatch, candidates: int) -> torch.Tensor:
    """The pure-torch path: filters batched; each sampled row's noise from a generator seeded per draw."""
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
        lo = _thresholds_torch(xs, temperature, dev(h["top_k"], torch.long), dev(h["top_p"]), candidates)
    gen = torch.Generator(device=x.device)
    noise = torch.empty_like(xs)  # [M, V]: exponential, then Gumbel, then the race's scores
    for j, r in enumerate(rows):
        gen.manual_seed(draw_key(int(h["seed"][r]), int(h["draw"][r])))
        noise[j].exponential_(generator=gen)  # CPU: drawn in double precision, so never 0 in practice
    score = noise.clamp_min_(1e-38).log_().neg_().mul_(temperature[:, None]).add_(xs)  # x + T * Gumbel
    if lo is not None:
        score.masked_fill_(xs < lo[:, None], float("-inf"))
    out[idx] = torch.argmax(score, dim=-1)
    return out


# ---- Triton kernels (CUDA; CPU tensors under TRITON_INTERPRET=1 in tests) --------------------------------
def triton_available(device: torch.device | str) -> bool:
    return triton is not None and torch.device(device).type == "cuda"


def _pow2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _programs(device: torch.device) -> int:
    """Programs to aim for in a vocabulary-split launch: enough to fill the GPU."""
    if device.type == "cuda":
        return 4 * torch.cuda.get_device_properties(device).multi_processor_count
    return 8


def _split(V: int, block: int, parts: int) -> tuple[int, int]:
    """(splits, chunk): the vocabulary cut into at most ``parts`` chunks of whole blocks."""
    parts = max(1, min(parts, _cdiv(V, block)))
    chunk = _cdiv(_cdiv(V, parts), block) * block
    return _cdiv(V, chunk), chunk


# The top-p mass is summed in chunks of this many blocks whatever the batch: its rounding, hence the nucleus
# of a row, does not depend on the batch's size.
_MASS_BLOCKS = 8


def triton_filter_thresholds(
    x: torch.Tensor, cols: dict, C: int, block: int, rows: int = 1, block_c: int | None = None
) -> torch.Tensor:
    """lo [N] float32 for logits x [N, V] (unit last stride): the filter threshold of each row. ``rows``:
    rows per program of the row-wise kernels. ``block_c`` (>= C): the width of the candidates' prefix sum;
    the sampler keeps it fixed, so that a row's rounding (its nucleus) does not depend on the batch's C."""
    N, V = x.shape
    cand = torch.topk(x, C, dim=-1, sorted=True).values  # [N, C] descending
    S, chunk = _split(V, block, _cdiv(V, block * _MASS_BLOCKS))
    part = torch.empty(N, S, dtype=torch.float32, device=x.device)  # [N, S] top-p mass per chunk
    params = (cand, C, cols["temperature"], cols["top_k"], cols["top_p"])
    _mass_kernel[(_cdiv(N, rows), S)](x, x.stride(0), *params, part, N, V, chunk, S, ROWS=rows, BLOCK=block)
    lo = torch.empty(N, dtype=torch.float32, device=x.device)
    unsettled = torch.empty(N, dtype=torch.int32, device=x.device)
    _threshold_kernel[(_cdiv(N, rows),)](
        *params, part, lo, unsettled, N, S, ROWS=rows, BLOCK_C=_pow2(max(C, block_c or C)), BLOCK_S=_pow2(S)
    )
    _bisect_kernel[(N,)](x, x.stride(0), *params, lo, unsettled, V, BLOCK=block)
    return lo


def triton_race(
    x: torch.Tensor, cols: dict, lo: torch.Tensor | None, block: int, out: torch.Tensor | None = None, rows: int = 1
) -> torch.Tensor:
    """tokens [N] long: per row the argmax of x (greedy rows) or of x + T * Gumbel over x >= lo."""
    N, V = x.shape
    S, chunk = _split(V, block, _cdiv(_programs(x.device), _cdiv(N, rows)))
    best = torch.empty(N, S, dtype=torch.float32, device=x.device)  # [N, S] best score per chunk
    where = torch.empty(N, S, dtype=torch.int32, device=x.device)  # [N, S] its token
    _race_kernel[(_cdiv(N, rows), S)](
        x, x.stride(0), cols["temperature"], cols["greedy"], cols["seed"], cols["draw"],
        x if lo is None else lo, best, where, N, V, chunk, S, HAS_LO=lo is not None, ROWS=rows, BLOCK=block,
    )
    out = torch.empty(N, dtype=torch.long, device=x.device) if out is None else out
    _race_finish_kernel[(_cdiv(N, rows),)](best, where, out, N, S, ROWS=rows, BLOCK_S=_pow2(S))
    return out


def triton_logsumexp(x: torch.Tensor, block: int) -> torch.Tensor:
    """logsumexp of each row of x [N, V] in one pass over x (online max and sum per chunk)."""
    N, V = x.shape
    S, chunk = _split(V, block, _cdiv(_programs(x.device), N))
    pm = torch.empty(N, S, dtype=torch.float32, device=x.device)
    ps = torch.empty(N, S, dtype=torch.float32, device=x.device)
    _lse_kernel[(N, S)](x, x.stride(0), pm, ps, V, chunk, S, BLOCK=block)
    m = pm.amax(dim=-1, keepdim=True)
    return (m + torch.log((ps * torch.exp(pm - m)).sum(dim=-1, keepdim=True))).squeeze(1)


if triton is not None:

    @triton.jit
    def _key(x):
        """float32 -> int32 of the same order (-0.0 counted as +0.0)."""
        b = (x + 0.0).to(tl.int32, bitcast=True)
        return tl.where(b >= 0, b, b ^ 0x7FFFFFFF)

    @triton.jit
    def _unkey(k):
        return tl.where(k >= 0, k, k ^ 0x7FFFFFFF).to(tl.float32, bitcast=True)

    @triton.jit
    def _gumbel(r):
        """Gumbel noise -log(E) from 32 random bits: E = -log(1 - w) exponential, w = (r + 1/2) / 2^32 in
        (0, 1); small E (the large noise that wins races) is w + w^2/2, exact where 1 - w would round."""
        w = (r.to(tl.float32) + 0.5) * 2.3283064365386963e-10
        e = tl.where(w < 0.0009765625, w + 0.5 * w * w, -tl.log(1.0 - w))
        return -tl.log(e)

    @triton.jit
    def _race_update(best, best_tok, x_rows, offs, end, live, r, t, lo, greedy):
        x = tl.load(x_rows + offs[None, :], mask=live & (offs < end)[None, :], other=float("-inf")).to(tl.float32)
        score = tl.where(greedy, x, tl.where(x >= lo, x + t * _gumbel(r), float("-inf")))
        take = score > best  # strict: a lane keeps its first (lowest) token among equal scores
        return tl.where(take, score, best), tl.where(take, offs[None, :], best_tok)

    @triton.jit
    def _race_kernel(
        x_ptr, stride, temp_ptr, greedy_ptr, seed_ptr, draw_ptr, lo_ptr, best_ptr, where_ptr, N, V, CHUNK, S,
        HAS_LO: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr,
    ):
        """Program (row group, s): each row's best (score, token) in chunk s; ties: the lowest token.

        Noise: Philox4x32-10 keyed by the row's seed; one call (counter = (c, draw)) gives 4 words, for the
        tokens base + j * BLOCK/4 + lane (j = 0..3) of the block starting at base, c = base / 4 + lane."""
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        s = tl.program_id(1)
        ok = rows < N
        live = ok[:, None]
        Q: tl.constexpr = BLOCK // 4
        lanes = tl.arange(0, Q)
        x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride
        t = tl.load(temp_ptr + rows, mask=ok, other=1.0)[:, None]
        greedy = (tl.load(greedy_ptr + rows, mask=ok, other=1) != 0)[:, None]
        seed = tl.load(seed_ptr + rows, mask=ok, other=0)[:, None]
        draw = tl.load(draw_ptr + rows, mask=ok, other=0)[:, None]
        lo = tl.full([ROWS, 1], float("-inf"), tl.float32)
        if HAS_LO:
            lo = tl.load(lo_ptr + rows, mask=ok, other=float("-inf"))[:, None]
        start = s * CHUNK
        end = tl.minimum(start + CHUNK, V)
        best = tl.full([ROWS, Q], float("-inf"), tl.float32)
        best_tok = tl.full([ROWS, Q], 2147483647, tl.int32)
        for off in range(start, end, BLOCK):
            r0, r1, r2, r3 = tl.randint4x(seed, (draw << 32) | (off // 4 + lanes).to(tl.int64)[None, :])
            best, best_tok = _race_update(best, best_tok, x_rows, off + lanes, end, live, r0, t, lo, greedy)
            best, best_tok = _race_update(best, best_tok, x_rows, off + Q + lanes, end, live, r1, t, lo, greedy)
            best, best_tok = _race_update(best, best_tok, x_rows, off + 2 * Q + lanes, end, live, r2, t, lo, greedy)
            best, best_tok = _race_update(best, best_tok, x_rows, off + 3 * Q + lanes, end, live, r3, t, lo, greedy)
        top = tl.max(best, 1)
        tok = tl.min(tl.where(best == top[:, None], best_tok, 2147483647), 1)
        tl.store(best_ptr + rows * S + s, top, mask=ok)
        tl.store(where_ptr + rows * S + s, tok, mask=ok)

    @triton.jit
    def _race_finish_kernel(best_ptr, where_ptr, out_ptr, N, S, ROWS: tl.constexpr, BLOCK_S: tl.constexpr):
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        ok = rows < N
        j = tl.arange(0, BLOCK_S)[None, :]
        at = rows[:, None] * S + j
        live = ok[:, None] & (j < S)
        best = tl.load(best_ptr + at, mask=live, other=float("-inf"))
        tok = tl.load(where_ptr + at, mask=live, other=2147483647)
        tok = tl.min(tl.where(best == tl.max(best, 1)[:, None], tok, 2147483647), 1)
        tl.store(out_ptr + rows, tl.where(tok == 2147483647, 0, tok).to(tl.int64), mask=ok)  # all -inf: 0

    @triton.jit
    def _top_k_value(cand_ptr, rows, k, C, ok):
        """The k-th largest logit of each row when its candidates hold it, else -inf (no top-k, or k > C)."""
        t_k = tl.load(cand_ptr + rows * C + tl.minimum(tl.maximum(k - 1, 0), C - 1), mask=ok, other=0.0)
        return tl.where((k > 0) & (k <= C), t_k, float("-inf"))

    @triton.jit
    def _mass_kernel(
        x_ptr, stride, cand_ptr, C, temp_ptr, top_k_ptr, top_p_ptr, part_ptr, N, V, CHUNK, S,
        ROWS: tl.constexpr, BLOCK: tl.constexpr,
    ):
        """Program (row group, s): sum over chunk s of exp((x - max) / T) for the x that top-k keeps, for
        the rows with top-p (0 for the others)."""
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        s = tl.program_id(1)
        ok = rows < N
        need = ok & (tl.load(top_p_ptr + rows, mask=ok, other=1.0) < 1.0)
        t = tl.load(temp_ptr + rows, mask=ok, other=1.0)[:, None]
        m = tl.load(cand_ptr + rows * C, mask=ok, other=0.0)[:, None]
        t_k = _top_k_value(cand_ptr, rows, tl.load(top_k_ptr + rows, mask=ok, other=0), C, ok)[:, None]
        x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride
        start = s * CHUNK
        end = tl.minimum(start + CHUNK, V)
        acc = tl.zeros([ROWS, BLOCK], dtype=tl.float32)
        for off in range(start, end, BLOCK):
            offs = (off + tl.arange(0, BLOCK))[None, :]
            x = tl.load(x_rows + offs, mask=need[:, None] & (offs < end), other=float("-inf")).to(tl.float32)
            acc += tl.where((x >= t_k) & (x > float("-inf")), tl.exp((x - m) / t), 0.0)
        tl.store(part_ptr + rows * S + s, tl.sum(acc, 1), mask=ok)

    @triton.jit
    def _threshold_kernel(
        cand_ptr, C, temp_ptr, top_k_ptr, top_p_ptr, part_ptr, lo_ptr, unsettled_ptr, N, S,
        ROWS: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_S: tl.constexpr,
    ):
        """Program row group: lo = max(k-th largest logit, nucleus boundary) from the sorted candidates. The
        nucleus ends at the last candidate whose preceding mass is < p * (the mass top-k keeps); rows the
        candidates cannot settle (k > C, or a nucleus that may go on past them) are flagged for bisection."""
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        ok = rows < N
        k = tl.load(top_k_ptr + rows, mask=ok, other=0)
        p = tl.load(top_p_ptr + rows, mask=ok, other=1.0)
        t = tl.load(temp_ptr + rows, mask=ok, other=1.0)
        need = ok & (p < 1.0)
        m = tl.load(cand_ptr + rows * C, mask=ok, other=0.0)
        t_k = _top_k_value(cand_ptr, rows, k, C, ok)
        j = tl.arange(0, BLOCK_C)[None, :]
        c = tl.load(cand_ptr + rows[:, None] * C + j, mask=need[:, None] & (j < C), other=float("-inf"))
        e = tl.where((c >= t_k[:, None]) & (c > float("-inf")), tl.exp((c - m[:, None]) / t[:, None]), 0.0)
        incl = tl.cumsum(e, 1)  # mass up to and including candidate j
        sj = tl.arange(0, BLOCK_S)[None, :]
        z = tl.sum(tl.load(part_ptr + rows[:, None] * S + sj, mask=need[:, None] & (sj < S), other=0.0), 1)
        below = tl.sum(((incl < (p * z)[:, None]) & (j < C)).to(tl.int32), 1)  # candidates 0..below are kept
        t_p = tl.load(cand_ptr + rows * C + tl.minimum(below, C - 1), mask=ok, other=0.0)
        tl.store(lo_ptr + rows, tl.where(need, tl.maximum(t_k, t_p), t_k), mask=ok)
        unsettled = (k > C) | (need & (k == 0) & (below >= C))
        tl.store(unsettled_ptr + rows, unsettled.to(tl.int32), mask=ok)

    @triton.jit
    def _count_at_least(x_row, V, key, BLOCK: tl.constexpr):
        acc = tl.zeros([BLOCK], dtype=tl.int32)
        for off in range(0, V, BLOCK):
            offs = off + tl.arange(0, BLOCK)
            x = tl.load(x_row + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
            acc += ((_key(x) >= key) & (offs < V)).to(tl.int32)
        return tl.sum(acc, 0)

    @triton.jit
    def _mass_above(x_row, V, key, m, t, BLOCK: tl.constexpr):
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for off in range(0, V, BLOCK):
            offs = off + tl.arange(0, BLOCK)
            x = tl.load(x_row + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
            acc += tl.where((_key(x) > key) & (x > float("-inf")), tl.exp((x - m) / t), 0.0)
        return tl.sum(acc, 0)

    @triton.jit
    def _bisect_kernel(
        x_ptr, stride, cand_ptr, C, temp_ptr, top_k_ptr, top_p_ptr, lo_ptr, unsettled_ptr, V, BLOCK: tl.constexpr
    ):
        """Program row, for a row flagged unsettled (others return at once): its exact threshold by bisection
        over the int keys of its logits, one pass over the row per step, at most 32 steps each: the k-th
        largest logit (k > 0), then the smallest key whose strictly-greater mass is < p (p < 1)."""
        row = tl.program_id(0)
        if tl.load(unsettled_ptr + row) != 0:
            x_row = x_ptr + row.to(tl.int64) * stride
            k = tl.load(top_k_ptr + row)
            p = tl.load(top_p_ptr + row)
            t = tl.load(temp_ptr + row)
            m = tl.load(cand_ptr + row * C)
            t_k = tl.full([], float("-inf"), tl.float32)
            if k > 0:  # the largest key with at least k logits at or above it
                lo = tl.full([], -2139095041, tl.int64)  # _key(-inf): every logit is at or above it
                hi = _key(m).to(tl.int64)
                while lo < hi:
                    mid = lo + (hi - lo + 1) // 2
                    if _count_at_least(x_row, V, mid.to(tl.int32), BLOCK) >= k:
                        lo = mid
                    else:
                        hi = mid - 1
                t_k = _unkey(lo.to(tl.int32))
            out = t_k
            if p < 1.0:  # the smallest key a with mass(keys > a) < p * mass(logits >= t_k)
                a = _key(t_k).to(tl.int64) - 1
                b = _key(m).to(tl.int64)
                target = p * _mass_above(x_row, V, a.to(tl.int32), m, t, BLOCK)
                while a < b:
                    mid = a + (b - a) // 2
                    if _mass_above(x_row, V, mid.to(tl.int32), m, t, BLOCK) < target:
                        b = mid
                    else:
                        a = mid + 1
                out = tl.maximum(t_k, _unkey(a.to(tl.int32)))
            tl.store(lo_ptr + row, out)

    @triton.jit
    def _lse_kernel(x_ptr, stride, pm_ptr, ps_ptr, V, CHUNK, S, BLOCK: tl.constexpr):
        """Program (row, s): max m and sum of exp(x - m) over chunk s (online: one read of the logits)."""
        row = tl.program_id(0)
        s = tl.program_id(1)
        x_row = x_ptr + row.to(tl.int64) * stride
        start = s * CHUNK
        end = tl.minimum(start + CHUNK, V)
        m_run = tl.full([BLOCK], float("-inf"), tl.float32)
        s_run = tl.zeros([BLOCK], dtype=tl.float32)
        for off in range(start, end, BLOCK):
            offs = off + tl.arange(0, BLOCK)
            x = tl.load(x_row + offs, mask=offs < end, other=float("-inf")).to(tl.float32)
            m_new = tl.maximum(m_run, x)
            live = m_new > float("-inf")
            s_run = tl.where(live, s_run * tl.exp(m_run - m_new) + tl.exp(x - m_new), 0.0)
            m_run = m_new
        top = tl.max(m_run, 0)
        total = tl.sum(tl.where(m_run > float("-inf"), s_run * tl.exp(m_run - top), 0.0), 0)
        tl.store(pm_ptr + row * S + s, top)
        tl.store(ps_ptr + row * S + s, total)


# ---- the engine's current API, kept as thin wrappers -------------------------------------------------------
_legacy: dict[tuple[str, int], Sampler] = {}


def sample(logits: torch.Tensor, states: list[SamplingState]) -> torch.Tensor:
    """logits [N, V] float32 -> next tokens [N] long (on the logits' device). Each state's draw index is the
    number of draws made for it through this function."""
    key = (str(logits.device), logits.shape[1])
    sampler = _legacy.get(key)
    if sampler is None:
        sampler = _legacy[key] = Sampler(logits.shape[1], logits.device, max_rows=max(len(states), 64))
    batch = sampler.prepare(states, [st.draws for st in states])
    for st in states:
        st.draws += 1
    return sampler.sample(logits, batch)


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
