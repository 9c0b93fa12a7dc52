"""Wall time of eager prefill steps at the Qwen3-30B-A3B shape, with a cProfile and a torch.profiler table.

Prefill steps run outside CUDA graphs: the host issues ~1,650 kernel launches per step (48 layers), so a small
step costs its host time whatever the GPU does. Steps of 1 x 64 up to 27 x 300 new tokens, then 2 x 300 new tokens
after 7,488 cached ones (a multi-turn turn), each timed from ``Engine.step()`` to a device sync (the median of 3),
after a warm-up that compiles every size; one step of each kind under cProfile (host functions by own time) and one
under torch.profiler (host ops, device time). Random bf16 weights built on the GPU (real_shape_model.py); ~1 minute
on an H200 (this script without flags).

``--host``: per step size (1 x 128 up to 8 x 1024 = case b's prefill step and 27 x 300), the host's time to issue
the model's forward (``model.forward`` returns once every kernel is queued) against the forward's GPU span (CUDA
events around it) and the step's wall: issue time >= span means the step waits for the host. Steps of more than 512
tokens include the waits of the expert grouping's sort (a stable argsort of more than 4,096 keys waits for the GPU,
once per MoE layer), so there the issue time is an upper bound (``--host``, its "sort" rows).

    PYTHONPATH=backends:. python3 loadtest/bench/bench_prefill_steps.py
    PYTHONPATH=backends:. python3 loadtest/bench/bench_prefill_steps.py --device cpu    # the tiny shape: a smoke test
    PYTHONPATH=backends:. python3 loadtest/bench/bench_prefill_steps.py --host          # issue time vs GPU span
    PYTHONPATH=backends:. python3 loadtest/bench/bench_prefill_steps.py --graphs        # eager vs prefill graphs
    PYTHONPATH=backends:. python3 loadtest/bench/bench_prefill_steps.py --graphs --shape moonlight   # MLA's graphs

``--graphs``: two engines on the one model (8 GiB of KV cache each, overlapped decode off so that a step is one
forward): every step eager (``max_cudagraph_capture_size=0``) against the default, which replays prefill-step CUDA
graphs up to 2,048 tokens (prefill_graphs.py). Step wall from ``Engine.step()`` to a device sync, the two engines
alternated, medians of 5: prompts of 1 x 128, 1 x 300, 2 x 200, 4 x 128, 1 x 1,000 and 2 x 900 tokens; 300 new
tokens after 7,488 cached (a multi-turn agent's turn); and mixed steps (a 300- or 1,000-token prompt admitted while
24 sequences decode, continuous batching). Each engine's first tokens of every case are compared (greedy): equal,
or the row says how many differ. ``--shape moonlight``: the MLA shape, whose graphs attend every row absorbed and
take only steps within ``layers/mla.py``'s GRAPH_MAX_KEY_READS (the 300 tokens after 7,488 cached read more: eager in
both engines); the rows measure that bound's estimate.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
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


class Bench:
    def __init__(self, device: str, model=None, cfg=None, shape: str = "qwen3-30b-a3b", **engine_args):
        self.cuda = device == "cuda"
        dev = torch.device("cuda", 0) if self.cuda else torch.device("cpu")
        shape, dtype = (shape, torch.bfloat16) if self.cuda else ("tiny", torch.float32)
        if model is None:
            model, cfg = rsm.build_engine_model(rsm.SHAPES[shape], dev, dtype, 0, "balanced")
        self.model, self.cfg = model, cfg
        self.engine = Engine(self.model, self.cfg, EngineConfig(
            max_num_seqs=32, max_model_len=8016 if self.cuda else 512, enable_routed_experts=True,
            enable_prefix_caching=True, **engine_args))
        self.rng = random.Random(0)
        self.ids = 0

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def prompts(self, n: int, length: int) -> list[list[int]]:
        return [[self.rng.randrange(self.cfg.vocab_size) for _ in range(length)] for _ in range(n)]

    def submit(self, prompts: list[list[int]], max_tokens: int = 2) -> list[list[int]]:
        """Submit greedy requests; returns each one's output token list (filled as the engine runs)."""
        reqs, outs = [], []
        for p in prompts:
            self.ids += 1
            out: list[int] = []
            reqs.append(Request(request_id=f"r{self.ids}", prompt_token_ids=p, return_routed_experts=True,
                                sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
                                on_output=lambda o, out=out: out.extend(o.new_token_ids)))
            outs.append(out)
        self.engine.add_requests(reqs)
        return outs

    def drain(self) -> None:
        while self.engine.num_unfinished:
            self.engine.step()
        self.sync()

    def timed_step(self, profile: str | None = None) -> float:
        """ms of the next step (a prefill: the requests were just submitted)."""
        self.sync()
        t = time.perf_counter()
        if profile == "cprofile":
            prof = cProfile.Profile()
            prof.enable()
            self.engine.step()
            self.sync()
            prof.disable()
            out = io.StringIO()
            pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(28)
            print(out.getvalue()[:6000])
        elif profile == "torch":
            from torch.profiler import ProfilerActivity, profile as torch_profile

            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
            with torch_profile(activities=acts) as prof:
                self.engine.step()
                self.sync()
            device_us = sum(e.self_device_time_total for e in prof.key_averages())
            print(f"    device kernel time {device_us / 1e3:.1f} ms (under the profiler)")
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))
        else:
            self.engine.step()
            self.sync()
        return (time.perf_counter() - t) * 1e3

    def issue_vs_gpu(self, n: int, length: int, reps: int = 4) -> None:
        """Medians over reps of: the host's time to issue the forward, the forward's GPU span, the step's wall."""
        model = self.engine.runner.model
        forward, seen = model.forward, {}

        def timed_forward(*a, **k):
            ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)] if self.cuda else None
            t = time.perf_counter()
            if ev:
                ev[0].record()
            out = forward(*a, **k)
            seen["issued"] = time.perf_counter() - t
            if ev:
                ev[1].record()
            seen["events"] = ev
            return out

        model.forward = timed_forward
        rows = []
        try:
            for _ in range(reps):
                self.submit(self.prompts(n, length))
                wall = self.timed_step()
                ev = seen["events"]
                rows.append((seen["issued"] * 1e3, ev[0].elapsed_time(ev[1]) if ev else float("nan"), wall))
                self.drain()
        finally:
            del model.forward  # the class's method again
        issued, span, wall = (statistics.median(c) for c in zip(*rows))
        print(f"prefill step {n} x {length}: forward issued by the host in {issued:.1f} ms, its GPU span {span:.1f} "
              f"ms, step wall {wall:.1f} ms (medians of {reps})", flush=True)

    def case(self, n: int, length: int, reps: int = 3, prefix: list[list[int]] | None = None,
             profile: str | None = None) -> None:
        walls = []
        for r in range(reps):
            ps = self.prompts(n, length) if prefix is None else [p + self.prompts(1, length)[0] for p in prefix]
            self.submit(ps)
            walls.append(self.timed_step(profile if r == reps - 1 else None))
            self.drain()
        over = "" if prefix is None else f" over {len(prefix[0])} cached"
        print(f"prefill step {n} x {length} new tokens{over}: wall {', '.join(f'{w:.1f}' for w in sorted(walls))} "
              f"ms", flush=True)


