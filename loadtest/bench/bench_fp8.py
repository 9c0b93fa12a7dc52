#!/usr/bin/env python
"""FP8 (W8A8 block-scaled) against bf16 at the Qwen3-30B-A3B shape, in one run on one GPU (issue 50).

The model: random bf16 weights built on the GPU (real_shape_model.py, balanced init). Its dense projections and
routed experts are quantised there in 128 x 128 blocks (fp8_load.quantize_in_memory; the e4m3 weights and scales
wait in host memory), and the bf16 weights are replaced in place by their dequantised values: the **dequantised
reference**, i.e. the very weights the FP8 model holds, run with bf16 activations. Then:

1. bf16 engine (the reference): (a) 1 x (128 + 256) decode ITL p50; (b) 64 x (1024 + 256) output tok/s; greedy
   references: --ref-prompts prompts of 128 tokens, 256 output tokens each, with their routed experts.
2. The same model switched to FP8 (fp8_load.install_fp8: Fp8Linear projections, W8A8 experts; router, norms,
   embeddings and lm_head stay bf16), a new engine: (a) and (b) again; then
   - routed-expert agreement, teacher-forced: each reference sequence (prompt + its 256 outputs) is the FP8
     engine's prompt; per MoE layer, the fraction of positions whose routed expert set equals the reference's
     (target >= 99% per layer);
   - greedy agreement: the FP8 engine generates 256 tokens from each reference prompt; fraction of steps whose
     token equals the reference's, and the first step where they differ (target >= 90% of 256 steps).
Ratios: ITL fp8 / bf16 (target <= 0.65), tok/s fp8 / bf16 (target >= 1.3).

Both engines use the same settings (--max-cudagraph-capture-size 64 by default, to keep start-up short: decode
batches of up to 64 replay graphs, prefill steps of more than 64 tokens run eagerly, in both). Repetitions use
fresh random prompts (seeded, the same for both), prefix caching off.

    python loadtest/bench/bench_fp8.py --out $OUT/fp8          # H100/H200: about 5-6 minutes
    .venv/bin/python loadtest/bench/bench_fp8.py --shape tiny --device cpu --scale 0.05 --ref-prompts 1  # CPU smoke
Output: progress lines; results.json and report.md in --out.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "backends"))
sys.path.insert(0, str(REPO))
from loadtest.bench import real_shape_model as rsm  # noqa: E402
from loadtest.bench.bench_real_shape import Batch, environment  # noqa: E402

T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:7.1f}s] {msg}", flush=True)


def prompts(seed: int, n: int, length: int, vocab: int) -> list[list[int]]:
    return torch.randint(3, vocab, (n, length), generator=torch.Generator().manual_seed(seed)).tolist()


def run_batch(engine, cfg, ps: list[list[int]], out_len: int, tag: str, timeout: float, routing: bool = True) -> Batch:
    batch = Batch(engine, ps, out_len, routing, tag)
    batch.collect_routing = routing
    batch.start()
    if not batch.wait(time.perf_counter() + timeout):
        raise RuntimeError(f"{tag}: not finished in {timeout:.0f} s ({batch.n_finished}/{batch.n})")
    batch.check(cfg)
    return batch


def rows_of(batch: Batch) -> np.ndarray:
    """The routed-experts rows [rows, L, K] of a one-request batch (Batch keeps every request's rows in arrival
    order, so rows are taken from batches of one)."""
    assert batch.n == 1
    return np.concatenate(batch.routing)


def measure(engine, cfg, args, tag: str) -> dict:
    """(a) and (b), each after a short warm-up of its shape."""
    out = {}
    vocab = cfg.vocab_size
    for case, (n, p, o) in {"a": args.size_a, "b": args.size_b}.items():
        run_batch(engine, cfg, prompts(999, n, p, vocab), min(16, o), f"{tag}-{case}-warm", args.timeout, False)
        reps = []
        for rep in range(args.reps):
            b = run_batch(engine, cfg, prompts(1000 + rep, n, p, vocab), o, f"{tag}-{case}-{rep}", args.timeout, False)
            m = b.metrics()
            reps.append(m)
            log(f"{tag} ({case}) {n} x ({p} + {o}) rep {rep + 1}: {m['tok_s']:.1f} tok/s, ITL p50 "
                f"{m['itl_p50_s'] * 1e3:.2f} ms, TTFT p50 {m['ttft_p50_s'] * 1e3:.0f} ms")
        out[case] = {"reps": reps, "tok_s": float(np.median([r["tok_s"] for r in reps])),
                     "itl_p50_s": float(np.median([r["itl_p50_s"] for r in reps]))}
    return out


def greedy_refs(engine, cfg, args, tag: str, forced: list[list[int]] | None = None) -> list[dict]:
    """Per reference prompt: 256 greedy tokens and their routed rows; ``forced``: teacher-forced sequences run as
    prompts (1 output token), returning the rows of every position."""
    out = []
    seqs = forced or prompts(7, args.ref_prompts, args.ref_prompt_len, cfg.vocab_size)
    for i, p in enumerate(seqs):
        o = 1 if forced else args.ref_tokens
        b = run_batch(engine, cfg, [p], o, f"{tag}-ref-{i}", args.timeout)
        out.append({"prompt": p, "tokens": b.tokens[0], "rows": rows_of(b)})
    return out


def agreement(ref: list[dict], fp8_forced: list[dict], fp8_free: list[dict], cfg) -> dict:
    moe = list(cfg.moe_layers)
    per_layer = {layer: [] for layer in moe}
    for r, f in zip(ref, fp8_forced):
        # reference rows: prompt + output - 1 positions; forced rows: the same positions (prompt = the whole sequence)
        n = min(len(r["rows"]), len(f["rows"]))
        a, b = np.sort(r["rows"][:n], -1), np.sort(f["rows"][:n], -1)
        for layer in moe:
            per_layer[layer].append((a[:, layer] == b[:, layer]).all(-1))
    sets = {layer: float(np.concatenate(v).mean()) for layer, v in per_layer.items()}
    equal, first = [], []
    for r, f in zip(ref, fp8_free):
        same = np.asarray(r["tokens"]) == np.asarray(f["tokens"])
        equal.append(float(same.mean()))
        first.append(int(np.argmin(same)) if not same.all() else len(same))
    return {"routed_sets_equal_per_layer": sets, "routed_sets_equal_min": min(sets.values()),
            "routed_sets_equal_mean": float(np.mean(list(sets.values()))), "greedy_tokens_equal": equal,
            "greedy_tokens_equal_mean": float(np.mean(equal)), "greedy_first_difference": first}


def build_engine(model, cfg, args):
    from moe_engine.engine import Engine, EngineConfig

    ecfg = EngineConfig(max_num_seqs=max(args.size_b[0], 1), max_model_len=args.max_model_len,
                        enable_prefix_caching=False, max_cudagraph_capture_size=args.graph_tokens,
                        **({"kv_cache_memory_bytes": int(args.kv_cache_gib * 2**30)} if args.kv_cache_gib else {}))
    t = time.perf_counter()
    engine = Engine(model, cfg, ecfg)
    engine.start()
    log(f"engine built in {time.perf_counter() - t:.1f} s; {engine.stats()}")
    return engine


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default=rsm.REAL_SHAPE, choices=sorted(rsm.SHAPES))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--scale", type=float, default=1.0, help="multiply prompt/output lengths and request counts")
    p.add_argument("--reps", type=int, default=1)
    p.add_argument("--ref-prompts", type=int, default=4, help="greedy reference sequences")
    p.add_argument("--graph-tokens", type=int, default=64, help="--max-cudagraph-capture-size of both engines")
    p.add_argument("--kv-cache-gib", type=float, default=None)
    p.add_argument("--timeout", type=float, default=240.0, help="seconds per batch")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    s = args.scale
    scaled = lambda n, pl, o: (max(1, round(n * s)), max(4, round(pl * s)), max(8, round(o * s)))  # noqa: E731
    args.size_a, args.size_b = scaled(1, 128, 256), scaled(64, 1024, 256)
    args.ref_prompt_len, args.ref_tokens = scaled(1, 128, 256)[1:]
    args.max_model_len = max(sum(args.size_b[1:]), sum(args.size_a[1:]), args.ref_prompt_len + args.ref_tokens) + 8
    out = Path(args.out or REPO / "loadtest" / "results" / f"fp8-{time.strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    from moe_engine import fp8_load

    results = {"benchmark": "loadtest/bench/bench_fp8.py", "argv": argv or sys.argv[1:],
               "environment": environment(device, dtype), "shape": args.shape}
    log(f"{args.shape} on {device} ({results['environment'].get('gpu', '')}); building random {dtype} weights")
    model, cfg = rsm.build_engine_model(rsm.SHAPES[args.shape], device, dtype, args.seed, "balanced", log)
    names = fp8_load.target_names(model)
    t = time.perf_counter()
    quantized = fp8_load.quantize_in_memory(model, names, to="cpu")
    fp8_load.dequantize_in_place(model, quantized)  # the dequantised reference: the FP8 model's own weights
    log(f"quantised {len(names)} weights in {time.perf_counter() - t:.1f} s (e4m3 + scales in host memory); "
        "bf16 weights replaced by their dequantised values")

    save = lambda: (out / "results.json").write_text(json.dumps(results, indent=1, default=float))  # noqa: E731
    engine = build_engine(model, cfg, args)
    results["bf16"] = measure(engine, cfg, args, "bf16")
    save()  # a run cut short keeps what it measured
    ref = greedy_refs(engine, cfg, args, "bf16")
    engine.shutdown()
    rsm.free_device_memory(device)

    t = time.perf_counter()
    fp8_load.install_fp8(model, quantized)
    del quantized
    rsm.free_device_memory(device)
    log(f"FP8 installed in {time.perf_counter() - t:.1f} s")
    engine = build_engine(model, cfg, args)
    results["fp8"] = measure(engine, cfg, args, "fp8")
    save()
    free = greedy_refs(engine, cfg, args, "fp8")
    forced = greedy_refs(engine, cfg, args, "fp8-forced", forced=[r["prompt"] + r["tokens"] for r in ref])
    engine.shutdown()
    results["agreement"] = agreement(ref, forced, free, cfg)
    b, f = results["bf16"], results["fp8"]
    results["ratios"] = {"itl_a_fp8_over_bf16": f["a"]["itl_p50_s"] / b["a"]["itl_p50_s"],
                         "tok_s_b_fp8_over_bf16": f["b"]["tok_s"] / b["b"]["tok_s"]}
    ag, r = results["agreement"], results["ratios"]
    lines = [
        f"# FP8 vs bf16, {args.shape}, {results['environment'].get('gpu', device)}", "",
        "| metric | bf16 | fp8 | ratio | target |", "|---|---|---|---|---|",
        f"| (a) ITL p50, 1 x ({args.size_a[1]} + {args.size_a[2]}) | {b['a']['itl_p50_s'] * 1e3:.2f} ms | "
        f"{f['a']['itl_p50_s'] * 1e3:.2f} ms | {r['itl_a_fp8_over_bf16']:.3f} | <= 0.65 |",
        f"| (b) output tok/s, {args.size_b[0]} x ({args.size_b[1]} + {args.size_b[2]}) | {b['b']['tok_s']:.0f} | "
        f"{f['b']['tok_s']:.0f} | {r['tok_s_b_fp8_over_bf16']:.3f} | >= 1.3 |",
        f"| routed sets = dequantised reference (teacher-forced), min / mean over layers | | "
        f"{ag['routed_sets_equal_min']:.2%} / {ag['routed_sets_equal_mean']:.2%} | | >= 99% per layer |",
        f"| greedy tokens = dequantised reference, {args.ref_tokens} steps x {args.ref_prompts} | | "
        f"{ag['greedy_tokens_equal_mean']:.2%} (first difference at {ag['greedy_first_difference']}) | | >= 90% |",
    ]
    save()
    (out / "report.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)
    log(f"done: {out / 'report.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
