"""MLA's latent cache in FP8 (``--kv-cache-dtype fp8``, kernels/kv_fp8.py) in the kernels of kernels/mla_attention.py.

- ``mla_rope_store`` writes exactly ``kv_fp8.quantize``'s bytes: the latent with the layer's k_scale, the rotated
  rope key (as the kernel rotates it in place, in q's dtype) with its v_scale; saturated values included, padding
  slots untouched;
- the absorbed decode kernel over an FP8 cache equals an independent float64 attention (HF's expanded keys and
  values) over the dequantised latents and rope keys, and the torch reference over the same FP8 cache, with several
  blocks per sequence and 1 to 3 splits (the same tolerances as test_mla_attention.py: identical input values, only
  the summation order differs).

The MLA layer over an FP8 cache (decode, chunked and dense prefill, prefill-graph steps against the op-by-op path
over the dequantised cache) is in test_mla_attention.py (its ``fp8kv`` cases), the engine in test_kv_fp8_engine.py.
"""
from __future__ import annotations

import os

import pytest
import torch

from moe_engine.kernels import kv_fp8
from moe_engine.kernels import mla_attention as mla_k

from .test_mla_attention import DEVICE, SMALL, expanded_float64, latent_step, needs_kernels

FP8 = torch.float8_e4m3fn
# distinct scales, neither 1.0: a scale ignored, or the latent's and the rope key's swapped, shows
LATENT_SCALE, ROPE_SCALE = 0.02, 0.05


