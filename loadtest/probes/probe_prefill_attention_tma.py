"""Probe: prefill attention with K/V tiles loaded through TMA, against the engine's paged kernel, on one GPU.

The engine's ``_attn_2d_kernel`` gathers each K/V tile key by key through the block table (pointer loads, 16-key
blocks) and runs at ~340 TFLOP/s on a multi-turn turn-16 step (27 chunks of 303 queries over ~7,500 cached keys);
cuDNN's Hopper kernel ran the same step's cached part at ~495 TFLOP/s (``probes/probe_cudnn_padded.py``).
Hopper's TMA copies a whole [keys, dims] box into shared memory asynchronously, but only a box of rows that are
contiguous in one tensor. This probe (run 86, which made the engine's TMA path; since then it times that path
itself, through ``KernelConfig``) compares:

* ``paged``: the engine kernel on 16-key blocks (pointer loads), the baseline;
* ``tma bs64``: a cache of 64-key blocks, where a 64-key tile is one block: one TMA box per tile;
* ``tma contig``: each sequence's keys in one block (as if gathered into a contiguous buffer first), timed with
  and without that gather, tiles of 64 or 128 keys;

over a sweep of query rows, key tiles, warps and stages. Unmasked key tiles (all below the tile's first query)
come through the descriptors, diagonal tiles by masked pointer loads (keys past a sequence are never read);
outputs are compared with the baseline's. Timing: CUDA events, median of ``--reps``.

    PYTHONPATH=backends:. python3 loadtest/probes/probe_prefill_attention_tma.py
    TRITON_INTERPRET=1 PYTHONPATH=backends:. python3 loadtest/probes/probe_prefill_attention_tma.py --check-cpu
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton

from moe_engine.kernels import paged_attention as pa

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: loadtest.* when run by path
from loadtest.probes.probe_prefill_attention_variants import step  # noqa: E402  (a paged step)
from loadtest.tune.sweep_prefill_tiles import median_ms  # noqa: E402  (CUDA-event timing, median of reps)

HQ, HKV, D = 32, 4, 128
SHAPES = {  # name: (sequences, new tokens each, cached tokens each)
    "T16 27x303 over 7500": (27, 303, 7500),
    "4x2k over 6k": (4, 2048, 6144),
}


def tma_config(block_m=128, tile_n=64, warps=4, stages=3, tma=True) -> pa.KernelConfig:
    """The engine's kernel with these TMA launch settings (``tma=False``: the same tiles by pointer loads)."""
    return pa.KernelConfig(prefill_tma=tma, prefill_tma_block_m=block_m, prefill_tile_n=tile_n,
                           prefill_tma_num_warps=warps, prefill_tma_num_stages=stages)


