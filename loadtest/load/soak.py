#!/usr/bin/env python
"""Soak with overload and disconnect waves: nothing hangs, only the documented statuses, memory stays flat.

    .venv/bin/python loadtest/load/soak.py --duration 600                     # the long run
    .venv/bin/python loadtest/load/soak.py --duration 120 --overload-every 40 --disconnect-every 30   # a short one

Starts its own moe-serve (as users get it: Triton private) on the embedded tiny model with small limits
(``--max-num-seqs 16 --max-pending-requests 32``) so that a burst of ``--overload-factor`` (10) times the
admission limit really overloads it; ``--host URL`` targets a running server instead (no memory samples).

Traffic: ``--concurrency`` closed-loop clients of mixed requests (traffic.py). On top, every
``--overload-every`` s a burst of factor x limit requests at once, and every ``--disconnect-every`` s a
wave of ``--disconnect-wave`` streams dropped after their first event (the engine must let them go: its
running count returns to at most the steady clients' within 5 s).

Memory: RSS of the frontend, tritonserver and the python stub every 5 s; the report compares the
minute after warm-up with the last minute. Writes ``--out`` (JSON) and prints a Markdown summary.
Exit status 1 when a request hung, a 5xx other than the documented 503 appeared, a stream ended
without [DONE], or a disconnect wave was not released.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: loadtest.* when run by path

from loadtest.bench.common import ProcSampler  # noqa: E402
from loadtest.load.traffic import Traffic, metric  # noqa: E402

RUNNING = 'moe_engine_requests{model="moe",state="running",version="1"}'


def memory_report(rows: list[dict], warmup_s: float) -> dict:
    if not rows:
        return {}
    t0 = rows[0]["t"]
    out = {}
    for key in ("rss_frontend", "rss_tritonserver", "rss_backend_stub"):
        early = [r[key] for r in rows if key in r and warmup_s <= r["t"] - t0 < warmup_s + 60]
        late = [r[key] for r in rows if key in r and r["t"] - rows[-1]["t"] > -60]
        if early and late:
            out[key] = {"after_warmup_mib": round(max(early) / 2**20, 1), "last_minute_mib": round(max(late) / 2**20, 1),
                        "max_mib": round(max(r.get(key, 0) for r in rows) / 2**20, 1)}
    return out


async def run(args, root: str, api_key: str | None, model: str) -> dict:
    traffic = Traffic(root, api_key, model, hang_after_s=args.hang_after)
    t_start = time.monotonic()
    stop_at = t_start + args.duration
    waves: list[dict] = []

    async def overload_waves():
        k = 1
        while time.monotonic() + 5 < stop_at:
            await asyncio.sleep(max(0.0, t_start + k * args.overload_every - time.monotonic()))
            if time.monotonic() + 5 >= stop_at:
                return
            n = args.overload_factor * args.max_pending
            t = time.monotonic()
            outs = await traffic.burst(n)
            waves.append({"kind": "overload", "at_s": round(t - t_start, 1), "requests": n,
                          "ok": sum(o.status == 200 for o in outs), "503": sum(o.status == 503 for o in outs),
                          "other": sum(o.status not in (200, 503) for o in outs),
                          "took_s": round(time.monotonic() - t, 1)})
            k += 1

    async def disconnect_waves():
        k = 1
        while time.monotonic() + 5 < stop_at:
            await asyncio.sleep(max(0.0, t_start + k * args.disconnect_every - time.monotonic()))
            if time.monotonic() + 5 >= stop_at:
                return
            t = time.monotonic()
            outs = await traffic.burst(args.disconnect_wave, disconnect_after_first=True)
            dropped = sum(o.status == -2 for o in outs)
            released = None
            while time.monotonic() - t < 30:
                running = metric(await traffic.metrics(), RUNNING)
                if running is not None and running <= args.concurrency:
                    released = round(time.monotonic() - t, 2)
                    break
                await asyncio.sleep(0.25)
            waves.append({"kind": "disconnect", "at_s": round(t - t_start, 1), "streams": args.disconnect_wave,
                          "dropped": dropped, "engine_released_after_s": released})
            k += 1

    tasks = [traffic.workers(args.concurrency, stop_at)]
    if args.overload_every:
        tasks.append(overload_waves())
    if args.disconnect_every:
        tasks.append(disconnect_waves())
    await asyncio.gather(*tasks)
    await asyncio.sleep(3)
    idle = metric(await traffic.metrics(), RUNNING)
    health = await traffic.health()
    metrics_text = await traffic.metrics()
    await traffic.aclose()
    summary = traffic.ledger.summary()
    summary.update(waves=waves, engine_running_after=idle, health_after=health,
                   rejected_total=metric(metrics_text, "moe_serve_rejected_requests_total"),
                   aborted_backend_failure=metric(metrics_text, 'moe_serve_aborted_requests_total{reason="backend_failure"}'))
    return summary


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=float, default=600)
    ap.add_argument("--concurrency", type=int, default=12)
    ap.add_argument("--max-pending", type=int, default=32, help="the server's --max-pending-requests")
    ap.add_argument("--overload-every", type=float, default=60, help="seconds between overload bursts (0: none)")
    ap.add_argument("--overload-factor", type=int, default=10)
    ap.add_argument("--disconnect-every", type=float, default=45, help="seconds between disconnect waves (0: none)")
    ap.add_argument("--disconnect-wave", type=int, default=100)
    ap.add_argument("--hang-after", type=float, default=120, help="client limit: a request still open then hangs")
    ap.add_argument("--warmup", type=float, default=30)
    ap.add_argument("--host", default=None, help="a running server's root URL (no start, no memory samples)")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--model", default="tiny-mixtral")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    server = sampler = None
    if args.host:
        root, api_key = args.host.rstrip("/"), args.api_key
    else:
        from openai_frontend.server_process import start_server

        api_key = "soak-key"
        server = start_server(tempfile.mkdtemp(prefix="soak-"), [
            "--max-num-seqs", "16", "--max-pending-requests", str(args.max_pending), "--max-model-len", "512",
        ], api_key=api_key, triton_api_key=None)
        root = server.root_url
        sampler = ProcSampler(server.proc.pid, interval=5.0).start()
    try:
        summary = asyncio.run(run(args, root, api_key, args.model))
    finally:
        if sampler is not None:
            summary_rows = sampler.stop()
        if server is not None:
            summary_exit = server.stop()
    if server is not None:
        summary["memory"] = memory_report(summary_rows, args.warmup)
        summary["server_exit_code"] = summary_exit
        summary["server_log"] = str(server.log_path)
    summary["duration_s"] = args.duration
    text = json.dumps(summary, indent=2)
    if args.out:
        Path(args.out).write_text(text)
    print(text)
    failed = (summary["hangs"] or summary["other_5xx"] or summary["streams_without_done"]
              or summary["503_without_retry_after"] or summary["not_allowed"]
              or any(w["kind"] == "disconnect" and w["engine_released_after_s"] is None for w in summary["waves"]))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
