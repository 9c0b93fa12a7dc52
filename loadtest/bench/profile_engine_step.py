#!/usr/bin/env python
"""Where an engine step's time goes, on the benchmark's model (the OLMoE-like checkpoint of bench_engine.py).

Runs C requests through ``Engine.step()`` on this thread and reports
  * wall time per step, split into prefill-carrying steps and decode-only steps,
  * for decode-only steps: the GPU time of the forward (CUDA events around it, CUDA only),
  * the top host functions of the decode steps (cProfile, cumulative time),
  * the top GPU kernels of a few decode steps (torch.profiler, CUDA only).

``--paired-capture`` instead measures what routing capture costs per decode step: two engines (capture on /
off) hold the same C sequences and their decode steps alternate, so both see the same machine state; it
reports the median step time of each and the median of the per-pair ratios.

Usage (see loadtest/README.md):
    .venv/bin/python loadtest/bench/profile_engine_step.py --device cuda --concurrency 16
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: loadtest.* when run by path
from loadtest.bench import bench_engine  # noqa: E402  (the benchmark's checkpoint and shape flags)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--no-capture", action="store_true", help="routing capture off")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    p.add_argument("--no-fused", action="store_true", help="no fused Triton kernels (op-by-op forward)")
    p.add_argument("--no-overlap", action="store_true", help="no overlapped decode (each step completes in turn)")
    p.add_argument("--paired-capture", action="store_true", help="capture on vs off, alternating decode steps")
    p.add_argument("--pairs", type=int, default=200, help="decode-step pairs for --paired-capture")
    p.add_argument("--sort", default="tottime", help="cProfile sort key (tottime, cumulative)")
    p.add_argument("--top", type=int, default=20, help="cProfile rows to print")
    p.add_argument("--steps-only", action="store_true", help="step times only (no cProfile / torch.profiler)")
    args, rest = p.parse_known_args()
    if args.paired_capture:
        args.output_len = max(args.output_len, args.pairs + 8)
    shape = bench_engine.parse_args(["--device", args.device, *rest])
    from moe_engine.checkpoint import load_model
    from moe_engine.config import load_config
    from moe_engine.engine import Engine, EngineConfig, Request
    from moe_engine.core.sampling import SamplingParams

    path = bench_engine.ensure_checkpoint(shape)
    dtype = "bfloat16" if args.device.startswith("cuda") else "float32"
    cfg, model = load_config(path), load_model(path, dtype=dtype, device=args.device, progress=False)
    engine = Engine(
        model,
        cfg,
        EngineConfig(
            max_num_seqs=args.concurrency,
            max_model_len=args.prompt_len + args.output_len,
            enable_routed_experts=not args.no_capture,
            enforce_eager=args.enforce_eager,
            fused_kernels=False if args.no_fused else None,
            # Paired steps of two engines must each finish before the other's starts.
            async_scheduling=False if (args.no_overlap or args.paired_capture) else None,
        ),
    )
    cuda = args.device.startswith("cuda")
    g = torch.Generator().manual_seed(0)
    if args.paired_capture:
        return paired_capture(args, cfg, model, engine, cuda)

    def submit_all():
        for _ in range(args.concurrency):
            prompt = torch.randint(3, cfg.vocab_size, (args.prompt_len,), generator=g).tolist()
            engine.add_request(
                Request(
                    engine.new_request_id(),
                    prompt,
                    SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True),
                    on_output=lambda out: None,
                )
            )

    def steps(profiler=None, decode=True):
        """Run until idle; [(decode_only, wall_s)]. The profiler sees decode-only steps, or (decode=False) the
        steps with prefill."""
        out = []
        while True:
            engine._drain_inbox()  # (the scheduler admits waiting requests in its plan)
            queued = list(engine.scheduler.running) + list(engine.scheduler.waiting)
            decode_only = all(s.is_decoding for s in queued)
            if profiler is not None and decode_only == decode:
                profiler.enable()
            t0 = time.perf_counter()
            if not engine.step():
                break
            if cuda and not engine.settings.async_scheduling:  # with overlap a step's GPU work runs into the next call
                torch.cuda.synchronize()
            out.append((decode_only, time.perf_counter() - t0))
            if profiler is not None:
                profiler.disable()
        return out

    submit_all()
    steps()  # warm-up: CUDA graphs captured, kernels loaded
    submit_all()
    timed = steps()
    pre = [t for d, t in timed if not d]
    dec = [t for d, t in timed if d]
    print(f"{args.concurrency} sequences, prompt {args.prompt_len}, output {args.output_len}, {args.device} {dtype}, "
          f"capture {'off' if args.no_capture else 'on'}, graphs {'on' if engine.runner.graphs is not None else 'off'}, "
          f"overlap {'on' if engine.settings.async_scheduling else 'off'}, fused kernels {'on' if engine.settings.fused_kernels else 'off'}")
    print(f"steps with prefill: {len(pre)}, total {sum(pre) * 1e3:.1f} ms, median {statistics.median(pre) * 1e3:.2f} ms")
    print(f"decode-only steps: {len(dec)}, total {sum(dec) * 1e3:.1f} ms, median {statistics.median(dec) * 1e3:.3f} ms")
    print(f"=> {args.concurrency * args.output_len / sum(t for _, t in timed):.0f} output tok/s (steps only)")
    if args.steps_only:
        return 0

    for decode in (True, False):
        submit_all()
        prof = cProfile.Profile()
        steps(prof, decode)
        print(f"cProfile of the {'decode-only steps' if decode else 'steps with prefill'}:")
        pstats.Stats(prof).sort_stats(args.sort).print_stats(args.top)

    if cuda:
        from torch.profiler import ProfilerActivity, profile

        submit_all()
        n = 0
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as tp:
            while engine.step():
                n += 1
            torch.cuda.synchronize()
        print(f"torch.profiler over {n} steps (all of them):")
        print(tp.key_averages().table(sort_by="cuda_time_total", row_limit=25))
        print(tp.key_averages().table(sort_by="cpu_time_total", row_limit=25))
    return 0


def paired_capture(args, cfg, model, on, cuda: bool) -> int:
    from moe_engine.engine import Engine, EngineConfig, Request
    from moe_engine.core.sampling import SamplingParams

    off = Engine(model, cfg, replace(on.engine_config, enable_routed_experts=False))
    max_tokens = args.pairs + 8
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, cfg.vocab_size, (args.prompt_len,), generator=g).tolist() for _ in range(args.concurrency)]
    for engine in (on, off):
        for prompt in prompts:
            sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
            engine.add_request(Request(engine.new_request_id(), prompt, sampling, on_output=lambda out: None))
        while any(not s.is_decoding for s in list(engine.scheduler.running) + list(engine.scheduler.waiting)) \
                or engine._inbox:
            engine.step()

    def timed_step(engine) -> float:
        t0 = time.perf_counter()
        engine.step()
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    for _ in range(5):  # warm-up: graphs captured
        timed_step(on), timed_step(off)
    t_on, t_off = [], []
    for i in range(max_tokens - 8):
        a, b = (on, off) if i % 2 == 0 else (off, on)  # alternate which goes first
        ta, tb = timed_step(a), timed_step(b)
        t_on.append(ta if a is on else tb)
        t_off.append(tb if a is on else ta)
    ratio = statistics.median(x / y for x, y in zip(t_on, t_off))
    print(f"{args.concurrency} sequences decoding (context {args.prompt_len}+), {args.device}, {len(t_on)} step pairs")
    print(f"capture on:  median {statistics.median(t_on) * 1e3:.3f} ms per decode step")
    print(f"capture off: median {statistics.median(t_off) * 1e3:.3f} ms per decode step")
    print(f"on/off per-pair median ratio: {ratio:.4f} (capture costs {100 * (ratio - 1):+.2f}% per decode step)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
