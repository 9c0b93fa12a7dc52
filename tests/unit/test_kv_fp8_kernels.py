"""FP8 KV cache (``--kv-cache-dtype fp8``) in the kernels: the store quantises, the paged decode and prefill kernels
dequantise on load, and every path reads the same values.

The stores (paged_attention.store_kv, the engine's rotary.store_kv and the fused rotary's cache write) must write
exactly ``kv_fp8.quantize``'s bytes (round to nearest even, saturating at +-448 after dividing by the layer's
scale). The attention kernels over an FP8 cache must equal the torch reference over the same cache and an
independent float64 attention over the dequantised keys and values (within the tolerances of
test_paged_attention.py: the inputs are identical values, only the summation order differs), with several blocks
per sequence, grouped-query heads, sliding windows and sinks (GPT-OSS), split-K decode, TMA key tiles, and the
prefix-cache property that a prompt's rows do not depend on how it was chunked.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from moe_engine.kernels import kv_fp8
from moe_engine.kernels import paged_attention as pa
from moe_engine.kernels import rotary as rotary_kernels
from moe_engine.layers.attend import ForwardBatch, LayerKV, attend_kernels, attend_stored

from .test_paged_attention import DEVICE, SMALL, SMALL_TMA, assert_close, dense_float64, make_step, needs_kernels

FP8 = torch.float8_e4m3fn
# k's scale far from 1 (a scale the kernels ignored would be caught), v's the uncalibrated default
K_SCALE, V_SCALE = 0.02, 1.0


def scales(k=K_SCALE, v=V_SCALE):
    return (torch.tensor([k], dtype=torch.float32, device=DEVICE), torch.tensor([v], dtype=torch.float32, device=DEVICE))


def fp8_step(step, k_scale=K_SCALE, v_scale=V_SCALE):
    """``step`` with its caches quantised (the NaN of never-written slots stay NaN) and its contiguous keys/values
    replaced by what the FP8 cache reads back, for dense_float64."""
    ks, vs = (s.cpu() for s in scales(k_scale, v_scale))
    return dataclasses.replace(
        step,
        k_cache=kv_fp8.quantize(step.k_cache.cpu(), ks).to(DEVICE),
        v_cache=kv_fp8.quantize(step.v_cache.cpu(), vs).to(DEVICE),
        keys=[kv_fp8.round_trip(k, ks) for k in step.keys],
        values=[kv_fp8.round_trip(v, vs) for v in step.values],
    )


def test_quantize_rounds_to_nearest_even_and_saturates():
    """The format itself: x / scale rounded to the nearest e4m3 value, ties to even, saturating at +-448 (no NaN
    from a large value); reading back multiplies by the scale."""
    s = torch.tensor([0.5])
    x = torch.tensor([0.0, 1.0, 1.0625 * 0.5, 1.1875 * 0.5, 300.0, -1e6, 224.0])
    q = kv_fp8.quantize(x, s)
    assert q.dtype == FP8
    # 1.0625 lies halfway between 1.0 and 1.125 (even: 1.0); 1.1875 between 1.125 and 1.25 (even: 1.25)
    assert q.float().tolist() == [0.0, 2.0, 1.0, 1.25, 448.0, -448.0, 448.0]
    assert kv_fp8.dequantize(q, s, torch.float32).tolist() == [0.0, 1.0, 0.5, 0.625, 224.0, -224.0, 224.0]


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_every_store_writes_the_quantised_values_the_reference_writes(dtype):
    """paged_attention.store_kv (and its torch version), the engine's rotary.store_kv and qk_norm_rope's fused cache
    write put kv_fp8.quantize(x, scale) at each token's slot, saturated values included; padding slots (< 0) and
    every other entry stay untouched."""
    g = torch.Generator().manual_seed(0)
    block_size, num_blocks, T, hkv, d = 8, 6, 9, 2, 64
    k = (torch.randn(T, hkv, d, generator=g) * 3).to(dtype)
    v = (torch.randn(T, hkv, d, generator=g) * 3).to(dtype)
    k[0, 0, :4] = torch.tensor([1e4, -1e4, 9.0, -9.0]).to(dtype)  # beyond 448 * K_SCALE: saturate
    slots = torch.randperm(num_blocks * block_size, generator=g)[:T]
    ks, vs = scales()
    want_k = torch.full((num_blocks, block_size, hkv, d), 0.5).to(FP8)
    want_v = want_k.clone()
    for t, s in enumerate(slots.tolist()):
        want_k[s // block_size, s % block_size] = kv_fp8.quantize(k[t], ks.cpu())
        want_v[s // block_size, s % block_size] = kv_fp8.quantize(v[t], vs.cpu())
    assert want_k.float().abs().max() == 448.0  # the saturated ones are in

    def check(kc, vc, what):  # compared as values: -0 and +0 are the same key
        assert torch.equal(kc.cpu().float(), want_k.float()) and torch.equal(vc.cpu().float(), want_v.float()), what

    def empty():
        return (torch.full((num_blocks, block_size, hkv, d), 0.5).to(FP8).to(DEVICE) for _ in range(2))

    dev = [x.to(DEVICE) for x in (k, v, slots)]
    kc, vc = empty()
    pa.store_kv(dev[0], dev[1], kc, vc, dev[2], k_scale=ks, v_scale=vs)
    check(kc, vc, "paged_attention.store_kv")
    kc, vc = (c.cpu() for c in empty())
    pa.store_kv_reference(k, v, kc, vc, slots, k_scale=ks.cpu(), v_scale=vs.cpu())
    check(kc, vc, "store_kv_reference")
    kc, vc = empty()
    rotary_kernels.store_kv(dev[0], dev[1], kc, vc, dev[2], k_scale=ks, v_scale=vs)
    check(kc, vc, "rotary.store_kv")
    # the fused rotary's write: cos = 1, sin = 0 leaves k as it is, so the cache must hold quantize(k)
    cos = torch.ones(T, d, dtype=dtype, device=DEVICE)
    sin = torch.zeros(T, d, dtype=dtype, device=DEVICE)
    kc, vc = empty()
    q = torch.randn(T, 4, d, generator=g).to(dtype).to(DEVICE)
    _, k_out = rotary_kernels.qk_norm_rope(q, dev[0], cos, sin, d,
                                           kv_cache=LayerKV(kc, vc, ks, vs).store_args(dev[1], dev[2]))
    assert torch.equal(k_out.cpu(), k)
    check(kc, vc, "qk_norm_rope's cache write")
    # a padding slot (< 0) writes nothing
    kc, vc = empty()
    pa.store_kv(dev[0][:1], dev[1][:1], kc, vc, torch.tensor([-1], device=DEVICE), k_scale=ks, v_scale=vs)
    assert torch.equal(kc.cpu().float(), torch.full_like(kc.cpu().float(), 0.5))


# (name, contexts, q_lens, hq, hkv, dk, block_size, window, sinks): several blocks per sequence, GQA groups
CASES = [
    ("decode_gqa", [0, 16, 40, 71], [1, 1, 1, 1], 8, 2, 64, 16, None, False),
    ("prefill_from_empty", [0, 0], [13, 34], 4, 4, 16, 8, None, False),
    ("chunks_with_context", [37, 16], [20, 9], 16, 2, 128, 32, None, False),
    ("mixed_decode_prefill", [30, 0, 70, 0], [1, 1, 1, 24], 4, 1, 64, 16, None, False),
    ("window_and_sinks", [50, 0, 33], [1, 26, 7], 8, 2, 32, 8, 7, True),
]


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name,contexts,q_lens,hq,hkv,dk,bs,window,with_sinks", CASES, ids=[c[0] for c in CASES])
def test_kernels_over_an_fp8_cache_equal_attention_over_the_dequantised_cache(name, contexts, q_lens, hq, hkv, dk, bs,
                                                                              window, with_sinks, dtype):
    step = fp8_step(make_step(contexts, q_lens, hq=hq, hkv=hkv, dk=dk, block_size=bs, dtype=dtype, seed=len(name)))
    sinks = torch.randn(hq, generator=torch.Generator().manual_seed(1)).to(DEVICE) if with_sinks else None
    ks, vs = scales()
    kw = step.kw(sliding_window=window, sinks=sinks, k_scale=ks, v_scale=vs)
    expected = dense_float64(step, window, sinks)
    reference = pa.paged_attention_reference(*step.args(), **kw)
    out = pa.paged_attention(*step.args(), **kw, config=SMALL, num_splits=1)
    assert out.dtype == dtype and torch.isfinite(out).all(), "read a NaN outside the sequences' keys"
    assert_close(reference, expected, dtype, "reference vs dense over the dequantised cache")
    assert_close(out, expected, dtype, "kernel vs dense over the dequantised cache")
    assert_close(out, reference, dtype, "kernel vs reference")


@needs_kernels
@pytest.mark.parametrize("window,with_sinks,num_splits,dtype", [
    (None, False, 3, torch.float32), (None, True, 8, torch.float32), (25, True, 5, torch.bfloat16),
])
def test_split_k_decode_over_an_fp8_cache(window, with_sinks, num_splits, dtype):
    contexts = [0, 36, 150, 233]
    step = fp8_step(make_step(contexts, [1] * 4, hq=8, hkv=2, dk=64, block_size=16, dtype=dtype, seed=num_splits))
    sinks = torch.randn(8, generator=torch.Generator().manual_seed(2)).to(DEVICE) if with_sinks else None
    ks, vs = scales()
    kw = step.kw(sliding_window=window, sinks=sinks, k_scale=ks, v_scale=vs)
    out = pa.paged_attention(*step.args(), **kw, num_splits=num_splits, config=SMALL)
    assert torch.isfinite(out).all()
    assert_close(out, dense_float64(step, window, sinks), dtype, f"split-K x{num_splits} vs dense")
    assert_close(out, pa.paged_attention(*step.args(), **kw, num_splits=1, config=SMALL), dtype, "split vs 2-D")


@needs_kernels
def test_tma_key_tiles_of_an_fp8_cache_give_the_pointer_loads_result_to_the_bit():
    """A bf16 prefill over an FP8 cache whose blocks hold whole key tiles takes the TMA loads: the same dequantised
    tiles into the same dots as the pointer loads."""
    step = fp8_step(make_step([37, 16, 0], [20, 9, 1], hq=4, hkv=1, dk=32, block_size=32, dtype=torch.bfloat16,
                              seed=4))
    ks, vs = scales()
    kw = step.kw(k_scale=ks, v_scale=vs)
    assert pa.tma_fits(step.q, step.k_cache, step.v_cache, SMALL.prefill_tile_n)
    with_tma = pa.paged_attention(*step.args(), **kw, config=SMALL_TMA)
    pointers = pa.paged_attention(*step.args(), **kw, config=dataclasses.replace(SMALL_TMA, prefill_tma=False))
    assert torch.isfinite(with_tma).all() and torch.equal(with_tma, pointers)
    assert_close(with_tma, dense_float64(step), torch.bfloat16, "TMA kernel vs dense")


@needs_kernels
def test_a_prompts_rows_over_an_fp8_cache_do_not_depend_on_how_it_was_chunked():
    """The prefix cache's guarantee with an FP8 cache: a prompt's attention rows are the same bits whether it is
    prefilled in one step or in chunks over its cached part (a prefix-cache hit reads the blocks a cold run wrote)."""
    L = 70
    whole = fp8_step(make_step([0], [L], hq=8, hkv=2, dk=64, block_size=16, dtype=torch.bfloat16, seed=5))
    ks, vs = scales()
    config = pa.KernelConfig(prefill_block_m=16, prefill_tile_n=16, prefill_tma_block_m=16)
    expected = pa.paged_attention(*whole.args(), **whole.kw(k_scale=ks, v_scale=vs), config=config)
    rows = []
    for lo, hi in ((0, 29), (29, 51), (51, L)):
        cu = torch.tensor([0, hi - lo], dtype=torch.int32, device=DEVICE)
        seq_lens = torch.tensor([hi], dtype=torch.int32, device=DEVICE)
        rows.append(pa.paged_attention(whole.q[lo:hi], whole.k_cache, whole.v_cache, whole.block_tables, cu, seq_lens,
                                       max_query_len=hi - lo, max_seq_len=hi, scale=whole.scale, config=config,
                                       k_scale=ks, v_scale=vs))
    assert torch.equal(torch.cat(rows), expected)


@needs_kernels
def test_the_engines_kernel_path_and_reference_path_read_the_same_fp8_values():
    """layers/attend.py over an FP8 LayerKV: the kernel path (paged kernel, and dense causal SDPA for the prompts
    from position 0, which attend their own k/v as the cache returns them) and the reference path (gather +
    dequantise + SDPA) agree within bf16 rounding and with float64 attention over the dequantised cache."""
    dtype = torch.bfloat16
    contexts, q_lens = [30, 0, 12, 0], [1, 1, 9, 40]
    step = fp8_step(make_step(contexts, q_lens, hq=8, hkv=2, dk=64, block_size=16, dtype=dtype, seed=5))
    ks, vs = scales()
    cache = LayerKV(step.k_cache, step.v_cache, ks, vs)
    tables = [[b for b in row.tolist() if b != 10**6] for row in step.block_tables.cpu()]
    # this step's own k/v before quantisation (what the layer holds); the cache has their FP8 values already
    raw = make_step(contexts, q_lens, hq=8, hkv=2, dk=64, block_size=16, dtype=dtype, seed=5)
    k = torch.cat([keys[-n:] for keys, n in zip(raw.keys, q_lens)]).to(DEVICE)
    v = torch.cat([values[-n:] for values, n in zip(raw.values, q_lens)]).to(DEVICE)
    batch = ForwardBatch.build(tables, contexts, q_lens, DEVICE, block_size=16, dense_prefill_min=16)
    batch.use_kernels = True
    assert batch.dense_from == 3  # the 40-token prompt takes dense causal SDPA
    expected = dense_float64(step)
    got = attend_kernels(step.q, k, v, cache, batch, step.scale, None, None)
    assert_close(got, expected, dtype, "kernel path (dense prefill) vs dense over the dequantised cache")
    ref_cache = LayerKV(torch.nan_to_num(step.k_cache.cpu().float()).to(FP8),
                        torch.nan_to_num(step.v_cache.cpu().float()).to(FP8), ks.cpu(), vs.cpu())
    ref_batch = ForwardBatch.build(tables, contexts, q_lens, "cpu", block_size=16)
    reference = attend_stored(step.q.cpu(), k.cpu(), v.cpu(), ref_cache, ref_batch, step.scale)
    assert_close(reference, expected, dtype, "reference path vs dense over the dequantised cache")
    assert_close(got, reference, dtype, "kernel path vs reference path")


def test_an_fp8_cache_without_scales_is_refused():
    step = fp8_step(make_step([3], [2], hq=4, hkv=2, dk=16, block_size=8))
    with pytest.raises(TypeError, match="needs k_scale and v_scale"):
        pa.paged_attention_reference(*(t.cpu() for t in step.args()), **step.kw())
    ks, _ = scales()
    with pytest.raises(ValueError, match="both k_scale and v_scale"):
        pa.paged_attention_reference(*(t.cpu() for t in step.args()), **step.kw(k_scale=ks.cpu()))
