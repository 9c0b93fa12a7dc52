#!/usr/bin/env python
"""Routed experts on vs off, end to end through the OpenAI-compatible API.

What it measures
----------------
Two moe-serve instances on the same checkpoint and flags run side by side: ``A`` with
routed experts on (the default), ``B`` started with ``--disable-routed-experts`` (no
capture work in the engine at all). The same requests as ``bench_layers.py`` (token-id
prompts of 64-192 tokens, 64 output tokens, seeded sampling) go through

  on              A, routed experts returned (every response's array checked)
  off (request)   A, ``return_routed_experts: false`` on each request (per-request opt-out)
  off (server)    B, server-wide off

for two endpoints: ``/inference/v1/generate`` streaming (SSE) and ``/v1/completions``
non-streaming, at concurrency 1 and 16. Output tokens/s and latency per output token;
trials interleaved (each repetition runs every variant, order rotating), medians. The
idle instance costs next to nothing while the other is measured. Bytes: the mean size of
the ``routed_experts`` string per response.

    .venv/bin/python loadtest/bench_routing_on_off.py                 # medium model, ~6 min
    .venv/bin/python loadtest/bench_routing_on_off.py --model deep    # 48 layers, top-8: big payloads
    .venv/bin/python loadtest/bench_routing_on_off.py --quick
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_layers import (  # noqa: E402
    REPO, ApiLayer, common_args, medians, progress, run_interleaved, server_flags, setup, table, trial,
)
from common import fetch_model_info, loadavg, token_prompts  # noqa: E402

sys.path.insert(0, str(REPO))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common_args(ap)
    ap.set_defaults(reps=4)
    args = ap.parse_args()
    conc, per, ckpt, name, lo, hi = setup(args)
    from openai_frontend.server_process import start_server

    work = HERE / "results" / f"bench_routing_on_off-{dt.datetime.now():%Y%m%d-%H%M%S}"
    work.mkdir(parents=True, exist_ok=True)
    load0 = loadavg()
    progress(f"load average {load0}; model {name}; starting two moe-serve instances (on, off)")
    on = start_server(work, server_flags(args, ckpt, name), model_name=name)
    off = None
    try:
        off = start_server(work, server_flags(args, ckpt, name, ["--disable-routed-experts"]), model_name=name)
        info_on, info_off = fetch_model_info(on.root_url), fetch_model_info(off.root_url)
        assert info_on.routed_experts_enabled and not info_off.routed_experts_enabled
        prompts = token_prompts(32, lo, hi, info_on.vocab_size, seed=2)
        results, layer_sets = {}, {}
        for stream, ep in ((True, "generate-stream"), (False, "completions")):
            layers = [
                ApiLayer(on, info_on, stream=stream, routed=True, name=f"{ep} on"),
                ApiLayer(on, info_on, stream=stream, routed=False, name=f"{ep} off (request)"),
                ApiLayer(off, info_off, stream=stream, routed=None, name=f"{ep} off (server)"),
            ]
            progress(f"{ep}: warm-up")
            for ly in layers:
                trial(ly, prompts, 4, 1, 8, args.temperature, offset=0)
                ly.bytes.clear()
            results[ep] = run_interleaved(layers, prompts, conc, per, args.reps, args.max_tokens, args.temperature,
                                          label=f"{ep} ")
            layer_sets[ep] = layers
    finally:
        rc_on = on.stop()
        rc_off = off.stop() if off else None
    load1 = loadavg()
    print(f"\nmodel {name}: {info_on.num_hidden_layers} layers, {info_on.num_experts} experts, top-{info_on.top_k}; "
          f"prompts {lo}-{hi} tokens, {args.max_tokens} output tokens, torch threads {args.num_threads or 'default'}; "
          f"{args.reps} reps, medians")
    out = {"command": " ".join(sys.argv), "model": info_on.__dict__, "load_before": load0, "per_worker": per}
    for ep, trials in results.items():
        med = medians(trials)
        names = [ly.name for ly in layer_sets[ep]]
        print(f"\n{ep}:\n")
        print(table(med, names, conc, f"{ep} on").replace(f"vs {ep} on", "vs on"))
        sizes = {ly.name: (statistics.mean(ly.bytes) if ly.bytes else 0) for ly in layer_sets[ep]}
        print("\nrouted_experts bytes per response (mean): "
              + ", ".join(f"{k}: {v:,.0f}" for k, v in sizes.items()))
        out[ep] = {"medians": med, "bytes_mean": sizes,
                   "trials": {f"{k[0]}|{k[1]}": v for k, v in trials.items()}}
    print(f"\nserver exit codes: on {rc_on}, off {rc_off}; load average before {load0}, after {load1}")
    out["load_after"] = load1
    path = Path(args.json) if args.json else work / "bench_routing_on_off.json"
    path.write_text(json.dumps(out, indent=1))
    progress(f"wrote {path}")


if __name__ == "__main__":
    main()
