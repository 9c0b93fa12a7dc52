#!/usr/bin/env python
"""One-command load test: start moe-serve, run locust headless, scrape /metrics, plot, stop, summarise.

    .venv/bin/python loadtest/load/run_loadtest.py --users 32 --duration 60s          # = make loadtest
    .venv/bin/python loadtest/load/run_loadtest.py --users 1,4,16,32,64 --duration 30s  # concurrency scan

Defaults: --users 32, --duration 60s, --model medium (Mixtral-style, 8 layers, 32
experts, top-4, built once under loadtest/results/checkpoints/), 64 output tokens
per request, prompts of 64-192 tokens, server flags as moe-serve's defaults
(--max-num-seqs 64) except --num-threads 1. ``--host URL`` tests a server that is already running
(no start/stop, no process sampling).

For each user count it runs ``locust -f loadtest/load/locustfile.py --headless -u N
-r N -t DURATION --csv --csv-full-history --json-file --html`` (closed loop: N
requests always in flight; in-flight requests are allowed to finish at the end,
so no client disconnects), and meanwhile samples every 2 s the RSS and CPU of
the server's processes (frontend, tritonserver, python backend stub), locust's
CPU, the machine's busy CPU (what neither used = other people's work), and the
engine gauges (running/waiting) from Triton's /metrics. After each run the API's
and Triton's /metrics are saved.

Output, under loadtest/results/<timestamp>/ (gitignored):
  u<N>/locust_stats.csv, locust_stats_history.csv, locust_failures.csv,
       locust_exceptions.csv, locust.json, locust.html, locust.log
  u<N>/requests.csv         one row per request (latency, TTFT, ITL, tokens, bytes)
  u<N>/verify.json          responses whose routed experts were verified, failures by reason
  u<N>/samples.csv          process/machine samples
  u<N>/metrics_{api,triton}_{before,after}.txt
  summary.json, summary.md, server.log, *.png
Throughput and latency figures use the steady window: from --warmup-s after
locust's start to the end of DURATION (requests finishing in it).
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(REPO))  # the repo root: loadtest.* when run by path

import numpy as np  # noqa: E402

from loadtest.bench.common import (  # noqa: E402
    ProcSampler, cpu_split, expert_counts, fetch_model_info, http_json, loadavg, parse_prom, percentile,
    prom_value, resolve_model, scrape, text_prompts, token_prompts, top_processes, write_csv,
)

ENDPOINTS = ("/v1/completions", "/v1/chat/completions [stream]", "/inference/v1/generate",
             "/inference/v1/generate [stream]")


def parse_duration(s: str) -> float:
    total, pos = 0.0, 0
    for m in re.finditer(r"(\d+(?:\.\d+)?)([hms]?)", s.strip()):
        if m.start() != pos:
            break
        total += float(m.group(1)) * {"h": 3600, "m": 60, "s": 1, "": 1}[m.group(2)]
        pos = m.end()
    if pos != len(s.strip()) or total <= 0:
        raise argparse.ArgumentTypeError(f"bad duration {s!r} (e.g. 60s, 5m, 1m30s)")
    return total


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ----------------------------------------------------------------------------- server


class Target:
    """The server under test: started here, or an existing URL."""

    def __init__(self, args, out: Path):
        self.server = None
        self.api_key = args.api_key
        if args.host:
            self.root_url = args.host.rstrip("/")
            self.triton_metrics_url = args.triton_metrics_url
            self.model_desc = "(existing server)"
            return
        from openai_frontend.server_process import start_server

        path, name = resolve_model(args.model)
        flags = ["--max-num-seqs", str(args.max_num_seqs), "--max-model-len", str(args.max_model_len)]
        if path:
            flags += ["--model", path, "--served-model-name", name]
        if args.num_threads:
            flags += ["--num-threads", str(args.num_threads)]
        flags += shlex.split(args.server_args)
        self.flags = flags
        self.model_desc = f"{name} ({path or 'embedded'})"
        log(f"starting moe-serve {' '.join(flags)}")
        t0 = time.monotonic()
        self.server = start_server(out, flags, api_key=args.api_key, model_name=name)
        log(f"server healthy after {time.monotonic() - t0:.1f} s: {self.server.base_url}")
        self.root_url = self.server.root_url
        self.triton_metrics_url = self.server.triton_metrics_url

    def stop(self, out: Path) -> dict:
        if self.server is None:
            return {}
        t0 = time.monotonic()
        rc = self.server.stop()
        shutil.copy(self.server.log_path, out / "server.log")
        text = (out / "server.log").read_text(errors="replace")
        harmless = ("CudaDriverHelper has not been initialized",)  # always printed on CPU (environment notes §4)
        bad = [ln for ln in text.splitlines() if re.search(r"Traceback|\bERROR\b|\bE\d{4} |Exception", ln)
               and not any(h in ln for h in harmless)]
        return {"exit_code": rc, "stop_s": round(time.monotonic() - t0, 2), "log_error_lines": len(bad),
                "log_error_examples": bad[:10]}


def warm_up(root: str, info, api_key: str | None) -> None:
    """A few requests of each kind, so first-request costs stay out of the measurement."""
    t = text_prompts(4, 30, 80, seed=99)
    ids = token_prompts(4, 64, 192, info.vocab_size, seed=99)
    sp = {"max_tokens": 16, "ignore_eos": True, "return_token_ids": True}
    for i in range(4):
        http_json(root + "/v1/completions", {"model": info.id, "prompt": t[i], **sp}, api_key)
        http_json(root + "/v1/chat/completions", {"model": info.id, "messages": [{"role": "user", "content": t[i]}],
                                                  **sp}, api_key)
        http_json(root + "/inference/v1/generate", {"model": info.id, "token_ids": ids[i], "sampling_params": sp},
                  api_key)


# ----------------------------------------------------------------------------- one locust run


def run_locust(args, target: Target, users: int, rdir: Path, info) -> dict:
    rdir.mkdir(parents=True, exist_ok=True)
    locust = Path(sys.executable).parent / "locust"
    cmd = [
        str(locust), "-f", str(HERE / "locustfile.py"), "--headless",
        "-u", str(users), "-r", str(args.spawn_rate or users), "-t", args.duration,
        "--host", target.root_url, "--stop-timeout", "900",
        "--csv", str(rdir / "locust"), "--csv-full-history", "--json-file", str(rdir / "locust"),
        "--html", str(rdir / "locust.html"), "--only-summary", "--loglevel", "INFO",
        "--max-tokens", str(args.max_tokens), "--prompt-tokens", args.prompt_tokens,
        "--num-prompts", str(args.num_prompts), "--temperature", str(args.temperature),
        "--request-log", str(rdir / "requests.csv"), "--verify-report", str(rdir / "verify.json"),
    ]
    if args.api_key:
        cmd += ["--api-key", args.api_key]
    if args.no_consistency:
        cmd += ["--no-consistency"]
    api_metrics = target.root_url + "/metrics"
    api_before = scrape(api_metrics)
    tri_before = scrape(target.triton_metrics_url) if target.triton_metrics_url else ""
    (rdir / "metrics_api_before.txt").write_text(api_before)
    (rdir / "metrics_triton_before.txt").write_text(tri_before)

    def engine_gauges() -> dict:
        out = {}
        if target.triton_metrics_url:
            p = parse_prom(scrape(target.triton_metrics_url, timeout=5))
            for state in ("running", "waiting"):
                out[f"engine_{state}"] = prom_value(p, "moe_engine_requests", state=state)
            out["engine_free_blocks"] = prom_value(p, "moe_engine_kv_blocks", state="free")
        a = parse_prom(scrape(api_metrics, timeout=5))
        out["api_pending_choices"] = prom_value(a, "moe_serve_pending_choices")
        return out

    load_before = loadavg()
    proc = None
    sampler = None
    if target.server is not None:
        sampler = ProcSampler(target.server.proc.pid, lambda: [proc.pid] if proc else [], interval=2.0,
                              extra=engine_gauges)
    t_launch = time.time()
    with open(rdir / "locust.log", "wb") as lf:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=lf, stderr=subprocess.STDOUT)
        if sampler:
            sampler.start()
        dur = parse_duration(args.duration)
        while proc.poll() is None:
            time.sleep(1)
            el = time.time() - t_launch
            if int(el) % 15 == 0:
                log(f"  u={users}: {el:5.0f}/{dur:.0f} s" + ("" if el < dur + 5 else " (in-flight requests finishing)"))
    rows = sampler.stop() if sampler else []
    write_csv(rdir / "samples.csv", rows)
    api_after = scrape(api_metrics)
    tri_after = scrape(target.triton_metrics_url) if target.triton_metrics_url else ""
    (rdir / "metrics_api_after.txt").write_text(api_after)
    (rdir / "metrics_triton_after.txt").write_text(tri_after)
    res = analyze(args, rdir, users, info, rows)
    res["locust_exit_code"] = proc.returncode
    res["load_before"], res["load_after"] = load_before, loadavg()
    res["server_side"] = server_deltas(api_before, api_after, tri_before, tri_after)
    return res


def server_deltas(api_b: str, api_a: str, tri_b: str, tri_a: str) -> dict:
    b, a = parse_prom(api_b), parse_prom(api_a)

    def d(name, **lab):
        return prom_value(a, name, **lab) - prom_value(b, name, **lab)

    statuses = {}
    for (n, lab), v in a.items():
        if n == "moe_serve_requests_total":
            ld = dict(lab)
            if ld.get("endpoint") in ("/v1/completions", "/v1/chat/completions", "/inference/v1/generate"):
                dv = v - b.get((n, lab), 0.0)
                if dv:
                    statuses[ld["status"]] = statuses.get(ld["status"], 0) + dv
    out = {
        "http_status_counts": statuses,
        "generation_tokens": d("moe_serve_generation_tokens_total"),
        "prompt_tokens": d("moe_serve_prompt_tokens_total"),
        "routed_experts_bytes": d("moe_serve_routed_experts_bytes_total"),
        "routed_experts_rows": d("moe_serve_routed_experts_rows_total"),
        "rejected": d("moe_serve_rejected_requests_total"),
        "client_disconnects": d("moe_serve_client_disconnects_total"),
        "pending_choices_after": prom_value(a, "moe_serve_pending_choices"),
    }
    if tri_a:
        tb, ta = parse_prom(tri_b), parse_prom(tri_a)
        out["triton_success"] = prom_value(ta, "nv_inference_request_success") - prom_value(tb, "nv_inference_request_success")
        out["triton_failures"] = {
            dict(lab)["reason"]: v - tb.get((n, lab), 0.0)
            for (n, lab), v in ta.items() if n in ("nv_inference_request_failure", "nv_inference_request_failure_total")
        }
        out["engine_after"] = {s: prom_value(ta, "moe_engine_requests", state=s) for s in ("running", "waiting")}
        out["engine_after"].update(
            {f"kv_blocks_{s}": prom_value(ta, "moe_engine_kv_blocks", state=s) for s in ("free", "total")})
    return out


def read_requests(path: Path) -> list[dict]:
    import csv

    if not path.exists():
        return []
    with open(path) as f:
        return list(csv.DictReader(f))


def pct3(xs) -> dict:
    return {"p50": percentile(xs, 50), "p90": percentile(xs, 90), "p99": percentile(xs, 99)} if xs else {}


def analyze(args, rdir: Path, users: int, info, rows: list[dict]) -> dict:
    reqs = read_requests(rdir / "requests.csv")
    jl = json.loads((rdir / "locust.json").read_text()) if (rdir / "locust.json").exists() else []
    start = min((e["start_time"] for e in jl), default=None)
    dur = parse_duration(args.duration)
    warm = args.warmup_s if args.warmup_s is not None else min(10.0, 0.1 * dur)
    if start is None:
        start = min((float(r["t_end"]) for r in reqs), default=time.time())
    w0, w1 = start + warm, start + dur
    win = [r for r in reqs if w0 <= float(r["t_end"]) <= w1]
    ok = [r for r in win if r["ok"] == "1"]
    span = w1 - w0
    res = {
        "users": users,
        "window_s": round(span, 1),
        "requests_total": len(reqs),
        "failures_total": sum(1 for r in reqs if r["ok"] != "1"),
        "requests_in_window": len(win),
        "output_tok_per_s": sum(int(r["output_tokens"]) for r in ok) / span,
        "req_per_s": len(ok) / span,
        "prompt_tok_per_s": sum(int(r["prompt_tokens"]) for r in ok) / span,
        "e2e_ms": pct3([1000 * float(r["e2e_s"]) for r in ok]),
        "ms_per_token": pct3([1000 * float(r["e2e_s"]) / int(r["output_tokens"]) for r in ok]),
        "ttft_ms": pct3([1000 * float(r["ttft_s"]) for r in ok if r["ttft_s"]]),
        "itl_ms": pct3([1000 * float(r["itl_s"]) for r in ok if r["itl_s"]]),
        "routed_bytes_mean": float(np.mean([int(r["routed_bytes"]) for r in ok])) if ok else float("nan"),
        "prompt_tokens": pct3([int(r["prompt_tokens"]) for r in ok]),
        "per_endpoint": {},
    }
    for ep in ENDPOINTS:
        er = [r for r in win if r["endpoint"] == ep]
        eok = [r for r in er if r["ok"] == "1"]
        if not er:
            continue
        res["per_endpoint"][ep] = {
            "requests": len(er), "failures": len(er) - len(eok),
            "req_per_s": len(eok) / span,
            "output_tok_per_s": sum(int(r["output_tokens"]) for r in eok) / span,
            "e2e_ms": pct3([1000 * float(r["e2e_s"]) for r in eok]),
            "ttft_ms": pct3([1000 * float(r["ttft_s"]) for r in eok if r["ttft_s"]]),
            "itl_ms": pct3([1000 * float(r["itl_s"]) for r in eok if r["itl_s"]]),
            "ms_per_token": pct3([1000 * float(r["e2e_s"]) / int(r["output_tokens"]) for r in eok]),
            "routed_bytes_mean": float(np.mean([int(r["routed_bytes"]) for r in eok])) if eok else None,
        }
    # Locust's own counts (real requests only; METRIC rows excluded).
    lf = [e for e in jl if e["method"] != "METRIC"]
    res["locust_requests"] = sum(e["num_requests"] for e in lf)
    res["locust_failures"] = sum(e["num_failures"] for e in lf)
    exc = rdir / "locust_exceptions.csv"
    res["locust_exceptions"] = max(0, len(exc.read_text().splitlines()) - 1) if exc.exists() else None
    ver = json.loads((rdir / "verify.json").read_text()) if (rdir / "verify.json").exists() else {}
    res["verify"] = {k: v for k, v in ver.items() if k not in ("model", "examples")}
    if rows:
        res["cpu"] = cpu_split(rows)
        rss0 = {k: rows[0][k] for k in rows[0] if k.startswith("rss_")}
        rss1 = {k: rows[-1][k] for k in rows[-1] if k.startswith("rss_")}
        res["rss_mib_start"] = {k[4:]: round(v / 2**20, 1) for k, v in rss0.items()}
        res["rss_mib_end"] = {k[4:]: round(v / 2**20, 1) for k, v in rss1.items()}
        res["engine_max_running"] = max(r.get("engine_running", 0) for r in rows)
        res["engine_max_waiting"] = max(r.get("engine_waiting", 0) for r in rows)
        res["load1_max"] = max(r["load1"] for r in rows)
    return res


# ----------------------------------------------------------------------------- plots


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_scan(results: list[dict], path: Path, title: str) -> None:
    plt = _plt()
    us = [r["users"] for r in results]
    fig, ax = plt.subplots(2, 2, figsize=(10, 7))
    a = ax[0, 0]
    a.plot(us, [r["output_tok_per_s"] for r in results], "o-", label="output tokens/s")
    a.set_ylabel("output tokens/s")
    a2 = a.twinx()
    a2.plot(us, [r["req_per_s"] for r in results], "s--", color="tab:orange", label="requests/s")
    a2.set_ylabel("requests/s", color="tab:orange")
    a.set_title("throughput")
    for a_, key, t in ((ax[0, 1], "e2e_ms", "request latency (ms), all endpoints"),
                       (ax[1, 0], "ttft_ms", "time to first token (ms), streaming"),
                       (ax[1, 1], "itl_ms", "inter-token latency (ms), streaming")):
        for q, st in (("p50", "o-"), ("p90", "s--"), ("p99", "^:")):
            a_.plot(us, [r[key].get(q, np.nan) for r in results], st, label=q)
        a_.set_title(t)
        a_.legend()
    for a_ in ax.flat:
        a_.set_xscale("log", base=2)
        a_.set_xticks(us)
        a_.set_xticklabels([str(u) for u in us])
        a_.set_xlabel("concurrent users (requests in flight)")
        a_.grid(alpha=0.3)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def plot_timeline(rdir: Path, res: dict, path: Path, title: str) -> None:
    import csv

    plt = _plt()
    reqs = [r for r in read_requests(rdir / "requests.csv") if r["ok"] == "1"]
    rows = []
    if (rdir / "samples.csv").exists():
        with open(rdir / "samples.csv") as f:
            rows = [{k: float(v) if v not in ("", None) else np.nan for k, v in r.items()} for r in csv.DictReader(f)]
    if not reqs:
        return
    t0 = rows[0]["t"] if rows else min(float(r["t_end"]) for r in reqs) - 1
    fig, ax = plt.subplots(2, 3, figsize=(14, 7))
    te = np.array([float(r["t_end"]) - t0 for r in reqs])
    tok = np.array([int(r["output_tokens"]) for r in reqs])
    e2e = np.array([1000 * float(r["e2e_s"]) for r in reqs])
    B = 10
    bins = np.arange(0, te.max() + B, B)
    s, _ = np.histogram(te, bins, weights=tok)
    ax[0, 0].step(bins[:-1], s / B, where="post")
    ax[0, 0].set_title(f"output tokens/s ({B} s bins, by completion time)")
    idx = np.digitize(te, bins)
    for q, lab in ((50, "p50"), (90, "p90"), (99, "p99")):
        v = [np.percentile(e2e[idx == i], q) if (idx == i).any() else np.nan for i in range(1, len(bins))]
        ax[0, 1].step(bins[:-1], v, where="post", label=lab)
    ax[0, 1].set_title(f"request latency (ms), {B} s bins")
    ax[0, 1].legend(fontsize=8)
    ttft = [(float(r["t_end"]) - t0, 1000 * float(r["ttft_s"])) for r in reqs if r["ttft_s"]]
    if ttft:
        x, y = zip(*ttft)
        ax[0, 2].plot(x, y, ".", ms=2, alpha=0.5)
        ax[0, 2].set_yscale("log")
    ax[0, 2].set_title("TTFT per streamed request (ms)")
    if rows:
        ts = np.array([r["t"] for r in rows]) - t0
        for k in sorted(k for k in rows[0] if k.startswith("rss_")):
            ax[1, 0].plot(ts, [r[k] / 2**20 for r in rows], label=k[4:])
        ax[1, 0].set_title("RSS (MiB) of the server's processes")
        ax[1, 0].legend(fontsize=8)
        for k, lab in (("engine_running", "running"), ("engine_waiting", "waiting"),
                       ("api_pending_choices", "API pending choices")):
            if k in rows[0]:
                ax[1, 1].plot(ts, [r[k] for r in rows], label=lab)
        ax[1, 1].set_title("engine requests (Triton /metrics)")
        ax[1, 1].legend(fontsize=8)
        dt_ = np.diff(ts)
        srv = np.diff([r["server_cpu"] for r in rows]) / dt_
        cli = np.diff([r["client_cpu"] for r in rows]) / dt_
        busy = np.diff([r["machine_busy"] for r in rows]) / dt_
        ax[1, 2].stackplot(ts[1:], srv, cli, np.clip(busy - srv - cli, 0, None),
                           labels=["moe-serve (all processes)", "locust", "other processes"], alpha=0.8, step="pre")
        ax[1, 2].set_ylim(0, max(2.0, float(np.nanmax(busy)) * 1.1) if len(busy) else 2.0)
        ax[1, 2].set_title("CPU (cores) on this machine")
        ax[1, 2].legend(fontsize=8, loc="lower right")
    for a in ax.flat:
        a.set_xlabel("seconds since locust start")
        a.grid(alpha=0.3)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=72)
    plt.close(fig)


def plot_experts(counts: np.ndarray, moe_layers, path: Path, title: str) -> dict:
    plt = _plt()
    layers = list(moe_layers)
    c = counts[layers].astype(float)
    share = c / np.maximum(c.sum(axis=1, keepdims=True), 1)
    E = c.shape[1]
    fig, ax = plt.subplots(figsize=(max(6, E * 0.28 + 2), max(3, len(layers) * 0.35 + 1.5)))
    im = ax.imshow(share * E, aspect="auto", cmap="viridis", interpolation="nearest")
    ax.set_yticks(range(len(layers)))
    ax.set_yticklabels([str(layer) for layer in layers])
    ax.set_ylabel("layer")
    ax.set_xlabel("expert")
    ax.set_xticks(range(0, E, max(1, E // 16)))
    fig.colorbar(im, ax=ax, label="load / uniform load (1 = balanced)")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    with np.errstate(divide="ignore", invalid="ignore"):
        return {"selections": int(c.sum()),
                "max_over_uniform_per_layer": [round(float(x), 2) for x in share.max(axis=1) * E],
                "min_over_uniform_per_layer": [round(float(x), 2) for x in share.min(axis=1) * E]}


# ----------------------------------------------------------------------------- report


def fmt(x, nd=0):
    if x is None or (isinstance(x, float) and np.isnan(x)):
        return "-"
    return f"{x:,.{nd}f}"


def summary_md(meta: dict, results: list[dict]) -> str:
    L = [f"# Load test {meta['timestamp']}", "",
         f"- model: {meta['model']}; server flags: `{meta.get('server_flags', '')}`",
         f"- workload: {meta['max_tokens']} output tokens/request (ignore_eos), prompts {meta['prompt_tokens']} tokens, "
         f"temperature {meta['temperature']} (seeded), endpoints: completions, chat stream, generate (+stream)",
         f"- duration {meta['duration']} per user count, steady window from {meta['warmup_s']} s",
         f"- load average before: {meta['load_before']}, after: {meta['load_after']}", ""]
    L += ["| users | out tok/s | req/s | e2e p50/p90/p99 ms | TTFT p50/p99 ms | ITL p50/p99 ms | ms/token p50 "
          "| requests | failures | verified | other CPU (cores) |",
          "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        e, t, i = r["e2e_ms"], r["ttft_ms"], r["itl_ms"]
        L.append(
            f"| {r['users']} | {fmt(r['output_tok_per_s'])} | {fmt(r['req_per_s'], 2)} | "
            f"{fmt(e.get('p50'))}/{fmt(e.get('p90'))}/{fmt(e.get('p99'))} | {fmt(t.get('p50'))}/{fmt(t.get('p99'))} | "
            f"{fmt(i.get('p50'), 1)}/{fmt(i.get('p99'), 1)} | {fmt(r['ms_per_token'].get('p50'), 1)} | "
            f"{r['requests_total']} | {r['failures_total']} (locust {r['locust_failures']}) | "
            f"{r['verify'].get('verified')} | {fmt(r.get('cpu', {}).get('other_cores'), 2)} |")
    last = results[-1]
    L += ["", f"Per endpoint (users={last['users']}):", "",
          "| endpoint | requests | failures | out tok/s | e2e p50/p99 ms | TTFT p50/p99 ms | ITL p50/p99 ms "
          "| routed_experts bytes (mean) |", "|---|---|---|---|---|---|---|---|"]
    for ep, p in last["per_endpoint"].items():
        L.append(f"| `{ep}` | {p['requests']} | {p['failures']} | {fmt(p['output_tok_per_s'])} | "
                 f"{fmt(p['e2e_ms'].get('p50'))}/{fmt(p['e2e_ms'].get('p99'))} | "
                 f"{fmt(p['ttft_ms'].get('p50'))}/{fmt(p['ttft_ms'].get('p99'))} | "
                 f"{fmt(p['itl_ms'].get('p50'), 1)}/{fmt(p['itl_ms'].get('p99'), 1)} | {fmt(p['routed_bytes_mean'])} |")
    return "\n".join(L) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--users", default=os.environ.get("USERS", "32"),
                    help="concurrent users; a comma list runs a concurrency scan (default 32)")
    ap.add_argument("--duration", default=os.environ.get("DURATION", "60s"), help="per user count (default 60s)")
    ap.add_argument("--spawn-rate", type=float, default=None, help="users/s (default: all at once)")
    ap.add_argument("--warmup-s", type=float, default=None, help="excluded from the steady window (default min(10 s, 10%%))")
    ap.add_argument("--model", default="medium", help="tiny | medium | checkpoint dir (default medium)")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--num-threads", type=int, default=1,
                    help="engine torch threads (default 1: on 2 cores, torch's default of 2 threads gave 1.5x less "
                         "throughput, see loadtest/reports/loadtest.md; 0 = torch's default)")
    ap.add_argument("--server-args", default="", help="more moe-serve flags, quoted")
    ap.add_argument("--host", default="", help="test this running server instead of starting one")
    ap.add_argument("--triton-metrics-url", default="", help="with --host: Triton's /metrics URL (optional)")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompt-tokens", default="64-192")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--no-consistency", action="store_true")
    ap.add_argument("--out", default="", help="results dir (default loadtest/results/<timestamp>)")
    ap.add_argument("--report-dir", default="", help="also copy the PNGs and summary.md here")
    ap.add_argument("--tag", default="", help="suffix for the results dir and plot titles")
    ap.add_argument("--reanalyze", default="", metavar="DIR",
                    help="only recompute summary and plots of a finished run's results dir")
    args = ap.parse_args()
    if args.reanalyze:
        return reanalyze(args, Path(args.reanalyze))
    users = [int(u) for u in str(args.users).split(",") if u.strip()]
    parse_duration(args.duration)

    ts = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = Path(args.out) if args.out else REPO / "loadtest" / "results" / (ts + (f"-{args.tag}" if args.tag else ""))
    out.mkdir(parents=True, exist_ok=True)
    meta = {"timestamp": ts, "users": users, "duration": args.duration, "max_tokens": args.max_tokens,
            "prompt_tokens": args.prompt_tokens, "temperature": args.temperature,
            "command": " ".join(shlex.quote(a) for a in sys.argv), "load_before": loadavg(),
            "top_before": top_processes()}
    log(f"results in {out}; load average {meta['load_before']}")
    for line in meta["top_before"][1:4]:
        log(f"  busiest before: {line}")

    target = Target(args, out)
    results, stop_info = [], {}
    try:
        meta["model"] = target.model_desc
        meta["server_flags"] = " ".join(getattr(target, "flags", []))
        info = fetch_model_info(target.root_url, args.api_key)
        meta["model_info"] = info.__dict__
        log(f"model {info.id}: {info.num_hidden_layers} layers, {info.num_experts} experts, top-{info.top_k}, "
            f"{info.dtype}; warming up")
        warm_up(target.root_url, info, args.api_key)
        prom0 = parse_prom(scrape(target.root_url + "/metrics"))
        for u in users:
            log(f"locust: {u} users for {args.duration}")
            r = run_locust(args, target, u, out / f"u{u:03d}", info)
            results.append(r)
            log(f"  u={u}: {r['output_tok_per_s']:.0f} output tok/s, {r['req_per_s']:.2f} req/s, "
                f"e2e p50 {r['e2e_ms'].get('p50', float('nan')):.0f} ms, failures {r['failures_total']} "
                f"(locust {r['locust_failures']}), verified {r['verify'].get('verified')}, "
                f"other processes {r.get('cpu', {}).get('other_cores', float('nan')):.2f} cores")
        prom1 = parse_prom(scrape(target.root_url + "/metrics"))
        counts = expert_counts(prom1, info.num_hidden_layers, info.num_experts) - \
            expert_counts(prom0, info.num_hidden_layers, info.num_experts)
        np.save(out / "expert_counts.npy", counts)
    finally:
        stop_info = target.stop(out)
    meta["server_stop"] = stop_info
    meta["load_after"] = loadavg()
    meta["top_after"] = top_processes()
    meta["warmup_s"] = args.warmup_s if args.warmup_s is not None else min(10.0, 0.1 * parse_duration(args.duration))
    return report(args, out, meta, results, counts, info)


def reanalyze(args, out: Path):
    """Recompute summary and plots of a finished run from its files (after a fix in the analysis)."""
    from loadtest.bench.common import ModelInfo

    old = json.loads((out / "summary.json").read_text())
    meta = old["meta"]
    args.duration, args.max_tokens = meta["duration"], meta["max_tokens"]
    args.warmup_s = meta.get("warmup_s")
    info = ModelInfo(**{**meta["model_info"], "moe_layers": tuple(meta["model_info"]["moe_layers"])})
    results = []
    for prev in old["results"]:
        rdir = out / f"u{prev['users']:03d}"
        rows = []
        if (rdir / "samples.csv").exists():
            import csv

            with open(rdir / "samples.csv") as f:
                rows = [{k: float(v) if v not in ("", None) else 0.0 for k, v in r.items()} for r in csv.DictReader(f)]
        r = analyze(args, rdir, prev["users"], info, rows)
        for k in ("locust_exit_code", "load_before", "load_after"):
            r[k] = prev.get(k)
        r["server_side"] = server_deltas(*((rdir / f"metrics_{w}.txt").read_text() for w in
                                           ("api_before", "api_after", "triton_before", "triton_after")))
        results.append(r)
    counts = np.load(out / "expert_counts.npy")
    if not args.tag:
        args.tag = out.name.split("-", 2)[2] if out.name.count("-") >= 2 else ""
    return report(args, out, meta, results, counts, info)


def report(args, out: Path, meta: dict, results: list[dict], counts: np.ndarray, info) -> int:
    stop_info = meta.get("server_stop", {})
    tag = f" {args.tag}" if args.tag else ""
    title = f"moe-serve {meta['model'].split(' ')[0]}{tag}: {args.max_tokens} out tok/req, {args.duration}/point"
    pngs = []
    if len(results) > 1:
        plot_scan(results, out / "scan.png", title)
        pngs.append(out / "scan.png")
    for r in results:
        p = out / f"timeline_u{r['users']:03d}.png"
        plot_timeline(out / f"u{r['users']:03d}", r, p, f"{title}, {r['users']} users")
        pngs.append(p)
    meta["experts"] = plot_experts(counts, info.moe_layers, out / "experts.png",
                                   f"expert load per layer over the run ({info.id}, /metrics)")
    pngs.append(out / "experts.png")

    md = summary_md(meta, results)
    (out / "summary.md").write_text(md)
    (out / "summary.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1, default=str))
    if args.report_dir:
        rd = Path(args.report_dir)
        rd.mkdir(parents=True, exist_ok=True)
        for p in pngs:
            shutil.copy(p, rd / p.name)
        shutil.copy(out / "summary.md", rd / "summary.md")
    print()
    print(md)
    total_fail = sum(r["failures_total"] + r["locust_failures"] + (r["locust_exceptions"] or 0) for r in results)
    unverified = sum(r["requests_total"] - r["failures_total"] - (r["verify"].get("verified") or 0) for r in results)
    print(f"server: exit code {stop_info.get('exit_code')}, stop {stop_info.get('stop_s')} s, "
          f"error lines in its log: {stop_info.get('log_error_lines')}")
    for r in results:
        ss = r["server_side"]
        print(f"u={r['users']}: server saw HTTP {ss['http_status_counts']}, rejected {ss['rejected']:.0f}, "
              f"disconnects {ss['client_disconnects']:.0f}, Triton successes {ss.get('triton_success')}, "
              f"failures {ss.get('triton_failures')}; RSS MiB {r.get('rss_mib_start')} -> {r.get('rss_mib_end')}; "
              f"CPU cores {json.dumps({k: round(v, 2) for k, v in r.get('cpu', {}).items() if isinstance(v, float)})}")
    print(f"failed requests: {total_fail}; successful responses not verified: {unverified}")
    print(f"load average before {meta['load_before']}, after {meta.get('load_after')}")
    print(f"results: {out}")
    return 0 if total_fail == 0 and unverified == 0 and stop_info.get("exit_code", 0) == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
