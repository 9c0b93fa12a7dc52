"""Batch-invariant primitives: what the forward computes with ``--enable-deterministic-inference``.

A row's result (a token's hidden state, its logits, its expert ids) must be a function of that row alone, never of
how many rows share the call or where the row sits in it. Which torch operations break that, and the variant used
instead (docs/design/determinism.md has the measurements):

* GEMMs. A BLAS blocks a GEMM by its row count: MKL computes one row differently at M = 1..3 than in a larger GEMM,
  and with two threads also at M = 5-11 (each thread gets a few rows). ``linear`` runs every GEMM in tiles of
  exactly ``TILE_ROWS`` rows (the last one zero-padded): every call has one shape, so the library makes the same
  choices every time. That a row's result then does not depend on its place in the tile nor on the other rows is
  checked once per weight shape, on this machine's BLAS, before the shape's first result is used (``_check_tiles``:
  every row at every place of the tile); a BLAS that fails it stops the engine instead of serving. On a GPU
  (Triton kernels on) ``kernels/batch_invariant.py``'s GEMM, invariant by construction.
* Elementwise functions on CPU (silu, sigmoid, rsqrt, exp, log, cos, sin, complex products). torch runs a
  contiguous tensor's elements through vector code and the last ``n mod 2 x vector width`` through scalar code,
  which rounds some results differently (silu and sigmoid of ~3.5% of float32 inputs, rsqrt of ~50% on an AVX2
  EPYC); a row of a [T, W] tensor falls in that tail or not by T. ``elementwise`` pads every call to a multiple of
  64 elements and cuts it into pieces that one thread runs whole: no element ever takes the scalar path. (+, -, *,
  /, casts, comparisons and max are single IEEE operations, the same in both paths, and need nothing.)
* Reductions. torch's CPU sum over a row of 40,000 elements is split over threads when it is the only row, not when
  there are several. ``row_sum`` adds a row's elements left to right: on CPU ``cumsum`` (a sequential scan per row;
  float32 accumulates in double), on a GPU explicit adds for the short rows a model fixes (router weights), else a
  Triton kernel with one program per row. softmax, log-softmax and logsumexp are built from it, from max (exact in
  any order) and from ``elementwise`` exp / log.
* Attention. ``attention`` (CPU): scores summed left to right over the head dimension, the softmax's sums and the
  weighted values summed left to right over the keys from position 0, masked keys adding exact zeros: a query's
  output depends on its own keys only, whatever its chunk, its batch, or whether its keys came from the prefix
  cache. On a GPU, ``kernels/batch_invariant.py``'s paged kernel.

Everything else the forward does (gathers, top-k, the routing bookkeeping, the HF-order expert sum) is exact.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

TILE_ROWS = 64  # rows of every CPU GEMM call
_EW_QUANTUM = 64  # elements: a multiple of every vector loop's step (2 x the widest vector, bfloat16 on AVX-512)
_EW_PIECE = 32768  # at::internal::GRAIN_SIZE: an elementwise op on at most this many elements runs on one thread
_SMALL_ROW = 16  # rows this short are summed by explicit adds (router weights, group scores)
_ATTN_ELEMENTS = 1 << 22  # query x key x head-dimension products per block of queries in ``attention``

_CHECKED: dict[tuple, bool] = {}  # GEMM shapes whose tiles were checked on this machine (``_check_tiles``)


class NotBatchInvariant(RuntimeError):
    """This machine's BLAS computes a row of a fixed-shape GEMM differently by its place in the GEMM."""


