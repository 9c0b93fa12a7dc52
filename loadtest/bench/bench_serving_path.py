#!/usr/bin/env python
"""The serving path alone at GPU rates: the real tritonserver, the moe backend and the API around an engine stand-in.

The engine is replaced by ``moe_engine.standin.StandInEngine`` (moe-serve's hidden ``--standin-engine``): a real
engine thread and step loop inside the real backend that computes nothing and hands out tokens and routed-experts
rows of a realistic shape (48 layers x top-8 of 128 experts, uint8 in the API) as fast as it is asked: every
``--step-interval-ms`` (0: as fast as its loop goes). Everything else is what users run: tritonserver, the python
backend's response thread and IPC, gRPC streaming, the FastAPI frontend, JSON and SSE.

Per endpoint and concurrency C (streams in a closed loop, ``--requests`` each): output tok/s, median TTFT and
inter-token gap of streamed requests, and the CPU time per 1,000 output tokens of each process (the API, i.e. the
moe-serve process; tritonserver; the python backend stub with the stand-in; this client), from /proc. Every
response is checked: token ids equal the stand-in's (where the endpoint returns them), in order, and the decoded
routed experts equal its rows for every position (shape prompt + output - 1).

    .venv/bin/python loadtest/bench/bench_serving_path.py                        # every endpoint, C = 1,16,64,256
    .venv/bin/python loadtest/bench/bench_serving_path.py --endpoints generate-stream,chat-stream --concurrency 64
    .venv/bin/python loadtest/bench/bench_serving_path.py --server-args "--stream-interval 4"

Endpoints: ``generate-stream``/``generate`` (/inference/v1/generate), ``chat-stream``/``chat``
(/v1/chat/completions), ``completions-stream``/``completions`` (/v1/completions), ``grpc-stream``/``grpc`` (the moe
model over Triton gRPC, tritonclient aio, as the API calls it).
"""
from __future__ import annotations

import argparse
import asyncio
import base64
import datetime as dt
import io
import json
import os
import shlex
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "backends"))

import numpy as np  # noqa: E402

from moe_engine.standin import standin_row_table, standin_rows, standin_tokens  # noqa: E402

try:
    import orjson

    loads = orjson.loads
    dumps = orjson.dumps
except ImportError:  # pragma: no cover
    loads = json.loads

    def dumps(x):
        return json.dumps(x).encode()

SHAPE = dict(num_hidden_layers=48, num_local_experts=128, num_experts_per_tok=8)  # Qwen3-30B-A3B's routing
ENDPOINTS = ("generate-stream", "generate", "chat-stream", "chat", "completions-stream", "completions",
             "grpc-stream", "grpc")
# H200, Qwen3-30B-A3B shape, 64 x (1024 + 256) tokens (docs/benchmarks.md, case b): what the path must carry.
H200_B_TOK_S = 3066


def progress(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def standin_checkpoint() -> Path:
    """A config-only checkpoint: the routing shape above, the embedded tiny model's tokenizer (no weights: the
    stand-in loads none)."""
    from moe_engine.tiny import ensure_tiny_checkpoint

    tiny = ensure_tiny_checkpoint()
    path = REPO / "loadtest" / "results" / "checkpoints" / "standin-l48-e128-k8"
    if not (path / "config.json").exists():
        path.mkdir(parents=True, exist_ok=True)
        for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "special_tokens_map.json"):
            if (tiny / name).exists():
                (path / name).write_bytes((tiny / name).read_bytes())
        cfg = json.loads((tiny / "config.json").read_text())
        cfg.update(SHAPE)
        (path / "config.json").write_text(json.dumps(cfg, indent=1))
    return path


# ----------------------------------------------------------------------------- CPU accounting


