"""Attention over the paged KV cache (moe_engine/paged_attention.py).

Each case builds a step the way the engine will: sequences with some context already cached and a chunk of
new queries, their blocks taken from a shuffled free list (block tables neither contiguous nor ordered), the
cache pre-filled with NaN so that anything read outside a sequence's keys poisons the result. The Triton
kernels (under the interpreter on CPU, as tests/unit/test_kernels.py; ``MOE_TEST_DEVICE=cuda`` compiles them)
are compared with the torch reference, and both with an independent float64 computation per sequence on the
contiguous keys and values (plain causal softmax attention, heads repeated), so the reference is checked too.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import pytest
import torch

from moe_engine.kernels import paged_attention as pa
from moe_engine.layers import attend
from moe_engine.layers.attend import (
    DENSE_PREFILL_MAX_CALLS,
    ForwardBatch,
    LayerKV,
    attend_cached,
    attend_kernels,
    cached_kv,
)

DEVICE = os.environ.get("MOE_TEST_DEVICE", "cpu")
needs_kernels = pytest.mark.skipif(not pa.available(DEVICE), reason="Triton (or its interpreter) unavailable")

# Small tiles: short sequences still span several key tiles and several query tiles per program grid.
SMALL = pa.KernelConfig(prefill_block_m=16, prefill_tile_n=16, decode_block_m=16, decode_tile_n=16,
                        decode_unsplit_tile_n=16)
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


@dataclass
class Step:
    q: torch.Tensor  # [T, Hq, Dk]
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # [B, max_blocks] int32
    cu_seqlens_q: torch.Tensor  # [B+1] int32
    seq_lens: torch.Tensor  # [B] int32
    keys: list  # per sequence [seq_len, Hkv, Dk]: what the cache holds, contiguous
    values: list
    q_lens: list
    scale: float

    def args(self):
        return self.q, self.k_cache, self.v_cache, self.block_tables, self.cu_seqlens_q, self.seq_lens

    def kw(self, **extra):
        return dict(max_query_len=max(self.q_lens), max_seq_len=int(self.seq_lens.max()), scale=self.scale, **extra)


def make_step(contexts, q_lens, *, hq, hkv, dk, dv=None, block_size=16, dtype=torch.float32, seed=0) -> Step:
    """Sequences with contexts[b] cached tokens plus q_lens[b] new ones (already stored, as after store_kv)."""
    dv = dk if dv is None else dv
    g = torch.Generator().manual_seed(seed)
    seq_lens = [c + n for c, n in zip(contexts, q_lens)]
    blocks_per_seq = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + 5  # a few never used
    free = torch.randperm(num_blocks, generator=g).tolist()  # shuffled free list
    max_blocks = max(blocks_per_seq) + 2
    tables = torch.full((len(seq_lens), max_blocks), 10**6, dtype=torch.int32)  # unused entries: garbage
    k_cache = torch.full((num_blocks, block_size, hkv, dk), float("nan"), dtype=dtype)
    v_cache = torch.full((num_blocks, block_size, hkv, dv), float("nan"), dtype=dtype)
    keys, values = [], []
    for b, s in enumerate(seq_lens):
        own = [free.pop() for _ in range(blocks_per_seq[b])]
        tables[b, : len(own)] = torch.tensor(own, dtype=torch.int32)
        k = torch.randn(s, hkv, dk, generator=g).to(dtype)
        v = torch.randn(s, hkv, dv, generator=g).to(dtype)
        for p in range(s):
            k_cache[own[p // block_size], p % block_size] = k[p]
            v_cache[own[p // block_size], p % block_size] = v[p]
        keys.append(k)
        values.append(v)
    T = sum(q_lens)
    q = torch.randn(T, hq, dk, generator=g).to(dtype)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    to = lambda x: x.to(DEVICE)  # noqa: E731
    return Step(to(q), to(k_cache), to(v_cache), to(tables), to(cu), to(torch.tensor(seq_lens, dtype=torch.int32)),
                keys, values, list(q_lens), scale=dk**-0.5)


def dense_float64(step: Step, sliding_window=None, sinks=None) -> torch.Tensor:
    """Independent check: per sequence, softmax(q k^T * scale) v in float64 on the contiguous k/v, heads
    repeated, query i at position seq_len - q_len + i, causal (and windowed: the W most recent positions)."""
    outs = []
    cu = step.cu_seqlens_q.tolist()
    for b, (k, v) in enumerate(zip(step.keys, step.values)):
        q = step.q[cu[b] : cu[b + 1]].cpu().double()  # [n, Hq, Dk]
        n, hq = q.shape[:2]
        g = hq // k.shape[1]
        k = k.double().repeat_interleave(g, dim=1)  # [L, Hq, Dk]
        v = v.double().repeat_interleave(g, dim=1)
        L = k.shape[0]
        scores = torch.einsum("qhd,khd->hqk", q, k) * step.scale  # [Hq, n, L]
        q_pos = torch.arange(L - n, L)[:, None]
        k_pos = torch.arange(L)[None, :]
        allowed = k_pos <= q_pos
        if sliding_window is not None:
            allowed &= k_pos > q_pos - sliding_window
        scores = scores.masked_fill(~allowed, float("-inf"))
        if sinks is not None:  # one extra logit per head in the denominator, no value
            scores = torch.cat([scores, sinks.double().cpu().view(hq, 1, 1).expand(hq, n, 1)], dim=-1)
        probs = torch.softmax(scores, dim=-1)[..., :L]
        outs.append(torch.einsum("hqk,khd->qhd", probs, v))
    return torch.cat(outs)


def assert_close(actual, expected, dtype, what):
    err = (actual.cpu().double() - expected.cpu().double()).abs().max().item()
    torch.testing.assert_close(actual.cpu().double(), expected.cpu().double(), **TOL[dtype], msg=f"{what}: max err {err}")


# (name, contexts, q_lens, hq, hkv, dk, dv, block_size, window, sinks)
CASES = [
    ("decode", [0, 16, 40, 71], [1, 1, 1, 1], 8, 2, 64, 64, 16, None, False),
    ("prefill_from_empty", [0, 0], [13, 34], 4, 4, 16, 16, 8, None, False),
    ("chunks_with_context", [37, 16], [20, 9], 16, 2, 128, 128, 32, None, False),
    ("mixed_decode_prefill", [30, 0, 70, 0, 19], [1, 1, 1, 24, 5], 4, 1, 80, 80, 16, None, False),
    ("dk_ne_dv", [5, 0], [1, 18], 4, 2, 64, 32, 8, None, False),
    ("sliding_window", [50, 0, 33], [1, 26, 7], 8, 2, 16, 16, 8, 7, False),
    ("sinks_g3", [9, 0, 40], [1, 17, 3], 6, 2, 64, 64, 16, None, True),
    ("window_and_sinks_decode", [0, 60, 29], [1, 1, 1], 6, 2, 64, 64, 16, 20, True),
    ("length_one_and_g8", [0, 0], [1, 2], 8, 1, 64, 64, 16, None, False),
]


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name,contexts,q_lens,hq,hkv,dk,dv,bs,window,with_sinks", CASES, ids=[c[0] for c in CASES])
def test_kernel_and_reference_match_dense_attention(name, contexts, q_lens, hq, hkv, dk, dv, bs, window, with_sinks, dtype):
    step = make_step(contexts, q_lens, hq=hq, hkv=hkv, dk=dk, dv=dv, block_size=bs, dtype=dtype, seed=len(name))
    sinks = torch.randn(hq, generator=torch.Generator().manual_seed(1)).to(DEVICE) if with_sinks else None
    kw = step.kw(sliding_window=window, sinks=sinks)
    expected = dense_float64(step, window, sinks)
    reference = pa.paged_attention_reference(*step.args(), **kw)
    out = pa.paged_attention(*step.args(), **kw, config=SMALL, num_splits=1)
    assert out.shape == (sum(q_lens), hq, dv) and out.dtype == dtype
    assert torch.isfinite(out).all(), "read a NaN outside the sequences' keys"
    assert_close(reference, expected, dtype, "reference vs dense")
    assert_close(out, expected, dtype, "kernel vs dense")
    assert_close(out, reference, dtype, "kernel vs reference")


@needs_kernels
def test_default_tiles_prefill_and_decode():
    """The shipped tile sizes (128-row query tiles, 64-key tiles) on a mixed step and a decode step."""
    for contexts, q_lens in (([3, 0, 90], [1, 150, 40]), ([200, 5], [1, 1])):
        step = make_step(contexts, q_lens, hq=8, hkv=2, dk=64, block_size=16, seed=7)
        out = pa.paged_attention(*step.args(), **step.kw(), num_splits=1)
        assert_close(out, dense_float64(step), torch.float32, f"default tiles {q_lens}")


# The TMA launch with the pointer launch's small tiles, so that the two differ only in how key tiles are loaded.
SMALL_TMA = dataclasses.replace(SMALL, prefill_tma_block_m=SMALL.prefill_block_m, prefill_k_rows=True)


@needs_kernels
@pytest.mark.parametrize("contexts,q_lens,hq,hkv,bs,window,with_sinks", [
    ([0, 0], [40, 7], 8, 2, 16, None, False),  # prompts from position 0
    ([37, 16, 0], [20, 9, 1], 4, 1, 32, None, False),  # chunks after cached keys, and a decode row
    ([70, 5], [33, 12], 8, 2, 64, None, True),  # 64-key blocks (four key tiles each), sinks
    ([50, 0], [26, 30], 8, 2, 16, 7, False),  # a window: every tile masked, pointer loads throughout
], ids=["from_zero", "cached_context", "blocks64_sinks", "window"])
def test_tma_key_tiles_give_the_pointer_loads_result_to_the_bit(contexts, q_lens, hq, hkv, bs, window, with_sinks,
                                                                 monkeypatch):
    """A bf16 prefill whose key tiles lie in one block loads its unmasked tiles through TMA descriptors: the same
    tiles into the same dots, so every output element equals the pointer-load launch's to the bit (and the dense
    float64 attention within bf16 tolerance); cache slots past each sequence hold NaN and are never read."""
    step = make_step(contexts, q_lens, hq=hq, hkv=hkv, dk=32, block_size=bs, dtype=torch.bfloat16, seed=bs + hq)
    sinks = torch.randn(hq, generator=torch.Generator().manual_seed(2)).to(DEVICE) if with_sinks else None
    kw = step.kw(sliding_window=window, sinks=sinks)
    assert pa.tma_fits(step.q, step.k_cache, step.v_cache, SMALL.prefill_tile_n)
    made = []
    real = pa._cache_descriptor

    def counted(cache, tile_n):
        made.append(tile_n)
        return real(cache, tile_n)

    monkeypatch.setattr(pa, "_cache_descriptor", counted)  # the real descriptors, counted
    with_tma = pa.paged_attention(*step.args(), **kw, config=SMALL_TMA)
    monkeypatch.undo()
    assert made == [SMALL.prefill_tile_n] * 2  # the launch went through TMA (K and V descriptors)
    pointers = pa.paged_attention(*step.args(), **kw, config=dataclasses.replace(SMALL_TMA, prefill_tma=False))
    assert torch.isfinite(with_tma).all(), "read a NaN outside the sequences' keys"
    assert torch.equal(with_tma, pointers)
    assert_close(with_tma, dense_float64(step, window, sinks), torch.bfloat16, "TMA kernel vs dense")


def test_tma_needs_a_16_bit_cache_whose_blocks_hold_whole_key_tiles():
    """Where TMA does not apply the pointer loads run: float32, key tiles across blocks, head dims that are not
    powers of two (no whole boxes)."""
    def fits(dtype, bs, dk, tile_n=64):
        q = torch.zeros(4, 8, dk, dtype=dtype, device=DEVICE)
        cache = torch.zeros(3, bs, 2, dk, dtype=dtype, device=DEVICE)
        return pa.tma_fits(q, cache, cache, tile_n)

    if not pa.interpreting() and not (DEVICE == "cuda" and torch.cuda.get_device_capability()[0] >= 9):
        assert not fits(torch.bfloat16, 64, 128)  # no TMA before Hopper
        return
    assert fits(torch.bfloat16, 64, 128) and fits(torch.float16, 128, 64) and fits(torch.bfloat16, 16, 128, 16)
    assert not fits(torch.float32, 64, 128)
    assert not fits(torch.bfloat16, 16, 128) and not fits(torch.bfloat16, 32, 128)
    assert not fits(torch.bfloat16, 64, 80) and not fits(torch.bfloat16, 64, 512)  # TMA boxes: <= 256 per dim


def test_default_block_size_is_64_only_where_prefill_key_tiles_come_through_tma():
    """--block-size unset: 64 (a key tile per block) where the attention kernels run with TMA, else vLLM's 16."""
    tma_here = pa.interpreting() or (DEVICE == "cuda" and torch.cuda.get_device_capability()[0] >= 9)
    assert pa.default_block_size(True, DEVICE, torch.bfloat16, {128}) == (64 if tma_here else 16)
    assert pa.default_block_size(False, DEVICE, torch.bfloat16, {128}) == 16  # reference attention (CPU engines)
    assert pa.default_block_size(True, DEVICE, torch.float32, {128}) == 16
    assert pa.default_block_size(True, DEVICE, torch.bfloat16, {192, 128}) == 16  # MLA-like widths: no whole boxes


