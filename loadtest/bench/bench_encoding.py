#!/usr/bin/env python
"""Routed-experts encoding benchmark: this project's codec vs vLLM's recipe vs stdlib base64 vs JSON lists.

What it measures
----------------
One response's routed experts for a long request: 32768 tokens x 48 layers x top-8
(the shape of a 32k-token rollout on a Qwen3-235B/DeepSeek-class model), as
uint8 (<= 256 experts; ids drawn from 128 experts) and as uint16 (> 256 experts; ids
drawn from 512). For each, server-side encode and client-side decode, time and bytes:

  encode
    moe-serve codec      ``openai_frontend.routing_codec.RoutedExpertsAccumulator``: the UINT16
                         chunks as they arrive from Triton (64 prefill chunks of 512 rows, as the
                         server's default --max-num-batched-tokens), copied once each (with the
                         uint16 -> uint8 cast) into a preallocated .npy buffer, then pybase64.
                         This is exactly what the server runs.
    vLLM recipe          ``np.concatenate`` of the chunks (given already in the final dtype, as
                         vLLM's scheduler stores them) + ``np.save`` into BytesIO + ``pybase64.b64encode``
                         + ``.decode()`` (vLLM #38939's serializer).
    np.save + stdlib     the same with the standard library's ``base64.b64encode``.
    JSON lists           ``tolist()`` + ``json.dumps`` (vLLM v0.21's nested-list field, #39917).
  decode (client)
    pybase64 + np.load   ``np.load(BytesIO(pybase64.b64decode(s)))``
    stdlib + np.load     ``np.load(BytesIO(base64.b64decode(s)))`` (vLLM's documented decode)
    JSON lists           ``json.loads`` + ``np.asarray(dtype)``

Every decode is checked against the original array. Trials are interleaved (each
repetition runs every method, the order rotating), medians reported; ``min`` too.
Single process, no server: the numbers are CPU time of the codec on this machine.

    .venv/bin/python loadtest/bench/bench_encoding.py            # about 2 min on 2 cores
    .venv/bin/python loadtest/bench/bench_encoding.py --quick    # smaller, seconds
"""
from __future__ import annotations

import argparse
import base64
import datetime as dt
import gc
import io
import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # the repo root: loadtest.* when run by path

import numpy as np  # noqa: E402
import pybase64  # noqa: E402

from moe_engine.config import routed_experts_dtype  # noqa: E402
from openai_frontend.routing_codec import RoutedExpertsAccumulator  # noqa: E402


def chunks_of(arr16: np.ndarray, prefill_chunk: int, decode_rows: int) -> list[np.ndarray]:
    """Split like the engine's per-step outputs: prefill chunks, then one row per decode step."""
    n = arr16.shape[0] - decode_rows
    out = [arr16[i: min(i + prefill_chunk, n)] for i in range(0, n, prefill_chunk)]
    out += [arr16[i: i + 1] for i in range(n, arr16.shape[0])]
    return out


def enc_codec(chunks16, L, K, dtype):
    acc = RoutedExpertsAccumulator(L, K, dtype)
    for c in chunks16:
        acc.add(c)
    b64, _ = acc.encode()
    return b64  # ASCII bytes, spliced into the JSON body as is


def enc_vllm(chunks_native, *_):
    arr = np.concatenate(chunks_native)
    buf = io.BytesIO()
    np.save(buf, arr)
    return pybase64.b64encode(buf.getvalue()).decode("ascii")


def enc_stdlib(chunks_native, *_):
    arr = np.concatenate(chunks_native)
    buf = io.BytesIO()
    np.save(buf, arr)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def enc_json(chunks_native, *_):
    return json.dumps(np.concatenate(chunks_native).tolist(), separators=(",", ":"))


def dec_pybase64(s, dtype):
    return np.load(io.BytesIO(pybase64.b64decode(s)), allow_pickle=False)


def dec_stdlib(s, dtype):
    return np.load(io.BytesIO(base64.b64decode(s)), allow_pickle=False)


def dec_json(s, dtype):
    return np.asarray(json.loads(s), dtype=dtype)


ENCODERS = {"moe-serve codec": enc_codec, "vLLM recipe (np.save + pybase64)": enc_vllm,
            "np.save + stdlib base64": enc_stdlib, "JSON nested lists": enc_json}
# which decoder a client uses for each encoding (the base64 ones are decoded both ways)
DECODERS = {"pybase64 + np.load": dec_pybase64, "stdlib base64 + np.load": dec_stdlib, "JSON lists": dec_json}


def timed(fn, *a):
    gc.collect()
    t0 = time.perf_counter()
    r = fn(*a)
    return time.perf_counter() - t0, r


