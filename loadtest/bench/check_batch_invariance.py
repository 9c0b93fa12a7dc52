#!/usr/bin/env python
"""Does a request get the same tokens and routed experts alone as in a batch? (engine in-process)

The load test compares every repeated request with its first occurrence and saw small
differences on the medium model. This reproduces that without any server: the same 16
prompts (64-192 tokens, 64 output tokens, ignore_eos) run one at a time, then all 16
together (chunked prefill, batched decode), with the server's EngineConfig, and the
outputs are compared: tokens, and per (row, layer) whether the k ids differ in slot order
only or as a set.

    .venv/bin/python loadtest/bench/check_batch_invariance.py --model medium [--greedy]
"""
from __future__ import annotations

import argparse
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
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from moe_engine.checkpoint import load_model
    from moe_engine.config import load_config
    from moe_engine.engine import Engine, EngineConfig, Request
    from moe_engine.core.sampling import SamplingParams
    from moe_engine.tiny import ensure_tiny_checkpoint

    path, name = resolve_model(args.model)
    path = path or str(ensure_tiny_checkpoint())
    cfg = load_config(path)
    model = load_model(path, dtype="float32", device="cpu", progress=False)
    rng = random.Random(2)
    prompts = [[rng.randrange(3, cfg.vocab_size) for _ in range(rng.randint(64, 192))] for _ in range(args.n)]

    def run(batch):
        eng = Engine(model, cfg, EngineConfig(max_num_seqs=64, max_model_len=1024, max_num_batched_tokens=512))
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
            sp = SamplingParams(max_tokens=64, ignore_eos=True, temperature=0.0) if args.greedy else \
                SamplingParams(max_tokens=64, ignore_eos=True, temperature=1.0, seed=1000 + i)
            eng.add_request(Request(f"r{i}", prompts[i], sp, on_output=collector(i)))
        while len(res) < len(batch):
            eng.step()
        return res

    alone = {}
    for i in range(args.n):
        alone.update(run([i]))
    batched = run(list(range(args.n)))
    identical = tok_diff = order = sets = cells = 0
    for i in range(args.n):
        (ta, ra), (tb, rb) = alone[i], batched[i]
        j = next((k for k, (a, b) in enumerate(zip(ta, tb)) if a != b), None)
        # Rows both share: all, or up to the first differing token (row r routes the token at position r).
        rows = ra.shape[0] if j is None else len(prompts[i]) + j
        a, b = ra[:rows], rb[:rows]
        d = (a != b).any(-1)
        s = (np.sort(a, -1) != np.sort(b, -1)).any(-1)
        cells += d.size
        order += int(d.sum() - s.sum())
        sets += int(s.sum())
        tok_diff += j is not None
        identical += (ta == tb and np.array_equal(ra, rb))
        where = [(int(r), int(c), "prompt" if r < len(prompts[i]) else "output") for r, c in np.argwhere(d)[:4]]
        print(f"prompt {i:2d} ({len(prompts[i])} tokens): "
              + ("identical" if ta == tb and np.array_equal(ra, rb) else
                 f"tokens {'differ from output ' + str(j) if j is not None else 'equal'}, "
                 f"{int(d.sum())} (row, layer) cells differ ({int(s.sum())} as a set) in the shared rows {where}"))
    print(f"\n{name}, {'greedy' if args.greedy else 'temperature 1 + seed'}: {identical}/{args.n} identical alone vs "
          f"batched; {tok_diff} with different tokens; of {cells} (row, layer) cells compared, {order} differ in slot "
          f"order only, {sets} as a set")


if __name__ == "__main__":
    main()
