#!/usr/bin/env python
"""Faults under load: kill or stop the backend while clients keep sending, and check that nothing hangs.

    .venv/bin/python loadtest/load/fault_injection.py                          # 3 faults, one of each kind
    .venv/bin/python loadtest/load/fault_injection.py --faults kill-stub,stop-stub,kill-triton,stop-triton --every 40

Starts its own moe-serve (Triton private, ``--max-backend-restarts`` high enough for every fault) on the
embedded tiny model and runs ``--concurrency`` closed-loop clients of mixed requests (traffic.py). Every
``--every`` seconds it injects the next fault:

  kill-stub    kill -9 of triton_python_backend_stub      stop-stub    kill -STOP of the stub
  kill-triton  kill -9 of tritonserver                    stop-triton  kill -STOP of tritonserver

and measures, per fault: when the requests that were in flight ended (all must, with a 503
``backend_unavailable`` or an SSE error event then [DONE]), how long /health stayed 503, and whether the
shared-memory regions of the killed server are gone. At the end: SIGTERM, exit code 0, no process of the
server left. Outcomes of all requests are checked as in soak.py. Writes ``--out`` (JSON), exit status 1
on any hang, unexpected status, leaked region or process.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: loadtest.* when run by path

import psutil  # noqa: E402

from loadtest.load.traffic import Traffic  # noqa: E402

FAULTS = {
    "kill-stub": ("triton_python_backend_stub", signal.SIGKILL),
    "stop-stub": ("triton_python_backend_stub", signal.SIGSTOP),
    "kill-triton": ("tritonserver", signal.SIGKILL),
    "stop-triton": ("tritonserver", signal.SIGSTOP),
}


def server_tree(pid: int) -> dict[str, psutil.Process]:
    return {p.name(): p for p in psutil.Process(pid).children(recursive=True)}


def shm_prefix(pid: int) -> str | None:
    triton = server_tree(pid).get("tritonserver")
    if triton is None:
        return None
    return next(a for a in triton.cmdline() if "shm-region-prefix-name=" in a).split("=")[-1]


async def run(args, server) -> dict:
    traffic = Traffic(server.root_url, server.api_key, "tiny-mixtral", hang_after_s=args.hang_after)
    t_start = time.monotonic()
    faults = [f.strip() for f in args.faults.split(",") if f.strip()]
    stop_at = t_start + args.every * (len(faults) + 1)
    results = []

    async def inject():
        for k, fault in enumerate(faults, start=1):
            await asyncio.sleep(max(0.0, t_start + k * args.every - time.monotonic()))
            name, sig = FAULTS[fault]
            while await traffic.health() != 200:  # the previous fault's recovery first
                await asyncio.sleep(0.5)
            proc = server_tree(server.proc.pid)[name]
            prefix = shm_prefix(server.proc.pid)
            regions = sorted(Path("/dev/shm").glob(prefix + "*"))
            at = time.monotonic()
            in_flight_before = len(traffic.ledger.outcomes)
            proc.send_signal(sig)
            # Health: 503 from when, back to 200 when.
            first_503 = back = None
            while time.monotonic() - at < 300:
                h = await traffic.health()
                if h == 503 and first_503 is None:
                    first_503 = time.monotonic() - at
                if h == 200 and first_503 is not None:
                    back = time.monotonic() - at
                    break
                await asyncio.sleep(0.2)
            # Requests that were running when the fault hit: started before `at`, ended after it.
            hit = [o for o in traffic.ledger.outcomes[in_flight_before:] if o.start < at]
            results.append({
                "fault": fault, "at_s": round(at - t_start, 1), "pid": proc.pid,
                "health_503_after_s": None if first_503 is None else round(first_503, 2),
                "healthy_again_after_s": None if back is None else round(back, 1),
                "in_flight_hit": len(hit),
                "in_flight_codes": sorted({f"{o.status}:{o.code}" for o in hit}),
                "in_flight_ended_within_s": round(max((o.end - at for o in hit), default=0.0), 2),
                "old_regions_left": sum(r.exists() for r in regions),
            })

    await asyncio.gather(traffic.workers(args.concurrency, stop_at), inject())
    await traffic.aclose()
    summary = traffic.ledger.summary()
    summary["faults"] = results
    return summary


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--faults", default="kill-stub,stop-stub,kill-triton")
    ap.add_argument("--every", type=float, default=40.0, help="seconds between faults (recovery included)")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--hang-after", type=float, default=120.0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    from openai_frontend.server_process import start_server

    n = len([f for f in args.faults.split(",") if f.strip()])
    server = start_server(tempfile.mkdtemp(prefix="faults-"), [
        "--max-num-seqs", "16", "--max-pending-requests", "64", "--max-model-len", "512",
        "--max-backend-restarts", str(n + 1),
    ], api_key="faults-key", triton_api_key=None)
    processes = [server.proc, *psutil.Process(server.proc.pid).children(recursive=True)]
    try:
        summary = asyncio.run(run(args, server))
        processes += psutil.Process(server.proc.pid).children(recursive=True)
        prefix = shm_prefix(server.proc.pid)
    finally:
        code = server.stop()
    time.sleep(1.0)
    left = [p.pid for p in processes if isinstance(p, psutil.Process) and p.is_running()
            and p.status() != psutil.STATUS_ZOMBIE]
    summary.update(server_exit_code=code, processes_left=left, server_log=str(server.log_path),
                   regions_left_after_stop=len(list(Path("/dev/shm").glob(prefix + "*"))) if prefix else None)
    text = json.dumps(summary, indent=2)
    if args.out:
        Path(args.out).write_text(text)
    print(text)
    failed = (summary["hangs"] or summary["other_5xx"] or summary["streams_without_done"] or summary["not_allowed"]
              or code != 0 or left or summary["regions_left_after_stop"]
              or any(f["healthy_again_after_s"] is None or f["old_regions_left"] or f["in_flight_ended_within_s"] > 5
                     for f in summary["faults"]))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