@needs_kernels
@pytest.mark.parametrize("k_rows,block_size", [(True, 8), (False, 8), (True, 16)], ids=["k_rows", "k_cols", "tma"])
def test_a_prompts_rows_do_not_depend_on_how_it_was_chunked(k_rows, block_size):
    """What makes a prefix-cache hit return a cold run's routing: a prompt's attention rows come out the same,
    to the bit, whether it is prefilled in one step or in chunks over its cached part. Chunks start mid-tile,
    so a key tile a row saw unmasked in one step is a masked (diagonal) tile in another; both loops must do
    the same arithmetic (on the GPU: the same fused multiply-adds too), also when the unmasked tiles come
    through TMA (blocks that hold whole key tiles)."""
    L = 70
    whole = make_step([0], [L], hq=8, hkv=2, dk=64, block_size=block_size, dtype=torch.bfloat16, seed=5)
    config = pa.KernelConfig(prefill_block_m=16, prefill_tile_n=16, prefill_k_rows=k_rows,  # 4 tokens per tile
                             prefill_tma_block_m=16)
    assert pa.tma_fits(whole.q, whole.k_cache, whole.v_cache, 16) == (block_size == 16)
    expected = pa.paged_attention(*whole.args(), **whole.kw(), config=config)
    for cuts in ((0, 29, 51, L), (0, 2, 18, 21, 66, L)):  # chunks of >= 2 tokens: 1 is a decode step
        rows = []
        for lo, hi in zip(cuts, cuts[1:]):
            cu = torch.tensor([0, hi - lo], dtype=torch.int32, device=DEVICE)
            seq_lens = torch.tensor([hi], dtype=torch.int32, device=DEVICE)
            rows.append(pa.paged_attention(whole.q[lo:hi], whole.k_cache, whole.v_cache, whole.block_tables, cu,
                                           seq_lens, max_query_len=hi - lo, max_seq_len=hi, scale=whole.scale,
                                           config=config))
        assert torch.equal(torch.cat(rows), expected), f"chunks {cuts}"


