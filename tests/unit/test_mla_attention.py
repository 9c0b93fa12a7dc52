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
