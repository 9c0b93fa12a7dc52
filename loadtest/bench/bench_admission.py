"""Host time of a multi-turn agent's turn around its first step: admitting long prompts that hit the prefix cache,
and handing out their first outputs (no model, no device).

At turn 16 of ``bench_multiturn.py`` 32 conversations each send ~7,800 tokens, ~7,500 of them cached; the GPU
waits while the host validates and admits them, and the first outputs carry each conversation's ~7,500-row history
of routed experts. This replays that on the CPU with the engine's own scheduler and block manager at the real
shape's bookkeeping sizes (48 layers x top-8 routing rows, uint8 in the cache, 11,353 blocks of 64 as on an H200),
prompts as JSON-parsed lists (fresh int objects, as a server gets them), and reports the median over rounds of:

- validate: the prompts' token ids checked (``Engine.validate``'s conversion to an id array and range check)
- schedule: ``Scheduler.schedule`` of the turn's first step (hashing, looking up and taking the cached blocks)
- prepare (device busy): ``Scheduler.prepare_outputs``, which the engine runs after launching the step, while the
  device computes it (cached rows copied into the first outputs)
- process / median output: ``Scheduler.process`` of that step's results, and when the median request's output
  was handed out within it

    PYTHONPATH=backends:. python3 loadtest/bench/bench_admission.py                 # ~30 s
    PYTHONPATH=OTHER/backends:. python3 loadtest/bench/bench_admission.py           # another tree's engine

A tree without ``prepare_outputs`` or the id array (before 2026-12-03) is measured with what it has: its
validation's per-token loop, and the cached rows copied in ``process``.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from types import SimpleNamespace

import numpy as np

from moe_engine.core.block_manager import BlockManager
from moe_engine.core.sampling import SamplingParams, make_state
from moe_engine.core.scheduler import Scheduler, StepResult
from moe_engine.core.sequence import Request, Sequence

try:
    from moe_engine.engine import _id_array
except ImportError:  # an older tree
    _id_array = None


def validate(prompt: list[int], vocab: int) -> np.ndarray | None:
    """What ``Engine.validate`` does with the ids (the tree's own way)."""
    if _id_array is None:
        assert not [t for t in prompt if not 0 <= t < vocab]
        return None
    ids = _id_array(prompt)
    assert ids is not None and ids.min() >= 0 and ids.max() < vocab
    return ids


def one_round(bm: BlockManager, args, rng: random.Random, rnd: int) -> dict[str, float]:
    L, K, V = args.layers, args.top_k, args.vocab
    sp = SamplingParams(max_tokens=args.output_tokens, ignore_eos=True)
    settings = SimpleNamespace(max_num_seqs=args.conversations, step_tokens=args.step_tokens,  # what Scheduler reads
                               max_model_len=args.history + args.new + args.output_tokens + 16, keep_routing_rows=True)
    sch = Scheduler(bm, settings, frozenset([0]))
    # The histories, as earlier turns left them: computed, registered with their rows, freed (cached).
    hist = [[rng.randrange(V) for _ in range(args.history)] for _ in range(args.conversations)]
    for i, h in enumerate(hist):
        s = Sequence(req=Request(f"h{rnd}-{i}", h), sampler=make_state(sp), tokens=list(h), num_prompt=len(h))
        assert bm.allocate(s.table, len(h))
        bm.register(s.table, s.tokens, len(h), np.zeros((len(h), L, K), np.uint16), 0)
        bm.free_table(s.table)
    prompts = [json.loads(json.dumps(h + [rng.randrange(V) for _ in range(args.new)])) for h in hist]

    t0 = time.perf_counter()
    ids = [validate(p, V) for p in prompts]
    t1 = time.perf_counter()
    extra = {} if ids[0] is None else {"prompt_ids": None}
    seqs = []
    for i, (p, a) in enumerate(zip(prompts, ids)):
        if extra:
            extra["prompt_ids"] = a
        seqs.append(Sequence(req=Request(f"r{rnd}-{i}", p, sampling=sp), sampler=make_state(sp), tokens=list(p),
                             num_prompt=len(p), **extra))
    for s in seqs:
        sch.add(s)
    t2 = time.perf_counter()
    plan = sch.schedule()
    t3 = time.perf_counter()
    prepare = getattr(sch, "prepare_outputs", None)
    if prepare is not None:
        prepare(plan)
    t4 = time.perf_counter()
    routing = np.random.default_rng(rnd).integers(0, 128, (plan.num_tokens, L, K)).astype(np.uint16)
    times: list[float] = []
    t5 = time.perf_counter()
    sch.process(StepResult(plan, [1] * len(plan.samplers), routing=routing), lambda s, o: times.append(time.perf_counter()))
    t6 = time.perf_counter()
    for s in list(sch.running):
        sch.finish(s, "abort", lambda *a: None)
    return {"validate": t1 - t0, "schedule": t3 - t2, "prepare (device busy)": t4 - t3, "process": t6 - t5,
            "median output": sorted(times)[len(times) // 2] - t5, "first-step requests": len(plan.items) / 1e3}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--conversations", type=int, default=32)
    ap.add_argument("--history", type=int, default=7500, help="cached tokens of each prompt")
    ap.add_argument("--new", type=int, default=300, help="new tokens of each prompt")
    ap.add_argument("--output-tokens", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--num-blocks", type=int, default=None, help="default: 726,592 tokens' worth (an H200's)")
    ap.add_argument("--block-size", type=int, default=64, help="64: the engine's default on Hopper GPUs")
    ap.add_argument("--step-tokens", type=int, default=8192)
    args = ap.parse_args()
    bm = BlockManager(args.num_blocks or 726592 // args.block_size, args.block_size, True, routing_shape=(args.layers, args.top_k), routing_dtype=np.uint8)
    rng = random.Random(0)
    rounds = [one_round(bm, args, rng, r) for r in range(args.rounds)]
    print(f"{args.conversations} prompts of {args.history} cached + {args.new} new tokens, rows {args.layers} x "
          f"{args.top_k}; median of {args.rounds} rounds (ms)")
    for k in rounds[0]:
        v = statistics.median(r[k] for r in rounds)
        print(f"  {k:24s} {v * 1e3:8.1f}" if k != "first-step requests" else f"  {k:24s} {v * 1e3:8.0f}")


if __name__ == "__main__":
    main()
