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

Issue 19 modes (``--modes``, default all), on one more instance ``C`` started with
``--no-enable-prefix-caching`` so that every request runs its whole prefill (what replay
changes; weights and prompt logprobs take no prefix-cache hits anyway, and the repeated
prompts of a benchmark would otherwise favour the plain variant):

  replay      plain  vs  ``replay_routed_experts`` = the prompt rows a first pass returned
              for the same prompt (every MoE layer of every prompt token forced)
  weights     plain  vs  ``return_routed_weights`` (float32 weights beside the ids)
  scoring     ``max_tokens: 1`` plain  vs  + ``prompt_logprobs: 0``  vs  + ``prompt_logprobs: 5``
              (completions only; requests/s is the figure: one output token each)

    .venv/bin/python loadtest/bench/bench_routing_on_off.py                 # medium model, ~12 min
    .venv/bin/python loadtest/bench/bench_routing_on_off.py --modes replay,weights,scoring   # issue 19 only
    .venv/bin/python loadtest/bench/bench_routing_on_off.py --model deep    # 48 layers, top-8: big payloads
    .venv/bin/python loadtest/bench/bench_routing_on_off.py --quick
"""
from __future__ import annotations

import argparse
import base64
import datetime as dt
import io
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: loadtest.* when run by path

import numpy as np  # noqa: E402

from loadtest.bench.bench_layers import (  # noqa: E402
    REPO, ApiLayer, common_args, medians, progress, run_interleaved, server_flags, setup, table, timing, trial,
)
from loadtest.bench.common import decode_routed, fetch_model_info, iter_sse, loadavg, token_prompts  # noqa: E402

MODES = ("routing", "replay", "weights", "scoring")


def npy_b64(arr: np.ndarray) -> str:
    buf = io.BytesIO()
    np.save(buf, arr)
    return base64.b64encode(buf.getvalue()).decode("ascii")


class Issue19Layer(ApiLayer):
    """An ApiLayer whose requests carry issue-19 fields; checks what they must return.

    ``replays``: prompt -> base64 .npy of its prompt rows (replay on); ``weights``: ask for routed weights;
    ``prompt_logprobs``: N (scoring).
    """

    def __init__(self, server, info, stream: bool, name: str, replays: dict | None = None, weights: bool = False,
                 prompt_logprobs: int | None = None):
        super().__init__(server, info, stream=stream, routed=True, name=name)
        self.replays, self.weights, self.prompt_logprobs = replays, weights, prompt_logprobs
        self.body_bytes: list[int] = []  # whole JSON body (non-streaming)

    def one(self, prompt, seed, max_tokens, temperature):
        sp = {"max_tokens": max_tokens, "temperature": temperature, "seed": seed, "ignore_eos": True,
              "return_token_ids": True}
        if self.replays is not None:
            sp["replay_routed_experts"] = self.replays[tuple(prompt)]
        if self.weights:
            sp["return_routed_weights"] = True
        if self.prompt_logprobs is not None:
            sp["prompt_logprobs"] = self.prompt_logprobs
        s = self._session()
        t0 = time.perf_counter()
        first = last = routed = weights = plp = None
        if self.stream:
            body = {"model": self.info.id, "token_ids": list(prompt), "sampling_params": sp, "stream": True}
            out = []
            with s.post(self.root + "/inference/v1/generate", json=body, stream=True, timeout=900) as r:
                r.raise_for_status()
                for tr, ev in iter_sse(r.iter_lines(chunk_size=None)):
                    plp = ev.get("prompt_logprobs") or plp
                    for ch in ev.get("choices") or ():
                        if ch.get("token_ids"):
                            out.extend(ch["token_ids"])
                            last = tr
                            first = first or tr
                        routed = ch.get("routed_experts") or routed
                        weights = ch.get("routed_weights") or weights
        else:
            r = s.post(self.root + "/v1/completions", json={"model": self.info.id, "prompt": list(prompt), **sp},
                       timeout=900)
            r.raise_for_status()
            self.body_bytes.append(len(r.content))
            ch = r.json()["choices"][0]
            out, routed, weights, plp = ch["token_ids"], ch.get("routed_experts"), ch.get("routed_weights"), \
                ch.get("prompt_logprobs")
        t_end = time.perf_counter()
        arr = self.verifier.check(routed, list(prompt), out)
        if self.replays is not None and not np.array_equal(arr[: len(prompt)],
                                                           decode_routed(self.replays[tuple(prompt)])):
            raise RuntimeError(f"{self.name}: the prompt rows are not the replayed ones")
        if self.weights and (weights is None or decode_routed(weights).shape != arr.shape):
            raise RuntimeError(f"{self.name}: routed_weights missing or misaligned")
        if self.prompt_logprobs is not None and (plp is None or len(plp) != len(prompt)):
            raise RuntimeError(f"{self.name}: prompt_logprobs missing")
        self.bytes.append(len(routed) + (len(weights) if weights else 0))
        return timing(t0, first, last, len(out), t_end)


def first_pass_routing(server, info, prompts) -> dict:
    """prompt -> base64 .npy of its prompt rows, as a client that replays a rollout holds them."""
    import requests

    out = {}
    for p in prompts:
        r = requests.post(server.root_url + "/v1/completions", timeout=900, json={
            "model": info.id, "prompt": list(p), "max_tokens": 1, "temperature": 0})
        r.raise_for_status()
        out[tuple(p)] = npy_b64(decode_routed(r.json()["choices"][0]["routed_experts"])[: len(p)])
    return out


def issue19_layers(server, info, prompts, modes) -> list[tuple[str, list, int]]:
    """(label, layers, max_tokens or 0 for --max-tokens) per endpoint and mode group."""
    groups = []
    replays = first_pass_routing(server, info, prompts) if "replay" in modes else None
    for stream, ep in ((True, "generate-stream"), (False, "completions")):
        layers = [Issue19Layer(server, info, stream, f"{ep} plain")]
        if "replay" in modes:
            layers.append(Issue19Layer(server, info, stream, f"{ep} replay", replays=replays))
        if "weights" in modes:
            layers.append(Issue19Layer(server, info, stream, f"{ep} weights", weights=True))
        if len(layers) > 1:
            groups.append((f"{ep} (replay / weights)", layers, 0))
    if "scoring" in modes:
        groups.append(("scoring (completions, max_tokens 1)", [
            Issue19Layer(server, info, False, "score plain"),
            Issue19Layer(server, info, False, "score prompt_logprobs=0", prompt_logprobs=0),
            Issue19Layer(server, info, False, "score prompt_logprobs=5", prompt_logprobs=5),
        ], 1))
    return groups


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common_args(ap)
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of {','.join(MODES)}")
    ap.set_defaults(reps=4)
    args = ap.parse_args()
    modes = [m for m in args.modes.split(",") if m]
    if set(modes) - set(MODES):
        ap.error(f"unknown modes {sorted(set(modes) - set(MODES))}")
    conc, per, ckpt, name, lo, hi = setup(args)

    work = REPO / "loadtest" / "results" / f"bench_routing_on_off-{dt.datetime.now():%Y%m%d-%H%M%S}"
    work.mkdir(parents=True, exist_ok=True)
    load0 = loadavg()
    out = {"command": " ".join(sys.argv), "load_before": load0, "per_worker": per}
    info = None
    if "routing" in modes:
        info = routing_on_off(args, work, conc, per, ckpt, name, lo, hi, out)
    if set(modes) & {"replay", "weights", "scoring"}:
        info = issue19(args, work, conc, per, ckpt, name, lo, hi, modes, out)
    load1 = loadavg()
    print(f"\nmodel {name}: {info.num_hidden_layers} layers, {info.num_experts} experts, top-{info.top_k}; "
          f"prompts {lo}-{hi} tokens, {args.max_tokens} output tokens, torch threads {args.num_threads or 'default'}; "
          f"{args.reps} reps, medians; load average before {load0}, after {load1}")
    out["model"], out["load_after"] = info.__dict__, load1
    path = Path(args.json) if args.json else work / "bench_routing_on_off.json"
    path.write_text(json.dumps(out, indent=1))
    progress(f"wrote {path}")


def report(label: str, trials: dict, layers: list, conc: list[int], out: dict) -> None:
    med = medians(trials)
    names = [ly.name for ly in layers]
    print(f"\n{label}:\n")
    print(table(med, names, conc, names[0]).replace(f"vs {names[0]}", "vs " + names[0].split(" ", 1)[1]))
    sizes = {ly.name: (statistics.mean(ly.bytes) if ly.bytes else 0) for ly in layers}
    print("\nrouted_experts (+ routed_weights) bytes per response (mean): "
          + ", ".join(f"{k}: {v:,.0f}" for k, v in sizes.items()))
    bodies = {ly.name: statistics.mean(ly.body_bytes) for ly in layers if getattr(ly, "body_bytes", None)}
    if bodies:
        print("JSON body bytes per response (mean): " + ", ".join(f"{k}: {v:,.0f}" for k, v in bodies.items()))
    out[label] = {"medians": med, "bytes_mean": sizes, "body_bytes_mean": bodies,
                  "trials": {f"{k[0]}|{k[1]}": v for k, v in trials.items()}}


def routing_on_off(args, work, conc, per, ckpt, name, lo, hi, out):
    from openai_frontend.server_process import start_server

    progress(f"model {name}: starting two moe-serve instances (on, off)")
    on = start_server(work, server_flags(args, ckpt, name), model_name=name)
    off = None
    try:
        off = start_server(work, server_flags(args, ckpt, name, ["--disable-routed-experts"]), model_name=name)
        info_on, info_off = fetch_model_info(on.root_url), fetch_model_info(off.root_url)
        assert info_on.routed_experts_enabled and not info_off.routed_experts_enabled
        prompts = token_prompts(32, lo, hi, info_on.vocab_size, seed=2)
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
            trials = run_interleaved(layers, prompts, conc, per, args.reps, args.max_tokens, args.temperature,
                                     label=f"{ep} ")
            report(ep, trials, layers, conc, out)
    finally:
        out["server_exit_codes_routing"] = [on.stop(), off.stop() if off else None]
    return info_on


def issue19(args, work, conc, per, ckpt, name, lo, hi, modes, out):
    from openai_frontend.server_process import start_server

    progress(f"model {name}: starting moe-serve --no-enable-prefix-caching (replay / weights / scoring)")
    server = start_server(work, server_flags(args, ckpt, name, ["--no-enable-prefix-caching"]), model_name=name)
    try:
        info = fetch_model_info(server.root_url)
        prompts = token_prompts(32, lo, hi, info.vocab_size, seed=2)
        for label, layers, max_tokens in issue19_layers(server, info, prompts, modes):
            progress(f"{label}: warm-up")
            for ly in layers:
                trial(ly, prompts, 4, 1, 8, args.temperature, offset=0)
                ly.bytes.clear()
            trials = run_interleaved(layers, prompts, conc, per, args.reps, max_tokens or args.max_tokens,
                                     args.temperature, label=f"{label} ")
            report(label, trials, layers, conc, out)
    finally:
        out["server_exit_code_issue19"] = server.stop()
    return info


if __name__ == "__main__":
    main()
