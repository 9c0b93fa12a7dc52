"""Host time of the engine's steps outside the forward, with routed experts on and off.

The host work of a prefill step (``scheduler.schedule``, ``ForwardBatch.build``, ``runner.results``,
``scheduler.process``) was time the GPU waited until steps after prefill and mixed steps were overlapped too (the
next one launched before the previous one's results are read, engine.py); it still bounds how fast the host can
feed the GPU, and is time the GPU waits where a step cannot be overlapped (a preemption, prompt scoring). It is
measured here on the CPU with the real shape's bookkeeping sizes (Qwen3-30B-A3B's 48 layers, 128 experts top-8:
routing rows of 48 x 8 per token, 8192-token steps) and tiny widths (hidden 64), so the forward
is cheap enough and the rest is what a real server's host does per step. Each timed call is wrapped; the forward
itself is reported for scale only.

    PYTHONPATH=backends:. python3 loadtest/bench/bench_host_time.py   # 64 x 1024 prompts, capture on and off
    PYTHONPATH=backends:. python3 loadtest/bench/bench_host_time.py --prompts 16 --prompt-len 2048 --modes on
    PYTHONPATH=backends:. python3 loadtest/bench/bench_host_time.py \\
        --prompts 32 --prompt-len 7488 --turn2 312 --layers 2

Takes about 75 s per mode on a 2-core machine (ten 8k-token steps of 48 layers). ``--turn2 N`` then sends every
prompt again with N new tokens (a multi-turn agent's next turn: the prompt is a prefix-cache hit) and reports that
round's calls apart ("turn 2"): admitting a long cached prompt hashes its blocks, which the host does before the
turn's first step.
"""
from __future__ import annotations

import argparse
import collections
import threading
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: loadtest.* when run by path
from loadtest.bench import real_shape_model as rsm  # noqa: E402
from moe_engine.layers import attend
from moe_engine.engine import Engine
from moe_engine.engine_config import EngineConfig
from moe_engine.core.sampling import SamplingParams
from moe_engine.core.sequence import Request


def timed(totals: dict, counts: collections.Counter, label: str, f):
    def g(*a, **k):
        t0 = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            totals[label] += time.perf_counter() - t0
            counts[label] += 1
    return g


def run(capture: bool, prompts: int, prompt_len: int, step_tokens: int, seed: int, turn2: int = 0,
        layers: int = 48) -> dict[str, tuple[float, int]]:
    """{call: (ms per call, calls)} for one prefill-heavy run (each prompt generates 2 tokens), and with
    ``turn2`` a second round of the same prompts plus ``turn2`` new tokens each (labels ending in ", turn 2")."""
    raw = dict(rsm.QWEN3_30B_A3B, hidden_size=64, head_dim=16, num_attention_heads=4, num_key_value_heads=4,
               moe_intermediate_size=16, intermediate_size=64, vocab_size=1024, num_hidden_layers=layers)
    model, cfg = rsm.build_engine_model(raw, torch.device("cpu"), torch.float32, seed=seed)
    totals: dict[str, float] = collections.defaultdict(float)
    counts: collections.Counter = collections.Counter()
    build = attend.ForwardBatch.build.__func__
    attend.ForwardBatch.build = classmethod(timed(totals, counts, "ForwardBatch.build", build))
    try:
        eng = Engine(model, cfg, EngineConfig(max_num_seqs=prompts, max_model_len=prompt_len + turn2 + 64,
                                              max_num_batched_tokens=step_tokens, enable_prefix_caching=True,
                                              enable_routed_experts=capture))
        wrapped = [(eng.scheduler, "schedule", "scheduler.schedule"), (eng.runner, "results", "runner.results"),
                   (eng.scheduler, "process", "scheduler.process"),
                   (eng.runner.model, "forward", "model.forward (for scale)")]
        plain = {(id(obj), name): getattr(obj, name) for obj, name, _ in wrapped}
        for obj, name, label in wrapped:
            setattr(obj, name, timed(totals, counts, label, plain[id(obj), name]))
        done, left = threading.Event(), [prompts]

        def on_output(out):
            if out.finished:
                left[0] -= 1
                if left[0] == 0:
                    done.set()

        g = torch.Generator().manual_seed(seed)
        sent = []
        for i in range(prompts):
            ids = torch.randint(3, 1000, (prompt_len,), generator=g).tolist()
            sent.append(ids)
            eng.add_request(Request(f"r{i}", ids, SamplingParams(max_tokens=2, ignore_eos=True, temperature=0.0),
                                    on_output=on_output, return_routed_experts=capture))
        while not done.is_set():
            eng.step()
        if turn2:
            for obj, name, label in wrapped:
                setattr(obj, name, timed(totals, counts, label + ", turn 2", plain[id(obj), name]))
            done.clear()
            left[0] = prompts
            for i, ids in enumerate(sent):
                new = torch.randint(3, 1000, (turn2,), generator=g).tolist()
                eng.add_request(Request(f"t2-{i}", ids + new, SamplingParams(max_tokens=2, ignore_eos=True,
                                        temperature=0.0), on_output=on_output, return_routed_experts=capture))
            while not done.is_set():
                eng.step()
    finally:
        attend.ForwardBatch.build = classmethod(build)
    return {k: (totals[k] * 1e3 / counts[k], counts[k]) for k in totals}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--step-tokens", type=int, default=8192, help="max_num_batched_tokens")
    ap.add_argument("--modes", default="on,off", help="routed experts on and/or off, in this order")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--turn2", type=int, default=0, help="then every prompt again plus this many new tokens")
    ap.add_argument("--layers", type=int, default=48, help="decoder layers (the routing rows' height)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    results = {}
    for mode in args.modes.split(","):
        t0 = time.perf_counter()
        results[mode] = run(mode == "on", args.prompts, args.prompt_len, args.step_tokens, args.seed, args.turn2,
                            args.layers)
        print(f"routed experts {mode}: {time.perf_counter() - t0:.0f} s", flush=True)
    labels = sorted({k for r in results.values() for k in r}, key=lambda k: (k.endswith("turn 2"), k))
    print(f"\n{args.prompts} x {args.prompt_len} prompts" + (f", then again + {args.turn2} tokens (turn 2)" if args.turn2
          else "") + f", {args.step_tokens} tokens per step, {args.layers} layers; ms per call (calls)")
    print(f"| call | " + " | ".join(f"routed experts {m}" for m in results) + " |")
    print("|---|" + "---:|" * len(results))
    for label in labels:
        cells = [f"{results[m][label][0]:.2f} ({results[m][label][1]})" if label in results[m] else "-" for m in results]
        print(f"| {label} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
