"""The batch-invariant building blocks of deterministic inference, one by one (test_deterministic.py runs them in the
engine): a row's result is the same bits whatever else shares the call.

The Triton kernels (kernels/batch_invariant.py, fused_moe.py's deterministic config) run under Triton's interpreter on
CPU, where a row's dot products are summed row by row (as a GPU tensor-core instruction sums them), so what these
tests check there is the kernels' structure: one tile configuration, a K split and a key split fixed by the shapes,
the two organisations of a GEMM and of a decode step giving the same bits. ``MOE_TEST_DEVICE=cuda`` checks the
compiled kernels, tensor-core instructions included. The CPU primitives (layers/invariant.py) run on CPU only.
"""
from __future__ import annotations

import os
import random

import pytest
import torch
import torch.nn.functional as F

from moe_engine.kernels import batch_invariant as bi
from moe_engine.kernels import fused_moe
from moe_engine.kernels import moe_routing as routing_kernels
from moe_engine.kernels import support as kernel_support
from moe_engine.layers import invariant as inv

from .test_paged_attention import assert_close

DEVICE = os.environ.get("MOE_TEST_DEVICE", "cpu")
needs_kernels = pytest.mark.skipif(not kernel_support.available(DEVICE),
                                   reason="Triton (or its interpreter) unavailable")
cpu_only = pytest.mark.skipif(DEVICE != "cpu", reason="the CPU primitives")
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])