SPLIT_CASES = [  # (window, with_sinks, num_splits, dtype)
    (None, False, 2, torch.float32),
    (None, False, 3, torch.float32),
    (None, True, 8, torch.float32),
    (13, False, 4, torch.float32),
    (25, True, 5, torch.bfloat16),
    (None, False, 11, torch.bfloat16),
]


@needs_kernels
@pytest.mark.parametrize("window,with_sinks,num_splits,dtype", SPLIT_CASES)
def test_split_k_decode_matches_dense_attention(window, with_sinks, num_splits, dtype):
    """Flash-decoding: lengths not divisible by the block, tile or split counts, a sequence of one token, and
    more splits than a short sequence has tiles (the empty splits must weigh nothing)."""
    contexts = [0, 36, 150, 233]
    step = make_step(contexts, [1] * len(contexts), hq=8, hkv=2, dk=64, block_size=16, dtype=dtype, seed=num_splits)
    sinks = torch.randn(8, generator=torch.Generator().manual_seed(2)).to(DEVICE) if with_sinks else None
    kw = step.kw(sliding_window=window, sinks=sinks)
    out = pa.paged_attention(*step.args(), **kw, num_splits=num_splits, config=SMALL)
    assert torch.isfinite(out).all()
    assert_close(out, dense_float64(step, window, sinks), dtype, f"split-K x{num_splits} vs dense")
    if num_splits == 3:
        assert_close(out, pa.paged_attention(*step.args(), **kw, num_splits=1, config=SMALL), dtype, "split vs 2-D")


