#!/usr/bin/env python
"""Engine throughput benchmark: moe_engine (routed-experts capture on / off) vs transformers ``generate``.

What it measures
----------------
Output tokens per second for a closed batch of ``C`` identical-length requests (all submitted at once,
clock stops when the last one finishes; prefill included), at each concurrency ``C``, for

  (a) ``engine+capture``  moe_engine, server-wide routed-experts capture on (every request asks for it),
  (b) ``engine``          moe_engine, ``EngineConfig(enable_routed_experts=False)`` (the server-wide switch),
  (c) ``hf_generate``     transformers ``generate`` on the same checkpoint: one batched call, left padding,
                          greedy, ``min_new_tokens = max_new_tokens`` (the ``ignore_eos`` equivalent).

The engine runs on its own thread (``Engine.start()``), as the Triton backend drives it; outputs arrive in
callbacks. All systems use the same prompts (fixed seed), the same prompt/output lengths and the same
weights. Trials are interleaved (every repetition runs every concurrency for every system, the system order
rotating between repetitions) so that machine noise hits all systems alike; the table reports medians.

The model is an OLMoE-like random checkpoint written by transformers itself (``OlmoeConfig`` +
``AutoModelForCausalLM.from_config`` with a fixed seed + ``save_pretrained``), cached under
``loadtest/results/checkpoints/``. Default shape: 4 layers, hidden 512, 8 heads (head_dim 64, no GQA, as
OLMoE), 64 experts, top-8, expert width 256 (OLMoE's 1/2 of hidden), vocab 16384; float32 on CPU (bf16
matmuls on CPU are slower than fp32 and not what CPU tests run), bfloat16 on CUDA.

Usage
-----
    .venv/bin/python loadtest/bench/bench_engine.py                 # default run (CPU: about 6 min on 2 cores)
    .venv/bin/python loadtest/bench/bench_engine.py --quick         # smoke run, under a minute
    .venv/bin/python loadtest/bench/bench_engine.py --device cuda   # GPU (bf16; more layers with --layers ...)

Results: a markdown table on stdout, and a JSON file (every trial, medians, environment) under
``loadtest/results/`` (gitignored). Progress goes to stderr.

Threads (CPU): ``--threads`` defaults to 1. On a shared machine, 2 OpenMP threads on 2 cores stall in
every parallel region whenever a neighbour process holds one core (an ``mm`` of 2x512x2048 measured 15 ms
instead of 0.1 ms), which measures the neighbours, not the code. Use ``--threads 0`` (torch's default)
on a quiet machine.
"""
from __future__ import annotations

import argparse
import atexit
import datetime as dt
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]

SYSTEMS = ("engine+capture", "engine", "hf_generate")
LABELS = {"engine+capture": "(a) engine, capture on", "engine": "(b) engine, capture off", "hf_generate": "(c) HF generate"}


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def select_engine(args) -> dict:
    """Put the engine to measure first on sys.path: the working tree (default), a git revision of it
    (``--engine-rev``, exported with ``git archive`` so uncommitted edits do not leak in), or a directory
    holding a ``moe_engine`` package (``--engine-path``, e.g. a prototype)."""
    info: dict = {}
    if args.engine_rev:
        commit = subprocess.check_output(["git", "rev-parse", args.engine_rev], cwd=REPO, text=True).strip()
        root = Path(tempfile.mkdtemp(prefix="bench_engine_src_"))
        atexit.register(shutil.rmtree, root, ignore_errors=True)
        archive = subprocess.run(
            ["git", "archive", commit, "backends/moe_engine"], cwd=REPO, check=True, capture_output=True
        ).stdout
        subprocess.run(["tar", "-x", "-C", str(root)], input=archive, check=True)
        path = root / "backends"
        info = {"source": f"git {args.engine_rev}", "commit": commit}
    elif args.engine_path:
        path = Path(args.engine_path).resolve()
        info = {"source": "directory"}
    else:
        path = REPO / "backends"
        info = {"source": "working tree"}
    sys.path.insert(0, str(path))
    import moe_engine

    info["module"] = str(Path(moe_engine.__file__).parent)
    return info


# ----------------------------------------------------------------------------- checkpoint


def checkpoint_dir(args) -> Path:
    name = (
        f"olmoe-l{args.layers}-h{args.hidden}-a{args.heads}-e{args.experts}k{args.top_k}"
        f"-i{args.intermediate}-v{args.vocab}-s{args.seed}"
    )
    return Path(args.cache_dir) / name


