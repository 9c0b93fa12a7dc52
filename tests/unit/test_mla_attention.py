"""Multi-head latent attention on the kernel path (kernels/mla_attention.py, layers/mla.py).

- the absorbed decode kernel (under Triton's interpreter on CPU; ``MOE_TEST_DEVICE=cuda`` compiles it) against an
  independent float64 computation of the *expanded* attention (kv_b_proj applied to every cached latent, as HF),
  over latents in shuffled blocks of a cache poisoned with NaN outside each sequence's keys, with 1 to 8 splits;
- the MLA layer on the kernel path (``batch.use_kernels``: absorbed decode for decode rows; prompt chunks expanded
  from the cached latents into the paged prefill kernel, or dense causal SDPA for prompts from position 0) against
  the op-by-op layer, for decode steps, mixed steps with prefix context, and long prompts, float32 and bfloat16.
"""
from __future__ import annotations

import os

import pytest
import torch

from moe_engine.kernels import mla_attention as mla_k
from moe_engine.kernels import paged_attention as pa

DEVICE = os.environ.get("MOE_TEST_DEVICE", "cpu")
needs_kernels = pytest.mark.skipif(not pa.available(DEVICE), reason="Triton (or its interpreter) unavailable")

SMALL = mla_k.MLAKernelConfig(block_h=16, tile_n=16)


