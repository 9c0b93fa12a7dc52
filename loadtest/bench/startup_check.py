#!/usr/bin/env python
"""Does each real shape start with no flags on this GPU, and what did it get? (issue 49)

For every ``--shapes`` entry (real_shape_model.py's shapes, random bf16 weights built on the GPU; ``gpt-oss-120b``'s
experts MXFP4, packed, as the published checkpoint): an engine with
``EngineConfig()`` (every default: gpu_memory_utilization, 8,192 tokens per step, 256 sequences, CUDA graphs, fused
kernels), its start-up time, the engine's own account of how memory was divided (the "KV budget" log line), the KV
cache's blocks and tokens, then a short batch served (``--serve`` requests of 128 + 32 tokens) to show the started
engine runs. One shape after the other, each model freed before the next is built.

    python loadtest/bench/startup_check.py --shapes qwen3-30b-a3b,gpt-oss-120b-8l --out $OUT/startup

Output: progress lines, and ``startup.json`` / ``startup.md`` in --out (one row per shape).
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
import time
import traceback
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "backends"))
sys.path.insert(0, str(REPO))
from loadtest.bench import real_shape_model as rsm  # noqa: E402

T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:7.1f} s] {msg}", flush=True)


class EngineLog(logging.Handler):
    """Keeps the engine's start-up lines (the KV budget, the graphs, the kernels warmed)."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        line = record.getMessage()
        self.lines.append(line)
        log(f"  engine: {line[:400]}")


def serve(engine, cfg, n: int) -> dict:
    """n requests of 128 random prompt tokens and 32 greedy output tokens with routed experts, stepped to the end."""
    from moe_engine.core.sequence import Request, SamplingParams

    done, rows = [], []
    g = torch.Generator().manual_seed(0)
    for i in range(n):
        prompt = torch.randint(10, cfg.vocab_size - 10, (128,), generator=g).tolist()

        def on_output(out, _i=i):
            if out.routed_experts is not None:
                rows.append(out.routed_experts.shape[0])
            if out.finished:
                done.append(out.finish_reason)

        engine.add_request(Request(request_id=f"s{i}", prompt_token_ids=prompt, on_output=on_output,
                                   sampling=SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)))
    t = time.perf_counter()
    while len(done) < n and time.perf_counter() - t < 120:
        engine.step()
    engine.step()  # the step in flight (overlapped scheduling) hands out its results
    return {"requests": n, "finished": len(done), "reasons": sorted(set(done)), "routing_rows": sum(rows),
            "seconds": time.perf_counter() - t}


def check(shape: str, device: torch.device, n_serve: int) -> dict:
    from moe_engine.engine import Engine, EngineConfig

    raw = rsm.SHAPES[shape]
    t = time.perf_counter()
    model, cfg = rsm.build_engine_model(raw, device, torch.bfloat16, seed=0, log=log, mxfp4=shape in rsm.MXFP4_ONLY)
    weights = sum(p.nbytes for p in model.parameters())
    log(f"{shape}: {weights / 2**30:.1f} GiB of weights built in {time.perf_counter() - t:.1f} s")
    handler = EngineLog()
    engine_log = logging.getLogger("moe_engine")
    engine_log.addHandler(handler)
    engine_log.setLevel(logging.INFO)
    row = {"shape": shape, "weights_gib": weights / 2**30}
    engine = None
    try:
        t = time.perf_counter()
        engine = Engine(model, cfg, EngineConfig())
        row["startup_s"] = time.perf_counter() - t
        kv = engine.runner.kv
        row.update(kv_cache_gib=kv.nbytes / 2**30, kv_blocks=kv.num_blocks, block_size=kv.block_size,
                   kv_tokens=(kv.num_blocks - 1) * kv.block_size, max_num_seqs=engine.settings.max_num_seqs,
                   step_tokens=engine.settings.step_tokens, status="started")
        log(f"{shape}: started in {row['startup_s']:.1f} s; KV cache {row['kv_cache_gib']:.1f} GiB = "
            f"{row['kv_tokens']:,} tokens")
        if n_serve:
            row["serve"] = serve(engine, cfg, n_serve)
            log(f"{shape}: served {row['serve']}")
    except Exception as err:  # noqa: BLE001 - a shape that does not start is the finding, the next one still runs
        row.update(status="failed", error=f"{type(err).__name__}: {err}")
        log(f"{shape}: FAILED {row['error']}\n{traceback.format_exc()[-2000:]}")
    finally:
        row["engine_log"] = [line for line in handler.lines if line.startswith(("KV budget", "engine:", "captured"))]
        engine_log.removeHandler(handler)
        if engine is not None:
            engine.shutdown()
        del engine, model
        rsm.free_device_memory(device)
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="qwen3-30b-a3b,gpt-oss-120b-8l")
    p.add_argument("--serve", type=int, default=8, help="requests served after the start (0: none)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    device = torch.device(args.device)
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    log(f"start-up check on {gpu}: {args.shapes}")
    rows = []
    for shape in args.shapes.split(","):
        rows.append(check(shape, device, args.serve))
        report = markdown(gpu, rows)
        if args.out:  # after every shape: a run cut short keeps the shapes it finished
            out = Path(args.out)
            out.mkdir(parents=True, exist_ok=True)
            (out / "startup.json").write_text(json.dumps({"gpu": gpu, "rows": rows}, indent=1, default=str))
            (out / "startup.md").write_text(report)
    print(report)
    return 0 if all(r["status"] == "started" for r in rows) else 1


def markdown(gpu: str, rows: list[dict]) -> str:
    lines = [f"# No-flags start-up, {gpu}", "", "| shape | weights | started | start-up | KV cache | KV tokens | served |",
             "|---|---:|---|---:|---:|---:|---|"]
    for r in rows:
        served = r.get("serve") or {}
        lines.append(f"| {r['shape']} | {r['weights_gib']:.1f} GiB | {r['status']} | {r.get('startup_s', 0):.0f} s | "
                     f"{r.get('kv_cache_gib', 0):.1f} GiB | {r.get('kv_tokens', 0):,} | "
                     f"{served.get('finished', '-')}/{served.get('requests', '-')} |")
    lines += ["", *[f"- {r['shape']}: {line}" for r in rows for line in r.get("engine_log", [])]]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