def ensure_checkpoint(args) -> Path:
    """Write the random OLMoE checkpoint with transformers itself (once; cached by shape and seed)."""
    out = checkpoint_dir(args)
    if (out / "config.json").is_file() and any(out.glob("*.safetensors")):
        return out
    from transformers import AutoModelForCausalLM, OlmoeConfig

    log(f"writing checkpoint {out} (transformers OlmoeConfig, seed {args.seed}, float32)")
    cfg = OlmoeConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.heads,
        num_experts=args.experts,
        num_experts_per_tok=args.top_k,
        max_position_embeddings=4096,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    model.save_pretrained(tmp)
    del model
    out.parent.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(out, ignore_errors=True)  # a partial earlier write
    os.replace(tmp, out)
    return out


# ----------------------------------------------------------------------------- systems


class EngineRunner:
    """One long-lived engine on its own thread; a trial submits C requests and waits for all of them."""

    def __init__(self, model, cfg, capture: bool, args):
        from moe_engine.engine import Engine, EngineConfig

        ecfg = EngineConfig(
            max_num_seqs=max(args.concurrency),
            max_model_len=args.prompt_len + args.output_len,
            enable_routed_experts=capture,
        )
        if args.max_num_batched_tokens:
            ecfg.max_num_batched_tokens = args.max_num_batched_tokens
        if hasattr(ecfg, "enable_prefix_caching"):  # repeated trials reuse prompts: measure the compute, not the cache
            ecfg.enable_prefix_caching = False
        self.ecfg = ecfg
        self.capture = capture
        self.cfg = cfg
        self.engine = Engine(model, cfg, ecfg)
        self.engine.start()

    def run(self, prompts: list[list[int]], output_len: int) -> dict:
        from moe_engine.engine import Request
        from moe_engine.core.sampling import SamplingParams

        n = len(prompts)
        done = threading.Event()
        lock = threading.Lock()
        state = {"finished": 0}
        tokens: list[list[int]] = [[] for _ in range(n)]
        rows = [0] * n
        row_shape: list = [None]
        first_token_t = [0.0] * n
        errors: list[str] = []

        def callback(i: int):
            def on_output(out):
                if out.new_token_ids and not tokens[i]:
                    first_token_t[i] = time.perf_counter()
                tokens[i].extend(out.new_token_ids)
                if out.routed_experts is not None:
                    rows[i] += out.routed_experts.shape[0]
                    row_shape[0] = out.routed_experts.shape[1:]
                if out.finished:
                    if out.finish_reason != "length":
                        errors.append(f"request {i}: finish_reason={out.finish_reason} {out.error or ''}")
                    with lock:
                        state["finished"] += 1
                        if state["finished"] == n:
                            done.set()

            return on_output

        sampling = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
        cpu0 = time.process_time()
        start = time.perf_counter()
        for i, p in enumerate(prompts):
            self.engine.add_request(
                Request(
                    request_id=self.engine.new_request_id(),
                    prompt_token_ids=p,
                    sampling=sampling,
                    return_routed_experts=True,
                    on_output=callback(i),
                )
            )
        if not done.wait(timeout=3600):
            raise RuntimeError("engine trial timed out")
        elapsed = time.perf_counter() - start
        cpu = time.process_time() - cpu0
        if errors:
            raise RuntimeError("engine trial failed: " + "; ".join(errors[:3]))
        L, K = self.cfg.num_hidden_layers, self.cfg.num_experts_per_tok
        for i, p in enumerate(prompts):
            if len(tokens[i]) != output_len:
                raise RuntimeError(f"request {i}: {len(tokens[i])} tokens, expected {output_len}")
            want_rows = len(p) + output_len - 1 if self.capture else 0
            if rows[i] != want_rows:
                raise RuntimeError(f"request {i}: {rows[i]} routed-experts rows, expected {want_rows}")
        if self.capture and tuple(row_shape[0]) != (L, K):
            raise RuntimeError(f"routed experts rows have shape {row_shape[0]}, expected ({L}, {K})")
        ttft = sorted(t - start for t in first_token_t)
        return {"elapsed_s": elapsed, "cpu_s": cpu, "tokens": tokens, "ttft_median_s": ttft[len(ttft) // 2]}

    def close(self) -> None:
        self.engine.shutdown()


class HFRunner:
    def __init__(self, path: Path, dtype: torch.dtype, device: str, args):
        from transformers import AutoModelForCausalLM

        kw = {}
        if args.hf_attn:
            kw["attn_implementation"] = args.hf_attn
        if args.hf_experts:
            kw["experts_implementation"] = args.hf_experts
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kw).to(device).eval()
        self.device = device
        self.attn_implementation = self.model.config._attn_implementation
        self.experts_implementation = getattr(self.model.config, "_experts_implementation", None)

    @torch.inference_mode()
    def run(self, prompts: list[list[int]], output_len: int) -> dict:
        pad = 0
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):  # left padding (a no-op for equal lengths, kept for generality)
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        cpu0 = time.process_time()
        start = time.perf_counter()
        ids, mask = ids.to(self.device), mask.to(self.device)
        out = self.model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=output_len,
            min_new_tokens=output_len,
            do_sample=False,
            pad_token_id=pad,
        )
        new = out[:, width:].tolist()  # host copy (synchronises on CUDA)
        elapsed = time.perf_counter() - start
        cpu = time.process_time() - cpu0
        if any(len(t) != output_len for t in new):
            raise RuntimeError(f"generate returned {out.shape[1] - width} new tokens, expected {output_len}")
        return {"elapsed_s": elapsed, "cpu_s": cpu, "tokens": new}


