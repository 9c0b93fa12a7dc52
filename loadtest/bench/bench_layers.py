#!/usr/bin/env python
"""Overhead of each layer: engine in-process vs Triton gRPC direct vs the OpenAI-compatible API.

What it measures
----------------
The same requests (token-id prompts of 64-192 tokens, fixed seed; 64 output tokens
with ignore_eos; seeded sampling at temperature 1; routed experts on) through:

  engine          ``moe_engine.Engine`` in this process, its own thread (as the Triton backend
                  runs it), same checkpoint, same EngineConfig and torch threads as the server;
                  results arrive in the engine's per-step callback.
  triton-grpc-stream   tritonclient (Python, aio) gRPC bidirectional stream to the ``moe`` model
                       of a running moe-serve, ``stream=true``: a response per engine step (or per
                       few steps: the backend paces its responses); a stream per request.
  api-generate-stream  POST /inference/v1/generate with ``stream: true`` (SSE), token ids in/out.
  triton-grpc          as triton-grpc-stream with ``stream=false``: one response at the end.
  api-completions      POST /v1/completions, non-streaming, the prompt as token ids,
                       ``return_token_ids`` (the frontend asks Triton for one response).

at concurrency 1 and 16 (C client threads, closed loop: each sends its next request when
the previous one ends; R requests per thread; the threads hand the HTTP and gRPC work to one asyncio loop,
as one efficient client process would do it). Per trial: output tokens/s (all output
tokens / wall time of the trial) and, per request, latency per output token
(end-to-end / output tokens), time to first token and inter-token latency where the layer
streams. Every response's routed experts are checked (shape (prompt + output - 1, layers,
top_k), ids < num_experts). Trials are interleaved: every repetition runs every layer at
every concurrency, the layer order rotating; tables show medians over repetitions (of
per-trial medians for the per-request figures).

The server runs beside this process (idle while the in-process engine is measured, and
vice versa). On the 2-core machine the client threads share the CPU with the server,
as real clients on the same host would.

    .venv/bin/python loadtest/bench/bench_layers.py                 # medium model, about 6 min
    .venv/bin/python loadtest/bench/bench_layers.py --model tiny    # engine cost small: overhead dominates
    .venv/bin/python loadtest/bench/bench_layers.py --quick
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import queue
import statistics
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # the repo root: loadtest.* when run by path
sys.path.insert(0, str(REPO / "backends"))

import numpy as np  # noqa: E402

from loadtest.bench.common import fetch_model_info, loadavg, resolve_model, token_prompts  # noqa: E402


@dataclass
class Result:
    e2e: float
    ttft: float | None
    itl: float | None
    n_out: int


def progress(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def check_rows(rows: np.ndarray | None, n_prompt: int, n_out: int, L: int, K: int, E: int, what: str) -> None:
    if rows is None or rows.shape != (n_prompt + n_out - 1, L, K) or (rows.size and int(rows.max()) >= E):
        raise RuntimeError(f"{what}: bad routed experts {None if rows is None else rows.shape}")


def timing(t0, t_first, t_last, n, t_end) -> Result:
    itl = (t_last - t_first) / (n - 1) if (t_first is not None and n > 1) else None
    return Result(t_end - t0, None if t_first is None else t_first - t0, itl, n)


# ----------------------------------------------------------------------------- layers


class EngineLayer:
    name = "engine"

    def __init__(self, ckpt: str, args, routed: bool = True):
        import torch

        from moe_engine.checkpoint import load_model
        from moe_engine.config import load_config
        from moe_engine.engine import Engine, EngineConfig

        if args.num_threads:
            torch.set_num_threads(args.num_threads)
        self.cfg = load_config(ckpt)
        model = load_model(ckpt, dtype="float32", device="cpu", progress=False)
        self.engine = Engine(model, self.cfg, EngineConfig(
            max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
            max_num_batched_tokens=args.max_num_batched_tokens, enable_routed_experts=routed))
        self.engine.start()
        self.routed = routed

    def one(self, prompt, seed, max_tokens, temperature) -> Result:
        from moe_engine.engine import Request
        from moe_engine.core.sampling import SamplingParams

        done = threading.Event()
        st = {"first": None, "last": None, "n": 0, "rows": [], "err": None}

        def cb(out):
            t = time.perf_counter()
            if out.new_token_ids:
                st["n"] += len(out.new_token_ids)
                st["last"] = t
                if st["first"] is None:
                    st["first"] = t
            if out.routed_experts is not None:
                st["rows"].append(out.routed_experts)
            if out.finished:
                st["err"] = out.error
                st["end"] = t
                done.set()

        t0 = time.perf_counter()
        self.engine.add_request(Request(
            request_id=self.engine.new_request_id(), prompt_token_ids=list(prompt),
            sampling=SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed, ignore_eos=True),
            return_routed_experts=self.routed, on_output=cb))
        done.wait()
        if st["err"]:
            raise RuntimeError(st["err"])
        if self.routed:
            c = self.cfg
            check_rows(np.concatenate(st["rows"]), len(prompt), st["n"], c.num_hidden_layers, c.num_experts_per_tok,
                       c.num_experts, "engine")
        return timing(t0, st["first"], st["last"], st["n"], st["end"])

    def close(self):
        self.engine.shutdown()


class AsyncClients:
    """One event loop on its own thread that every client thread of a trial hands its request to: the clients'
    HTTP and gRPC work is asyncio (aiohttp with its C parser, tritonclient's aio gRPC), not a Python thread per
    stream parsing its own socket. The clients share the machine with the server, so their CPU counts against the
    server's: at 64 streams a thread per stream with ``requests`` cost the server more than the API itself did
    (loadtest/reports/serving_path.md)."""

    _loop = None
    _lock = threading.Lock()  # the first trial's threads arrive together: one loop, or a client bound to another

    @classmethod
    def run(cls, coro):
        import asyncio

        with cls._lock:
            if cls._loop is None:
                cls._loop = asyncio.new_event_loop()
                threading.Thread(target=cls._loop.run_forever, name="bench-clients", daemon=True).start()
        return asyncio.run_coroutine_threadsafe(coro, cls._loop).result()


class GrpcLayer:
    def __init__(self, server, info, routed: bool = True, stream: bool = True):
        self.url = server.triton_grpc_url
        self.headers = server.triton_grpc_headers  # moe-serve's per-run Triton key
        self.info = info
        self.routed = routed
        self.stream = stream
        self.name = "triton-grpc" + ("-stream" if stream else "")
        self.client = None
        self.lock = threading.Lock()
        self.ids = 0

    def one(self, prompt, seed, max_tokens, temperature) -> Result:
        with self.lock:
            self.ids += 1
            rid = f"b{self.ids}"
        return AsyncClients.run(self._one(prompt, seed, max_tokens, temperature, rid))

    async def _one(self, prompt, seed, max_tokens, temperature, rid) -> Result:
        import tritonclient.grpc as grpcclient
        import tritonclient.grpc.aio as grpcaio

        if self.client is None:
            self.client = grpcaio.InferenceServerClient(self.url)

        def t(name, v, dt_, np_dt):
            a = np.asarray(v, dtype=np_dt)
            x = grpcclient.InferInput(name, list(a.shape), dt_)
            x.set_data_from_numpy(a)
            return x

        ins = [t("input_ids", prompt, "INT64", np.int64), t("max_tokens", [max_tokens], "INT32", np.int32),
               t("stream", [self.stream], "BOOL", bool), t("temperature", [temperature], "FP32", np.float32),
               t("seed", [seed], "INT64", np.int64), t("ignore_eos", [True], "BOOL", bool),
               t("return_routed_experts", [self.routed], "BOOL", bool)]
        outs = [grpcclient.InferRequestedOutput(n) for n in ("output_ids", "routed_experts", "finish_reason")]

        async def gen():
            yield {"model_name": "moe", "inputs": ins, "outputs": outs, "request_id": rid}

        t0 = time.perf_counter()
        n, first, last, rows = 0, None, None, []
        async for result, error in self.client.stream_infer(gen(), headers=self.headers):
            if error is not None:
                raise RuntimeError(f"triton: {error}")
            tr = time.perf_counter()
            ids = result.as_numpy("output_ids")
            if ids is not None and ids.size:
                n += ids.size
                last = tr
                first = first or tr
            re_ = result.as_numpy("routed_experts")
            if re_ is not None and re_.size:
                rows.append(re_)
            fr = result.as_numpy("finish_reason")
            if fr is not None and fr.size and fr.reshape(-1)[0]:
                break  # the backend's last response (aio has no final flag)
        t_end = time.perf_counter()
        if not self.stream:  # one response: no first token before the end, no inter-token gaps
            first = last = None
        if self.routed:
            i = self.info
            check_rows(np.concatenate(rows), len(prompt), n, i.num_hidden_layers, i.top_k, i.num_experts, "grpc")
        return timing(t0, first, last, n, t_end)

    def close(self):
        if self.client is not None:
            AsyncClients.run(self.client.close())


class ApiLayer:
    """stream=True: /inference/v1/generate SSE; stream=False: /v1/completions with a token-id prompt."""

    def __init__(self, server, info, stream: bool, routed: bool | None = True, name: str | None = None):
        from loadtest.bench.common import RoutingVerifier

        self.root = server.root_url
        self.info = info
        self.stream = stream
        self.routed = routed  # None: leave the server's default
        self.name = name or ("api-generate-stream" if stream else "api-completions")
        self.verifier = RoutingVerifier(info, consistency=False)
        self.bytes = []
        self.session = None

    def one(self, prompt, seed, max_tokens, temperature) -> Result:
        return AsyncClients.run(self._one(prompt, seed, max_tokens, temperature))

    async def _one(self, prompt, seed, max_tokens, temperature) -> Result:
        import aiohttp

        if self.session is None:
            self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                                 timeout=aiohttp.ClientTimeout(total=900))
        sp = {"max_tokens": max_tokens, "temperature": temperature, "seed": seed, "ignore_eos": True,
              "return_token_ids": True}
        if self.routed is not None:
            sp["return_routed_experts"] = self.routed
        t0 = time.perf_counter()
        if self.stream:
            body = {"model": self.info.id, "token_ids": list(prompt), "sampling_params": sp, "stream": True}
            out, first, last, routed = [], None, None, None
            async with self.session.post(self.root + "/inference/v1/generate", data=_dumps(body),
                                         headers=_JSON) as r:
                r.raise_for_status()
                buf = bytearray()
                async for chunk in r.content.iter_any():
                    buf += chunk
                    tr = time.perf_counter()
                    for data in _sse_events(buf):
                        if data == b"[DONE]":
                            continue
                        ev = _loads(data)
                        if "error" in ev:
                            raise RuntimeError(f"SSE error event: {ev}")
                        for ch in ev.get("choices") or ():
                            if ch.get("token_ids"):
                                out.extend(ch["token_ids"])
                                last = tr
                                first = first or tr
                            if ch.get("routed_experts") is not None:
                                routed = ch["routed_experts"]
            t_end = time.perf_counter()
        else:
            body = {"model": self.info.id, "prompt": list(prompt), **sp}
            async with self.session.post(self.root + "/v1/completions", data=_dumps(body), headers=_JSON) as r:
                r.raise_for_status()
                ch = _loads(await r.read())["choices"][0]
            t_end = time.perf_counter()
            out, first, last, routed = ch["token_ids"], None, None, ch.get("routed_experts")
        if self.routed is False or not self.info.routed_experts_enabled:
            if routed is not None:
                raise RuntimeError(f"{self.name}: routed_experts returned although off")
        else:
            self.verifier.check(routed, list(prompt), out)
        self.bytes.append(len(routed) if routed else 0)
        return timing(t0, first, last, len(out), t_end)

    def close(self):
        if self.session is not None:
            AsyncClients.run(self.session.close())


try:
    import orjson

    _loads, _dumps = orjson.loads, orjson.dumps
except ImportError:  # pragma: no cover
    _loads = json.loads

    def _dumps(x):
        return json.dumps(x).encode()


_JSON = {"content-type": "application/json"}


def _sse_events(buf: bytearray) -> list[bytes]:
    """The complete ``data:`` payloads at the front of ``buf`` (taken out of it)."""
    out = []
    while (i := buf.find(b"\n\n")) >= 0:
        block = bytes(buf[:i])
        del buf[: i + 2]
        out.extend(line[6:] for line in block.split(b"\n") if line.startswith(b"data: "))
    return out


# ----------------------------------------------------------------------------- trials


def trial(layer, prompts, C: int, per_worker: int, max_tokens: int, temperature: float, offset: int) -> dict:
    results: list[Result] = []
    errors: list[str] = []
    lock = threading.Lock()
    barrier = threading.Barrier(C + 1)

    def worker(w):
        barrier.wait()
        for j in range(per_worker):
            i = (offset + w * per_worker + j) % len(prompts)
            try:
                r = layer.one(prompts[i], 1000 + i, max_tokens, temperature)
            except Exception as e:  # noqa: BLE001
                with lock:
                    errors.append(f"{type(e).__name__}: {e}")
                continue
            with lock:
                results.append(r)

    ths = [threading.Thread(target=worker, args=(w,), daemon=True) for w in range(C)]
    for t in ths:
        t.start()
    barrier.wait()
    t0 = time.perf_counter()
    for t in ths:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise RuntimeError(f"{layer.name} C={C}: {len(errors)} errors, e.g. {errors[0]}")
    med = (lambda xs: statistics.median(xs) if xs else None)
    return {
        "wall_s": wall, "requests": len(results),
        "tok_per_s": sum(r.n_out for r in results) / wall,
        "ms_per_token": med([1000 * r.e2e / r.n_out for r in results]),
        "e2e_ms": med([1000 * r.e2e for r in results]),
        "ttft_ms": med([1000 * r.ttft for r in results if r.ttft is not None]),
        "itl_ms": med([1000 * r.itl for r in results if r.itl is not None]),
    }


def run_interleaved(layers, prompts, conc, per_worker, reps, max_tokens, temperature, label="") -> dict:
    trials: dict = {(ly.name, c): [] for ly in layers for c in conc}
    order = list(layers)
    for rep in range(reps):
        order = order[1:] + order[:1]
        for ly in order:
            for c in conc:
                r = trial(ly, prompts, c, per_worker[c], max_tokens, temperature, offset=rep * 7)
                trials[(ly.name, c)].append(r)
                progress(f"{label}rep {rep + 1}/{reps} {ly.name:16s} C={c:<3d} {r['tok_per_s']:7.1f} tok/s  "
                         f"{r['ms_per_token']:6.1f} ms/token  ({r['requests']} requests, {r['wall_s']:.1f} s)")
    return trials


def medians(trials: dict) -> dict:
    out = {}
    for key, rs in trials.items():
        m = {}
        for f in ("tok_per_s", "ms_per_token", "e2e_ms", "ttft_ms", "itl_ms"):
            xs = [r[f] for r in rs if r[f] is not None]
            m[f] = statistics.median(xs) if xs else None
        m["trials"] = len(rs)
        m["tok_per_s_all"] = [round(r["tok_per_s"], 1) for r in rs]
        out[f"{key[0]}|{key[1]}"] = m
    return out


def fmt(x, nd=1):
    return "-" if x is None else f"{x:,.{nd}f}"


def table(med: dict, names: list[str], conc: list[int], base: str) -> str:
    lines = ["| layer | C | output tok/s | vs " + base + " | ms / output token | vs " + base
             + " | TTFT ms | ITL ms | tok/s per trial |", "|---|---|---|---|---|---|---|---|---|"]
    for c in conc:
        b = med[f"{base}|{c}"]
        for n in names:
            m = med[f"{n}|{c}"]
            lines.append(f"| {n} | {c} | {fmt(m['tok_per_s'])} | {m['tok_per_s'] / b['tok_per_s']:.2f} | "
                         f"{fmt(m['ms_per_token'])} | {m['ms_per_token'] / b['ms_per_token']:.2f} | "
                         f"{fmt(m['ttft_ms'])} | {fmt(m['itl_ms'])} | {m['tok_per_s_all']} |")
    return "\n".join(lines)


def common_args(ap):
    ap.add_argument("--model", default="medium", help="tiny | medium | checkpoint dir (default medium)")
    ap.add_argument("--concurrency", default="1,16")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--requests-per-worker", default="1:6,16:2",
                    help="requests each client thread sends per trial, per concurrency (C:R,...)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompt-tokens", default="64-192")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--num-threads", type=int, default=1,
                    help="engine torch threads, server and in-process alike (default 1; 0 = torch's default)")
    ap.add_argument("--quick", action="store_true", help="2 reps, fewer requests")
    ap.add_argument("--json", default="")


def setup(args):
    from loadtest.bench.common import parse_range

    conc = [int(c) for c in args.concurrency.split(",")]
    per = dict((int(a), int(b)) for a, b in (x.split(":") for x in args.requests_per_worker.split(",")))
    per = {c: per.get(c, 2) for c in conc}
    if args.quick:
        args.reps = 2
        per = {c: max(1, v // 2) for c, v in per.items()}
    ckpt, name = resolve_model(args.model)
    if ckpt is None:
        from moe_engine.tiny import ensure_tiny_checkpoint

        ckpt = str(ensure_tiny_checkpoint())
    lo, hi = parse_range(args.prompt_tokens)
    return conc, per, ckpt, name, lo, hi


def server_flags(args, ckpt, name, extra=()):
    f = ["--model", ckpt, "--served-model-name", name, "--max-num-seqs", str(args.max_num_seqs),
         "--max-model-len", str(args.max_model_len), "--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    if args.num_threads:
        f += ["--num-threads", str(args.num_threads)]
    return f + list(extra)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common_args(ap)
    args = ap.parse_args()
    conc, per, ckpt, name, lo, hi = setup(args)
    from openai_frontend.server_process import start_server

    work = REPO / "loadtest" / "results" / f"bench_layers-{dt.datetime.now():%Y%m%d-%H%M%S}"
    work.mkdir(parents=True, exist_ok=True)
    load0 = loadavg()
    progress(f"load average {load0}; model {name}; starting moe-serve")
    server = start_server(work, server_flags(args, ckpt, name), model_name=name)
    layers = []
    try:
        info = fetch_model_info(server.root_url)
        prompts = token_prompts(32, lo, hi, info.vocab_size, seed=2)
        progress("loading the in-process engine")
        layers = [EngineLayer(ckpt, args), GrpcLayer(server, info, stream=True), ApiLayer(server, info, stream=True),
                  GrpcLayer(server, info, stream=False), ApiLayer(server, info, stream=False)]
        progress("warm-up")
        for ly in layers:
            trial(ly, prompts, 4, 1, 8, args.temperature, offset=0)
        trials = run_interleaved(layers, prompts, conc, per, args.reps, args.max_tokens, args.temperature)
    finally:
        for ly in layers:
            ly.close()
        rc = server.stop()
    load1 = loadavg()
    med = medians(trials)
    names = [ly.name for ly in layers]
    md = table(med, names, conc, "engine")
    print(f"\nmodel {name}: {info.num_hidden_layers} layers, {info.num_experts} experts, top-{info.top_k}; "
          f"prompts {lo}-{hi} tokens, {args.max_tokens} output tokens, torch threads {args.num_threads or 'default'}; "
          f"{args.reps} reps, medians\n")
    print(md)
    print(f"\nserver exit code {rc}; load average before {load0}, after {load1}")
    path = Path(args.json) if args.json else work / "bench_layers.json"
    path.write_text(json.dumps({"command": " ".join(sys.argv), "model": info.__dict__, "load_before": load0,
                                "load_after": load1, "per_worker": per, "medians": med,
                                "trials": {f"{k[0]}|{k[1]}": v for k, v in trials.items()}}, indent=1))
    progress(f"wrote {path}")


if __name__ == "__main__":
    main()