def _proc_cpu(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        parts = f.read().rsplit(")", 1)[1].split()
    return (int(parts[11]) + int(parts[12])) / os.sysconf("SC_CLK_TCK")


def server_pids(root_pid: int) -> dict[str, int]:
    import psutil

    out = {"api": root_pid}
    for child in psutil.Process(root_pid).children(recursive=True):
        name = child.name()
        if name.startswith("tritonserver"):
            out["tritonserver"] = child.pid
        elif "python_backend_stub" in name or "triton_python" in " ".join(child.cmdline()[:1]):
            out["backend"] = child.pid
    return out


class CpuMeter:
    def __init__(self, pids: dict[str, int]):
        self.pids = dict(pids, client=os.getpid())

    def read(self) -> dict[str, float]:
        return {k: _proc_cpu(p) for k, p in self.pids.items()}


# ----------------------------------------------------------------------------- checks


class Expect:
    """What the stand-in hands out; with ``exact=False`` (a real model) only counts and shapes are checked."""

    def __init__(self, vocab: int, L: int, K: int, E: int, exact: bool = True):
        self.vocab = vocab
        self.table = standin_row_table(L, K, E)
        self.L, self.K, self.E = L, K, E
        self.exact = exact

    def tokens(self, seed: int, n_prompt: int, n_out: int) -> list[int] | None:
        return standin_tokens(seed, n_prompt, n_out, self.vocab) if self.exact else None

    def same_tokens(self, got: list[int], seed: int, n_prompt: int, n_out: int) -> bool:
        return got == self.tokens(seed, n_prompt, n_out) if self.exact else len(got) == n_out

    def check_array(self, arr: np.ndarray, n_prompt: int, n_out: int, what: str) -> None:
        want_shape = (n_prompt + n_out - 1, self.L, self.K)
        if self.exact:
            ok = np.array_equal(arr, standin_rows(self.table, 0, n_prompt + n_out - 1))
        else:
            ok = arr.shape == want_shape and int(arr.max()) < self.E
        if not ok or arr.shape != want_shape:
            raise RuntimeError(f"{what}: routed experts {arr.dtype} {arr.shape} differ from the engine's "
                               f"{want_shape}")

    def check_rows(self, b64: str | None, n_prompt: int, n_out: int, what: str) -> None:
        if b64 is None:
            raise RuntimeError(f"{what}: no routed_experts")
        arr = np.load(io.BytesIO(base64.b64decode(b64)))
        want = standin_rows(self.table, 0, n_prompt + n_out - 1) if self.exact else arr
        if arr.dtype != np.uint8 or arr.shape != want.shape or not np.array_equal(arr, want):
            raise RuntimeError(f"{what}: routed experts {arr.dtype} {arr.shape} differ from the stand-in's "
                               f"{want.shape}")
        self.check_array(arr, n_prompt, n_out, what)


# ----------------------------------------------------------------------------- clients


class Stats:
    def __init__(self):
        self.tokens = 0
        self.requests = 0
        self.ttft: list[float] = []
        self.itl: list[float] = []
        self.events = 0


def _sse_events(buf: bytearray):
    """Complete ``data:`` payloads at the front of ``buf`` (removed from it)."""
    out = []
    while True:
        i = buf.find(b"\n\n")
        if i < 0:
            return out
        block = bytes(buf[:i])
        del buf[: i + 2]
        for line in block.split(b"\n"):
            if line.startswith(b"data: "):
                out.append(line[6:])


async def http_one(session, url: str, endpoint: str, prompt: list[int], seed: int, max_tokens: int,
                   exp: Expect, st: Stats, model: str) -> None:
    stream = endpoint.endswith("-stream")
    kind = endpoint.split("-")[0]
    common = {"max_tokens": max_tokens, "seed": seed, "ignore_eos": True, "temperature": 0.0}
    if kind == "generate":
        body = {"model": model, "token_ids": prompt, "stream": stream,
                "sampling_params": {**common, "return_routed_experts": True}}
        path = "/inference/v1/generate"
    elif kind == "completions":
        body = {"model": model, "prompt": prompt, "stream": stream, "return_routed_experts": True,
                "return_token_ids": True, **common}
        path = "/v1/completions"
    else:
        body = {"model": model, "messages": [{"role": "user", "content": "hello " * 30}], "stream": stream,
                "return_routed_experts": True, **common}
        path = "/v1/chat/completions"
    if stream:
        body["stream_options"] = {"include_usage": True}
    t0 = time.perf_counter()
    first = last = None
    ids: list[int] = []
    routed = None
    usage = None
    n_prompt = len(prompt)
    async with session.post(url + path, data=dumps(body), headers={"content-type": "application/json"}) as r:
        if r.status != 200:
            raise RuntimeError(f"{endpoint}: HTTP {r.status}: {(await r.read())[:300]!r}")
        if stream:
            buf = bytearray()
            async for chunk in r.content.iter_any():
                buf += chunk
                for data in _sse_events(buf):
                    if data == b"[DONE]":
                        continue
                    ev = loads(data)
                    st.events += 1
                    if ev.get("usage"):
                        usage = ev["usage"]
                    for ch in ev.get("choices") or ():
                        got = ch.get("token_ids")
                        if got is None and kind == "chat":
                            got = ch.get("delta", {}).get("content") or None
                        if got:
                            t = time.perf_counter()
                            if first is None:
                                first = t
                                st.ttft.append(t - t0)
                            last = t
                            if kind != "chat":
                                ids.extend(got)
                        if ch.get("routed_experts") is not None:
                            routed = ch["routed_experts"]
        else:
            resp = loads(await r.read())
            ch = resp["choices"][0]
            usage = resp.get("usage")
            ids = ch.get("token_ids") or []
            routed = ch.get("routed_experts")
    if kind == "chat":
        n_prompt, n_out = usage["prompt_tokens"], usage["completion_tokens"]
    else:
        n_out = len(ids)
        if not exp.same_tokens(ids, seed, n_prompt, max_tokens):
            raise RuntimeError(f"{endpoint}: tokens differ from the engine's ({len(ids)})")
    if n_out != max_tokens:
        raise RuntimeError(f"{endpoint}: {n_out} tokens, asked {max_tokens}")
    exp.check_rows(routed, n_prompt, n_out, endpoint)
    st.tokens += n_out
    st.requests += 1
    if stream and first is not None and last is not None and n_out > 1:
        st.itl.append((last - first) / (n_out - 1))


class GrpcClient:
    def __init__(self, url: str, headers: dict):
        import tritonclient.grpc.aio as grpcaio

        self.client = grpcaio.InferenceServerClient(url)
        self.headers = headers

    async def one(self, endpoint: str, prompt: list[int], seed: int, max_tokens: int, exp: Expect, st: Stats):
        import tritonclient.grpc as grpcclient

        def t(name, arr, dtype):
            x = grpcclient.InferInput(name, list(arr.shape), dtype)
            x.set_data_from_numpy(arr)
            return x

        stream = endpoint == "grpc-stream"
        ins = [t("input_ids", np.asarray(prompt, np.int64), "INT64"),
               t("max_tokens", np.array([max_tokens], np.int32), "INT32"),
               t("stream", np.array([stream]), "BOOL"), t("seed", np.array([seed], np.int64), "INT64"),
               t("ignore_eos", np.array([True]), "BOOL"), t("return_routed_experts", np.array([True]), "BOOL")]
        outs = [grpcclient.InferRequestedOutput(n) for n in ("output_ids", "routed_experts", "finish_reason")]

        async def gen():
            yield {"model_name": "moe", "inputs": ins, "outputs": outs, "request_id": f"s{seed}"}

        t0 = time.perf_counter()
        first = last = None
        ids, rows = [], []
        async for result, error in self.client.stream_infer(gen(), headers=self.headers):
            if error is not None:
                raise RuntimeError(f"grpc: {error}")
            got = result.as_numpy("output_ids")
            if got is not None and got.size:
                tnow = time.perf_counter()
                if first is None:
                    first = tnow
                    st.ttft.append(tnow - t0)
                last = tnow
                ids.extend(got.tolist())
            re_ = result.as_numpy("routed_experts")
            if re_ is not None and re_.size:
                rows.append(re_)
            st.events += 1
            fr = result.as_numpy("finish_reason")
            if fr is not None and fr.size and fr.reshape(-1)[0]:
                break
        n = len(prompt)
        if not exp.same_tokens(ids, seed, n, max_tokens):
            raise RuntimeError("grpc: tokens differ from the engine's")
        exp.check_array(np.concatenate(rows), n, max_tokens, "grpc")
        st.tokens += len(ids)
        st.requests += 1
        if stream and len(ids) > 1:
            st.itl.append((last - first) / (len(ids) - 1))

    async def close(self):
        await self.client.close()


async def run_trial(server, endpoint: str, C: int, requests: int, prompt_len: int, max_tokens: int, exp: Expect,
                    meter: CpuMeter, model: str, seed0: int) -> dict:
    import aiohttp

    st = Stats()
    rng = np.random.default_rng(seed0)
    prompts = [rng.integers(3, exp.vocab, prompt_len).tolist() for _ in range(8)]
    conn = aiohttp.TCPConnector(limit=0, force_close=False)
    timeout = aiohttp.ClientTimeout(total=900)
    grpc = GrpcClient(server.triton_grpc_url, server.triton_grpc_headers) if endpoint.startswith("grpc") else None
    async with aiohttp.ClientSession(connector=conn, timeout=timeout) as session:
        async def worker(w: int) -> None:
            for j in range(requests):
                seed = seed0 * 100_000 + w * 1000 + j
                prompt = prompts[(w + j) % len(prompts)]
                if grpc is not None:
                    await grpc.one(endpoint, prompt, seed, max_tokens, exp, st)
                else:
                    await http_one(session, server.root_url, endpoint, prompt, seed, max_tokens, exp, st, model)

        cpu0 = meter.read()
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(w) for w in range(C)))
        wall = time.perf_counter() - t0
        cpu1 = meter.read()
    if grpc is not None:
        await grpc.close()
    cpu = {k: cpu1[k] - cpu0[k] for k in cpu0}
    med = (lambda xs: 1000 * statistics.median(xs) if xs else None)
    return {"endpoint": endpoint, "C": C, "wall_s": wall, "requests": st.requests, "tokens": st.tokens,
            "tok_per_s": st.tokens / wall, "events_per_s": st.events / wall, "tokens_per_event":
            st.tokens / st.events if st.events else None, "ttft_ms": med(st.ttft), "itl_ms": med(st.itl),
            "cpu_s": cpu, "cpu_ms_per_ktok": {k: 1e6 * v / st.tokens for k, v in cpu.items()},
            "cores_busy": sum(cpu.values()) / wall}