# ----------------------------------------------------------------------------- helpers


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def environment(args, device: str, dtype: torch.dtype) -> dict:
    env = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "device": device,
        "dtype": str(dtype).removeprefix("torch."),
    }
    try:
        import transformers

        env["transformers"] = transformers.__version__
    except ImportError:
        pass
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                env["cpu"] = line.split(":", 1)[1].strip()
                break
        env["mem_gib"] = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (OSError, ValueError):
        pass
    if device.startswith("cuda"):
        env["gpu"] = torch.cuda.get_device_name(0)
    try:
        env["git_commit"] = subprocess.check_output(["git", "rev-parse", "HEAD"], cwd=REPO, text=True).strip()
        dirty = subprocess.check_output(
            ["git", "status", "--porcelain", "--", "backends/moe_engine"], cwd=REPO, text=True
        ).strip()
        env["engine_uncommitted_changes"] = dirty.splitlines()
    except (OSError, subprocess.CalledProcessError):
        pass
    return env


def loadavg() -> list[float] | None:
    try:
        return list(os.getloadavg())
    except OSError:
        return None


def fmt_table(results: dict, concurrency: list[int], systems: list[str]) -> str:
    has = set(systems)
    head = ["concurrency"] + [f"{LABELS[s]} tok/s" for s in SYSTEMS if s in has]
    if {"engine+capture", "engine"} <= has:
        head.append("a/b (capture cost)")
    if {"engine+capture", "hf_generate"} <= has:
        head.append("a/c (vs HF)")
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---:" for _ in head) + "|"]
    for c in concurrency:
        r = results[str(c)]
        row = [str(c)] + [f"{r[s]['tok_s_median']:.1f}" for s in SYSTEMS if s in has]
        if "a/b" in r:
            row.append(f"{r['a/b']:.3f}")
        if "a/c" in r:
            row.append(f"{r['a/c']:.2f}x")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def fmt_checks(results: dict, concurrency: list[int]) -> str:
    """The same ratios two noise-robust ways: median of back-to-back pairs, and per CPU-second."""
    keys = [("a/b_paired_median", "a/b paired"), ("a/b_cpu", "a/b per CPU-s"), ("a/c_paired_median", "a/c paired"),
            ("a/c_cpu", "a/c per CPU-s")]
    keys = [(k, n) for k, n in keys if all(k in results[str(c)] for c in concurrency)]
    if not keys:
        return ""
    head = ["concurrency"] + [n for _, n in keys]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---:" for _ in head) + "|"]
    for c in concurrency:
        lines.append("| " + " | ".join([str(c)] + [f"{results[str(c)][k]:.3f}" for k, _ in keys]) + " |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- main


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N (default cpu)")
    p.add_argument("--dtype", default="auto", help="auto (float32 on CPU, bfloat16 on CUDA) | float32 | bfloat16 | float16")
    p.add_argument("--concurrency", default=None, help="comma-separated (default 1,4,16,64; --quick: 1,4,16)")
    p.add_argument("--prompt-len", type=int, default=None, help="prompt tokens per request (default 128; --quick: 32)")
    p.add_argument("--output-len", type=int, default=None, help="output tokens per request (default 64; --quick: 16)")
    p.add_argument("--reps", type=int, default=None, help="repetitions of every (concurrency, system) trial; medians reported (default 5; --quick: 2)")
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"subset of {','.join(SYSTEMS)}")
    p.add_argument("--quick", action="store_true", help="smoke run: concurrency 1,4,16, prompt 32, output 16, 2 reps")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads on CPU (0 = torch's default); see the docstring")
    p.add_argument("--max-num-batched-tokens", type=int, default=0, help="engine step token budget (0 = engine default)")
    p.add_argument("--hf-attn", default=None, help="transformers attn_implementation (default: transformers' default)")
    p.add_argument("--hf-experts", default=None, help="transformers experts_implementation (default: transformers' default)")
    g = p.add_argument_group("model shape (OLMoE-like)")
    g.add_argument("--layers", type=int, default=4)
    g.add_argument("--hidden", type=int, default=512)
    g.add_argument("--heads", type=int, default=8)
    g.add_argument("--experts", type=int, default=64)
    g.add_argument("--top-k", type=int, default=8)
    g.add_argument("--intermediate", type=int, default=256, help="per-expert MLP width")
    g.add_argument("--vocab", type=int, default=16384)
    g.add_argument("--seed", type=int, default=0)
    e = p.add_mutually_exclusive_group()
    e.add_argument("--engine-rev", default=None, help="measure moe_engine as of this git revision (e.g. HEAD) instead of the working tree")
    e.add_argument("--engine-path", default=None, help="measure the moe_engine package found in this directory (prototypes)")
    p.add_argument("--cache-dir", default=str(REPO / "loadtest" / "results" / "checkpoints"))
    p.add_argument("--json", default=None, help="output JSON path (default loadtest/results/bench_engine-<time>.json)")
    args = p.parse_args(argv)
    quick = {"concurrency": "1,4,16", "prompt_len": 32, "output_len": 16, "reps": 2}
    full = {"concurrency": "1,4,16,64", "prompt_len": 128, "output_len": 64, "reps": 5}
    for key, value in (quick if args.quick else full).items():  # explicit flags win over --quick
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.concurrency = [int(c) for c in str(args.concurrency).split(",") if c]
    args.systems = [s for s in args.systems.split(",") if s]
    bad = set(args.systems) - set(SYSTEMS)
    if bad:
        p.error(f"unknown systems {sorted(bad)}; known: {', '.join(SYSTEMS)}")
    return args


def expert_width(cfg) -> int:
    """The expert width of a MoEConfig of any engine revision (nested specs since issue 15, flat before)."""
    return getattr(getattr(cfg, "experts", None), "intermediate_size", None) or cfg.moe_intermediate_size


def main(argv=None) -> int:
    args = parse_args(argv)
    device = args.device
    if device == "cpu" and args.threads > 0:
        torch.set_num_threads(args.threads)
    if args.dtype == "auto":
        dtype = torch.float32 if device == "cpu" else torch.bfloat16
    else:
        dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[args.dtype]
    t_begin = time.perf_counter()
    engine_src = select_engine(args)
    log(f"moe_engine: {engine_src}")

    from moe_engine.checkpoint import load_model
    from moe_engine.config import load_config

    path = ensure_checkpoint(args)
    cfg = load_config(path)
    log(f"checkpoint {path}: {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, {cfg.num_experts} experts "
        f"top-{cfg.num_experts_per_tok}, expert width {expert_width(cfg)}, vocab {cfg.vocab_size}; "
        f"{device} {str(dtype).removeprefix('torch.')}, {torch.get_num_threads()} torch threads")

    runners: dict = {}
    model = None
    if "engine+capture" in args.systems or "engine" in args.systems:
        model = load_model(path, dtype=dtype, device=device, progress=False)
        if "engine+capture" in args.systems:
            runners["engine+capture"] = EngineRunner(model, cfg, True, args)
        if "engine" in args.systems:
            runners["engine"] = EngineRunner(model, cfg, False, args)
    if "hf_generate" in args.systems:
        runners["hf_generate"] = HFRunner(path, dtype, device, args)
    systems = [s for s in SYSTEMS if s in runners]
    n_params = sum(p.numel() for p in (model or runners["hf_generate"].model).parameters())

    # Prompts: fixed per concurrency, shared by every system and repetition.
    gen = torch.Generator().manual_seed(1234)
    prompts = {
        c: torch.randint(3, cfg.vocab_size, (c, args.prompt_len), generator=gen).tolist() for c in args.concurrency
    }

    try:
        # Warm-up: one full trial of every concurrency and system, so that first-use costs (allocator growth,
        # kernel selection and plan caches per shape, e.g. cuDNN attention per key length in HF's decode, CUDA
        # graph capture per bucket in the engine, lazy CUDA init) fall outside the timed trials. (A warm-up of
        # 4 output tokens left HF's first timed repetition 5-8x slower on the H200.)
        log("warm-up ...")
        for c in args.concurrency:
            for s in systems:
                runners[s].run(prompts[c], args.output_len)

        trials: list[dict] = []
        total = args.reps * len(args.concurrency) * len(systems)
        tokens_first_rep: dict = {}
        load_start = loadavg()
        for rep in range(args.reps):
            order = systems[rep % len(systems) :] + systems[: rep % len(systems)]  # rotate per repetition
            for c in args.concurrency:
                for s in order:
                    r = runners[s].run(prompts[c], args.output_len)
                    tok_s = c * args.output_len / r["elapsed_s"]
                    trial = {
                        "rep": rep,
                        "concurrency": c,
                        "system": s,
                        "elapsed_s": r["elapsed_s"],
                        "cpu_s": r["cpu_s"],
                        "tok_s": tok_s,
                        "tok_per_cpu_s": c * args.output_len / r["cpu_s"],
                    }
                    if "ttft_median_s" in r:
                        trial["ttft_median_s"] = r["ttft_median_s"]
                    trials.append(trial)
                    if rep == 0:
                        tokens_first_rep[(c, s)] = r["tokens"]
                    log(f"[{len(trials):3d}/{total}] rep {rep + 1}/{args.reps}  C={c:<3d} {s:15s} "
                        f"{c * args.output_len:6d} tok in {r['elapsed_s']:7.2f} s = {tok_s:8.1f} tok/s"
                        f" (cpu {r['cpu_s']:6.2f} s)"
                        f"   (elapsed {time.perf_counter() - t_begin:5.0f} s)")
        load_end = loadavg()
    finally:
        for s in ("engine+capture", "engine"):
            if s in runners:
                runners[s].close()

    # Aggregate: medians per (concurrency, system); ratios of medians, plus the median of per-repetition
    # paired ratios (the two trials of a pair ran back to back, so they share the machine's state).
    results: dict = {}
    for c in args.concurrency:
        r: dict = {}
        for s in systems:
            xs = [t["tok_s"] for t in trials if t["concurrency"] == c and t["system"] == s]
            cs = [t["tok_per_cpu_s"] for t in trials if t["concurrency"] == c and t["system"] == s]
            r[s] = {
                "tok_s_median": median(xs),
                "tok_s_min": min(xs),
                "tok_s_max": max(xs),
                "tok_s_all": xs,
                "tok_per_cpu_s_median": median(cs),
            }
            ttfts = [t["ttft_median_s"] for t in trials if t["concurrency"] == c and t["system"] == s and "ttft_median_s" in t]
            if ttfts:
                r[s]["ttft_median_s"] = median(ttfts)

        def paired(x: str, y: str, key: str = "tok_s") -> float:
            per_rep = []
            for rep in range(args.reps):
                a = [t[key] for t in trials if t["rep"] == rep and t["concurrency"] == c and t["system"] == x]
                b = [t[key] for t in trials if t["rep"] == rep and t["concurrency"] == c and t["system"] == y]
                per_rep.append(a[0] / b[0])
            return median(per_rep)

        if "engine+capture" in r and "engine" in r:
            r["a/b"] = r["engine+capture"]["tok_s_median"] / r["engine"]["tok_s_median"]
            r["a/b_paired_median"] = paired("engine+capture", "engine")
            r["a/b_cpu"] = r["engine+capture"]["tok_per_cpu_s_median"] / r["engine"]["tok_per_cpu_s_median"]
        if "engine+capture" in r and "hf_generate" in r:
            r["a/c"] = r["engine+capture"]["tok_s_median"] / r["hf_generate"]["tok_s_median"]
            r["a/c_paired_median"] = paired("engine+capture", "hf_generate")
            r["a/c_cpu"] = r["engine+capture"]["tok_per_cpu_s_median"] / r["hf_generate"]["tok_per_cpu_s_median"]
        # Sanity: do the engine and transformers produce the same greedy tokens (fp32: they should)?
        base = "engine+capture" if "engine+capture" in systems else ("engine" if "engine" in systems else None)
        if base and "hf_generate" in systems:
            a, b = tokens_first_rep[(c, base)], tokens_first_rep[(c, "hf_generate")]
            same = sum(x == y for ta, tb in zip(a, b) for x, y in zip(ta, tb))
            r["greedy_token_agreement_vs_hf"] = same / (len(a) * args.output_len)
        results[str(c)] = r

    table = fmt_table(results, args.concurrency, systems)
    targets = {}
    if all("a/b" in results[str(c)] for c in args.concurrency):
        worst = min(results[str(c)]["a/b"] for c in args.concurrency)
        worst_cpu = min(results[str(c)]["a/b_cpu"] for c in args.concurrency)
        targets["capture_overhead_le_2pct"] = {"worst_a_over_b": worst, "worst_a_over_b_cpu": worst_cpu, "met": worst >= 0.98}
    if "16" in results and "a/c" in results["16"]:
        targets["speedup_vs_hf_at_16_ge_5x"] = {
            "a_over_c": results["16"]["a/c"],
            "a_over_c_cpu": results["16"]["a/c_cpu"],
            "met": results["16"]["a/c"] >= 5.0,
        }

    env = environment(args, device, dtype)
    env["loadavg_start"], env["loadavg_end"] = load_start, load_end
    hf = runners.get("hf_generate")
    report = {
        "benchmark": "loadtest/bench/bench_engine.py",
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "timestamp_utc": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "model": {
            "checkpoint": str(path),
            "architecture": cfg.architecture,
            "parameters": n_params,
            "num_hidden_layers": cfg.num_hidden_layers,
            "hidden_size": cfg.hidden_size,
            "num_attention_heads": getattr(cfg.attention, "num_heads", None) or cfg.num_attention_heads,
            "num_experts": cfg.num_experts,
            "num_experts_per_tok": cfg.num_experts_per_tok,
            "moe_intermediate_size": expert_width(cfg),
            "vocab_size": cfg.vocab_size,
        },
        "workload": {
            "concurrency": args.concurrency,
            "prompt_len": args.prompt_len,
            "output_len": args.output_len,
            "reps": args.reps,
            "metric": "output tokens / wall time of a closed batch of C requests (prefill included)",
        },
        "engine_source": engine_src,
        "engine_config": vars(runners["engine+capture"].ecfg if "engine+capture" in runners else runners["engine"].ecfg)
        if ("engine+capture" in runners or "engine" in runners)
        else None,
        "hf": {"attn_implementation": hf.attn_implementation, "experts_implementation": hf.experts_implementation}
        if hf
        else None,
        "environment": env,
        "results": results,
        "targets": targets,
        "trials": trials,
        "wall_s": time.perf_counter() - t_begin,
    }
    out = Path(args.json) if args.json else REPO / "loadtest" / "results" / (
        "bench_engine-" + dt.datetime.now().strftime("%Y%m%d-%H%M%S") + ".json"
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))

    print(f"\nmoe_engine vs transformers generate: {cfg.architecture} {n_params / 1e6:.0f}M params "
          f"({cfg.num_hidden_layers}L, hidden {cfg.hidden_size}, {cfg.num_experts} experts top-{cfg.num_experts_per_tok}), "
          f"{device} {env['dtype']}, {torch.get_num_threads()} threads; prompt {args.prompt_len}, output {args.output_len} "
          f"tokens; median of {args.reps} reps (output tok/s)")
    if hf:
        print(f"transformers: attn_implementation={hf.attn_implementation}, experts_implementation={hf.experts_implementation}")
    print()
    print(table)
    checks = fmt_checks(results, args.concurrency)
    if checks:
        print("\nnoise checks (median of per-repetition back-to-back ratios; ratio of output tokens per process CPU-second):\n")
        print(checks)
    print()
    for name, t in targets.items():
        vals = ", ".join(f"{k}={v:.3f}" for k, v in t.items() if k != "met")
        print(f"target {name}: {'MET' if t['met'] else 'NOT MET'} ({vals})")
    agree = {c: results[str(c)].get("greedy_token_agreement_vs_hf") for c in args.concurrency}
    if any(v is not None for v in agree.values()):
        print("greedy token agreement engine vs HF: " + ", ".join(f"C={c}: {v:.1%}" for c, v in agree.items() if v is not None))
    print(f"load average start {load_start}, end {load_end}; wall {report['wall_s']:.0f} s")
    print(f"JSON: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