@needs_kernels
@pytest.mark.parametrize("num_splits", [1, 4])
def test_padding_entries_read_nothing(num_splits):
    """What CUDA-graph padding looks like: a sequence with no query in this step, a padded decode entry (one
    query, no keys, a garbage block table row) and tokens past the last sequence. The padded decode row comes
    out zero without a block read, the rows past cu_seqlens_q[B] keep what `out` held, the real rows are right."""
    step = make_step([10, 40], [1, 1], hq=4, hkv=2, dk=16, block_size=8, seed=3)
    q = torch.cat([step.q[:1], torch.randn(1, 4, 16).to(DEVICE), step.q[1:], torch.randn(2, 4, 16).to(DEVICE)])
    cu = torch.tensor([0, 1, 1, 2, 3], dtype=torch.int32, device=DEVICE)  # sequence 1: no query; 2: padding
    seq_lens = torch.tensor([11, 0, 0, 41], dtype=torch.int32, device=DEVICE)
    garbage = step.block_tables[:1] * 0 + 10**6
    tables = torch.cat([step.block_tables[:1], garbage, garbage, step.block_tables[1:]])
    args = (q, step.k_cache, step.v_cache, tables, cu, seq_lens)
    kw = dict(max_query_len=1, max_seq_len=41, scale=step.scale)
    out = torch.full((5, 4, 16), 7.0, device=DEVICE)
    pa.paged_attention(*args, **kw, out=out, num_splits=num_splits, config=SMALL)
    expected = dense_float64(step)
    assert_close(out[[0, 2]], expected, torch.float32, "real rows")
    assert torch.equal(out[1], torch.zeros(4, 16, device=DEVICE))
    assert torch.equal(out[3:], torch.full((2, 4, 16), 7.0, device=DEVICE))
    reference = pa.paged_attention_reference(*(t.cpu() for t in args), **kw)
    assert_close(reference[[0, 2]], expected, torch.float32, "reference real rows")
    assert not reference[[1, 3, 4]].any()


