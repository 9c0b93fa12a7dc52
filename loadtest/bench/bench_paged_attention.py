#!/usr/bin/env python
"""Paged attention kernels (backends/moe_engine/paged_attention.py) on one GPU, against torch SDPA.

Shape: Qwen3-30B-A3B attention (32 query / 4 KV heads of 128, bf16), one layer, paged cache of 16-token
blocks handed out from a shuffled free list (block tables not contiguous).

* decode: B sequences x context L, one query each (B in 1/16/64/256, L in 1k/8k/32k). Kernel time is a CUDA
  graph replay of one ``paged_attention`` call (the engine replays decode steps from graphs; capture also
  proves the call capturable), the median over reps with the L2 cache flushed before each; GB/s = K/V bytes
  read / time. ``splits`` is what ``choose_num_splits`` picks (1 = the 2-D kernel).
* prefill: 16 sequences x 8192 tokens, in chunks of 2048 (four steps, each over its cached context; the
  time is their sum) and 8192 (one step); TFLOP/s counts the causal work (4 * D * keys seen, per query head).
* SDPA: ``F.scaled_dot_product_attention`` (FlashAttention backend when it takes the call) on K/V already
  gathered into contiguous [B, Hkv, L, D] tensors, the gather not timed: decode as the G query heads of a kv
  head attending together (no repeated K/V), prefill causal with ``enable_gqa`` (or repeated K/V if refused).
  Both prefill chunkings do the same work as one causal 16 x 8192 SDPA call, which is the SDPA figure.

    .venv/bin/python loadtest/bench/bench_paged_attention.py            # the full table (~1-2 min)
    .venv/bin/python loadtest/bench/bench_paged_attention.py --quick    # fewer shapes and reps (< 1 min)
    .venv/bin/python loadtest/bench/bench_paged_attention.py --check    # max error, kernel vs reference, same shapes
    .venv/bin/python loadtest/bench/bench_paged_attention.py --sweep  # decode: every split count; prefill: tile configs
    .venv/bin/python loadtest/bench/bench_paged_attention.py --sweep --cases prefill --reps 10
    .venv/bin/python loadtest/bench/bench_paged_attention.py --cases prefill --sdpa-backends  # + cuDNN, efficient
    .venv/bin/python loadtest/bench/bench_paged_attention.py --cases dense  # the engine's dense prefill per length
    .venv/bin/python loadtest/bench/bench_paged_attention.py --cases layers  # short decodes, 48 layers per graph

``--check`` exits 1 if an error exceeds 2% of the reference's largest magnitude. ``--smoke`` runs tiny shapes
on the CPU under Triton's interpreter (tests the script, measures nothing).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

if "--smoke" in sys.argv:  # the interpreter is chosen when Triton kernels are defined, so before imports
    os.environ["TRITON_INTERPRET"] = "1"

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "backends"))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from moe_engine.kernels import paged_attention as pa  # noqa: E402

sys.path.insert(0, str(REPO))  # the repo root: loadtest.* when run by path
from loadtest.bench import real_shape_model as rsm  # noqa: E402

HQ, HKV, D = 32, 4, 128
G = HQ // HKV
SCALE = D**-0.5


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="decode B 1/64 x L 1k/32k, 10 reps")
    p.add_argument("--check", action="store_true", help="compare kernel and reference outputs instead of timing")
    p.add_argument("--sweep", action="store_true", help="time every split count (decode) and tile configs (prefill)")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on CPU under TRITON_INTERPRET=1")
    p.add_argument("--reps", type=int, default=None, help="timed repetitions per case (default 50, quick 10)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--no-sdpa", action="store_true", help="skip the SDPA comparison")
    p.add_argument("--sdpa-backends", action="store_true",
                   help="prefill: time every SDPA backend (flash, cudnn, efficient; GQA or repeated K/V)")
    p.add_argument("--cases", default="decode,prefill", help="comma-separated: decode, prefill, dense (first-call "
                   "and steady host/device time of attention.dense_causal per prompt length and SDPA backend), "
                   "layers (short-context decode, 48 layers per CUDA graph, every split count and key tile)")
    return p.parse_args()


# ---------------------------------------------------------------------------------------------- timing


class Timer:
    def __init__(self, device: torch.device, reps: int, warmup: int):
        self.device, self.reps, self.warmup = device, reps, warmup
        self.cuda = device.type == "cuda"
        # Zeroed before each rep so that no rep reads K/V left in L2 by the previous one (H200 L2: 50 MB).
        self.flush = torch.empty(256 * 2**20 if self.cuda else 1, dtype=torch.int8, device=device)

    def eager(self, fn) -> float:
        """Median ms of fn() (launch overhead included when the host is slower than the GPU)."""
        for _ in range(self.warmup):
            fn()
        if not self.cuda:
            times = []
            for _ in range(self.reps):
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
            return statistics.median(times)
        torch.cuda.synchronize()
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(self.reps)]
        for start, end in events:
            self.flush.zero_()
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize()
        return statistics.median(s.elapsed_time(e) for s, e in events)

    def graph(self, fn) -> tuple[float, str]:
        """Median ms of a CUDA graph replay of fn (GPU time only); eager time if capture fails."""
        if not self.cuda:
            return self.eager(fn), "eager"
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(3):  # compile and warm up outside the capture
                    fn()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                fn()
            torch.cuda.synchronize()
        except Exception as exc:  # noqa: BLE001 - report and fall back
            print(f"    (graph capture failed: {type(exc).__name__}: {str(exc)[:160]}; timing eagerly)")
            torch.cuda.synchronize()
            return self.eager(fn), "eager"
        return self.eager(graph.replay), "graph"


# ---------------------------------------------------------------------------------------------- shapes


def make_cache(num_seqs: int, seq_len: int, block_size: int, device, dtype, seed: int):
    """A cache holding num_seqs sequences of seq_len tokens in shuffled blocks, and their block tables."""
    g = torch.Generator(device=device).manual_seed(seed)
    nblk = -(-seq_len // block_size)
    num_blocks = num_seqs * nblk
    k_cache = torch.randn(num_blocks, block_size, HKV, D, device=device, dtype=dtype, generator=g)
    v_cache = torch.randn(num_blocks, block_size, HKV, D, device=device, dtype=dtype, generator=g)
    tables = torch.randperm(num_blocks, device=device, generator=g).view(num_seqs, nblk).to(torch.int32)
    return k_cache, v_cache, tables


def gathered(cache: torch.Tensor, tables: torch.Tensor, seq_len: int) -> torch.Tensor:
    """[B, Hkv, seq_len, D] contiguous copy of each sequence's keys (or values)."""
    B, nblk = tables.shape
    return cache[tables.long()].view(B, nblk * cache.shape[1], HKV, D)[:, :seq_len].transpose(1, 2).contiguous()


