#!/usr/bin/env python
"""Multi-turn agent benchmark (issue 18): prefix caching and ``routed_experts_prompt_start`` in an agent loop.

The loop: C conversations (default 32) x T turns (16). Turn k sends the whole conversation so far plus about U new
user tokens (300) and generates O tokens (200; greedy, ``ignore_eos``), routed experts on. The conversations step
in lockstep, as a rollout batch steps its environments: turn k starts for all of them when the last answer of
turn k-1 is in. Every response's routed experts are checked (rows = prompt + output - 1 - prompt start).

Runs (``--runs``): ``<cache>-<routing>``, cache ``on`` | ``off`` (``--no-enable-prefix-caching``), routing
  full    every response carries the routing of the whole conversation
  start   ``routed_experts_prompt_start`` = previous prompt + previous output - 1: each turn returns only the rows
          the previous turns did not (the last token of the previous answer was never forwarded, so it has no
          row yet), and the conversation's rows arrive exactly once
  mixed   conversations alternate full / start (one run measures both; --quick)
An ``off`` run replays the prompts of the first ``on`` run (same tokens: a like-for-like comparison) and may run
only some turns (``--off-turns``): with the cache off nothing survives a request, so turn k alone costs what it
costs after turns 1..k-1.

Per turn and run: TTFT p50/p99 (submit -> first token), output tok/s (the turn's output tokens / its wall time),
response bytes (mean per response; server mode: the whole SSE body; engine mode: the routed-experts field as the
API would send it, base64 of the uint8/uint16 ``.npy``), prefix-cache hit rate (hit / looked-up prompt tokens),
and, for full routing, history rows changed: rows of earlier positions that differ from what the previous turn
returned for them, split into rows in blocks the cache served (must be 0: a stale row otherwise) and rows
forwarded again (the partial last block, or everything with the cache off), where a model that is not batch
invariant may flip near-tied experts.

Targets: cache on: TTFT p50 of the last turn within 2x of turn 1's; prompt start: response bytes flat across turns
(max / min <= 1.2); cache-on output tok/s >= 3x cache-off at the last turn (the H200 target).

Modes:
  --mode server   moe-serve on a checkpoint (default ``medium``, loadtest/bench/common.py; CPU), two servers (cache on
                  and off) started side by side, ``--endpoints generate,chat`` (``/inference/v1/generate`` with
                  token ids; ``/v1/chat/completions`` with messages, where the previous answer goes back as text),
                  streaming. The runs are interleaved turn by turn, so that the runs compared share the machine's
                  conditions.
  --mode engine   the engine's public API in-process on the Qwen3-30B-A3B shape with random weights built on the
                  device (bench/real_shape_model.py); one engine (and KV cache) per run, runs one after another.

Usage:
    .venv/bin/python loadtest/bench/bench_multiturn.py --mode server --conversations 8 --turns 8 --user-tokens 96 \
        --output-tokens 32                          # CPU, medium model: about 5 minutes (loadtest/reports/multiturn.md)
    python loadtest/bench/bench_multiturn.py --mode engine --device cuda --quick --out $OUT/multiturn  # H200, < 4 min
    python loadtest/bench/bench_multiturn.py --mode engine --device cuda --out $OUT/multiturn   # all runs: several min
    .venv/bin/python loadtest/bench/bench_multiturn.py --mode engine --device cpu --shape tiny --conversations 4 \
        --turns 4 --user-tokens 32 --output-tokens 8                # CPU smoke test of the engine mode (seconds)
--quick: runs ``on-mixed,off-mixed``, the off run only at turns 1 and the last, a 210 s budget (no turn starts after
it; the on run starts none after 65% of it, so that the off run's replay fits).
Output: ``results.json`` and ``report.md`` in --out (default loadtest/results/multiturn-<time>/).

Longer than the project's usual ~450 lines: one benchmark whose two drivers (HTTP server, in-process engine) share
the agent loop, its checks and the report.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import cProfile
import datetime as dt
import gc
import io
import json
import logging
import math
import os
import pstats
import random
import re
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # the repo root: loadtest.* when run by path
sys.path.insert(0, str(REPO / "backends"))

T0 = time.perf_counter()
SERVER_BLOCK_SIZE = 16  # KV block size of the servers of server mode (passed as --block-size)
_WORDS = ("the agent reads a file then calls a tool and the router picks experts for every token while the trainer "
          "replays each rollout policy gradient step with cached prefix blocks of the conversation so far").split()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:7.1f} s] {msg}", flush=True)


def pct(xs, q) -> float | None:
    return float(np.percentile(np.asarray(xs, dtype=float), q)) if len(xs) else None


def b64_npy_bytes(rows: int, layers: int, top_k: int, dtype) -> int:
    """Length of the base64 of the ``.npy`` file the API sends for a [rows, layers, top_k] array."""
    import io

    buf = io.BytesIO()  # np.save's header, which the server's encoder writes too (byte-identical output)
    np.lib.format.write_array_header_1_0(
        buf, {"descr": np.lib.format.dtype_to_descr(np.dtype(dtype)), "fortran_order": False,
              "shape": (rows, layers, top_k)})
    raw = len(buf.getvalue()) + rows * layers * top_k * np.dtype(dtype).itemsize
    return 4 * math.ceil(raw / 3)


# ----------------------------------------------------------------------------- conversations


@dataclass
class Result:
    """One request of one turn."""

    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft_s: float | None = None
    end_s: float | None = None  # since the turn started
    bytes: int = 0  # the whole response (server: SSE body; engine: the routed-experts field)
    routed_bytes: int = 0  # the routed_experts field (base64 .npy)
    rows: np.ndarray | None = None
    reply_ids: list = field(default_factory=list)
    reply_text: str = ""
    error: str | None = None


@dataclass
class Conversation:
    routing: str  # "full" | "start"
    prompt: list  # token ids (generate, engine) or chat messages
    prev_total: int = 0  # tokens of the conversation the previous turn forwarded or produced (prompt + output)
    prev_rows: np.ndarray | None = None  # full routing: what the previous turn returned, and for which tokens
    prev_tokens: list = field(default_factory=list)

    def start(self) -> int:
        return max(0, self.prev_total - 1) if self.routing == "start" else 0


class Users:
    """Deterministic user turns: token ids, or text of about ``n`` tokens for the chat template."""

    def __init__(self, vocab_size: int, seed: int, tokenizer=None):
        self.vocab, self.seed, self.tok = vocab_size, seed, tokenizer

    def ids(self, conv: int, turn: int, n: int) -> list[int]:
        rng = random.Random(self.seed * 1_000_003 + conv * 1009 + turn)
        return [rng.randrange(3, self.vocab) for _ in range(n)]

    def text(self, conv: int, turn: int, n: int) -> str:
        rng = random.Random(self.seed * 1_000_003 + conv * 1009 + turn)
        words: list[str] = []
        while len(self.tok.encode(" ".join(words), add_special_tokens=False)) < n:
            words += [rng.choice(_WORDS) for _ in range(8)]
        return " ".join(words)


# ----------------------------------------------------------------------------- backends


class EngineBackend:
    """The engine's public API in-process: a turn's requests are submitted together (``Engine.add_requests``),
    outputs arrive by callback."""


    def __init__(self, model, cfg, ecfg, step_trace: bool = False, profile: tuple[int, str] | None = None):
        from moe_engine.engine import Engine
        from loadtest.bench.step_trace import StepTracer

        self.cfg = cfg
        self.engine = Engine(model, cfg, ecfg)
        self.block_size = self.engine.blocks.block_size  # whole blocks are what the prefix cache serves
        # --step-trace: every step timed (step_trace.py); ``run_turn`` logs a turn's prefill steps
        self.steps: list[dict] | None = StepTracer(self.engine).steps if step_trace else None
        self.turn_no = 0  # set by AgentRun.turn before run_turn (0: a warm-up)
        self.profile = profile  # (turn, path): cProfile the engine thread's steps of that turn into path
        self._profiler = None
        if profile is not None:
            self._profile_steps()
        self.engine.start()
        # the wire dtype the server would use (uint8 up to 256 experts); no frontend import: the GPU image
        # has no pybase64
        self.wire_dtype = np.dtype(cfg.routed_experts_dtype)
        self._ids = 0

    def cache_counters(self) -> tuple[float, float]:
        s = self.engine.stats()
        return s["prefix_cache_queries"], s["prefix_cache_hits"]

    def _profile_steps(self) -> None:
        """--profile-turn: each engine step of the chosen turn runs under cProfile in the engine thread (admission,
        launch, results and output processing; the submitting thread's validation is timed apart)."""
        step = self.engine.step

        def profiled_step():
            prof = self._profiler
            if prof is None:
                return step()
            prof.enable()
            try:
                return step()
            finally:
                prof.disable()

        self.engine.step = profiled_step

    def _write_profile(self, prof, submit_s: float, gc_ms: list[float]) -> None:
        turn, path = self.profile
        buf = io.StringIO()
        buf.write(f"turn {turn}: engine thread's steps under cProfile (timings inflated by the profiler); "
                  f"add_requests (validation, submitting thread) {1e3 * submit_s:.1f} ms; garbage collections "
                  f"during the turn: {len(gc_ms)}, {sum(gc_ms):.1f} ms (largest {max(gc_ms, default=0):.1f} ms)\n")
        for key in ("tottime", "cumulative"):
            pstats.Stats(prof, stream=buf).sort_stats(key).print_stats(30)
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(path, "w") as f:
            f.write(buf.getvalue())
        log(f"  profile of turn {turn} written to {path}")

    def run_turn(self, convs: list[Conversation], out_tokens: int, timeout: float) -> list[Result]:
        from moe_engine.engine import Request
        from moe_engine.core.sampling import SamplingParams

        results = [Result(prompt_tokens=len(c.prompt)) for c in convs]
        parts: list[list] = [[] for _ in convs]
        done, left, lock = threading.Event(), [len(convs)], threading.Lock()
        t0 = time.perf_counter()

        def callback(i: int):
            def on_output(out) -> None:
                r = results[i]
                if out.new_token_ids:
                    if r.ttft_s is None:
                        r.ttft_s = time.perf_counter() - t0
                    r.reply_ids.extend(out.new_token_ids)
                if out.routed_experts is not None and len(out.routed_experts):
                    parts[i].append(out.routed_experts)
                if out.finished:
                    r.end_s = time.perf_counter() - t0
                    if out.finish_reason != "length":
                        r.error = f"finish {out.finish_reason}: {out.error}"
                    with lock:
                        left[0] -= 1
                        if left[0] == 0:
                            done.set()
            return on_output

        sampling = SamplingParams(max_tokens=out_tokens, temperature=0.0, ignore_eos=True)
        reqs = []
        for i, c in enumerate(convs):
            self._ids += 1
            reqs.append(Request(request_id=f"mt-{self._ids}", prompt_token_ids=list(c.prompt), sampling=sampling,
                                return_routed_experts=True, routed_experts_prompt_start=c.start(),
                                on_output=callback(i)))
        # Together: the turn's first step sees every request (one add_request after another let the engine start
        # with the first few, and which few varied from turn to turn and run to run).
        first = len(self.steps) if self.steps is not None else 0
        profiling = self.profile is not None and self.turn_no == self.profile[0]
        gc_ms: list[float] = []

        def on_gc(phase, info, t=[0.0]):
            if phase == "start":
                t[0] = time.perf_counter()
            else:
                gc_ms.append(1e3 * (time.perf_counter() - t[0]))

        if profiling:
            gc.callbacks.append(on_gc)
            self._profiler = cProfile.Profile()
        t_submit = time.perf_counter()
        self.engine.add_requests(reqs)
        submit_s = time.perf_counter() - t_submit
        finished = done.wait(timeout)
        if profiling:
            prof, self._profiler = self._profiler, None
            gc.callbacks.remove(on_gc)
            self._write_profile(prof, submit_s, gc_ms)
        if not finished:
            raise TimeoutError(f"a turn took longer than {timeout:.0f} s")
        if self.steps is not None:
            for st in self.steps[first:]:
                for k in ("t_launch", "t_launched", "t_results", "t_done"):
                    st[k] -= t0
                if st["prefill_tokens"]:
                    # launched: launch returned (the host's output work for the step follows); results: the host
                    # starts waiting for the GPU (later than the GPU's end when that work outlasts it)
                    gpu = f", GPU {1e3 * st['gpu_s']:.1f} ms" if st.get("gpu_s") is not None else ""
                    log(f"  step {1e3 * st['t_launch']:7.1f} -> {1e3 * st['t_done']:7.1f} ms (launched "
                        f"{1e3 * st['t_launched']:.1f}, results {1e3 * st['t_results']:.1f}{gpu}): {st['tokens']} "
                        f"tokens, {st['seqs']} sequences; prefill {st['prefill_tokens']} tokens of "
                        f"{st['prefill_seqs']} sequences after {st['prefill_context']} cached tokens (mean)")
            ttft = sorted(r.ttft_s for r in results if r.ttft_s is not None)
            if ttft:
                log(f"  TTFT min / p50 / max {1e3 * ttft[0]:.0f} / {1e3 * pct(ttft, 50):.0f} / {1e3 * ttft[-1]:.0f} ms")
        L, K = self.cfg.num_hidden_layers, self.cfg.num_experts_per_tok
        for r, p in zip(results, parts):
            r.output_tokens = len(r.reply_ids)
            n = sum(len(x) for x in p)
            r.bytes = r.routed_bytes = b64_npy_bytes(n, L, K, self.wire_dtype)
            r.rows = (np.concatenate(p) if len(p) > 1 else p[0]) if p else np.zeros((0, L, K), np.uint16)
        return results

    def close(self) -> None:
        self.engine.shutdown()
        self.engine = None


class ServerBackend:
    """A running moe-serve: one streaming HTTP request per conversation and turn, from a thread each."""

    def __init__(self, server, endpoint: str, workers: int):
        import httpx

        self.server, self.endpoint = server, endpoint
        self.block_size = SERVER_BLOCK_SIZE  # whole blocks are what the prefix cache serves
        self.client = httpx.Client(timeout=httpx.Timeout(900.0), limits=httpx.Limits(max_connections=workers + 4))
        self.pool = concurrent.futures.ThreadPoolExecutor(workers)

    def cache_counters(self) -> tuple[float, float]:
        time.sleep(0.45)  # the backend refreshes Triton's metrics every 0.2 s
        text = urllib.request.urlopen(self.server.triton_metrics_url, timeout=10).read().decode()

        def value(name: str) -> float:
            m = re.search(r"^%s\{[^}]*\} (\S+)$" % name, text, re.M)
            return float(m.group(1)) if m else float("nan")
        return value("moe_engine_prefix_cache_queries"), value("moe_engine_prefix_cache_hits")

    def run_turn(self, convs: list[Conversation], out_tokens: int, timeout: float) -> list[Result]:
        t0 = time.perf_counter()
        futures = [self.pool.submit(self._one, c, out_tokens, t0) for c in convs]
        return [f.result(timeout=timeout) for f in futures]

    def _one(self, conv: Conversation, out_tokens: int, t0: float) -> Result:
        from loadtest.bench.common import decode_routed

        common = {"stream": True, "stream_options": {"include_usage": True}, "model": self.server.model}
        if self.endpoint == "generate":
            url = "/inference/v1/generate"
            body = {**common, "token_ids": conv.prompt, "sampling_params": {
                "max_tokens": out_tokens, "temperature": 0.0, "ignore_eos": True,
                "routed_experts_prompt_start": conv.start()}}
        else:
            url = "/v1/chat/completions"
            body = {**common, "messages": conv.prompt, "max_tokens": out_tokens, "temperature": 0.0,
                    "ignore_eos": True, "routed_experts_prompt_start": conv.start()}
        r, routed, buf = Result(), None, bytearray()
        with self.client.stream("POST", self.server.root_url + url, json=body) as resp:
            if resp.status_code != 200:
                r.error = f"HTTP {resp.status_code}: {resp.read()[:300]!r}"
                return r
            for chunk in resp.iter_bytes():
                r.bytes += len(chunk)
                buf += chunk
                while (nl := buf.find(b"\n")) >= 0:
                    line, buf = bytes(buf[:nl]), buf[nl + 1 :]
                    if not line.startswith(b"data: ") or line == b"data: [DONE]":
                        continue
                    ev = json.loads(line[6:])
                    for c in ev.get("choices") or []:
                        if r.ttft_s is None:  # the first chunk of a choice comes with its first token
                            r.ttft_s = time.perf_counter() - t0
                        if self.endpoint == "generate":
                            r.reply_ids += c.get("token_ids") or []
                        else:
                            r.reply_text += (c.get("delta") or {}).get("content") or ""
                        if c.get("finish_reason"):
                            routed = c.get("routed_experts")
                    if ev.get("usage"):
                        r.prompt_tokens = ev["usage"]["prompt_tokens"]
                        r.output_tokens = ev["usage"]["completion_tokens"]
        r.end_s = time.perf_counter() - t0
        if routed is None:
            r.error = "no routed_experts on the final chunk"
        else:
            r.rows, r.routed_bytes = decode_routed(routed), len(routed)
        return r

    def close(self) -> None:
        self.pool.shutdown()
        self.client.close()


# ----------------------------------------------------------------------------- the loop


class AgentRun:
    """One run of the agent loop, a turn at a time. A live run builds its conversations from the answers and
    records them in ``script``; a replay (``source``: a live run's script) sends what the live run sent."""

    def __init__(self, backend, args, name: str, users: Users, endpoint: str, source: dict | None = None):
        self.backend, self.args, self.name, self.users, self.endpoint, self.source = (
            backend, args, name, users, endpoint, source)
        routing = name.split("-", 1)[1]
        self.modes = [("full", "start")[i % 2] if routing == "mixed" else routing for i in range(args.conversations)]
        self.convs = [Conversation(m, []) for m in self.modes]
        self.script: dict = {}
        self.only: set[int] = set()  # a replay's turns
        self.record = {"name": name, "endpoint": endpoint, "modes": self.modes, "turns": {}, "complete": True,
                       "replayed": source is not None}

    def turn(self, turn: int) -> None:
        args, convs, endpoint, name, modes = self.args, self.convs, self.endpoint, self.name, self.modes
        for i, c in enumerate(convs):
            if self.source is not None:  # replay: the conversation as the live run had it at this turn
                c.prompt, c.prev_total = self.source[turn][i]
            elif endpoint == "chat":
                c.prompt = c.prompt + [{"role": "user", "content": self.users.text(i, turn, args.user_tokens)}]
            else:
                c.prompt = c.prompt + self.users.ids(i, turn, args.user_tokens)
        self.script[turn] = [(c.prompt, c.prev_total) for c in convs]
        backend = self.backend
        backend.turn_no = turn
        q0, h0 = backend.cache_counters()
        results = backend.run_turn(convs, args.output_tokens, timeout=args.turn_timeout)
        wall = max(r.end_s or 0.0 for r in results)
        q1, h1 = backend.cache_counters()
        rec = {"wall_s": wall, "output_tokens": sum(r.output_tokens for r in results),
               "hit_rate": (h1 - h0) / (q1 - q0) if q1 > q0 else None, "errors": [], "by_mode": {}}
        rec["tok_s"] = rec["output_tokens"] / wall if wall else None
        changed = {}
        for i, (c, r) in enumerate(zip(convs, results)):
            start = c.start()
            if r.error is None and r.rows is not None and len(r.rows) != r.prompt_tokens + r.output_tokens - 1 - start:
                r.error = f"{len(r.rows)} rows for {r.prompt_tokens} + {r.output_tokens} tokens from {start}"
            if r.error:
                rec["errors"].append(f"conversation {i}: {r.error}")
                continue
            if c.routing == "full" and endpoint != "chat":  # token positions are known: check the history's rows
                if c.prev_rows is not None:
                    n = min(len(c.prev_rows), len(os.path.commonprefix([c.prev_tokens, c.prompt])))
                    diff = (r.rows[:n] != c.prev_rows[:n]).any(axis=(1, 2))
                    # With the cache on, whole blocks of the rows the previous turn returned are served from the
                    # cache: a changed row there would be a stale one; the rest were forwarded again.
                    bs = backend.block_size
                    cached = (n // bs) * bs if name.startswith("on") else 0
                    changed[i] = (int(diff[:cached].sum()), int(diff[cached:].sum()))
                c.prev_rows, c.prev_tokens = r.rows, c.prompt + r.reply_ids
            c.prev_total = r.prompt_tokens + r.output_tokens
            if self.source is None:
                c.prompt = (c.prompt + [{"role": "assistant", "content": r.reply_text}] if endpoint == "chat"
                            else c.prompt + r.reply_ids)
        for mode in sorted(set(modes)):
            idx = [i for i, m in enumerate(modes) if m == mode and not results[i].error]
            rs = [results[i] for i in idx]
            rec["by_mode"][mode] = {
                "ttft_p50_s": pct([r.ttft_s for r in rs], 50), "ttft_p99_s": pct([r.ttft_s for r in rs], 99),
                "bytes_mean": float(np.mean([r.bytes for r in rs])) if rs else None,
                "routed_bytes_mean": float(np.mean([r.routed_bytes for r in rs])) if rs else None,
                "rows_mean": float(np.mean([len(r.rows) for r in rs])) if rs else None,
                "prompt_tokens_mean": float(np.mean([r.prompt_tokens for r in rs])) if rs else None,
                "history_rows_changed": [sum(changed[i][k] for i in idx if i in changed) for k in (0, 1)]
                if mode == "full" and changed else None,  # [in cached blocks, forwarded again]
            }
        self.record["turns"][turn] = rec
        summary = ", ".join(f"{m}: TTFT p50 {_ms(v['ttft_p50_s'])}, {_kb(v['bytes_mean'])}/resp"
                            for m, v in rec["by_mode"].items())
        log(f"{name} [{endpoint}] turn {turn}: {rec['output_tokens']} tok in {wall:.2f} s = {rec['tok_s'] or 0:.0f} tok/s, "
            f"hit rate {_pct(rec['hit_rate'])}; {summary}" + (f"; {len(rec['errors'])} ERRORS" if rec["errors"] else ""))




# ----------------------------------------------------------------------------- report


def _ms(s) -> str:
    return "-" if s is None else f"{s * 1e3:.0f} ms"


def _kb(b) -> str:
    return "-" if b is None else f"{b / 1024:.1f} KiB"


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def targets(runs: list[dict]) -> list[dict]:
    """The issue's three targets, each with the numbers it was judged on (a run cut short by the time budget is
    judged at the last turn it reached)."""
    out = []
    for r in runs:
        t = r["turns"]
        last = max(t, default=None)
        if not r["name"].startswith("on") or 1 not in t or last == 1:
            continue
        for mode, first in t[1]["by_mode"].items():
            lo, hi = first["ttft_p50_s"], t[last]["by_mode"][mode]["ttft_p50_s"]
            ratio = hi / lo if lo and hi else None
            out.append({"target": f"cache on: TTFT p50 turn {last} <= 2x turn 1", "run": r["name"],
                        "endpoint": r["endpoint"], "routing": mode, "value": ratio, "ok": ratio is not None and ratio <= 2})
    for r in runs:
        b = [rec["by_mode"]["start"]["bytes_mean"] for rec in r["turns"].values() if "start" in rec["by_mode"]]
        if len(b) >= 2:
            out.append({"target": f"prompt start: bytes per response flat over {len(b)} turns (max/min <= 1.2)",
                        "run": r["name"], "endpoint": r["endpoint"], "routing": "start", "value": max(b) / min(b),
                        "ok": max(b) / min(b) <= 1.2})
    for on in (r for r in runs if r["name"].startswith("on")):
        for off in (r for r in runs if r["name"].startswith("off") and r["endpoint"] == on["endpoint"]):
            common = set(on["turns"]) & set(off["turns"]) - {1}
            if common:
                last = max(common)
                ratio = on["turns"][last]["tok_s"] / off["turns"][last]["tok_s"]
                out.append({"target": f"output tok/s at turn {last}: cache on >= 3x off (H200)",
                            "run": f"{on['name']} / {off['name']}", "endpoint": on["endpoint"], "routing": "-",
                            "value": ratio, "ok": ratio >= 3.0})
    return out


def markdown(res: dict) -> str:
    lines = [f"# Multi-turn agent benchmark ({res['mode']} mode)", "", f"`{res['command']}`", "",
             f"{res['setup']}", "", "## Targets", "", "| target | run | endpoint | routing | value | met |",
             "|---|---|---|---|---:|:-:|"]
    for t in res["targets"]:
        value = "-" if t["value"] is None else f"{t['value']:.2f}"
        lines.append(f"| {t['target']} | {t['run']} | {t['endpoint']} | {t['routing']} | {value} | "
                     f"{'yes' if t['ok'] else 'NO'} |")
    for r in res["runs"]:
        lines += ["", f"## {r['name']} ({r['endpoint']})" + ("" if r["complete"] else " (cut short)"), "",
                  "| turn | prompt tokens | tok/s | wall | hit rate | routing | TTFT p50 | TTFT p99 | rows | bytes/resp "
                  "| routed_experts bytes | history rows changed (cached / forwarded again) | errors |",
                  "|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
        for turn, rec in r["turns"].items():
            for mode, m in rec["by_mode"].items():
                lines.append(
                    f"| {turn} | {m['prompt_tokens_mean'] or 0:.0f} | {rec['tok_s'] or 0:.0f} | {rec['wall_s']:.2f} s | "
                    f"{_pct(rec['hit_rate'])} | {mode} | {_ms(m['ttft_p50_s'])} | {_ms(m['ttft_p99_s'])} | "
                    f"{m['rows_mean'] or 0:.0f} | {_kb(m['bytes_mean'])} | {_kb(m['routed_bytes_mean'])} | "
                    f"{'-' if m['history_rows_changed'] is None else ' / '.join(map(str, m['history_rows_changed']))} | "
                    f"{len(rec['errors'])} |")
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- main


def warm_up(backend, args, users: Users, endpoint: str) -> None:
    """One untimed turn of the first turn's shape (compiles, first-call costs), on prompts no run uses."""
    t = time.perf_counter()
    convs = [Conversation("full", [{"role": "user", "content": users.text(10_000 + i, 0, args.user_tokens)}]
                          if endpoint == "chat" else users.ids(10_000 + i, 0, args.user_tokens))
             for i in range(args.conversations)]
    results = backend.run_turn(convs, min(16, args.output_tokens), timeout=args.turn_timeout)
    errors = [r.error for r in results if r.error]
    if errors:
        raise RuntimeError(f"warm-up failed: {errors[0]}")
    log(f"warm-up ({endpoint}): {time.perf_counter() - t:.1f} s")


def run_all(args, make_backend, endpoints: list[str], users_for, interleave: bool) -> list[dict]:
    """Every run for every endpoint; ``make_backend(name, endpoint)`` gives a backend (closed after use).

    ``interleave`` (server mode, where both servers stay up): turn k of every run, then turn k + 1, so that runs
    compared with each other share the machine's conditions (on a shared CPU they drift by 2x within minutes).
    Otherwise (engine mode: one engine, with its KV cache, at a time) each run goes to its end before the next."""
    records = []
    for endpoint in endpoints:
        runs: list[AgentRun] = []
        live: AgentRun | None = None
        for k, name in enumerate(args.run_list):
            backend = make_backend(name, endpoint)
            warm_up(backend, args, users_for(-1), endpoint)
            replay = name.startswith("off") and live is not None
            run = AgentRun(backend, args, name, users_for(k), endpoint, live.script if replay else None)
            if replay:  # --off-turns; "last" is the live run's last turn (it may have been cut short)
                last = args.turns if interleave else max(live.script, default=0)
                run.only = {min(t, last) for t in args.off_turn_list}
            live = live or (run if name.startswith("on") else None)
            runs.append(run)
            if not interleave:
                try:
                    _play(args, [run])
                finally:
                    backend.close()
        if interleave:
            try:
                _play(args, runs)
            finally:
                for run in runs:
                    run.backend.close()
        records += [r.record for r in runs]
    return records


def _play(args, runs: list[AgentRun]) -> None:
    """Turns 1..T of ``runs`` together; a replay only at its --off-turns (``last``: the live run's last turn)."""
    live_only = len(runs) == 1 and not runs[0].record["replayed"] and args.off_follows
    deadline = args.live_deadline if live_only else args.deadline
    for turn in range(1, args.turns + 1):
        for run in runs:
            if run.source is not None and (turn not in run.only or turn not in run.source):
                continue
            if not run.record["complete"]:
                continue
            if time.perf_counter() > deadline:
                run.record["complete"] = False
                log(f"{run.name}: time budget spent before turn {turn}; no more turns")
                continue
            run.turn(turn)


def server_mode(args) -> tuple[list[dict], str]:
    from loadtest.bench.common import resolve_model

    from openai_frontend.server_process import start_server
    from openai_frontend.tokenizer import Tokenizer

    ckpt, name = resolve_model(args.model)
    if ckpt is None:
        from moe_engine.tiny import ensure_tiny_checkpoint

        ckpt = str(ensure_tiny_checkpoint())
    cfg = json.loads((Path(ckpt) / "config.json").read_text())
    endpoints = args.endpoints.split(",")
    # Chat: the previous answer goes back as text, which can re-tokenize into more tokens than were generated.
    per_turn = args.user_tokens + args.output_tokens + (40 + 2 * args.output_tokens if "chat" in endpoints else 0)
    max_len = -(-(args.turns * per_turn + 64) // 16) * 16
    if max_len > cfg["max_position_embeddings"]:
        raise SystemExit(f"--turns x (user + output tokens) needs max_model_len {max_len}, more than the model's "
                         f"{cfg['max_position_embeddings']}: use fewer turns or tokens")
    # KV cache: every conversation of every cache-on run at its longest (runs are interleaved on one server), so
    # that a hit rate below 100% of the history is the block granularity, not eviction.
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    elem = 2 if cfg.get("torch_dtype") in ("bfloat16", "float16") else 4
    per_token = cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * 2 * head_dim * elem
    on_runs = sum(r.startswith("on") for r in args.run_list)
    kv_gib = 1.1 * max(1, on_runs) * args.conversations * (max_len + 2 * SERVER_BLOCK_SIZE) * per_token / 2**30
    flags = ["--model", ckpt, "--served-model-name", name, "--max-num-seqs", str(args.conversations),
             "--max-model-len", str(max_len), "--kv-cache-memory", f"{kv_gib:.6f}",
             "--block-size", str(SERVER_BLOCK_SIZE)]
    flags += ["--num-threads", str(args.num_threads)] if args.num_threads else []
    flags += ["--max-num-batched-tokens", str(args.max_num_batched_tokens)] if args.max_num_batched_tokens else []
    work = args.out / "servers"
    work.mkdir(parents=True, exist_ok=True)
    log(f"starting moe-serve x2 ({name}; cache on and --no-enable-prefix-caching): {' '.join(flags)}")
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        f_on = pool.submit(start_server, work, flags, model_name=name)
        f_off = pool.submit(start_server, work, flags + ["--no-enable-prefix-caching"], model_name=name)
        servers = {"on": f_on.result(), "off": f_off.result()}
    try:
        for key, s in servers.items():
            card = json.loads(urllib.request.urlopen(s.base_url + "/models", timeout=10).read())["data"][0]
            if card.get("prefix_caching_enabled", key == "on") != (key == "on"):
                raise SystemExit(f"the {key} server says prefix_caching_enabled={card.get('prefix_caching_enabled')}")
        tok = Tokenizer.from_dir(ckpt)
        runs = run_all(args, lambda run_name, ep: ServerBackend(servers[run_name.split("-")[0]], ep, args.conversations),
                       endpoints, lambda k: Users(cfg["vocab_size"], args.seed * 100 + k, tok), interleave=True)
    finally:
        codes = {k: s.stop() for k, s in servers.items()}
        log(f"servers stopped: {codes}")
    setup = (f"moe-serve on `{name}` ({cfg['num_hidden_layers']} layers, {cfg.get('num_local_experts')} experts "
             f"top-{cfg['num_experts_per_tok']}), CPU, max_model_len {max_len}, max_num_seqs {args.conversations}, "
             f"KV cache {kv_gib * 1024:.0f} MiB, "
             f"torch threads {args.num_threads or 'default'}; {args.conversations} conversations x {args.turns} turns, "
             f"{args.user_tokens} user tokens and {args.output_tokens} output tokens per turn (greedy, streaming); "
             f"endpoints {args.endpoints}.")
    return runs, setup


def engine_mode(args) -> tuple[list[dict], str]:
    import torch

    from loadtest.bench import real_shape_model as rsm
    from moe_engine.engine import EngineConfig

    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:  # the parameters' device, as the engine compares it
        device = torch.device("cuda", torch.cuda.current_device())
    if args.device == "cpu" and args.num_threads:
        torch.set_num_threads(args.num_threads)
    dtype = (torch.bfloat16 if device.type == "cuda" else torch.float32) if args.dtype == "auto" else getattr(torch, args.dtype)
    log(f"building {args.shape} with random weights ({args.init}) on {device}, {dtype} ...")
    model, cfg = rsm.build_engine_model(rsm.SHAPES[args.shape], device, dtype, args.seed, args.init, log)
    max_len = -(-(args.turns * (args.user_tokens + args.output_tokens) + 16) // 16) * 16
    extra = {k: v for k, v in (("max_num_batched_tokens", args.max_num_batched_tokens),
                               ("gpu_memory_utilization", args.gpu_memory_utilization),
                               ("block_size", args.block_size)) if v}

    def backend(name: str, endpoint: str):
        ecfg = EngineConfig(max_num_seqs=args.conversations, max_model_len=max_len, enable_routed_experts=True,
                            enable_prefix_caching=name.startswith("on"), **extra)
        rsm.free_device_memory(device)
        profile = None
        if args.profile_turn and name.startswith("on"):
            profile = (args.profile_turn, os.path.join(args.out or ".", f"profile_{name}_turn{args.profile_turn}.txt"))
        b = EngineBackend(model, cfg, ecfg, step_trace=args.step_trace, profile=profile)
        log(f"engine for {name}: {ecfg}; stats {b.engine.stats()}")
        return b

    runs = run_all(args, backend, ["engine"], lambda k: Users(cfg.vocab_size, args.seed * 100 + k), interleave=False)
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    setup = (f"engine API in-process, {args.shape} shape ({cfg.num_hidden_layers} layers, {cfg.num_experts} experts "
             f"top-{cfg.num_experts_per_tok}, vocabulary {cfg.vocab_size}), random {args.init} weights, {dtype}, "
             f"{gpu}, torch {torch.__version__}; max_model_len {max_len}, max_num_seqs {args.conversations}; "
             f"{args.conversations} conversations x {args.turns} turns, {args.user_tokens} user tokens and "
             f"{args.output_tokens} output tokens per turn (greedy).")
    return runs, setup


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--mode", required=True, choices=("server", "engine"))
    p.add_argument("--runs", default=None, help="comma list of on|off-full|start|mixed (default on-full,on-start,"
                   "off-full; --quick: on-mixed,off-mixed)")
    p.add_argument("--conversations", type=int, default=32)
    p.add_argument("--turns", type=int, default=16)
    p.add_argument("--user-tokens", type=int, default=300)
    p.add_argument("--output-tokens", type=int, default=200)
    p.add_argument("--off-turns", default=None, help="turns an off run replays: all | comma list, 'last' = the "
                   "live run's last (default all; --quick: 1,last)")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--time-budget", type=float, default=None, help="seconds from start; no turn starts later, "
                   "and a live run followed by an off run starts none after 65%% of it (default: 210 with --quick)")
    p.add_argument("--turn-timeout", type=float, default=600.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="directory for results.json and report.md")
    p.add_argument("--num-threads", type=int, default=1, help="CPU: torch threads (server: engine's; 0: default)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    g = p.add_argument_group("server mode")
    g.add_argument("--model", default="medium", help="tiny | medium | deep | checkpoint dir")
    g.add_argument("--endpoints", default="generate,chat")
    g = p.add_argument_group("engine mode")
    g.add_argument("--device", default="cuda")
    g.add_argument("--profile-turn", type=int, default=0, help="cProfile the engine thread's steps of this turn of "
                   "the cache-on run (with the submitting thread's add_requests time and the garbage collections) "
                   "into OUT/profile_<run>_turn<K>.txt")
    g.add_argument("--step-trace", action="store_true", help="log every turn's prefill steps (start and end on "
                   "the host clock, tokens, sequences, cached context)")
    g.add_argument("--shape", default="qwen3-30b-a3b", choices=("qwen3-30b-a3b", "tiny"))
    g.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float32", "float16"))
    g.add_argument("--init", default="balanced", choices=("balanced", "std0.02"))
    g.add_argument("--gpu-memory-utilization", type=float, default=None)
    g.add_argument("--block-size", type=int, default=None, help="tokens per KV-cache block (default: the engine's)")
    args = p.parse_args(argv)
    args.run_list = (args.runs or ("on-mixed,off-mixed" if args.quick else "on-full,on-start,off-full")).split(",")
    bad = [r for r in args.run_list if not re.fullmatch(r"(on|off)-(full|start|mixed)", r)]
    if bad:
        p.error(f"unknown runs {bad}")
    off = args.off_turns or ("1,last" if args.quick else "all")
    args.off_turn_list = list(range(1, args.turns + 1)) if off == "all" else sorted(
        {args.turns if t == "last" else int(t) for t in off.split(",")})
    budget = args.time_budget if args.time_budget is not None else (210.0 if args.quick else 0.0)
    args.deadline = T0 + budget if budget > 0 else float("inf")
    # A live run leaves a third of the budget to the cache-off replay that follows it.
    args.off_follows = any(r.startswith("off") for r in args.run_list)
    args.live_deadline = T0 + 0.65 * budget if budget > 0 else float("inf")
    stamp = f"{dt.datetime.now():%Y%m%d-%H%M%S}"
    args.out = Path(args.out) if args.out else REPO / "loadtest" / "results" / f"multiturn-{stamp}"
    args.out.mkdir(parents=True, exist_ok=True)
    return args


def _jsonable(x):
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, Path):
        return str(x)
    return x


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.mode == "engine":  # the engine's own lines (KV cache, kernel warm-up, graph capture) in the log
        logging.basicConfig(level=logging.WARNING, stream=sys.stdout, format="%(name)s %(levelname)s: %(message)s")
        logging.getLogger("moe_engine").setLevel(logging.INFO)
    command = "bench_multiturn.py " + " ".join(sys.argv[1:] if argv is None else argv)
    log(f"{command}; out {args.out}")
    runs, setup = (server_mode if args.mode == "server" else engine_mode)(args)
    res = {"mode": args.mode, "command": command, "setup": setup,
           "timestamp_utc": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
           "args": {k: v for k, v in vars(args).items() if k != "deadline"}, "runs": runs,
           "targets": targets(runs), "wall_s": time.perf_counter() - T0}
    (args.out / "results.json").write_text(json.dumps(_jsonable(res), indent=1))
    report = markdown(res)
    (args.out / "report.md").write_text(report)
    print("\n" + report, flush=True)
    errors = sum(len(rec["errors"]) for r in runs for rec in r["turns"].values())
    log(f"done in {res['wall_s']:.0f} s; {errors} wrong responses; {args.out / 'report.md'}")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