def latent_step(seq_lens, *, hq, r, p, nope, v, block_size=8, dtype=torch.float32, seed=0):
    """Decode tokens over latents cached in shuffled blocks (NaN elsewhere), the per-head kv_b_proj weight, and
    each token's expanded queries: (caches, tables, lens, w [hq, nope + v, r], q_nope, q_rope, latents, ropes)."""
    g = torch.Generator().manual_seed(seed)
    blocks_per = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per) + 3
    free = torch.randperm(num_blocks, generator=g).tolist()
    width = max(blocks_per) + 1
    tables = torch.full((len(seq_lens), width), 10**6, dtype=torch.int32)
    lat_c = torch.full((num_blocks, block_size, 1, r), float("nan"), dtype=dtype)
    rope_c = torch.full((num_blocks, block_size, 1, p), float("nan"), dtype=dtype)
    lats, ropes = [], []
    for b, s in enumerate(seq_lens):
        own = [free.pop() for _ in range(blocks_per[b])]
        tables[b, : len(own)] = torch.tensor(own, dtype=torch.int32)
        lat = torch.randn(s, r, generator=g).to(dtype)
        rope = torch.randn(s, p, generator=g).to(dtype)
        for j in range(s):
            lat_c[own[j // block_size], j % block_size, 0] = lat[j]
            rope_c[own[j // block_size], j % block_size, 0] = rope[j]
        lats.append(lat)
        ropes.append(rope)
    w = (torch.randn(hq, nope + v, r, generator=g) * r**-0.5).to(dtype)
    q_nope = torch.randn(len(seq_lens), hq, nope, generator=g).to(dtype)
    q_rope = torch.randn(len(seq_lens), hq, p, generator=g).to(dtype)
    return lat_c, rope_c, tables, torch.tensor(seq_lens, dtype=torch.int32), w, q_nope, q_rope, lats, ropes


def expanded_float64(w, q_nope, q_rope, lats, ropes, nope, scale):
    """HF's MLA attention in float64: keys (W_UK latent, rope), values W_UV latent, softmax attention per head;
    returns the output in latent space too (o_lat [N, Hq, R] with o = W_UV o_lat) for the kernel's own check."""
    outs, lat_outs = [], []
    w = w.double()
    for i, (lat, rope) in enumerate(zip(lats, ropes)):
        lat, rope = lat.double(), rope.double()
        k_nope = torch.einsum("hnr,jr->hjn", w[:, :nope], lat)  # [Hq, L, nope]
        vals = torch.einsum("hvr,jr->hjv", w[:, nope:], lat)  # [Hq, L, v]
        s = (torch.einsum("hn,hjn->hj", q_nope[i].double(), k_nope) + q_rope[i].double() @ rope.t()) * scale
        prob = torch.softmax(s, dim=-1)
        outs.append(torch.einsum("hj,hjv->hv", prob, vals))
        lat_outs.append(prob @ lat)
    return torch.stack(outs), torch.stack(lat_outs)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_absorbed_decode_equals_expanded_attention(dtype):
    """q_lat = q_nope @ W_UK, the kernel over the latent cache, W_UV after it: HF's expanded attention within
    rounding, for 1 to 8 splits of the keys (lengths not multiples of the tile), 4 heads (padded to a 16-row
    program) and 20 heads (two head blocks), a rope dim below the dot's minimum (padded)."""
    tol = dict(atol=2e-5, rtol=2e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    for hq, lens in ((4, [1, 7, 40, 100]), (20, [33, 5])):
        r, p, nope, v = 32, 8, 16, 12
        lat_c, rope_c, tables, seq_lens, w, q_nope, q_rope, lats, ropes = latent_step(
            lens, hq=hq, r=r, p=p, nope=nope, v=v, dtype=dtype, seed=hq)
        scale = (nope + p) ** -0.5
        ref, ref_lat = expanded_float64(w, q_nope, q_rope, lats, ropes, nope, scale)
        q_lat = torch.einsum("thn,hnr->thr", q_nope.float(), w[:, :nope].float()).to(dtype)
        dev = [t.to(DEVICE) for t in (q_lat, q_rope, lat_c, rope_c, tables, seq_lens)]
        for splits in (1, 2, 3, 8):
            o_lat = mla_k.mla_decode(*dev, max_seq_len=max(lens), scale=scale, num_splits=splits, config=SMALL)
            assert o_lat.shape == (len(lens), hq, r) and o_lat.dtype == dtype and torch.isfinite(o_lat).all()
            if dtype == torch.float32:
                torch.testing.assert_close(o_lat.cpu().double(), ref_lat, **tol)
            out = torch.einsum("thr,hvr->thv", o_lat.cpu().float(), w[:, nope:].float())
            torch.testing.assert_close(out.double(), ref, **tol)
        torch.testing.assert_close(mla_k.mla_decode_reference(q_lat, q_rope, lat_c, rope_c, tables, seq_lens,
                                                              scale=scale).double(), ref_lat, **tol)


@needs_kernels
def test_absorbed_decode_writes_into_strided_out_and_chooses_splits():
    """out may be a transposed view ([Hq, N, R] storage, as the layer's batched GEMM wants it); the default split
    count follows paged_attention's rule over (token, head block) programs."""
    lat_c, rope_c, tables, seq_lens, w, q_nope, q_rope, _, _ = latent_step([300, 3], hq=4, r=32, p=16, nope=16, v=16)
    q_lat = torch.randn(2, 4, 32)
    store = torch.zeros(4, 2, 32)
    dev = [t.to(DEVICE) for t in (q_lat, q_rope, lat_c, rope_c, tables, seq_lens)]
    got = mla_k.mla_decode(*dev, max_seq_len=300, scale=0.1, out=store.to(DEVICE).transpose(0, 1), config=SMALL)
    want = mla_k.mla_decode_reference(q_lat, q_rope, lat_c, rope_c, tables, seq_lens, scale=0.1)
    torch.testing.assert_close(got.cpu(), want, atol=1e-5, rtol=1e-5)
    assert mla_k.num_splits_for(2, 4, 300) == pa.choose_num_splits(2, 1, 300) > 1
    assert mla_k.head_blocks(128) == 8 and mla_k.head_blocks(16) == 1 and mla_k.head_blocks(4) == 1


# ----------------------------------------------------------------------------- the layer on the kernel path


def make_layer(arch: str, dtype: torch.dtype, seed: int = 0, **overrides):
    """An MLA layer of the tiny transformers config of ``arch`` (its rope style and q_lora_rank), random weights,
    and its rotary tables."""
    import json

    from moe_engine.config import config_from_dict
    from moe_engine.layers.mla import MLAttention
    from moe_engine.layers.rotary import RotaryEmbedding

    from .hf_checkpoints import hf_config

    cfg = config_from_dict(json.loads(hf_config(arch, **overrides).to_json_string()))
    layer = MLAttention(cfg.attention, cfg.rope, cfg.hidden_size, cfg.rms_norm_eps, 0)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g) if "norm" in name else
                    torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)
    layer.prefill_config = pa.KernelConfig(prefill_block_m=16, prefill_tile_n=16, prefill_num_warps=4,
                                           prefill_num_stages=1, prefill_tma=False)
    layer.decode_config = SMALL
    return cfg, layer.to(dtype).to(DEVICE), RotaryEmbedding(cfg.rope).to(DEVICE)


def run_step(layer, rotary, cache, tables, contexts, q_lens, x, use_kernels, dense_min=None):
    from moe_engine.layers.attend import ForwardBatch

    batch = ForwardBatch.build(tables, contexts, q_lens, DEVICE, cache.block_size, dense_prefill_min=dense_min)
    batch.use_kernels = use_kernels
    layer.within_rounding = use_kernels  # and q/q_a with kv_a in one GEMM (fuse_projections), o_proj small_linear
    if use_kernels:
        layer.fuse_projections()
        assert layer._joined_weight() is not None
    cos, sin = rotary(batch.positions, x.dtype)
    with torch.inference_mode():
        return layer(x, cos, sin, batch, cache[0]), batch


# ``--kv-cache-dtype fp8``: the layer tests below also run over an e4m3 cache, with scales that are not 1.0 and differ
# between the latent (k_scale) and the rope key (v_scale), so that a scale ignored or swapped shows.
FP8_KV = dict(kv_dtype=torch.float8_e4m3fn, kv_scales=[(0.02, 0.05)])
LAYER_CASES = [("deepseek_v2", torch.float32, {}), ("deepseek_v3", torch.float32, {}),
               ("deepseek_v3", torch.bfloat16, {}), ("deepseek_v2", torch.float32, FP8_KV),
               ("deepseek_v3", torch.bfloat16, FP8_KV)]
LAYER_IDS = ["v2-fp32", "v3-fp32", "v3-bf16", "v2-fp32-fp8kv", "v3-bf16-fp8kv"]


def copy_of(cache, cfg, dtype):
    """A cache of the same kind (model dtype, or FP8 with the same scales) holding ``cache``'s contents."""
    from moe_engine.core.kv_cache import KVCache

    fp8 = cache[0].k_scale is not None
    kw = dict(kv_dtype=cache.kv_dtype, kv_scales=[(cache[0].k_scale.item(), cache[0].v_scale.item())]) if fp8 else {}
    c = KVCache([mla_spec(cfg)], num_blocks=cache.num_blocks, block_size=cache.block_size, dtype=dtype,
                device=DEVICE, **kw)
    c[0].k.copy_(cache[0].k)
    c[0].v.copy_(cache[0].v)
    return c


def assert_same_cache(got, want, cfg, blocks=slice(None)):
    """The kernel path's cache writes are the op-by-op path's: the latent bit for bit (an FP8 cache: both quantise
    the same model-dtype latent with kv_fp8's rounding); the rotated rope key too, but V2's complex rotary within an
    ulp of float32 (kernels/mla_attention.py's mla_rope_store), hence within one e4m3 step in an FP8 cache."""
    (gk, gv), (wk, wv) = (got[0].k[blocks], got[0].v[blocks]), (want[0].k[blocks], want[0].v[blocks])
    fp8 = want[0].k_scale is not None
    bits = (lambda t: t.view(torch.uint8)) if fp8 else (lambda t: t)
    assert torch.equal(bits(gk), bits(wk))
    if cfg.rope.style != "complex":
        assert torch.equal(bits(gv), bits(wv))
    elif fp8:
        torch.testing.assert_close(gv.float(), wv.float(), atol=2**-9, rtol=2**-3)
        assert (bits(gv) != bits(wv)).float().mean() < 0.01
    else:
        torch.testing.assert_close(gv, wv, atol=1e-6, rtol=1e-6)


@needs_kernels
@pytest.mark.parametrize("arch,dtype,cache_kw", LAYER_CASES, ids=LAYER_IDS)
def test_layer_kernel_path_equals_op_by_op(arch, dtype, cache_kw):
    """Three sequences prefilled in chunks by the op-by-op layer; then, from copies of that cache, one decode step
    and one mixed step (two decodes, a chunk after cached context, a prompt from position 0, and a long prompt from
    position 0 last, which takes dense causal SDPA in bf16) on both paths: outputs within rounding, and the same
    cache contents written (assert_same_cache). Over an FP8 cache the op-by-op path attends over the dequantised
    cache (LayerKV.read), the kernels dequantise on load: the same values, so the same tolerance."""
    cfg, layer, rotary, cache, tables, g = layer_with_history(arch, dtype, **cache_kw)
    assert cache[0].k.dtype == cache_kw.get("kv_dtype", dtype)
    H = cfg.hidden_size
    tol = dict(atol=2e-5, rtol=2e-5) if dtype == torch.float32 else dict(atol=4e-2, rtol=4e-2)
    steps = (
        ([0, 1, 2], [30, 9, 17], [1, 1, 1], None),  # decode step: absorbed for every row
        # mixed: decodes of 0 and 1, a chunk of 2 after its 17 cached tokens, prompts 3 and 4 from position 0
        ([0, 1, 2, 3, 4], [30, 9, 17, 0, 0], [1, 1, 5, 12, 20], 16),
    )
    for seqs, contexts, q_lens, dense_min in steps:
        x = torch.randn(sum(q_lens), H, generator=g).to(dtype).to(DEVICE)
        outs, caches = [], []
        for use_kernels in (False, True):
            c = copy_of(cache, cfg, dtype)
            out, batch = run_step(layer, rotary, c, [tables[i] for i in seqs], contexts, q_lens, x, use_kernels,
                                  dense_min)
            outs.append(out)
            caches.append(c)
        if dense_min is not None:
            assert batch.dense_from == 4  # the 20-token prompt (bf16: dense SDPA; float32: the paged kernel)
        assert torch.isfinite(outs[1]).all()
        torch.testing.assert_close(outs[1].float(), outs[0].float(), **tol)
        assert_same_cache(caches[1], caches[0], cfg)


def layer_with_history(arch: str, dtype: torch.dtype, **cache_kw):
    """make_layer's layer and a cache of 40 blocks of 8 (the last: the null block) where the op-by-op layer prefilled
    sequence 0 with 30 tokens, 1 with 9 and 2 with 17 (two chunks); five tables of 5 shuffled blocks each.
    ``cache_kw``: KVCache's (kv_dtype, kv_scales: an FP8 cache)."""
    from moe_engine.core.kv_cache import KVCache

    cfg, layer, rotary = make_layer(arch, dtype)
    g = torch.Generator().manual_seed(1)
    cache = KVCache([mla_spec(cfg)], num_blocks=40, block_size=8, dtype=dtype, device=DEVICE, **cache_kw)
    free = torch.randperm(39, generator=g).tolist()
    tables = [[free.pop() for _ in range(5)] for _ in range(5)]
    for ctx, lens in (([0, 0, 0], [21, 9, 11]), ([21, 9, 11], [9, 0, 6])):
        keep = [i for i, n in enumerate(lens) if n]
        x = torch.randn(sum(lens), cfg.hidden_size, generator=g).to(dtype).to(DEVICE)
        run_step(layer, rotary, cache, [tables[i] for i in keep], [ctx[i] for i in keep], [lens[i] for i in keep],
                 x, use_kernels=False)
    return cfg, layer, rotary, cache, tables, g


@needs_kernels
@pytest.mark.parametrize("arch,dtype,cache_kw", [("deepseek_v3", torch.float32, {}),
                                                 ("deepseek_v2", torch.bfloat16, {}),
                                                 ("deepseek_v3", torch.bfloat16, FP8_KV)],
                         ids=["v3-fp32", "v2-bf16", "v3-bf16-fp8kv"])
def test_prefill_graph_step_attends_every_row_absorbed(arch, dtype, cache_kw):
    """A prefill graph's step (core/prefill_graphs.py: staged as a replay stages it, padded to its token bucket, no
    host lengths) takes every row through the absorbed kernel, each token a query of its own keys (split over
    them): two decodes, a chunk after 17 cached tokens and a prompt from position 0 give the op-by-op layer's
    outputs within rounding and write the same cache; the padding rows write only the null block. Over an FP8
    cache too (its scales: tensors the graph reads, as it reads the cache)."""
    import numpy as np

    from moe_engine.core.prefill_graphs import StagingLayout, replay_batch, stage_step

    cfg, layer, rotary, cache, tables, g = layer_with_history(arch, dtype, **cache_kw)
    seqs, contexts, q_lens = [0, 1, 2, 3], [30, 9, 17, 0], [1, 1, 5, 12]
    T, Tp, max_model_len = sum(q_lens), 32, 200  # 200: the kernel splits each token's keys 4 ways
    x = torch.randn(T, cfg.hidden_size, generator=g).to(dtype).to(DEVICE)
    caches = [copy_of(cache, cfg, dtype) for _ in range(2)]
    want, _ = run_step(layer, rotary, caches[0], [tables[i] for i in seqs], contexts, q_lens, x, use_kernels=False)

    layout = StagingLayout.for_engine(Tp, 6, max_model_len, 8)
    host = np.zeros(layout.size, dtype=np.int64)
    stage_step(host, layout, None, contexts, q_lens, [tables[i] for i in seqs], Tp, null_block=39, block_size=8)
    batch = replay_batch(torch.from_numpy(host).to(DEVICE), layout, Tp, max_model_len, 8)
    assert not batch.host_lengths and mla_k.num_splits_for(Tp, cfg.attention.num_heads, max_model_len) == 4
    calls = []
    real = layer._prefill_expanded
    layer._prefill_expanded = lambda *a, **kw: calls.append(a) or real(*a, **kw)
    layer.within_rounding = True
    layer.fuse_projections()
    x_pad = torch.cat([x, x[:1].expand(Tp - T, -1)])  # the padding's token-0 embeddings
    cos, sin = rotary(batch.positions, dtype)
    with torch.inference_mode():
        got = layer(x_pad, cos, sin, batch, caches[1][0])
    assert not calls  # nothing expanded
    tables_t, lens_t = batch.token_rows()
    assert lens_t[:T].tolist() == [31, 10, *range(18, 23), *range(1, 13)] and lens_t[T:].eq(1).all()
    assert tables_t[T:, 0].eq(39).all()  # padding rows read the null block
    tol = dict(atol=2e-5, rtol=2e-5) if dtype == torch.float32 else dict(atol=4e-2, rtol=4e-2)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got[:T].float(), want.float(), **tol)
    assert_same_cache(caches[1], caches[0], cfg, blocks=slice(0, 39))


def mla_spec(cfg):
    from moe_engine.core.kv_cache import KVSpec

    return KVSpec(1, cfg.attention.mla.kv_lora_rank, cfg.attention.mla.qk_rope_head_dim)


def test_kv_cache_holds_the_latent_and_reports_it(tmp_path, caplog):
    """The cache per token is the latent + rope key (576 values per layer at the V2/V3 shapes), in the start-up log
    and stats() (the /metrics gauge moe_engine_kv_cache_bytes_per_token); at 32k context a KV budget holds ~9x the
    sequences expanded per-head K/V would."""
    import logging
    import sys
    from pathlib import Path

    from moe_engine.checkpoint import load_model
    from moe_engine.config import config_from_dict, load_config
    from moe_engine.core.kv_cache import KVSpec, blocks_for_budget, bytes_per_block
    from moe_engine.engine import Engine, EngineConfig
    from moe_engine.models.decoder import MoEForCausalLM

    from .hf_checkpoints import make_hf_model, save_hf_checkpoint

    path = save_hf_checkpoint(make_hf_model("deepseek_v3", seed=0), tmp_path / "v3")
    cfg = load_config(path)
    with caplog.at_level(logging.INFO, logger="moe_engine.engine"):
        engine = Engine(load_model(path, progress=False), cfg, EngineConfig(max_model_len=64))
    per_layer = 32 + 8  # the tiny config's kv_lora_rank + qk_rope_head_dim
    assert engine.stats()["kv_bytes_per_token"] == cfg.num_hidden_layers * per_layer * 4  # float32
    assert f"{cfg.num_hidden_layers * per_layer * 4} bytes per token in float32, {per_layer} values per layer: MLA " \
           "latent 32 + " \
           "rope key 8" in caplog.text
    # Moonlight-16B-A3B's shape (built on the meta device): 576 values per layer against 16 heads x (192 + 128)
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from loadtest.bench import real_shape_model as rsm

    moon = config_from_dict(rsm.MOONLIGHT_16B_A3B)
    with torch.device("meta"):
        specs = MoEForCausalLM(moon).kv_layout()
    assert bytes_per_block(specs, 1, torch.bfloat16) == 27 * 576 * 2 == rsm.kv_bytes_per_token(moon, 2)
    expanded = [KVSpec(16, 192, 128)] * 27
    budget, tokens = 40 << 30, 32768
    latent_seqs = blocks_for_budget(specs, 16, torch.bfloat16, budget) * 16 // tokens
    expanded_seqs = blocks_for_budget(expanded, 16, torch.bfloat16, budget) * 16 // tokens
    assert latent_seqs >= 8 * expanded_seqs > 0, (latent_seqs, expanded_seqs)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_store_rotates_in_place_as_apply_rotary_and_caches(dtype):
    """mla_rope_store: q's rope dims and the shared rope key rotated in place, the latent and the key cached at each
    slot (a negative slot writes nothing): the half and interleave styles equal apply_rotary to the bit, V2's complex
    style within float32 rounding (to the bit in bf16 here)."""
    from moe_engine.layers.rotary import apply_rotary

    g = torch.Generator().manual_seed(0)
    T, H, nope, P, R, bs = 5, 20, 16, 8, 32, 4
    slots = torch.tensor([3, -1, 9, 0, 14])
    for style in ("half", "interleave", "complex"):
        q = torch.randn(T, H, nope + P, generator=g).to(dtype)
        kv = torch.randn(T, R + P, generator=g).to(dtype)
        latent = torch.randn(T, R, generator=g).to(dtype)
        if style == "complex":
            cos, sin = torch.polar(torch.ones(T, P // 2), torch.rand(T, P // 2, generator=g) * 6) * 1.3, None
        else:
            cos, sin = (torch.randn(T, P // 2, generator=g).repeat(1, 2).to(dtype) for _ in range(2))
        want_q = apply_rotary(q[..., nope:], cos, sin, style)
        want_k = apply_rotary(kv[:, R:].reshape(T, 1, P), cos, sin, style)[:, 0]
        lc, rc = torch.zeros(4, bs, 1, R, dtype=dtype), torch.zeros(4, bs, 1, P, dtype=dtype)
        dev = [t.to(DEVICE) if t is not None else None for t in (q, kv, cos, sin, latent, lc, rc, slots)]
        qd, kvd, cd, sd, ld, lcd, rcd, sl = dev
        mla_k.mla_rope_store(qd, kvd[:, R:], cd, sd, style, nope, ld, lcd, rcd, sl)
        exact = style != "complex" or dtype == torch.bfloat16
        check = torch.equal if exact else (lambda a, b: torch.allclose(a, b, atol=1e-6, rtol=1e-6))
        assert check(qd[..., nope:].cpu(), want_q) and torch.equal(qd[..., :nope].cpu(), q[..., :nope]), style
        assert check(kvd[:, R:].cpu(), want_k) and torch.equal(kvd[:, :R].cpu(), kv[:, :R]), style
        for t, slot in enumerate(slots.tolist()):
            if slot >= 0:
                assert torch.equal(lcd.cpu()[slot // bs, slot % bs, 0], latent[t])
                assert torch.equal(rcd.cpu()[slot // bs, slot % bs, 0], kvd[t, R:].cpu())
        assert int((lcd.cpu() != 0).any(-1).sum()) == 4  # the padding token wrote nothing