# ----------------------------------------------------------------------------------------------- GEMMs


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           kernels: bool = False) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` ([..., K] x [N, K] -> [..., N]) whose every output row depends only on its input
    row. ``kernels``: the Triton GEMM (GPU, or the interpreter in tests), else fixed-shape BLAS tiles."""
    if kernels:
        from ..kernels import batch_invariant as bi_kernels

        return bi_kernels.linear(x, weight, bias)
    if x.device.type != "cpu":
        raise NotBatchInvariant("deterministic inference on a GPU runs the Triton GEMM (fused kernels on)")
    K, N = x.shape[-1], weight.shape[0]
    rows = x.reshape(-1, K)
    T = rows.shape[0]
    dtype = torch.result_type(rows, weight)
    if T == 0:
        return torch.empty(*x.shape[:-1], N, dtype=dtype)
    _check_tiles(weight, bias, rows.dtype)
    return _tiled(rows, weight, bias).view(*x.shape[:-1], N)


def _tiled(rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """rows [T, K] -> [T, N], one BLAS call per TILE_ROWS rows into one output buffer: every call has the shape
    [TILE_ROWS, K] x [K, N], its operands start 64-byte aligned (fresh buffers, whole tiles apart)."""
    T, K = rows.shape
    R = TILE_ROWS
    padded = -(-T // R) * R
    a = rows.new_zeros(padded, K)
    a[:T] = rows
    wt = weight.t()
    out = torch.empty(padded, weight.shape[0], dtype=torch.result_type(rows, weight))
    for lo in range(0, padded, R):
        if bias is None:
            torch.mm(a[lo : lo + R], wt, out=out[lo : lo + R])
        else:
            torch.addmm(bias, a[lo : lo + R], wt, out=out[lo : lo + R])
    return out[:T]


def _check_tiles(weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> None:
    """Once per GEMM shape (and layout, dtype, bias, thread count): run a tile of random rows at every rotation and
    require each row's result to be the same bits at every place. Raises NotBatchInvariant otherwise."""
    key = (tuple(weight.shape), tuple(weight.stride()), weight.dtype, dtype, bias is None, torch.get_num_threads())
    if key in _CHECKED:
        return
    g = torch.Generator().manual_seed(52)
    R, K = TILE_ROWS, weight.shape[1]
    rows = torch.randn(R, K, generator=g).to(dtype)
    first = _tiled(rows, weight, bias)
    for shift in range(1, R):
        moved = _tiled(torch.roll(rows, shift, 0), weight, bias)
        if not torch.equal(torch.roll(moved, -shift, 0), first):
            raise NotBatchInvariant(
                f"this CPU's BLAS ({torch.get_num_threads()} threads) computes a row of a [{R}, {K}] x "
                f"[{K}, {weight.shape[0]}] {dtype} GEMM differently by its place in the GEMM: deterministic "
                f"inference cannot run on it (try fewer threads: --num-threads)")
    _CHECKED[key] = True


# ----------------------------------------------------------------------------------------------- elementwise


def elementwise(fn, *xs: torch.Tensor) -> torch.Tensor:
    """``fn(*xs)`` (an elementwise function of tensors of one shape after broadcasting), each element computed by
    the same code whatever the tensor's size: on CPU the elements are zero-padded to a multiple of 64 and run in
    pieces of at most ``_EW_PIECE`` (one thread each), so none takes the scalar tail of torch's vector loops. Other
    devices compute every element alike already."""
    if xs[0].device.type != "cpu":
        return fn(*xs)
    xs = torch.broadcast_tensors(*xs)
    shape, n = xs[0].shape, xs[0].numel()
    if n == 0:
        return fn(*xs)
    padded = -(-n // _EW_QUANTUM) * _EW_QUANTUM
    flats = []
    for x in xs:
        f = x.new_zeros(padded)
        f[:n] = x.reshape(-1)
        flats.append(f)
    pieces = [fn(*(f[lo : lo + _EW_PIECE] for f in flats)) for lo in range(0, padded, _EW_PIECE)]
    out = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
    return out[:n].view(shape)


def silu(x: torch.Tensor) -> torch.Tensor:
    return elementwise(F.silu, x)


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    return elementwise(torch.sigmoid, x)


def exp(x: torch.Tensor) -> torch.Tensor:
    return elementwise(torch.exp, x)


def log(x: torch.Tensor) -> torch.Tensor:
    return elementwise(torch.log, x)


def rsqrt(x: torch.Tensor) -> torch.Tensor:
    return elementwise(torch.rsqrt, x)


def cos(x: torch.Tensor) -> torch.Tensor:
    return elementwise(torch.cos, x)


def sin(x: torch.Tensor) -> torch.Tensor:
    return elementwise(torch.sin, x)


def mul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a * b for complex tensors (a complex product rounds more than once, and its vector code fuses)."""
    return elementwise(torch.mul, a, b)


# ----------------------------------------------------------------------------------------------- reductions


def row_sum(x: torch.Tensor, keepdim: bool = False) -> torch.Tensor:
    """``x.sum(-1)`` with each row's elements added left to right, so that trailing zeros (masked keys, padding)
    change nothing. CPU: ``cumsum``, a sequential scan per row (float32 accumulates in double, rounded once); other
    devices: explicit adds for rows of at most ``_SMALL_ROW`` (a width the model fixes: router weights), else a
    Triton kernel with one program per row."""
    W = x.shape[-1]
    if W == 0:
        out = x.new_zeros(x.shape[:-1])
    elif x.device.type == "cpu":
        out = x.cumsum(-1)[..., -1]
    elif W <= _SMALL_ROW:
        out = x[..., 0]
        for j in range(1, W):
            out = out + x[..., j]
    else:
        from ..kernels import batch_invariant as bi_kernels

        out = bi_kernels.row_sum(x)
    return out.unsqueeze(-1) if keepdim else out


def softmax(x: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """softmax over the last dimension, in float32, returned in ``dtype`` (default: x's). On CUDA torch's own (one
    warp, or one block, per row; its launch is chosen from the row length only)."""
    out_dtype = dtype or x.dtype
    if x.device.type != "cpu":
        return torch.softmax(x, dim=-1, dtype=torch.float32).to(out_dtype)
    x = x.float()
    e = exp(x - x.amax(-1, keepdim=True))
    return (e / row_sum(e, keepdim=True)).to(out_dtype)


def logsumexp(x: torch.Tensor) -> torch.Tensor:
    """logsumexp over the last dimension of float32 rows [N, V] -> [N]."""
    if x.device.type != "cpu":
        from ..kernels import batch_invariant as bi_kernels

        return bi_kernels.logsumexp(x)
    x = x.float()
    m = x.amax(-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    return (log(row_sum(exp(x - m), keepdim=True)) + m).squeeze(-1)


def log_softmax(x: torch.Tensor) -> torch.Tensor:
    x = x.float()
    return x - logsumexp(x)[..., None]


def top_n(x: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, ids) of the n largest of each row, ties in ascending id order. ``torch.topk`` orders tied values by
    how its selection went, which depends on k: the top-2 of a row asked beside a top-3 request (a step's top-N is
    the largest any of its rows asks) could list two tied tokens the other way round. A stable sort does not."""
    values, ids = torch.sort(x, dim=-1, descending=True, stable=True)
    return values[..., :n], ids[..., :n]


# ----------------------------------------------------------------------------------------------- attention


def attention(
    q: torch.Tensor,  # [T, Hq, Dk]
    keys: torch.Tensor,  # [B, Hkv, Lk, Dk]: each sequence's keys from position 0 (past its length: anything)
    values: torch.Tensor,  # [B, Hkv, Lk, Dv]
    batch,  # ForwardBatch: token_seq, positions, seq_lens
    scale: float,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,  # [Hq]
) -> torch.Tensor:  # [T, Hq, Dv] in q's dtype
    """Causal attention of each query over its own sequence's keys, every sum in a fixed order (float32): q . k
    added over the head dimension left to right, the softmax's max (exact), exp, and its sum and the weighted
    values added key by key from position 0, starting from +0. A masked key adds an exact zero wherever it stands, so a query's result depends on its position, its query
    vector and its sequence's keys only: not on the step's padding, its chunking, its other sequences, or on
    whether the keys came from the prefix cache. Sinks (GPT-OSS) join the softmax's denominator. Queries run in
    blocks (of one sequence or several), each over the longest key range among them."""
    T, Hq, Dk = q.shape
    B, Hkv, Lk, _ = keys.shape
    Dv, G = values.shape[-1], Hq // keys.shape[1]
    out = torch.empty(T, Hq, Dv, dtype=q.dtype, device=q.device)
    if T == 0:
        return out
    valid = torch.arange(Lk, device=q.device)[None, :] < batch.seq_lens[:, None]  # [B, Lk]; past it: stale memory
    keys = torch.where(valid[:, None, :, None], keys, 0).float().permute(3, 0, 1, 2)  # [Dk, B, Hkv, Lk]
    values = torch.where(valid[:, None, :, None], values, 0).float().permute(2, 0, 1, 3)  # [Lk, B, Hkv, Dv]
    seq_lens = batch.seq_lens.tolist()
    token_seq = batch.token_seq.tolist()
    step = max(1, _ATTN_ELEMENTS // max(1, Hq * Lk * max(Dk, Dv)))
    for lo in range(0, T, step):
        hi = min(T, lo + step)
        n, L = hi - lo, max(seq_lens[b] for b in set(token_seq[lo:hi]))
        seq, pos = batch.token_seq[lo:hi], batch.positions[lo:hi]
        qs = q[lo:hi].float().view(n, Hkv, G, Dk)
        ks = keys[:, seq, :, :L]  # [Dk, n, Hkv, L]
        scores = qs[..., 0, None] * ks[0][:, :, None, :]
        for d in range(1, Dk):
            scores = scores + qs[..., d, None] * ks[d][:, :, None, :]  # [n, Hkv, G, L]
        scores = scores * scale
        k_pos = torch.arange(L, device=q.device)
        allowed = k_pos[None, :] <= pos[:, None]  # [n, L]
        if sliding_window is not None:
            allowed &= k_pos[None, :] > pos[:, None] - sliding_window
        scores = scores.masked_fill(~allowed[:, None, None, :], float("-inf"))
        m = scores.amax(-1, keepdim=True)  # every query sees itself: finite
        if sinks is not None:
            sink = sinks.float().view(1, Hkv, G, 1)
            m = torch.maximum(m, sink)
        p = exp(scores - m)  # masked keys: exactly 0
        vs = values[:L, seq]  # [L, n, Hkv, Dv]
        total = torch.zeros(n, Hkv, G, 1, device=q.device)
        o = torch.zeros(n, Hkv, G, Dv, device=q.device)
        for j in range(L):  # key by key from position 0: the block's longest range adds exact zeros for the others
            total = total + p[..., j, None]
            o = o + p[..., j, None] * vs[j][:, :, None, :]
        if sinks is not None:
            total = total + exp(sink - m)
        out[lo:hi] = (o / total).view(n, Hq, Dv).to(q.dtype)
    return out


def attention_from_cache(q, cache, batch, scale, sliding_window=None, sinks=None) -> torch.Tensor:
    """``attention`` over a paged layer cache (layers/attend.py's ``LayerKV``), gathering each sequence's keys."""
    from .attend import cached_kv

    keys, values = cached_kv(cache, batch)  # [B, Hkv, Lk, D]
    return attention(q, keys, values, batch, scale, sliding_window, sinks)



class InvariantLinear(torch.nn.Linear):
    """An ``nn.Linear`` whose forward is ``linear`` (MoEForCausalLM.use_batch_invariant swaps a Linear's class to
    this and back: same parameters, same names)."""

    bi_kernels = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.bi_kernels)