def graphs_vs_eager(shape: str, reps: int = 5) -> None:
    """--graphs: the same steps on an all-eager engine and on one with prefill-step graphs, alternated."""
    eager = Bench("cuda", shape=shape, max_cudagraph_capture_size=0, kv_cache_memory_bytes=8 << 30,
                  overlap_decode=False)
    graphed = Bench("cuda", eager.model, eager.cfg, kv_cache_memory_bytes=8 << 30, overlap_decode=False)
    assert graphed.engine.runner.prefill_graphs is not None and eager.engine.runner.prefill_graphs is None
    bound = graphed.engine.runner.prefill_graph_max_key_reads  # MLA: steps reading more keys run eagerly
    if bound is not None:
        print(f"{shape}: prefill graphs take steps whose tokens read at most {bound:,} keys (MLA: every row absorbed)",
              flush=True)
    rng = random.Random(1)
    vocab = eager.cfg.vocab_size

    def prompts(n: int, length: int) -> list[list[int]]:
        return [[rng.randrange(vocab) for _ in range(length)] for _ in range(n)]

    history = prompts(1, 7488)  # cached in both engines before the multi-turn case
    for b in (eager, graphed):
        b.submit(history)
        b.drain()

    def one(b: Bench, case: str, ps: list[list[int]]) -> tuple[float, list[int]]:
        """ms of the step that prefills ``ps`` (for "mixed": while 24 sequences decode), and its first tokens."""
        running: list[str] = []
        if case == "mixed":
            first_id = b.ids + 1
            decoding = b.submit(prompts(24, 64), max_tokens=1000)  # below max_num_seqs: the prompt is admitted
            running = [f"r{i}" for i in range(first_id, b.ids + 1)]
            while not all(decoding):  # every one has its first token: the next steps decode them
                b.engine.step()
        outs = b.submit(ps)
        wall = b.timed_step()
        for rid in running:
            b.engine.abort(rid)
        b.drain()
        return wall, [o[0] for o in outs]

    cases = [("1 x 128", 1, 128), ("1 x 300", 1, 300), ("2 x 200", 2, 200), ("4 x 128", 4, 128),
             ("1 x 1,000", 1, 1000), ("2 x 900", 2, 900), ("300 after 7,488 cached", 0, 300),
             ("mixed: 300 + 24 decodes", 0, 300), ("mixed: 1,000 + 24 decodes", 0, 1000)]
    for name, n, length in cases:
        walls: dict[str, list[float]] = {"eager": [], "graphs": []}
        differ = 0
        for r in range(reps + 1):  # the first round warms both
            ps = [history[0] + prompts(1, length)[0]] if "cached" in name else prompts(max(n, 1), length)
            case = "mixed" if name.startswith("mixed") else ""
            got = {}
            for label, b in (("eager", eager), ("graphs", graphed))[:: 1 if r % 2 else -1]:
                wall, first = one(b, case, ps)
                got[label] = first
                if r:
                    walls[label].append(wall)
            differ += sum(a != g for a, g in zip(got["eager"], got["graphs"]))
        e, g = (statistics.median(walls[k]) for k in ("eager", "graphs"))
        print(f"prefill step {name}: eager {e:.1f} ms, graphs {g:.1f} ms ({e / g:.2f}x); first tokens that "
              f"differ: {differ} of {(reps + 1) * max(n, 1)}", flush=True)
    print(f"prefill graphs replayed {graphed.engine.runner.prefill_graphs.replays} steps; captured "
          f"{len(graphed.engine.runner.prefill_graphs._graphs)} graphs", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--host", action="store_true", help="only the host's issue time of the forward vs its GPU span")
    ap.add_argument("--graphs", action="store_true", help="eager steps vs prefill-step CUDA graphs (two engines)")
    ap.add_argument("--shape", default="qwen3-30b-a3b", choices=("qwen3-30b-a3b", "moonlight"),
                    help="--graphs: the model shape (moonlight: MLA, its graphs absorb every row)")
    args = ap.parse_args()
    if args.graphs:
        graphs_vs_eager(args.shape)
        return
    b = Bench(args.device)
    if args.host:
        sizes = ((1, 128), (2, 300), (6, 300), (3, 512), (8, 1024), (27, 300)) if b.cuda else ((1, 128), (8, 64))
        for n, length in sizes:  # compile every size first
            b.submit(b.prompts(n, length))
            b.drain()
        for n, length in sizes:
            b.issue_vs_gpu(n, length)
        return
    for n, length in ((1, 300), (2, 300), (8, 300), (27, 300), (1, 64)):  # compile every size first
        b.submit(b.prompts(n, length))
        b.drain()
    for n, length in ((1, 64), (1, 300), (2, 300), (8, 300), (27, 300)):
        b.case(n, length)
    b.case(2, 300, reps=2, profile="cprofile")
    b.case(2, 300, reps=2, profile="torch")
    prefix = b.prompts(2, 7488 if b.cuda else 96)  # cached context: a multi-turn agent's later turn
    b.submit(prefix)
    b.drain()
    b.case(2, 300, prefix=prefix)
    b.case(2, 300, reps=2, prefix=prefix, profile="cprofile")


if __name__ == "__main__":
    main()