def first_working(variants, device):
    """The first (label, fn) whose fn runs; (None, None, reason) if none does."""
    reasons = []
    for label, fn in variants:
        try:
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize()
            return label, fn, None
        except Exception as exc:  # noqa: BLE001
            reasons.append(f"{label}: {type(exc).__name__}: {str(exc).splitlines()[0][:100] if str(exc) else ''}")
    return None, None, "; ".join(reasons)


def backend_only(fn, name: str = "FLASH_ATTENTION"):
    """fn under one SDPA backend (torch.nn.attention.SDPBackend.<name>): an error if that backend refuses."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def run():
        with sdpa_kernel([getattr(SDPBackend, name)]):
            return fn()

    return run


def flash_only(fn):
    return backend_only(fn, "FLASH_ATTENTION")


def sdpa_decode(q, k_dense, v_dense):
    """q [B, Hq, D] -> the G query heads of each kv head as G query rows over its keys (no mask needed)."""
    B = q.shape[0]
    qg = q.view(B, HKV, G, D)
    return lambda: F.scaled_dot_product_attention(qg, k_dense, v_dense, scale=SCALE)


def sdpa_prefill_variants(q_dense, k_dense, v_dense):
    rep = {}

    def repeated():
        if "k" not in rep:
            rep["k"], rep["v"] = k_dense.repeat_interleave(G, dim=1), v_dense.repeat_interleave(G, dim=1)
        return F.scaled_dot_product_attention(q_dense, rep["k"], rep["v"], is_causal=True, scale=SCALE)

    def gqa():
        return F.scaled_dot_product_attention(q_dense, k_dense, v_dense, is_causal=True, scale=SCALE, enable_gqa=True)

    return [("flash, enable_gqa", flash_only(gqa)), ("flash, repeated K/V", flash_only(repeated)),
            ("default backend, repeated K/V", repeated)]


def sdpa_prefill_backends(q_dense, k_dense, v_dense):
    """--sdpa-backends: every SDPA backend that could take a causal GQA prefill, each timed on its own."""
    variants = sdpa_prefill_variants(q_dense, k_dense, v_dense)
    out = [variants[0]]
    for name in ("CUDNN_ATTENTION", "EFFICIENT_ATTENTION"):
        out.append((f"{name.split('_')[0].lower()}, enable_gqa", backend_only(
            lambda: F.scaled_dot_product_attention(q_dense, k_dense, v_dense, is_causal=True, scale=SCALE,
                                                   enable_gqa=True), name)))
        out.append((f"{name.split('_')[0].lower()}, repeated K/V (repeat timed)", backend_only(
            lambda: F.scaled_dot_product_attention(q_dense, k_dense.repeat_interleave(G, dim=1),
                                                   v_dense.repeat_interleave(G, dim=1), is_causal=True,
                                                   scale=SCALE), name)))
    return out


# ---------------------------------------------------------------------------------------------- cases


def decode_case(B, L, args, device, dtype, timer, rows, check_rows):
    k_cache, v_cache, tables = make_cache(B, L, args.block_size, device, dtype, seed=B * 7 + L)
    g = torch.Generator(device=device).manual_seed(1)
    q = torch.randn(B, HQ, D, device=device, dtype=dtype, generator=g)
    cu = torch.arange(B + 1, device=device, dtype=torch.int32)
    seq_lens = torch.full((B,), L, device=device, dtype=torch.int32)
    out = torch.empty(B, HQ, D, device=device, dtype=dtype)
    splits = pa.choose_num_splits(B, HKV, L)
    kv_bytes = 2 * B * L * HKV * D * k_cache.element_size()

    def call(ns):
        return lambda: pa.paged_attention(q, k_cache, v_cache, tables, cu, seq_lens, max_query_len=1, max_seq_len=L,
                                          scale=SCALE, out=out, num_splits=ns)

    if args.check:
        idx = sorted({0, B - 1})
        sub = dict(max_query_len=1, max_seq_len=L, scale=SCALE)
        ref = pa.paged_attention_reference(q[idx], k_cache, v_cache, tables[idx],
                                           torch.arange(len(idx) + 1, device=device, dtype=torch.int32),
                                           seq_lens[idx], **sub)
        for ns in sorted({1, splits}):
            call(ns)()
            check_rows.append((f"decode B={B} L={L}", f"splits={ns}", out[idx].clone(), ref))
        return

    variants = sorted({1, 2, 4, 8, 16, 32, 64} if args.sweep else {splits})
    for ns in variants:
        ms, how = timer.graph(call(ns))
        row = {"case": f"decode B={B} L={_k(L)}", "splits": ns, "kernel_ms": ms, "timing": how,
               "kernel_rate": kv_bytes / ms / 1e6}
        if not args.no_sdpa and ns == variants[0]:
            k_dense, v_dense = gathered(k_cache, tables, L), gathered(v_cache, tables, L)
            label, fn, why = first_working([("flash", flash_only(sdpa_decode(q, k_dense, v_dense))),
                                            ("default backend", sdpa_decode(q, k_dense, v_dense))], device)
            if fn is None:
                row["sdpa"] = f"failed ({why})"
            else:
                sms, _ = timer.graph(fn)
                row.update(sdpa_ms=sms, sdpa_rate=kv_bytes / sms / 1e6, sdpa=label)
            del k_dense, v_dense
        rows.append(row)
        print(_fmt(row, "GB/s"), flush=True)


def layers_case(device, dtype, reps: int, block_size: int) -> None:
    """Short-context decode as a model runs it: one call per layer (48 layers, each its own cache), all in one
    CUDA graph, time per call = replay / 48 (a single call's event timing is mostly launch latency at this size);
    split counts 1-16 and key tiles 64 / 128, B sequences x L keys (batch-1 decode of case a: L 128-384)."""
    layers = 48
    print(f"layers: {layers} calls per graph replay, {reps} replays; us per call")
    for B, lens in ((1, (128, 256, 384, 512, 1024)), (4, (256, 512, 1024)), (16, (512, 1024, 2048)),
                    (32, (512, 1024, 2048))):
        for L in lens:
            caches = [make_cache(B, L, block_size, device, dtype, seed=i) for i in range(layers)]
            g = torch.Generator(device=device).manual_seed(1)
            qs = [torch.randn(B, HQ, D, device=device, dtype=dtype, generator=g) for _ in range(layers)]
            cu = torch.arange(B + 1, device=device, dtype=torch.int32)
            seq_lens = torch.full((B,), L, device=device, dtype=torch.int32)
            out = torch.empty(B, HQ, D, device=device, dtype=dtype)
            cells = []
            for tile_n in (64, 128):
                config = pa.KernelConfig(decode_tile_n=tile_n, decode_unsplit_tile_n=tile_n)
                for ns in (1, 2, 4, 8, 16):
                    if ns > 1 and L // ns < 32:
                        continue

                    def run(_ns=ns, _c=config):
                        for q, (k, v, t) in zip(qs, caches):
                            pa.paged_attention(q, k, v, t, cu, seq_lens, max_query_len=1, max_seq_len=L, scale=SCALE,
                                               out=out, num_splits=_ns, config=_c)

                    us = rsm.graph_replay_seconds(run, reps) * 1e6 / layers
                    cells.append((us, f"tile {tile_n} splits {ns}"))
            chosen = pa.choose_num_splits(B, HKV, L)
            best = min(cells)
            engine_tile = pa.DEFAULT_CONFIG.decode_tile_n if chosen > 1 else pa.DEFAULT_CONFIG.decode_unsplit_tile_n
            print(f"  B={B} L={L:5d} (engine: splits {chosen}, tile {engine_tile}): best "
                  f"{best[1]} {best[0]:.2f} us | " + ", ".join(f"{n} {t:.2f}" for t, n in cells), flush=True)
            caches = qs = None  # free before the next shape


def _prefill(bm: int, tn: int, warps: int, stages: int) -> pa.KernelConfig:
    return pa.KernelConfig(prefill_block_m=bm, prefill_tile_n=tn, prefill_num_warps=warps, prefill_num_stages=stages)


PREFILL_CONFIGS = [  # --sweep: (label, config); tune/sweep_prefill_tiles.py sweeps 57 such configs
    ("default", pa.DEFAULT_CONFIG),
    ("bm128 tn64 w8 s2 (before run23)", _prefill(128, 64, 8, 2)),
    ("bm256 tn64 w8 s3", _prefill(256, 64, 8, 3)),
    ("bm128 tn64 w4 s3", _prefill(128, 64, 4, 3)),
    ("bm128 tn32 w4 s4", _prefill(128, 32, 4, 4)),
    ("bm64 tn64 w4 s2", _prefill(64, 64, 4, 2)),
    ("bm256 tn128 w16 s2", _prefill(256, 128, 16, 2)),
]


def prefill_case(S, L, chunk, args, device, dtype, timer, rows, check_rows):
    k_cache, v_cache, tables = make_cache(S, L, args.block_size, device, dtype, seed=S + chunk)
    g = torch.Generator(device=device).manual_seed(2)
    steps = []
    for ctx in range(0, L, chunk):
        q = torch.randn(S * chunk, HQ, D, device=device, dtype=dtype, generator=g)
        cu = torch.arange(S + 1, device=device, dtype=torch.int32) * chunk
        seq_lens = torch.full((S,), ctx + chunk, device=device, dtype=torch.int32)
        steps.append((q, cu, seq_lens, torch.empty_like(q), ctx + chunk))
    flops = 4 * D * HQ * S * (L * (L + 1) // 2)  # QK^T and PV, causal: query at p sees p + 1 keys

    def call(step, config):
        q, cu, seq_lens, out, kv_len = step
        return lambda: pa.paged_attention(q, k_cache, v_cache, tables, cu, seq_lens, max_query_len=chunk,
                                          max_seq_len=kv_len, scale=SCALE, out=out, config=config)

    if args.check:
        q, cu, seq_lens, out, kv_len = steps[-1]  # the last chunk: most cached context
        call(steps[-1], pa.DEFAULT_CONFIG)()
        ref = pa.paged_attention_reference(q[:chunk], k_cache, v_cache, tables[:1], cu[:2], seq_lens[:1],
                                           max_query_len=chunk, max_seq_len=kv_len, scale=SCALE)
        check_rows.append((f"prefill {S}x{L} chunk {chunk}", f"last chunk, seq 0", out[:chunk].clone(), ref))
        return

    configs = PREFILL_CONFIGS if args.sweep else PREFILL_CONFIGS[:1]
    for label, config in configs:
        try:
            ms = sum(timer.eager(call(step, config)) for step in steps)
        except Exception as exc:  # noqa: BLE001 - a sweep config may not fit; say so and go on
            print(f"  prefill chunk {chunk} config {label}: {type(exc).__name__}: {str(exc)[:160]}")
            continue
        row = {"case": f"prefill {S}x{_k(L)} chunk {_k(chunk)}", "splits": label if args.sweep else "-",
               "kernel_ms": ms, "timing": f"eager, {len(steps)} step(s)", "kernel_rate": flops / ms / 1e9}
        if not args.no_sdpa and label == "default":
            row.update(prefill_sdpa(S, L, k_cache, v_cache, tables, device, dtype, timer, flops, args.sdpa_backends))
        rows.append(row)
        print(_fmt(row, "TFLOP/s"), flush=True)


_SDPA_PREFILL = {}


def prefill_sdpa(S, L, k_cache, v_cache, tables, device, dtype, timer, flops, all_backends=False):
    """One causal S x L SDPA call (same work as every chunking), measured once per (S, L); all_backends: also
    each backend alone, printed."""
    if (S, L) not in _SDPA_PREFILL:
        g = torch.Generator(device=device).manual_seed(3)
        q_dense = torch.randn(S, HQ, L, D, device=device, dtype=dtype, generator=g)
        k_dense, v_dense = gathered(k_cache, tables, L), gathered(v_cache, tables, L)
        label, fn, why = first_working(sdpa_prefill_variants(q_dense, k_dense, v_dense), device)
        if fn is None:
            _SDPA_PREFILL[S, L] = {"sdpa": f"failed ({why})"}
        else:
            ms = timer.eager(fn)
            _SDPA_PREFILL[S, L] = {"sdpa_ms": ms, "sdpa_rate": flops / ms / 1e9, "sdpa": label}
        for label, fn in sdpa_prefill_backends(q_dense, k_dense, v_dense) if all_backends else ():
            label, fn, why = first_working([(label, fn)], device)
            if fn is None:
                print(f"  SDPA {S}x{_k(L)} {why}", flush=True)
                continue
            ms = timer.eager(fn)
            print(f"  SDPA {S}x{_k(L)} {label:<40} {ms * 1e3:10.1f} us {flops / ms / 1e9:8.1f} TFLOP/s", flush=True)
        del q_dense, k_dense, v_dense
    return _SDPA_PREFILL[S, L]


# ---------------------------------------------------------------------------------------------- output


def _k(n: int) -> str:
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


def _fmt(row, unit) -> str:
    s = f"  {row['case']:<28} splits {str(row['splits']):<16} kernel {row['kernel_ms'] * 1e3:10.1f} us " \
        f"{row['kernel_rate']:8.1f} {unit} ({row['timing']})"
    if "sdpa_ms" in row:
        s += f" | sdpa {row['sdpa_ms'] * 1e3:10.1f} us {row['sdpa_rate']:8.1f} {unit} ({row['sdpa']}) " \
             f"| kernel/sdpa speedup {row['sdpa_ms'] / row['kernel_ms']:.2f}x"
    elif "sdpa" in row:
        s += f" | sdpa {row['sdpa']}"
    return s


def print_table(rows):
    print("\n| case | splits / config | kernel us | kernel rate | SDPA us | SDPA rate | SDPA / kernel |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for r in rows:
        unit = "GB/s" if r["case"].startswith("decode") else "TFLOP/s"
        sdpa = (f"{r['sdpa_ms'] * 1e3:.1f} | {r['sdpa_rate']:.1f} {unit} | {r['sdpa_ms'] / r['kernel_ms']:.2f}x"
                if "sdpa_ms" in r else f"{r.get('sdpa', '-')} | - | -")
        print(f"| {r['case']} | {r['splits']} | {r['kernel_ms'] * 1e3:.1f} | {r['kernel_rate']:.1f} {unit} | {sdpa} |")


def report_checks(check_rows) -> bool:
    ok = True
    print("\n| case | path | max abs err | max err / max abs ref | result |")
    print("|---|---|---:|---:|---|")
    for case, path, out, ref in check_rows:
        err = (out.float() - ref.float()).abs().max().item()
        rel = err / max(ref.float().abs().max().item(), 1e-30)
        good = bool(torch.isfinite(out).all()) and rel < 2e-2
        ok &= good
        print(f"| {case} | {path} | {err:.3e} | {rel:.3e} | {'PASS' if good else 'FAIL'} |")
    return ok


def dense_case(device, dtype) -> None:
    """attention.dense_causal (the engine's prefill of prompts from position 0) per prompt length: the first call
    of a new length (cuDNN builds an execution plan per shape), then the median wall time of 10 synchronised calls
    and of the host's part alone (the call returning, no sync), for cuDNN-first and FlashAttention-only."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from moe_engine.layers.attend import dense_causal

    g = torch.Generator(device=device).manual_seed(4)
    for label, backends in (("cudnn first", None), ("flash only", [SDPBackend.FLASH_ATTENTION])):
        for L in (1024, 1016, 1100, 2000, 4096, 8177, 8192):
            qkv = torch.randn(L, (HQ + 2 * HKV) * D, device=device, dtype=dtype, generator=g)
            q, k, v = (t.view(L, -1, D) for t in qkv.split([HQ * D, HKV * D, HKV * D], -1))  # the engine's views

            def call():
                if backends is None:
                    return dense_causal(q, k, v, SCALE)
                with sdpa_kernel(backends):
                    return F.scaled_dot_product_attention(
                        *(x.transpose(0, 1).unsqueeze(0) for x in (q, k, v)), is_causal=True, scale=SCALE,
                        enable_gqa=True)

            torch.cuda.synchronize()
            t = time.perf_counter()
            call()
            torch.cuda.synchronize()
            first = time.perf_counter() - t
            walls, hosts = [], []
            for _ in range(10):
                torch.cuda.synchronize()
                t = time.perf_counter()
                call()
                hosts.append(time.perf_counter() - t)
                torch.cuda.synchronize()
                walls.append(time.perf_counter() - t)
            flops = 4 * D * HQ * (L * (L + 1) // 2)
            wall = statistics.median(walls)
            print(f"  dense {label:<12} L={L:>5}: first call {first * 1e3:8.2f} ms, then {wall * 1e3:7.3f} ms "
                  f"({flops / wall / 1e12:5.0f} TFLOP/s), host {statistics.median(hosts) * 1e6:6.0f} us", flush=True)


def main() -> int:
    args = parse_args()
    if "dense" in args.cases.split(","):
        if not torch.cuda.is_available():
            print("--cases dense needs a CUDA GPU (it times cuDNN's and FlashAttention's kernels)")
            return 2
        dense_case(torch.device("cuda"), torch.bfloat16)
    if "layers" in args.cases.split(","):
        if not torch.cuda.is_available():
            print("--cases layers needs a CUDA GPU (CUDA graphs)")
            return 2
        layers_case(torch.device("cuda"), torch.bfloat16, args.reps or 20, args.block_size)
    if args.smoke:
        device, dtype = torch.device("cpu"), torch.bfloat16
        decode_shapes, prefill_shapes, reps, warmup = [(1, 40), (3, 100)], [(2, 64, 32), (2, 64, 64)], 1, 0
    else:
        if not torch.cuda.is_available():
            print("needs a CUDA GPU (or --smoke for a CPU run of the script under the Triton interpreter)")
            return 2
        device, dtype = torch.device("cuda"), torch.bfloat16
        if args.quick:
            decode_shapes = [(b, n) for b in (1, 64) for n in (1024, 32768)]
            prefill_shapes, reps, warmup = [(16, 8192, 2048), (16, 8192, 8192)], 10, 3
        else:
            decode_shapes = [(b, n) for b in (1, 16, 64, 256) for n in (1024, 8192, 32768)]
            prefill_shapes, reps, warmup = [(16, 8192, 2048), (16, 8192, 8192)], 50, 5
        print(f"GPU {torch.cuda.get_device_name(device)}, torch {torch.__version__}, "
              f"triton {getattr(pa.triton, '__version__', '?')}")
    reps = args.reps or reps
    cases = set(args.cases.split(","))
    decode_shapes = decode_shapes if "decode" in cases else []
    prefill_shapes = prefill_shapes if "prefill" in cases else []
    print(f"Hq {HQ}, Hkv {HKV}, D {D}, {str(dtype).split('.')[-1]}, block size {args.block_size}, {reps} reps")
    timer = Timer(device, reps, warmup)
    rows, check_rows = [], []
    t0 = time.time()
    for B, L in decode_shapes:
        decode_case(B, L, args, device, dtype, timer, rows, check_rows)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    for S, L, chunk in prefill_shapes:
        prefill_case(S, L, chunk, args, device, dtype, timer, rows, check_rows)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if args.check:
        ok = report_checks(check_rows)
        print(f"\n{'all within 2%' if ok else 'SOME CHECKS FAILED'} ({time.time() - t0:.0f} s)")
        return 0 if ok else 1
    print_table(rows)
    print(f"\n({time.time() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
