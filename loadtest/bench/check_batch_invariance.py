#!/usr/bin/env python
"""Does a request get the same tokens and routed experts alone as in a batch? (engine in-process)

The load test compares every repeated request with its first occurrence and saw small
differences on the medium model. This reproduces that without any server: the same 16
prompts (64-192 tokens, 64 output tokens, ignore_eos) run one at a time, then all 16
together (chunked prefill, batched decode), with the server's EngineConfig, and the
outputs are compared: tokens, and per (row, layer) whether the k ids differ in slot order
only or as a set.

    .venv/bin/python loadtest/bench/check_batch_invariance.py --model medium [--greedy]

At a real shape on a GPU (random weights built there, real_shape_model.py), with and without deterministic
inference (issue 52: a 512-token prompt alone and inside a batch of 64):

    python3 loadtest/bench/check_batch_invariance.py --shape qwen3-30b-a3b --device cuda --dtype bfloat16 \
        --n 64 --prompt-len 512 --greedy [--deterministic]

The alone runs share one engine (one request at a time), the batched run gets another; prefix caching is off.
"""
from __future__ import annotations

import argparse
import gc
import random
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # the repo root: loadtest.* when run by path
sys.path.insert(0, str(REPO / "backends"))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from loadtest.bench.common import resolve_model  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="medium")
    ap.add_argument("--greedy", action="store_true", help="temperature 0 (default: temperature 1, seed per prompt)")
    ap.add_argument("--n", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--shape", default=None,
                    help="a real_shape_model.py shape with random weights (instead of --model)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    ap.add_argument("--prompt-len", type=int, default=None, help="every prompt this long (default: 64-192 tokens)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--deterministic", action="store_true", help="--enable-deterministic-inference")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from moe_engine.checkpoint import load_model
    from moe_engine.config import load_config
    from moe_engine.engine import Engine, EngineConfig, Request
    from moe_engine.core.sampling import SamplingParams
    from moe_engine.tiny import ensure_tiny_checkpoint

    dtype = getattr(torch, args.dtype)
    if args.shape:
        from loadtest.bench import real_shape_model as rsm

        name = args.shape
        model, cfg = rsm.build_engine_model(rsm.SHAPES[args.shape], torch.device(args.device), dtype, seed=0)
    else:
        path, name = resolve_model(args.model)
        path = path or str(ensure_tiny_checkpoint())
        cfg = load_config(path)
        model = load_model(path, dtype=dtype, device=args.device, progress=False)
    rng = random.Random(2)
    prompts = [[rng.randrange(3, cfg.vocab_size) for _ in range(args.prompt_len or rng.randint(64, 192))]
               for _ in range(args.n)]
    max_len = max(map(len, prompts)) + args.max_tokens
    engine_cfg = EngineConfig(max_num_seqs=max(64, args.n), max_model_len=max(1024, max_len),
                              max_num_batched_tokens=512 if args.device == "cpu" else None,
                              enable_prefix_caching=False, deterministic_inference=args.deterministic,
                              kv_cache_memory_bytes=None if args.device == "cpu" else 8 << 30)
    engines = {}

    def run(batch, which):
        if which not in engines:
            engines.clear()  # (the alone engine's memory, before the batched one is built)
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            engines[which] = Engine(model, cfg, engine_cfg)
        eng = engines[which]
        res = {}

        def collector(i):
            toks, rows = [], []

            def cb(o):
                toks.extend(o.new_token_ids)
                if o.routed_experts is not None:
                    rows.append(o.routed_experts)
                if o.finished:
                    res[i] = (toks, np.concatenate(rows))
            return cb

        for i in batch:
            sp = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, temperature=0.0) if args.greedy else \
                SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, temperature=1.0, seed=1000 + i)
            eng.add_request(Request(f"r{i}", prompts[i], sp, on_output=collector(i)))
        while len(res) < len(batch):
            eng.step()
        return res

    alone = {}
    for i in range(args.n):
        alone.update(run([i], "alone"))
    batched = run(list(range(args.n)), "batched")
    identical = tok_diff = order = sets = cells = rows_equal = rows_total = 0
    for i in range(args.n):
        (ta, ra), (tb, rb) = alone[i], batched[i]
        j = next((k for k, (a, b) in enumerate(zip(ta, tb)) if a != b), None)
        # Rows both share: all, or up to the first differing token (row r routes the token at position r).
        rows = ra.shape[0] if j is None else len(prompts[i]) + j
        a, b = ra[:rows], rb[:rows]
        d = (a != b).any(-1)
        s = (np.sort(a, -1) != np.sort(b, -1)).any(-1)
        cells += d.size
        rows_equal += int((~d.any(-1)).sum())
        rows_total += d.shape[0]
        order += int(d.sum() - s.sum())
        sets += int(s.sum())
        tok_diff += j is not None
        identical += (ta == tb and np.array_equal(ra, rb))
        where = [(int(r), int(c), "prompt" if r < len(prompts[i]) else "output") for r, c in np.argwhere(d)[:4]]
        print(f"prompt {i:2d} ({len(prompts[i])} tokens): "
              + ("identical" if ta == tb and np.array_equal(ra, rb) else
                 f"tokens {'differ from output ' + str(j) if j is not None else 'equal'}, "
                 f"{int(d.sum())} (row, layer) cells differ ({int(s.sum())} as a set) in the shared rows {where}"))
    mode = "deterministic inference" if eng_settings(engines) else "default mode"
    sampling = "greedy" if args.greedy else "temperature 1 + seed"
    print(f"\n{name}, {mode}, {sampling}: {identical}/{args.n} identical alone vs "
          f"batched; {tok_diff} with different tokens; of {cells} (row, layer) cells compared, {order} differ in slot "
          f"order only, {sets} as a set; {rows_equal}/{rows_total} rows with every layer's experts equal")


def eng_settings(engines: dict) -> bool:
    return any(e.settings.deterministic_inference for e in engines.values())


if __name__ == "__main__":
    main()