def fmt(x, nd=1):
    return "-" if x is None else f"{x:,.{nd}f}"


def table(rows: list[dict]) -> str:
    procs = ("api", "tritonserver", "backend", "client")
    out = ["| endpoint | C | output tok/s | tokens / event | TTFT ms | ITL ms | "
           + " | ".join(f"{p} CPU ms / 1k tok" for p in procs) + " | cores busy |",
           "|---|---:|---:|---:|---:|---:|" + "---:|" * len(procs) + "---:|"]
    for r in rows:
        cp = r["cpu_ms_per_ktok"]
        out.append(f"| {r['endpoint']} | {r['C']} | {fmt(r['tok_per_s'], 0)} | {fmt(r['tokens_per_event'])} | "
                   f"{fmt(r['ttft_ms'])} | {fmt(r['itl_ms'], 2)} | "
                   + " | ".join(fmt(cp.get(p), 0) for p in procs) + f" | {r['cores_busy']:.2f} |")
    return "\n".join(out)


def median_rows(trials: dict) -> list[dict]:
    rows = []
    for key, rs in trials.items():
        rs = sorted(rs, key=lambda r: r["tok_per_s"])
        m = dict(rs[len(rs) // 2])
        m["tok_per_s_all"] = [round(r["tok_per_s"]) for r in rs]
        rows.append(m)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--endpoints", default=",".join(ENDPOINTS))
    ap.add_argument("--concurrency", default="1,16,64,256")
    ap.add_argument("--requests", default="1:8,16:4,64:2,256:1", help="requests per stream and trial, per C")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--step-interval-ms", type=float, default=0.0,
                    help="the stand-in's least time between steps (0: as fast as it goes)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--server-args", default="", help="more moe-serve flags")
    ap.add_argument("--model", default="",
                    help="a real model instead of the stand-in (tiny, medium or a checkpoint dir): counts and shapes "
                         "checked, not values")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    from openai_frontend.server_process import start_server

    endpoints = args.endpoints.split(",")
    conc = [int(c) for c in args.concurrency.split(",")]
    per = dict((int(a), int(b)) for a, b in (x.split(":") for x in args.requests.split(",")))
    work = REPO / "loadtest" / "results" / f"serving_path-{dt.datetime.now():%Y%m%d-%H%M%S}"
    work.mkdir(parents=True, exist_ok=True)
    if args.model:
        from loadtest.bench.common import resolve_model

        path, _ = resolve_model(args.model)
        if path is None:
            from moe_engine.tiny import ensure_tiny_checkpoint

            path = ensure_tiny_checkpoint()
        ckpt = Path(path)
        engine_flags = ["--num-threads", "1", "--max-num-batched-tokens", "512"]
    else:
        ckpt = standin_checkpoint()
        engine_flags = ["--standin-engine", json.dumps({"step_interval_s": args.step_interval_ms / 1000})]
    flags = ["--model", str(ckpt), "--served-model-name", "standin", *engine_flags,
             "--max-num-seqs", str(max(64, max(conc))), "--max-model-len", "1024" if args.model else "4096",
             "--max-pending-requests", str(max(256, max(conc))), *shlex.split(args.server_args)]
    progress(f"load average {os.getloadavg()}; starting moe-serve {' '.join(flags)}")
    server = start_server(work, flags, model_name="standin")
    trials: dict = {}
    try:
        meter = CpuMeter(server_pids(server.proc.pid))
        progress(f"processes {meter.pids}")
        cfg = json.loads((ckpt / "config.json").read_text())
        exp = Expect(cfg["vocab_size"], cfg["num_hidden_layers"], cfg["num_experts_per_tok"],
                     cfg.get("num_local_experts") or cfg.get("num_experts"), exact=not args.model)
        asyncio.run(run_trial(server, endpoints[0], 4, 1, args.prompt_tokens, 16, exp, meter, "standin", 1))
        for rep in range(args.reps):
            order = endpoints[rep % len(endpoints):] + endpoints[: rep % len(endpoints)]
            for ep in order:
                for c in conc:
                    r = asyncio.run(run_trial(server, ep, c, per.get(c, 1), args.prompt_tokens, args.max_tokens,
                                              exp, meter, "standin", 10 + rep))
                    trials.setdefault((ep, c), []).append(r)
                    progress(f"rep {rep + 1} {ep:18s} C={c:<3d} {r['tok_per_s']:8.0f} tok/s "
                             f"{fmt(r['tokens_per_event'])} tok/event  cores {r['cores_busy']:.2f}  "
                             + " ".join(f"{k} {v:.0f}" for k, v in r["cpu_ms_per_ktok"].items()))
    finally:
        rc = server.stop()
    rows = median_rows({k: trials[k] for k in sorted(trials, key=lambda k: (endpoints.index(k[0]), k[1]))})
    print(f"\nstand-in engine, step interval {args.step_interval_ms} ms; {args.prompt_tokens}-token prompts, "
          f"{args.max_tokens} output tokens, routed experts 48 x top-8 of 128 (uint8) checked; medians of "
          f"{args.reps}; server flags {args.server_args!r}; exit {rc}\n")
    print(table(rows))
    print(f"\nH200 engine at (b): {H200_B_TOK_S:,} tok/s over 64 streams; load average {os.getloadavg()}")
    path = Path(args.json) if args.json else work / "serving_path.json"
    path.write_text(json.dumps({"command": " ".join(sys.argv), "rows": rows,
                                "trials": {f"{k[0]}|{k[1]}": v for k, v in trials.items()}}, indent=1))
    progress(f"wrote {path}")


if __name__ == "__main__":
    main()
