"""Rollout throughput with continuous batching: more requests than sequence slots, prompts admitted as others end.

An RL rollout sends a batch of prompts larger than ``max_num_seqs``; each time sequences finish, waiting prompts
join the running decodes in a mixed step (a prompt chunk beside the decode rows). This benchmark runs such a
rollout at the Qwen3-30B-A3B shape (random bf16 weights built on the GPU): R requests, prompts of 128-384 tokens
(``--prompt-lens``), greedy outputs of 32-288 tokens (uniform; seeded), routed experts on, all submitted at once,
through 64 slots.
Two engines on the one model run it alternately (8 GiB of KV cache each):

* ``graphs``: the default, prefill and mixed steps of up to 2,048 tokens replay CUDA graphs (prefill_graphs.py);
* ``decode graphs only``: ``max_cudagraph_capture_size=64``, so decode steps replay graphs as before and every
  step that carries a prompt (128+ tokens) runs eagerly, as before prefill graphs.

Reported per engine (medians over the repetitions): output tok/s from the submission to the last token, the steps
and how many carried prompt tokens, their mean wall time (``Engine.step()``, host and GPU: prefill steps are not
overlapped), and whether every request's tokens equal the other engine's (greedy: they should; bfloat16 ties
can break differently where the kernels' tiles differ).

    PYTHONPATH=backends:. python3 loadtest/bench/bench_continuous.py [--requests 192] [--reps 2]
    PYTHONPATH=backends:. python3 loadtest/bench/bench_continuous.py --prompt-lens 512 1536   # longer prompts
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: loadtest.* when run by path
from loadtest.bench import real_shape_model as rsm  # noqa: E402
from moe_engine.engine import Engine, EngineConfig, Request
from moe_engine.core.sampling import SamplingParams


def workload(requests: int, vocab: int, seed: int, prompt_lens: tuple[int, int]) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [([rng.randrange(vocab) for _ in range(rng.randint(*prompt_lens))], rng.randint(32, 288))
            for _ in range(requests)]


def rollout(engine: Engine, work: list[tuple[list[int], int]], tag: str) -> dict:
    """Run every request to the end on this thread; tok/s, step counts and times, each request's tokens."""
    outs: list[list[int]] = [[] for _ in work]
    engine.add_requests([
        Request(request_id=f"{tag}-{i}", prompt_token_ids=p, return_routed_experts=True,
                sampling=SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True),
                on_output=lambda o, out=outs[i]: out.extend(o.new_token_ids))
        for i, (p, n) in enumerate(work)])
    runner, launched = engine.runner, []
    launch = runner.launch

    def recording_launch(plan, *a, **k):  # which steps carry prompt tokens (more than one token per sequence)
        launched.append(plan.num_tokens > len(plan.items))
        return launch(plan, *a, **k)

    runner.launch = recording_launch
    replays = getattr(runner.prefill_graphs, "replays", 0)
    prompt_ms, steps, t0 = [], 0, time.perf_counter()
    try:
        while engine.num_unfinished:
            del launched[:]
            t = time.perf_counter()
            engine.step()
            if any(launched):  # not overlapped: the step's forward is done when step() returns
                prompt_ms.append((time.perf_counter() - t) * 1e3)
            steps += 1
    finally:
        del runner.launch  # the class's method again
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    return {"tok_s": sum(n for _, n in work) / wall, "wall_s": wall, "steps": steps,
            "prompt_steps": len(prompt_ms), "prompt_step_ms": statistics.mean(prompt_ms) if prompt_ms else 0.0,
            "graph_steps": getattr(runner.prefill_graphs, "replays", 0) - replays,
            "tokens": outs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=192)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--prompt-lens", type=int, nargs=2, default=(128, 384), metavar=("LO", "HI"),
                    help="prompt lengths, uniform (the shortest must exceed the comparison engine's 64)")
    args = ap.parse_args()
    dev = torch.device("cuda", 0)
    t0 = time.perf_counter()
    model, cfg = rsm.build_engine_model(rsm.SHAPES["qwen3-30b-a3b"], dev, torch.bfloat16, 0, "balanced")
    common = dict(max_num_seqs=args.max_num_seqs, max_model_len=args.prompt_lens[1] + 288,
                  kv_cache_memory_bytes=8 << 30, enable_prefix_caching=False)
    engines = {"graphs": Engine(model, cfg, EngineConfig(**common)),
               "decode graphs only": Engine(model, cfg, EngineConfig(max_cudagraph_capture_size=args.max_num_seqs,
                                                                     **common))}
    assert engines["graphs"].runner.prefill_graphs is not None
    # its prefill graphs stop at 64 tokens, below the shortest prompt: every step carrying one runs eagerly
    assert engines["decode graphs only"].runner.max_prefill_graph_tokens < args.prompt_lens[0]
    print(f"[{time.perf_counter() - t0:5.1f} s] model and engines ready", flush=True)
    for name, eng in engines.items():  # warm-up: every kernel and graph of the workload's shapes
        rollout(eng, workload(args.max_num_seqs * 2, cfg.vocab_size, 99, args.prompt_lens), f"warm-{name}")
    results: dict[str, list[dict]] = {name: [] for name in engines}
    for rep in range(args.reps):
        work = workload(args.requests, cfg.vocab_size, rep, args.prompt_lens)
        order = list(engines) if rep % 2 == 0 else list(reversed(engines))
        for name in order:
            r = rollout(engines[name], work, f"{name}-{rep}")
            results[name].append(r)
            print(f"[{time.perf_counter() - t0:5.1f} s] rep {rep} {name}: {r['tok_s']:,.0f} output tok/s, "
                  f"{r['wall_s']:.2f} s, {r['steps']} steps, {r['prompt_steps']} with prompt tokens at "
                  f"{r['prompt_step_ms']:.1f} ms on average ({r['graph_steps']} replayed from graphs)", flush=True)
        a, b = (results[name][-1]["tokens"] for name in engines)
        print(f"  requests whose tokens differ between the engines: {sum(x != y for x, y in zip(a, b))} of "
              f"{len(a)}", flush=True)
    base = statistics.median(r["tok_s"] for r in results["decode graphs only"])
    for name, rs in results.items():
        tok_s = statistics.median(r["tok_s"] for r in rs)
        print(f"{name}: {tok_s:,.0f} output tok/s (median of {len(rs)}; {tok_s / base:.2f}x), steps with prompt "
              f"tokens {statistics.median(r['prompt_step_ms'] for r in rs):.1f} ms on average", flush=True)


if __name__ == "__main__":
    main()