def rand(*shape, dtype=torch.float32, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(DEVICE, dtype)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The same bits (NaN == NaN, -0.0 != 0.0)."""
    def bits(t):
        return torch.empty_like(t, memory_format=torch.contiguous_format).copy_(t).view(torch.uint8)

    return a.shape == b.shape and a.dtype == b.dtype and bool(torch.equal(bits(a), bits(b)))


# ----------------------------------------------------------------------------------------------- GEMM


@needs_kernels
@DTYPES
@pytest.mark.parametrize("K,N,bias", [(100, 96, False), (130, 40, True), (300, 20, False)])
def test_triton_gemm_rows_do_not_depend_on_the_row_count_or_the_split_organisation(K, N, bias, dtype):
    """Rows 0..M-1 of a GEMM of M rows are the first rows of the GEMM of all of them, for row counts that take
    either organisation (per-split programs + the ordered sum, or the splits summed inside each program); the
    K split is fixed by the weight's shape (at least two splits here) and the result is F.linear's within
    rounding."""
    w, b = rand(N, K, dtype=dtype, seed=1, scale=K**-0.5), (rand(N, dtype=dtype, seed=2) if bias else None)
    x = rand(150, K, dtype=dtype, seed=3)
    assert bi.k_splits(N, K, dtype)[1] >= 2
    full = bi.linear(x, w, b, splits=False)
    assert same(bi.linear(x, w, b, splits=True), full)
    for M in (1, 2, 3, 17, 64, 65, 129):
        for splits in (True, False):
            assert same(bi.linear(x[:M], w, b, splits=splits), full[:M]), (M, splits)
    assert same(bi.linear(x[37:38], w.t().contiguous().t(), b), full[37:38])  # a transposed weight's strides
    ref = F.linear(x.float(), w.float(), None if b is None else b.float())
    assert_close(full, ref, dtype, "F.linear")


@cpu_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cpu_gemm_rows_do_not_depend_on_the_row_count(dtype):
    """MKL computes a row of a 1-3 row GEMM (and, with two threads, of 5-11 rows) otherwise than in a larger one;
    the fixed-shape tiles compute it alike at every row count, and equal to F.linear within rounding."""
    w, b = rand(48, 64, dtype=dtype, seed=1), rand(48, dtype=dtype, seed=2)
    x = rand(200, 64, dtype=dtype, seed=3)
    full = inv.linear(x, w, b)
    for M in (1, 2, 3, 5, 9, 11, 63, 64, 65, 130):
        assert same(inv.linear(x[:M], w, b), full[:M]), M
    assert_close(full, F.linear(x.float(), w.float(), b.float()), dtype, "F.linear")


@cpu_only
def test_a_blas_that_computes_a_row_by_its_place_stops_the_engine(monkeypatch):
    """``_check_tiles`` runs every shape's tile at every rotation before its first use; a BLAS whose result for a
    row depends on its place (simulated) is refused with a clear error instead of serving."""
    real_mm = torch.mm

    def mm_by_place(a, b, out=None):  # row r gets r * 1e-3 added: its place shows
        y = real_mm(a, b) + torch.arange(a.shape[0], dtype=a.dtype)[:, None] * 1e-3
        return y if out is None else out.copy_(y)

    monkeypatch.setattr(inv, "_CHECKED", {})
    monkeypatch.setattr(torch, "mm", mm_by_place)
    with pytest.raises(inv.NotBatchInvariant, match="by its place"):
        inv.linear(rand(3, 8), rand(5, 8))


# ----------------------------------------------------------------------------------------------- elementwise, sums


@cpu_only
@pytest.mark.parametrize("fn", [F.silu, torch.sigmoid, torch.rsqrt, torch.exp, torch.cos], ids=lambda f: f.__name__)
def test_cpu_elementwise_functions_compute_every_element_alike(fn):
    """Row 0 of [T, 7] gives the same bits for every T (torch's scalar tail of a vector loop rounds silu, sigmoid and
    rsqrt otherwise on some elements); and the values are torch's own."""
    x = rand(300, 7, seed=4).abs() + 0.1
    first = inv.elementwise(fn, x[:1])
    for T in range(1, 60):
        assert same(inv.elementwise(fn, x[:T])[:1], first), T
    big = inv.elementwise(fn, x.repeat(40, 1))  # pieces of _EW_PIECE elements
    assert same(big[:300], inv.elementwise(fn, x))
    torch.testing.assert_close(big[:300], fn(x), rtol=1e-6, atol=0)


@DTYPES
def test_sums_and_softmax_do_not_depend_on_the_row_count_or_trailing_zeros(dtype):
    """row_sum adds left to right: zeros appended to a row change nothing; softmax, logsumexp and log_softmax of a
    row are the same bits alone, among many rows and padded with -inf."""
    x = rand(70, 300, seed=5, dtype=dtype).float()
    s = inv.row_sum(x)
    assert same(inv.row_sum(torch.cat([x, torch.zeros(70, 77, device=x.device)], -1)), s)
    for T in (1, 2, 33):
        assert same(inv.row_sum(x[:T]), s[:T])
        assert same(inv.softmax(x[:T], torch.float32), inv.softmax(x, torch.float32)[:T])
        assert same(inv.logsumexp(x[:T]), inv.logsumexp(x)[:T])
    torch.testing.assert_close(s, x.sum(-1), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(inv.logsumexp(x), torch.logsumexp(x, -1), rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(inv.log_softmax(x), torch.log_softmax(x, -1), rtol=1e-6, atol=1e-5)
    values, ids = inv.top_n(torch.tensor([[1.0, 3.0, 3.0, 2.0, 3.0]], device=x.device), 2)
    assert ids.tolist() == [[1, 2]] and values.tolist() == [[3.0, 3.0]]  # ties: ascending ids, whatever n


@needs_kernels
def test_the_vocabulary_logsumexp_does_not_depend_on_the_row_count():
    x = rand(9, 5000, seed=6, scale=3.0)
    full = bi.logsumexp(x)
    for T in (1, 2, 5):
        assert same(bi.logsumexp(x[:T]), full[:T])
    torch.testing.assert_close(full, torch.logsumexp(x, -1), rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------------------------- attention


def paged_step(seqs, hkv: int, block_size: int = 16, dtype=torch.float32, seed: int = 0):
    """One step over sequences ``seqs`` = [(keys [L, Hkv, D], values, queries [L, Hq, D], context, q_len)]: each
    sequence's first context + q_len keys in shuffled blocks of a NaN-filled cache (nothing else may be read), its
    queries context..context+q_len-1. Returns (q, k_cache, v_cache, tables, cu_seqlens_q, seq_lens)."""
    rng = random.Random(seed)
    lens = [c + n for _, _, _, c, n in seqs]
    per = [-(-s // block_size) for s in lens]
    free = list(range(sum(per) + 3))
    rng.shuffle(free)
    D, Dv = seqs[0][0].shape[-1], seqs[0][1].shape[-1]
    k_cache = torch.full((len(free), block_size, hkv, D), float("nan"), dtype=dtype)
    v_cache = torch.full((len(free), block_size, hkv, Dv), float("nan"), dtype=dtype)
    tables = torch.full((len(seqs), max(per) + 1), 10**6, dtype=torch.int32)
    qs = []
    for b, (k, v, q, c, n) in enumerate(seqs):
        own = [free.pop() for _ in range(per[b])]
        tables[b, : len(own)] = torch.tensor(own, dtype=torch.int32)
        for p in range(c + n):
            k_cache[own[p // block_size], p % block_size] = k[p]
            v_cache[own[p // block_size], p % block_size] = v[p]
        qs.append(q[c : c + n])
    cu = torch.tensor([0, *torch.tensor([n for *_, n in seqs]).cumsum(0).tolist()], dtype=torch.int32)
    to = lambda t: t.to(DEVICE)  # noqa: E731
    return (to(torch.cat(qs)), to(k_cache), to(v_cache), to(tables), to(cu), to(torch.tensor(lens, dtype=torch.int32)))


def attend(step, **kw):
    q, k, v, tables, cu, lens = step
    q_lens = (cu[1:] - cu[:-1]).tolist()
    return bi.attention(q, k, v, tables, cu, lens, max_query_len=max(q_lens), max_seq_len=int(lens.max()), **kw)


def a_sequence(L: int, hq: int, hkv: int, d: int, dtype, seed: int):
    return (rand(L, hkv, d, dtype=dtype, seed=seed), rand(L, hkv, d, dtype=dtype, seed=seed + 1),
            rand(L, hq, d, dtype=dtype, seed=seed + 2))


@needs_kernels
@pytest.mark.parametrize("window,sinks,dtype", [(None, False, torch.bfloat16), (45, True, torch.float32)],
                         ids=["causal-bf16", "window_sinks-fp32"])
def test_attention_gives_a_query_the_same_bits_in_every_kind_of_step(window, sinks, dtype):
    """A 200-key sequence (two 128-key ranges): its prompt prefilled whole and alone, in three chunks (the later
    ones over cached keys) beside other sequences' prefills and decodes, and its last token decoded alone (one
    program per key range, or all ranges in one program) and in a batch: every row of every query the same bits;
    and attention itself, within rounding of a float64 computation."""
    hq, hkv, d, L = 4, 2, 16, 200
    scale = d**-0.5
    sink = rand(hq, seed=9) if sinks else None
    kw = dict(scale=scale, sliding_window=window, sinks=sink)
    k, v, q = seq = a_sequence(L, hq, hkv, d, dtype, seed=10)
    other = a_sequence(90, hq, hkv, d, dtype, seed=20)
    short = a_sequence(7, hq, hkv, d, dtype, seed=30)

    whole = attend(paged_step([(k, v, q, 0, L)], hkv, dtype=dtype), **kw)  # [L, Hq, D]
    rows, start = [], 0
    for n, company in ((70, [(*other, 0, 41)]), (100, [(*short, 6, 1), (*other, 41, 49)]), (30, [(*short, 0, 7)])):
        out = attend(paged_step([*company[:1], (*seq, start, n), *company[1:]], hkv, dtype=dtype, seed=n), **kw)
        lo = company[0][4] if len(company) else 0
        rows.append(out[lo : lo + n])
        start += n
    assert same(torch.cat(rows), whole), "chunked prefill beside others"
    last = whole[L - 1 : L]
    for split in (True, False):
        assert same(attend(paged_step([(*seq, L - 1, 1)], hkv, dtype=dtype), split=split, **kw), last), split
        batch = paged_step([(*short, 6, 1), (*seq, L - 1, 1), (*other, 89, 1)], hkv, dtype=dtype, seed=3)
        assert same(attend(batch, split=split, **kw)[1:2], last), ("batched decode", split)

    ref = reference(q, k, v, scale, window, sink)
    assert_close(whole, ref, dtype, "float64 attention")


def reference(q, k, v, scale, window, sinks):
    q, k, v = (t.cpu().double() for t in (q, k, v))
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    L = q.shape[0]
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    pos = torch.arange(L)
    allowed = pos[None, :] <= pos[:, None]
    if window is not None:
        allowed &= pos[None, :] > pos[:, None] - window
    scores = scores.masked_fill(~allowed, float("-inf"))
    if sinks is not None:
        scores = torch.cat([scores, sinks.cpu().double().view(-1, 1, 1).expand(-1, L, 1)], -1)
    return torch.einsum("hqk,khd->qhd", torch.softmax(scores, -1)[..., :L], v)


@needs_kernels
def test_dense_attention_is_the_paged_one_over_one_block_per_sequence():
    """MLA's expanded keys go through the same kernel: each sequence one power-of-two block."""
    from moe_engine.layers.attend import ForwardBatch

    hq, d, L = 4, 24, 50
    k, v, q = a_sequence(L, hq, hq, d, torch.float32, seed=40)
    batch = ForwardBatch.build([[0, 1, 2, 3]], [20], [30], DEVICE, 16)
    keys, values = k[None].transpose(1, 2), v[None].transpose(1, 2)  # [1, H, L, D]
    out = bi.attention_dense(q[20:], keys, values, batch, d**-0.5)
    assert_close(out, reference(q, k, v, d**-0.5, None, None)[20:], torch.float32, "dense")


# ----------------------------------------------------------------------------------------------- fused MoE


@needs_kernels
@DTYPES
def test_expert_rows_do_not_depend_on_the_other_tokens_of_their_experts(dtype):
    """fused_moe's deterministic config: a token's expert outputs are the same bits whether its experts get one row
    (a decode step) or a hundred (its rows at other places of other row tiles)."""
    E, H, I, K = 8, 64, 32, 2
    gate_up, down = rand(E, 2 * I, H, dtype=dtype, seed=50, scale=H**-0.5), rand(E, H, I, dtype=dtype, seed=51,
                                                                                 scale=I**-0.5)
    x = rand(120, H, dtype=dtype, seed=52)
    g = torch.Generator().manual_seed(53)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(120)]).to(DEVICE)

    def token_rows(T: int, t: int) -> torch.Tensor:
        xs, ts = x[:T], ids[:T]
        pos, tok, offs = routing_kernels.route(ts, E, None)
        y = fused_moe.expert_mlp(xs, gate_up, down, pos, tok, offs, deterministic=True)
        return y[pos[t].long()]  # [K, H] in the token's slot order

    alone = token_rows(1, 0)
    for T in (2, 9, 57, 120):
        assert same(token_rows(T, 0), alone), T
    assert same(token_rows(120, 77), token_rows(78, 77))