def run_case(label, tokens, L, K, num_experts, reps, json_reps, prefill_chunk, rng, progress):
    dtype = np.dtype(routed_experts_dtype(num_experts))
    # Random ids (the codecs' cost does not depend on the values).
    arr16 = rng.integers(0, num_experts, (tokens, L, K)).astype(np.uint16)
    ref = arr16.astype(dtype)
    chunks16 = chunks_of(arr16, prefill_chunk, decode_rows=min(64, tokens // 2))
    chunks_native = [c.astype(dtype) for c in chunks16]
    res = {m: {"encode_s": [], "bytes": None} for m in ENCODERS}
    outputs = {}
    order = list(ENCODERS)
    for rep in range(reps):
        order = order[1:] + order[:1]
        for m in order:
            if m == "JSON nested lists" and rep >= json_reps:
                continue
            src = chunks16 if m == "moe-serve codec" else chunks_native
            t, out = timed(ENCODERS[m], src, L, K, dtype)
            res[m]["encode_s"].append(t)
            res[m]["bytes"] = len(out)
            outputs[m] = out if rep == 0 else outputs.get(m)
            del out
            progress(f"{label} encode rep {rep + 1}/{reps}: {m} {res[m]['encode_s'][-1] * 1000:.1f} ms")
    # The codec must write exactly the bytes of vLLM's np.save + base64 (same wire format).
    codec_out = outputs["moe-serve codec"]
    same_bytes = (codec_out.decode("ascii") if isinstance(codec_out, bytes) else codec_out) == \
        outputs["vLLM recipe (np.save + pybase64)"]
    if not same_bytes:
        raise SystemExit(f"{label}: the codec's output differs from np.save + base64")
    # Client decode of the base64 .npy string (identical for every base64 encoder) and of the JSON.
    inputs = {"pybase64 + np.load": codec_out, "stdlib base64 + np.load": codec_out,
              "JSON lists": outputs["JSON nested lists"]}
    dec = {d: [] for d in DECODERS}
    order = list(DECODERS)
    for rep in range(reps):
        order = order[1:] + order[:1]
        for d in order:
            if d == "JSON lists" and rep >= json_reps:
                continue
            td, back = timed(DECODERS[d], inputs[d], dtype)
            if back.dtype != dtype or not np.array_equal(back, ref):
                raise SystemExit(f"{label}: {d} does not round-trip")
            dec[d].append(td)
            del back
        progress(f"{label} decode rep {rep + 1}/{reps}")
    return {
        "label": label, "shape": [tokens, L, K], "num_experts": num_experts, "dtype": str(dtype),
        "raw_bytes": int(ref.nbytes), "chunks": len(chunks16), "codec_bytes_equal_np_save_base64": same_bytes,
        "encode": {m: {"median_ms": 1000 * statistics.median(v["encode_s"]), "min_ms": 1000 * min(v["encode_s"]),
                       "n": len(v["encode_s"]), "bytes": v["bytes"]} for m, v in res.items()},
        "decode": {d: {"median_ms": 1000 * statistics.median(v), "min_ms": 1000 * min(v), "n": len(v)}
                   for d, v in dec.items()},
    }


def table(results) -> str:
    out = []
    for r in results:
        t, L, K = r["shape"]
        out.append(f"\n**{r['label']}**: {t} tokens x {L} layers x top-{K}, {r['num_experts']} experts, "
                   f"{r['dtype']}, raw {r['raw_bytes'] / 2**20:.1f} MiB, {r['chunks']} chunks from the engine\n")
        out.append("| encode (server) | median ms | min ms | size MiB | x codec time |")
        out.append("|---|---|---|---|---|")
        base = r["encode"]["moe-serve codec"]["median_ms"]
        for m, v in r["encode"].items():
            out.append(f"| {m} | {v['median_ms']:.1f} | {v['min_ms']:.1f} | {v['bytes'] / 2**20:.2f} | "
                       f"{v['median_ms'] / base:.2f} |")
        out.append("")
        out.append("| decode (client; the base64 string is the same for every base64 encoder) | median ms | min ms |")
        out.append("|---|---|---|")
        for m, v in r["decode"].items():
            out.append(f"| {m} | {v['median_ms']:.1f} | {v['min_ms']:.1f} |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--reps", type=int, default=11)
    ap.add_argument("--json-reps", type=int, default=3, help="JSON lists are slow: fewer repetitions")
    ap.add_argument("--prefill-chunk", type=int, default=512)
    ap.add_argument("--quick", action="store_true", help="4096 tokens, 3 reps")
    ap.add_argument("--json", default="", help="write results here (default loadtest/results/bench_encoding-<ts>.json)")
    args = ap.parse_args()
    if args.quick:
        args.tokens, args.reps, args.json_reps = 4096, 3, 2

    def progress(msg):
        print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)

    load0 = os.getloadavg()
    progress(f"load average {load0}")
    rng = np.random.default_rng(0)
    results = [
        run_case("uint8 (<= 256 experts)", args.tokens, args.layers, args.top_k, 128, args.reps, args.json_reps,
                 args.prefill_chunk, rng, progress),
        run_case("uint16 (> 256 experts)", args.tokens, args.layers, args.top_k, 512, args.reps, args.json_reps,
                 args.prefill_chunk, rng, progress),
    ]
    load1 = os.getloadavg()
    md = table(results)
    print(md)
    print(f"\nload average before {tuple(round(x, 2) for x in load0)}, after {tuple(round(x, 2) for x in load1)}")
    stamp = f"{dt.datetime.now():%Y%m%d-%H%M%S}"
    path = Path(args.json) if args.json else REPO / "loadtest" / "results" / f"bench_encoding-{stamp}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"command": " ".join(sys.argv), "load_before": load0, "load_after": load1,
                                "results": results}, indent=1))
    progress(f"wrote {path}")


if __name__ == "__main__":
    main()