def scales():
    return tuple(torch.tensor([s], dtype=torch.float32, device=DEVICE) for s in (LATENT_SCALE, ROPE_SCALE))


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_rope_store_writes_the_bytes_kv_fp8_quantize_writes(dtype):
    g = torch.Generator().manual_seed(0)
    T, H, nope, P, R, bs, nblocks = 6, 20, 16, 8, 32, 4, 4
    slots = torch.tensor([3, -1, 9, 0, 14, 5])
    ls, rs = scales()
    for style in ("half", "interleave", "complex"):
        q = torch.randn(T, H, nope + P, generator=g).to(dtype)
        kv = (torch.randn(T, R + P, generator=g) * 3).to(dtype)
        latent = (torch.randn(T, R, generator=g) * 3).to(dtype)
        latent[0, :2] = torch.tensor([1e3, -1e3]).to(dtype)  # beyond 448 * LATENT_SCALE: saturate
        if style == "complex":
            cos, sin = torch.polar(torch.ones(T, P // 2), torch.rand(T, P // 2, generator=g) * 6) * 1.3, None
        else:
            cos, sin = (torch.randn(T, P // 2, generator=g).repeat(1, 2).to(dtype) for _ in range(2))
        sentinel = torch.tensor(0.5).to(FP8)
        lc = sentinel.expand(nblocks, bs, 1, R).clone().to(DEVICE)
        rc = sentinel.expand(nblocks, bs, 1, P).clone().to(DEVICE)
        qd, kvd, ld, sl = (t.to(DEVICE) for t in (q, kv, latent, slots))
        cd, sd = cos.to(DEVICE), None if sin is None else sin.to(DEVICE)
        mla_k.mla_rope_store(qd, kvd[:, R:], cd, sd, style, nope, ld, lc, rc, sl, latent_scale=ls, rope_scale=rs)
        want_l = sentinel.expand(nblocks, bs, 1, R).clone()
        want_r = sentinel.expand(nblocks, bs, 1, P).clone()
        rotated = kvd[:, R:].cpu()  # the kernel's own rotation (test_mla_attention.py checks it against apply_rotary)
        for t, slot in enumerate(slots.tolist()):
            if slot >= 0:
                want_l[slot // bs, slot % bs, 0] = kv_fp8.quantize(latent[t], ls.cpu())
                want_r[slot // bs, slot % bs, 0] = kv_fp8.quantize(rotated[t], rs.cpu())
        assert want_l.float().abs().max() == 448.0  # the saturated ones are in
        assert torch.equal(lc.cpu().view(torch.uint8), want_l.view(torch.uint8)), style
        assert torch.equal(rc.cpu().view(torch.uint8), want_r.view(torch.uint8)), style


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_absorbed_decode_over_an_fp8_cache_equals_attention_over_the_dequantised_one(dtype):
    """Four sequences of 1 to 100 keys in blocks of 8 (up to 13 blocks each), 4 heads; the cache quantised (its
    never-written slots stay NaN, which no read may touch)."""
    tol = dict(atol=2e-5, rtol=2e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    lens, hq, r, p, nope, v = [1, 7, 40, 100], 4, 32, 8, 16, 12
    lat_c, rope_c, tables, seq_lens, w, q_nope, q_rope, lats, ropes = latent_step(
        lens, hq=hq, r=r, p=p, nope=nope, v=v, dtype=dtype, seed=3)
    ls, rs = (s.cpu() for s in scales())
    lat_q, rope_q = kv_fp8.quantize(lat_c, ls), kv_fp8.quantize(rope_c, rs)
    assert torch.isnan(lat_q.float()).any()  # the poison survives quantisation
    # what the cache reads back, per sequence, for the independent float64 attention
    lats = [kv_fp8.round_trip(x, ls) for x in lats]
    ropes = [kv_fp8.round_trip(x, rs) for x in ropes]
    scale = (nope + p) ** -0.5
    ref, ref_lat = expanded_float64(w, q_nope, q_rope, lats, ropes, nope, scale)
    q_lat = torch.einsum("thn,hnr->thr", q_nope.float(), w[:, :nope].float()).to(dtype)
    fp8_kw = dict(latent_scale=ls.to(DEVICE), rope_scale=rs.to(DEVICE))
    dev = [t.to(DEVICE) for t in (q_lat, q_rope, lat_q, rope_q, tables, seq_lens)]
    torch_ref = mla_k.mla_decode_reference(q_lat, q_rope, lat_q, rope_q, tables, seq_lens, scale=scale,
                                           latent_scale=ls, rope_scale=rs)
    torch.testing.assert_close(torch_ref.double(), ref_lat, **tol)
    for splits in (1, 3):
        o_lat = mla_k.mla_decode(*dev, max_seq_len=max(lens), scale=scale, num_splits=splits, config=SMALL, **fp8_kw)
        assert o_lat.dtype == dtype and torch.isfinite(o_lat).all()
        torch.testing.assert_close(o_lat.cpu().float(), torch_ref.float(), **tol)
        out = torch.einsum("thr,hvr->thv", o_lat.cpu().float(), w[:, nope:].float())
        torch.testing.assert_close(out.double(), ref, **tol)


@needs_kernels
def test_an_fp8_cache_without_scales_or_scales_without_one_is_refused():
    lat_c, rope_c, tables, seq_lens, _, _, q_rope, _, _ = latent_step([5], hq=4, r=32, p=8, nope=16, v=12)
    q_lat = torch.randn(1, 4, 32)
    ls, rs = scales()
    dev = [t.to(DEVICE) for t in (q_lat, q_rope, lat_c, rope_c, tables, seq_lens)]
    fp8 = [t.to(FP8) for t in dev[2:4]]
    with pytest.raises(TypeError, match="FP8 cache needs"):
        mla_k.mla_decode(dev[0], dev[1], *fp8, *dev[4:], max_seq_len=5, scale=0.1)
    with pytest.raises(TypeError, match="expected torch.float8_e4m3fn"):
        mla_k.mla_decode(*dev, max_seq_len=5, scale=0.1, latent_scale=ls, rope_scale=rs)


HOPPER_COMPILE = r"""
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from moe_engine.kernels import mla_attention as ma

R, P, Hq, cfg = 512, 64, 16, ma.DEFAULT_CONFIG  # Moonlight-16B-A3B: latent 512, rope key 64, 16 heads
out = {}
for kv in ("bf16", "fp8e4nv"):  # the cache's dtype; queries and output bf16
    fp8 = kv != "bf16"
    common = dict(R=R, P=P, R_PAD=R, P_PAD=P, INTERPRET=False, PDL=True, KV_FP8=fp8, DT=1)
    consts = dict(Hq=Hq, BLOCK_H=max(cfg.block_h, 16), TILE_N=cfg.tile_n, BLOCK_SIZE=16, DIRECT=False, IEEE=False,
                  **common)
    sig = {"out_ptr": "*bf16", "part_m_ptr": "*fp32", "part_l_ptr": "*fp32", "part_acc_ptr": "*fp32",
           "ql_ptr": "*bf16", "qr_ptr": "*bf16", "lat_ptr": "*" + kv, "rope_ptr": "*" + kv, "tables_ptr": "*i32",
           "seq_lens_ptr": "*i32", "lat_scale_ptr": "*fp32", "rope_scale_ptr": "*fp32", "scale_log2": "fp32",
           **{n: "i32" for n in ("s_qlt", "s_qlh", "s_qrt", "s_qrh", "s_ot", "s_oh", "s_bt", "s_lb", "s_lo", "s_rb",
                                 "s_ro")}, **{n: "constexpr" for n in consts}}
    ck = triton.compile(ASTSource(ma._mla_decode_kernel, sig, constexprs=consts), target=GPUTarget("cuda", 90, 32),
                        options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages})
    out[f"decode {kv}"] = {"shared": ck.metadata.shared, "pdl": "griddepcontrol.wait" in ck.asm["ptx"]}
    consts = dict(NOPE=128, P=P, P_PAD=P, R=R, R_PAD=R, STYLE=ma.ROPE_STYLES["interleave"], BLOCK_H=16, DT=1,
                  STORE=True, PDL=True, KV_FP8=fp8)
    sig = {"q_ptr": "*bf16", "kr_ptr": "*bf16", "lat_ptr": "*bf16", "cos_ptr": "*bf16", "sin_ptr": "*bf16",
           "lc_ptr": "*" + kv, "rc_ptr": "*" + kv, "slot_ptr": "*i64", "lat_scale_ptr": "*fp32",
           "rope_scale_ptr": "*fp32", **{n: "i32" for n in ("s_qt", "s_qh", "s_kt", "s_lt", "s_ct", "s_st", "s_lcs",
                                                            "s_rcs", "Hq")}, **{n: "constexpr" for n in consts}}
    ck = triton.compile(ASTSource(ma._mla_rope_kernel, sig, constexprs=consts), target=GPUTarget("cuda", 90, 32),
                        options={"num_warps": 4, "num_stages": 1})
    ptx = ck.asm["ptx"]
    out[f"rope store {kv}"] = {"shared": ck.metadata.shared, "e4m3": "e4m3" in ptx, "div_rn": "div.rn.f32" in ptx}
print(json.dumps(out))
"""


def test_mla_kernels_compile_for_hopper_with_either_cache(tmp_path):
    """The interpreter cannot see the compiled path (e4m3 loads and their conversion, the IEEE division of the
    store, shared memory, the PDL wait): the absorbed decode and the rope store compile for sm_90 at Moonlight's
    shape over a bf16 and an FP8 latent cache, with ptxas from the Triton wheel (no GPU needed)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("triton.backends.nvidia")
    repo = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=str(repo / "backends"), TRITON_CACHE_DIR=str(tmp_path))
    done = subprocess.run([sys.executable, "-c", HOPPER_COMPILE], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(result) == 4 and all(r["shared"] <= 227 * 1024 for r in result.values()), result
    assert result["decode fp8e4nv"]["pdl"] and result["decode bf16"]["pdl"]
    assert result["rope store fp8e4nv"]["e4m3"] and result["rope store fp8e4nv"]["div_rn"]
    assert not result["rope store bf16"]["e4m3"]