def test_forward_batch_fields_follow_their_per_token_definition():
    """ForwardBatch.build (vectorised) against the definition written token by token: position, cache slot
    (block of the position's table entry), sequence, index in the chunk, last token, cu offsets, and the block
    table padded with the null block to the longest sequence's blocks (longer tables cut there)."""
    bs, null = 4, 99
    contexts, q_lens = [7, 0, 30, 0, 5], [1, 6, 1, 13, 3]
    g = torch.Generator().manual_seed(3)
    tables = [torch.randperm(90, generator=g)[: -(-(c + q) // bs) + extra].tolist()
              for c, q, extra in zip(contexts, q_lens, (0, 2, 0, 1, 0))]
    batch = ForwardBatch.build(tables, contexts, q_lens, "cpu", block_size=bs, null_block=null)
    pos, slot, seq, qidx = [], [], [], []
    for b, (c, q) in enumerate(zip(contexts, q_lens)):
        for i in range(q):
            p = c + i
            pos.append(p)
            slot.append(tables[b][p // bs] * bs + p % bs)
            seq.append(b)
            qidx.append(i)
    nb = -(-max(c + q for c, q in zip(contexts, q_lens)) // bs)
    padded = [(t[:nb] + [null] * nb)[:nb] for t in tables]
    assert batch.positions.tolist() == pos and batch.slot_mapping.tolist() == slot
    assert batch.token_seq.tolist() == seq and batch.token_qidx.tolist() == qidx
    assert batch.cu_seqlens_q.tolist() == [0, 1, 7, 8, 21, 24] and batch.last_token_index.tolist() == [0, 6, 7, 20, 23]
    assert batch.seq_lens.tolist() == [8, 6, 31, 13, 8] and batch.block_tables.tolist() == padded
    assert batch.max_query_len == 13 and batch.max_seq_len == 31 and batch.num_tokens == 24
    with pytest.raises(ValueError, match="cannot hold"):
        ForwardBatch.build([[1]], [3], [2], "cpu", block_size=bs)


def test_dense_prefill_covers_the_trailing_prompts_prefilled_from_position_zero():
    """ForwardBatch.dense_from: the step's last sequences that start at position 0 with 2+ tokens, from the first
    of them with at least dense_prefill_min tokens on; none when that would be more than DENSE_PREFILL_MAX_CALLS."""
    def dense_from(contexts, q_lens, minimum=8):
        tables = [[0] * 4 for _ in contexts]
        return ForwardBatch.build(tables, contexts, q_lens, "cpu", block_size=16, dense_prefill_min=minimum).dense_from

    assert dense_from([30, 0, 12, 0, 0], [1, 1, 9, 20, 17]) == 3  # decodes, a continuing chunk, two prompts
    assert dense_from([0, 0], [20, 17]) == 0
    assert dense_from([0, 5], [20, 17]) == 2  # the last one continues a prompt: no dense run
    assert dense_from([0, 0, 0], [5, 20, 7]) == 1  # a short prompt first stays on the kernel, one after a long one not
    assert dense_from([0, 0], [3, 7]) == 2  # none long enough
    assert dense_from([0, 0, 0], [1, 1, 1], minimum=1) == 3  # single tokens are decodes
    assert dense_from([0], [20], minimum=10**6) == 1
    assert dense_from([0] * (DENSE_PREFILL_MAX_CALLS + 1), [9] * (DENSE_PREFILL_MAX_CALLS + 1)) == \
        DENSE_PREFILL_MAX_CALLS + 1
    assert dense_from([0] * DENSE_PREFILL_MAX_CALLS, [9] * DENSE_PREFILL_MAX_CALLS) == 0


def test_dense_buckets_bound_the_padding_and_the_plan_count():
    """Every length pads to a bucket at most 1/8 longer (or to the first multiple of 512); up to 8192 tokens there
    are 16 buckets, and eight per doubling above: the cuDNN plans warm_dense_prefill makes at start."""
    b = attend.dense_bucket
    for n in (1, 100, 511, 512, 513, 4095, 4096, 4097, 8191, 8192, 8193, 20000, 65536, 70001):
        assert n <= b(n) <= max(512 * -(-n // 512), n + n // 8), n
        assert b(b(n)) == b(n), n  # a bucket is its own bucket
    assert len({b(n) for n in range(1, 8193)}) == 16
    assert len({b(n) for n in range(8193, 16385)}) == 8


def test_dense_causal_padding_leaves_every_real_row_as_unpadded_sdpa():
    """dense_causal pads q/k/v with zeros after the prompt; causal attention never lets a real query see them:
    every row equals SDPA on the unpadded prompt (float32, grouped-query heads)."""
    g = torch.Generator().manual_seed(9)
    L, hq, hkv, d = 300, 8, 2, 16
    q, k, v = (torch.randn(L, h, d, generator=g) for h in (hq, hkv, hkv))
    got = attend.dense_causal(q, k, v, d**-0.5)
    expected = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.repeat_interleave(hq // hkv, 1).transpose(0, 1),
        v.repeat_interleave(hq // hkv, 1).transpose(0, 1), is_causal=True, scale=d**-0.5).transpose(0, 1)
    assert attend.dense_bucket(L) == 512 and got.shape == (L, hq, d)
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-6)


def test_warm_dense_prefill_makes_one_call_per_bucket_and_shape(monkeypatch):
    """warm_dense_prefill runs dense_causal once for every bucket from DENSE_PREFILL_MIN_TOKENS to the step's
    limit, per attention shape (the plans cuDNN would otherwise build while a request waits)."""
    seen = []
    monkeypatch.setattr(attend, "dense_causal", lambda q, k, v, scale: seen.append((q.shape, k.shape, v.shape)))
    shapes = {(4, 2, 8, 8), (2, 1, 16, 16)}
    calls = attend.warm_dense_prefill(shapes, torch.device("cpu"), torch.bfloat16, max_tokens=8192)
    lengths = sorted({attend.dense_bucket(n) for n in range(attend.DENSE_PREFILL_MIN_TOKENS, 8193)})
    assert calls == len(seen) == 2 * len(lengths)
    assert sorted({s[0][0] for s in seen}) == lengths
    assert {(q[1], k[1], q[2], v[2]) for q, k, v in seen} == shapes


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_kernel_path_with_dense_prefill_matches_dense_attention(dtype):
    """attention.attend_kernels on a step of decodes, a chunk with context and two prompts from position 0: the
    prompts through dense causal SDPA (cuDNN / FlashAttention on CUDA), the rest through the paged kernel, one
    output in the step's token order, equal to the float64 attention (float32 steps keep the kernel for all)."""
    contexts, q_lens = [30, 0, 12, 0, 0, 0], [1, 1, 9, 40, 33, 6]
    step = make_step(contexts, q_lens, hq=8, hkv=2, dk=64, block_size=16, dtype=dtype, seed=5)
    tables = [[b for b in row.tolist() if b != 10**6] for row in step.block_tables.cpu()]
    batch = ForwardBatch.build(tables, contexts, q_lens, DEVICE, block_size=16, dense_prefill_min=16)
    batch.use_kernels = True
    assert batch.dense_from == 3  # the two long prompts and the short one after them
    # this step's own k/v (store_kv has written them into the cache already)
    k = torch.cat([keys[-n:] for keys, n in zip(step.keys, q_lens)]).to(DEVICE)
    v = torch.cat([values[-n:] for values, n in zip(step.values, q_lens)]).to(DEVICE)
    got = attend_kernels(step.q, k, v, LayerKV(step.k_cache, step.v_cache), batch, step.scale, None, None)
    assert got.shape == (sum(q_lens), 8, 64) and got.dtype == dtype
    assert_close(got, dense_float64(step), dtype, "kernel path with dense prefill")
    # the same prompts through the paged kernel alone agree within the same tolerance
    paged = pa.paged_attention(*step.args(), **step.kw())
    assert_close(got, paged, dtype, "dense prefill vs paged kernel")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_reference_computes_exactly_as_the_engines_reference_attention(dtype):
    """The reference keeps attention.py's arithmetic (HF parity of the CPU engine): same bits as
    ``attend_cached`` over the same paged cache, for a mixed step (decodes first, as the engine
    plans them) and for one fresh sequence."""
    for contexts, q_lens in (([5, 33, 0, 12], [1, 1, 21, 6]), ([0], [48])):
        step = make_step(contexts, q_lens, hq=4, hkv=2, dk=16, block_size=8, dtype=dtype, seed=11)
        tables = [[b for b in row.tolist() if b != 10**6] for row in step.block_tables.cpu()]
        # attention.py over the same paged cache (never-written entries zeroed: its gather reads whole blocks)
        cache = LayerKV(torch.nan_to_num(step.k_cache.cpu()), torch.nan_to_num(step.v_cache.cpu()))
        batch = ForwardBatch.build(tables, contexts, q_lens, "cpu", block_size=8)
        for sinks in (None, torch.randn(4).to(dtype)):
            parts = batch.parts or [(0, batch.num_tokens, batch)]
            q = step.q.cpu()
            expected = torch.cat([
                attend_cached(q[a:b], *cached_kv(cache, sub), sub, step.scale, 9, sinks)
                for a, b, sub in parts
            ])
            got = pa.paged_attention_reference(*(t.cpu() for t in step.args()), **step.kw(sliding_window=9, sinks=sinks))
            assert torch.equal(got, expected), (q_lens, sinks is not None)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_store_kv_copies_each_token_to_its_slot_exactly(dtype):
    """Bit-exact copy to slot = block * block_size + offset; slots < 0 (padding) are skipped and every other
    cache entry is untouched. The torch version does the same."""
    g = torch.Generator().manual_seed(0)
    for block_size in (8, 32):
        num_blocks, T, hkv, dk, dv = 6, 9, 3, 64, 32
        k = torch.randn(T, hkv, dk, generator=g).to(dtype)
        v = torch.randn(T, hkv, dv, generator=g).to(dtype)
        slots = torch.randperm(num_blocks * block_size, generator=g)[:T]
        slots[[2, 7]] = -1
        k_cache = torch.randn(num_blocks, block_size, hkv, dk, generator=g).to(dtype)
        v_cache = torch.randn(num_blocks, block_size, hkv, dv, generator=g).to(dtype)
        expected_k, expected_v = k_cache.clone(), v_cache.clone()
        for t, s in enumerate(slots.tolist()):
            if s >= 0:
                expected_k[s // block_size, s % block_size] = k[t]
                expected_v[s // block_size, s % block_size] = v[t]
        dev = [x.to(DEVICE) for x in (k, v, k_cache, v_cache, slots)]
        pa.store_kv(*dev)
        assert torch.equal(dev[2].cpu(), expected_k) and torch.equal(dev[3].cpu(), expected_v)
        ref_k, ref_v = k_cache.clone(), v_cache.clone()
        pa.store_kv_reference(k, v, ref_k, ref_v, slots)
        assert torch.equal(ref_k, expected_k) and torch.equal(ref_v, expected_v)


def test_gather_blocks_returns_each_sequence_in_order():
    step = make_step([0, 21], [5, 1], hq=2, hkv=2, dk=16, block_size=8, seed=5)
    got = pa.gather_blocks(step.k_cache.cpu(), step.block_tables.cpu(), 22)  # [B, 22, Hkv, Dk]
    assert torch.equal(got[1], step.keys[1]) and torch.equal(got[0, :5], step.keys[0])


def test_bad_arguments_raise_clear_errors():
    step = make_step([3], [2], hq=4, hkv=2, dk=16, block_size=8)
    q, kc, vc, bt, cu, sl = (t.cpu() for t in step.args())
    with pytest.raises(ValueError, match="multiple of kv heads"):
        pa.paged_attention_reference(q[:, :3], kc, vc, bt, cu, sl, **step.kw())
    with pytest.raises(TypeError, match="dtype"):
        pa.paged_attention_reference(q.double(), kc, vc, bt, cu, sl, **step.kw())
    with pytest.raises(ValueError, match="sinks"):
        pa.paged_attention_reference(q, kc, vc, bt, cu, sl, **step.kw(sinks=torch.zeros(3)))
    with pytest.raises(ValueError, match="power of two"):
        pa.paged_attention_reference(q, kc[:, :6], vc[:, :6], bt, cu, sl, **step.kw())
    with pytest.raises(TypeError, match="differ from the cache"):
        pa.store_kv_reference(torch.zeros(1, 2, 16, dtype=torch.bfloat16), torch.zeros(1, 2, 16), kc, vc,
                              torch.zeros(1, dtype=torch.long))


def test_num_splits_rule():
    """Split only while programs are scarce, into ranges of about 64 keys (half as many splits would leave
    ranges longer than that), powers of two, at most 64; never up to 128 keys."""
    for num_seqs in (1, 2, 4, 16, 64, 256):
        for max_len in (100, 128, 129, 256, 384, 1024, 8192, 32768):
            n = pa.choose_num_splits(num_seqs, 4, max_len, num_sms=132)
            assert n >= 1 and n & (n - 1) == 0 and n <= 64
            assert n == 1 or (max_len > 128 and -(-max_len // (n // 2)) > 64)
            assert n == 1 or num_seqs * 4 * (n // 2) < 2 * 132  # half as many splits would not fill two waves
            assert n == 1 or num_seqs * 4 < 132  # no split from one wave of (sequence, head) programs
    assert [pa.choose_num_splits(1, 4, L) for L in (128, 256, 384, 512, 1024)] == [1, 4, 8, 8, 16]
    assert pa.choose_num_splits(1, 4, 32768) == 64 and pa.choose_num_splits(256, 4, 32768) == 1
    assert pa.choose_num_splits(64, 4, 1280) == pa.choose_num_splits(33, 4, 1280) == 1  # a wave or more
    assert pa.choose_num_splits(32, 4, 1280) == 4  # 0.97 waves: splits still pay


HOPPER_COMPILE = r"""
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from moe_engine.kernels import paged_attention as pa

kernel, out = pa._attn_2d_kernel, {}
for name, decode, dtype, G, dk, dv, tma, kv in json.loads(sys.argv[1]):  # kv: the cache's dtype (fp8e4nv)
    kv = kv or dtype
    dk_pad, dv_pad, esize = pa._pow2(dk), pa._pow2(dv), 4 if dtype == "fp32" else 2
    block_m, tile_n, warps, stages, krow = pa.tiles_2d(decode, G, dk_pad, dv_pad, esize, tma=tma)
    consts = dict(G=G, BLOCK_Q=1 if decode else block_m // G, BLOCK_M=block_m, TILE_N=tile_n,
                  BLOCK_SIZE=64 if tma else 16, DK=dk, DV=dv, DK_PAD=dk_pad, DV_PAD=dv_pad, HAS_WINDOW=False,
                  HAS_SINKS=False, KROW=krow, TMA=tma, IEEE=dtype == "fp32", INTERPRET=False, PDL=True,
                  KV_FP8=kv != dtype, DT={"fp32": 0, "bf16": 1}[dtype])
    descs = {"k_desc": f"tensordesc<{kv}[{tile_n}, {dk}]>" if tma else "constexpr",
             "v_desc": f"tensordesc<{kv}[{tile_n}, {dv}]>" if tma else "constexpr"}
    consts.update({n: None for n, t in descs.items() if t == "constexpr"})
    ptr = "*" + dtype
    sig = {"out_ptr": ptr, "q_ptr": ptr, "k_cache_ptr": "*" + kv, "v_cache_ptr": "*" + kv, **descs, "sinks_ptr": ptr,
           "tables_ptr": "*i32", "cu_ptr": "*i32", "seq_lens_ptr": "*i32", "k_scale_ptr": "*fp32",
           "v_scale_ptr": "*fp32", "num_seqs": "i32", "scale_log2": "fp32",
           "window": "i32",
           **{n: "i32" for n in ("s_qt", "s_qh", "s_ot", "s_oh", "s_bt", "s_kb", "s_ko", "s_kh", "s_vb", "s_vo", "s_vh")},
           **{n: "constexpr" for n in consts if n not in descs}}
    ck = triton.compile(ASTSource(kernel, sig, constexprs=consts), target=GPUTarget("cuda", 90, 32),
                        options={"num_warps": warps, "num_stages": stages})
    out[name] = {"shared": ck.metadata.shared, "tile_n": tile_n, "block_m": block_m, "warps": warps,
                 "tma_loads": "cp.async.bulk.tensor" in ck.asm["ptx"], "wgmma": "wgmma" in ck.asm["ptx"]}
print(json.dumps(out))
"""


def test_two_d_kernel_launches_compile_for_hopper_within_its_shared_memory(tmp_path):
    """The launch paged_attention picks for the 2-D kernel (decode steps walk 128-key tiles, prefill 256-row query
    tiles) compiles for sm_90 within its 227 KiB of shared memory (ptxas from the Triton wheel; no GPU needed).
    Where the shared-memory estimate (Q plus every pipeline stage of K/V, an upper bound: the compiled decode
    kernels use far less) leaves no room for 128 keys, float32 caches and MLA's 192-wide keys, a decode keeps the
    64-key tile it had before 128 became the default."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("triton.backends.nvidia")
    cases = [("decode bf16 d128", True, "bf16", 8, 128, 128, False, None),
             ("prefill bf16 d128", False, "bf16", 8, 128, 128, False, None),
             ("decode fp32 d128", True, "fp32", 8, 128, 128, False, None),
             ("decode bf16 mla", True, "bf16", 16, 192, 128, False, None),
             ("prefill bf16 d128 tma", False, "bf16", 8, 128, 128, True, None),
             # --kv-cache-dtype fp8: e4m3 tiles dequantised after each load (kernels/kv_fp8.py), TMA too
             ("decode bf16 d128 fp8kv", True, "bf16", 8, 128, 128, False, "fp8e4nv"),
             ("prefill bf16 d128 fp8kv", False, "bf16", 8, 128, 128, False, "fp8e4nv"),
             ("prefill bf16 d128 fp8kv tma", False, "bf16", 8, 128, 128, True, "fp8e4nv")]
    repo = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=str(repo / "backends"), TRITON_CACHE_DIR=str(tmp_path))
    done = subprocess.run([sys.executable, "-c", HOPPER_COMPILE, json.dumps(cases)], env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    for name, r in result.items():
        assert r["shared"] <= 227 * 1024, f"{name}: {r['shared']} bytes of shared memory"
    assert result["decode bf16 d128"]["tile_n"] == 128 and result["prefill bf16 d128"]["block_m"] == 256
    assert result["decode fp32 d128"]["tile_n"] == 64 and result["decode bf16 mla"]["tile_n"] == 64
    tma = result["prefill bf16 d128 tma"]  # 64-key blocks: one warpgroup's 128 rows, tiles through TMA on wgmma
    assert tma["tma_loads"] and tma["wgmma"] and (tma["block_m"], tma["tile_n"], tma["warps"]) == (128, 64, 4)
    assert not any(r["tma_loads"] for name, r in result.items() if not name.endswith("tma"))
    assert result["prefill bf16 d128 fp8kv tma"]["tma_loads"]