def reblock(k, tables, block):
    """The same sequences' keys in a cache of `block`-key blocks (in order; padded): (cache, tables)."""
    S, nb16 = tables.shape
    bs = k.shape[1]
    flat = k[tables.long()].reshape(S, nb16 * bs, *k.shape[2:])  # [S, L16, Hkv, D]
    nblk = -(-flat.shape[1] // block)
    pad = flat.new_zeros(S, nblk * block, *k.shape[2:])
    pad[:, :flat.shape[1]] = flat
    return pad.view(S * nblk, block, *k.shape[2:]), torch.arange(S * nblk, device=k.device, dtype=torch.int32).view(S, nblk)


def gather_contig(k, v, tables, lp, out_k, out_v):
    """The contiguous copy a 'contig' step would make: each sequence's blocks into [S, lp, Hkv, D]."""
    S = tables.shape[0]
    nb = lp // k.shape[1]
    idx = tables[:, :nb].reshape(-1).long()
    torch.index_select(k, 0, idx, out=out_k.view(S * nb, *k.shape[1:]))
    torch.index_select(v, 0, idx, out=out_v.view(S * nb, *v.shape[1:]))


def check_cpu() -> None:
    """Under TRITON_INTERPRET=1: on small bf16 steps, the engine's kernel with TMA tiles equals it with pointer loads
    to the bit, on 16-key blocks, 64-key blocks (re-blocked) and one block per sequence."""
    assert pa.interpreting(), "run with TRITON_INTERPRET=1"
    for S, new, cached in ((2, 9, 0), (3, 5, 37), (1, 40, 70)):
        q, k, v, tables, cu, seq_lens = step(S, new, cached, "cpu", torch.bfloat16, hq=4, hkv=2, d=16, block=16)
        kw = dict(max_query_len=new, max_seq_len=new + cached, scale=16**-0.5)
        for block in (16, 64, 128):
            kb, tb = reblock(k, tables, block)
            vb, _ = reblock(v, tables, block)
            assert pa.tma_fits(q, kb, vb, 16)
            runs = [pa.paged_attention(q, kb, vb, tb, cu, seq_lens, **kw, config=tma_config(8, 16, tma=tma))
                    for tma in (True, False)]
            assert torch.equal(*runs), (S, new, cached, block)
    print("interpreter: TMA tiles equal pointer loads to the bit")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check-cpu", action="store_true")
    p.add_argument("--reps", type=int, default=20)
    args = p.parse_args()
    if args.check_cpu:
        return check_cpu()
    torch.manual_seed(0)
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__, flush=True)
    configs = [  # (block_m, tile_n, warps, stages)
        (256, 64, 16, 3), (256, 64, 16, 2), (256, 64, 8, 3), (128, 64, 8, 3), (128, 64, 4, 3),
        (128, 128, 8, 2), (128, 128, 8, 3), (128, 64, 8, 4), (256, 128, 16, 2), (64, 64, 4, 3), (64, 128, 4, 2),
    ]
    for name, (S, new, cached) in SHAPES.items():
        q, k, v, tables, cu, seq_lens = step(S, new, cached, "cuda", torch.bfloat16, block=16)
        L = cached + new
        flops = 4 * S * new * (cached + (new + 1) / 2) * D * HQ
        kw = dict(max_query_len=new, max_seq_len=L, scale=D**-0.5)
        ref = pa.paged_attention(q, k, v, tables, cu, seq_lens, **kw)
        base = median_ms(lambda: pa.paged_attention(q, k, v, tables, cu, seq_lens, **kw), args.reps)
        print(f"{name}: paged (engine, 16-key blocks) {base:.3f} ms {flops / base / 1e9:.0f} TFLOP/s", flush=True)
        lp = pa._pow2(L)  # one block per sequence (block sizes are powers of two)
        k64, t64 = reblock(k, tables, 64)
        v64, _ = reblock(v, tables, 64)
        kc, tc = reblock(k, tables, lp)
        vc, _ = reblock(v, tables, lp)
        gk, gv = torch.empty_like(kc), torch.empty_like(vc)
        t16 = torch.nn.functional.pad(tables, (0, lp // 16 - tables.shape[1]))  # pad entries: block 0, never read
        gms = median_ms(lambda: gather_contig(k, v, t16, lp, gk, gv), args.reps)
        print(f"  gather of the keys/values into [B, {lp}, Hkv, D]: {gms:.3f} ms", flush=True)
        for label, kk, vv, tt in (("tma bs64", k64, v64, t64), ("tma contig", kc, vc, tc)):
            for bm, tn, w, st in configs:
                if kk.shape[1] % tn:
                    continue
                config = tma_config(bm, tn, w, st)
                fn = lambda: pa.paged_attention(q, kk, vv, tt, cu, seq_lens, **kw, config=config)  # noqa: E731
                try:
                    out = fn()
                    ms = median_ms(fn, args.reps)
                except Exception as err:  # noqa: BLE001 (a config that does not compile or fit: say so, go on)
                    print(f"  {label} bm{bm} tn{tn} w{w} s{st}: failed {type(err).__name__}: {str(err)[:120]}")
                    continue
                err = (out.float() - ref.float()).abs().max().item()
                extra = f", {ms + gms:.3f} with the gather ({base / (ms + gms):.3f}x)" if label == "tma contig" else ""
                print(f"  {label} bm{bm} tn{tn} w{w} s{st}: {ms:.3f} ms {flops / ms / 1e9:.0f} TFLOP/s "
                      f"{base / ms:.3f}x{extra}  max |diff| {err:.1e}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
