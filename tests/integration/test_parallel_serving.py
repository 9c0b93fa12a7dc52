"""moe-serve with --tensor-parallel-size 2 and with --data-parallel-size 2 on CPU (gloo), each its own server.

- TP = 2: the same tokens and the same routed experts as the session's one-rank server; the second rank is a
  process under the Triton model instance; when it is killed mid-request the request fails (no hang), the
  watchdog restarts the backend, which serves again with a new rank; SIGTERM leaves no process behind.
- DP = 2: two Triton model instances, each its own engine; concurrent requests reach both (each instance's
  engine gauges on /metrics show steps).
- sizes the model cannot be split into are refused before anything starts.
"""
from __future__ import annotations

import concurrent.futures
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import httpx
import openai
import psutil

from ..unit.parallel_harness import rank_processes
from .conftest import start_moe_serve
from .openai_helpers import decode, extra, wait_until


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key=server.api_key, max_retries=0, timeout=120)


def complete(server, prompt: str, max_tokens: int = 12):
    r = client(server).completions.create(model=server.model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                          extra_body={"return_token_ids": True})
    choice = r.choices[0]
    return extra(choice, "token_ids"), decode(extra(choice, "routed_experts"))


def test_tensor_parallel_server_answers_like_one_rank_and_survives_a_dead_rank(tmp_path, moe_server):
    server = start_moe_serve(tmp_path, ["--tensor-parallel-size", "2"])
    try:
        ranks = rank_processes(server.proc.pid)
        assert len(ranks) == 1
        expected = {}
        for prompt in ("Hello, world", "Mixture of experts routes every token"):
            one_ids, one_rows = expected[prompt] = complete(moe_server, prompt)
            two_ids, two_rows = complete(server, prompt)
            assert two_ids == one_ids
            assert two_rows.shape == one_rows.shape and (two_rows == one_rows).all()

        answer = {}

        def long_request():
            answer["r"] = httpx.post(server.base_url + "/completions", timeout=120,
                                     headers={"Authorization": f"Bearer {server.api_key}"},
                                     json={"prompt": "x", "max_tokens": 1000, "ignore_eos": True})

        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            fut = pool.submit(long_request)
            time.sleep(1.0)
            os.kill(ranks[0].pid, signal.SIGKILL)
            fut.result(60)
        # ended with an error at once, not a hang or a 500
        assert answer["r"].status_code == 503, answer["r"].text
        assert answer["r"].json()["error"]["code"] == "backend_unavailable"
        # moe_engine_alive turned 0, the watchdog restarted the backend: serving again, with a new rank
        assert wait_until(lambda: httpx.get(server.root_url + "/health").status_code == 200
                          and len(rank_processes(server.proc.pid)) == 1, timeout=120)
        assert rank_processes(server.proc.pid)[0].pid != ranks[0].pid
        assert complete(server, "Hello, world")[0] == expected["Hello, world"][0]
        everything = psutil.Process(server.proc.pid).children(recursive=True)
    finally:
        code = server.stop()
    assert code == 0, server.log_tail()
    time.sleep(1.0)
    assert not [p for p in everything if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


def test_data_parallel_replicas_share_concurrent_requests(tmp_path):
    server = start_moe_serve(tmp_path, ["--data-parallel-size", "2"])
    try:
        prompts = [f"Request {i}: the quick brown fox" for i in range(12)]
        with concurrent.futures.ThreadPoolExecutor(12) as pool:
            results = list(pool.map(lambda p: complete(server, p, max_tokens=24), prompts))
        assert all(0 < len(ids) <= 24 for ids, _ in results)
        def steps() -> dict[str, float]:
            with urllib.request.urlopen(server.root_url + "/metrics", timeout=5) as r:
                text = r.read().decode()
            return {m[0]: float(m[1]) for m in re.findall(
                r'^moe_engine_steps\{[^}]*instance="([^"]+)"[^}]*\} (\S+)$', text, re.M)}

        # The backends refresh their gauges every 0.2 s and the API reads Triton's metrics port: wait for both.
        assert wait_until(lambda: len(steps()) == 2 and all(v > 0 for v in steps().values()), timeout=10), steps()

        # A state-changing RL operation would reach one replica only: refused by name, nothing changes; reads work.
        auth = {"Authorization": f"Bearer {server.api_key}"}
        for path, body in (("/update_weights_from_disk", {"model_path": str(tmp_path)}), ("/flush_cache", {}),
                           ("/release_memory_occupation", {})):
            r = httpx.post(server.root_url + path, json=body, headers=auth, timeout=30)
            assert r.status_code == 400 and "data-parallel-size" in r.json()["error"]["message"], (path, r.text)
        r = httpx.get(server.root_url + "/get_weight_version", headers=auth, timeout=30)
        assert r.status_code == 200 and r.json()["weight_version"]
        ids, _ = complete(server, prompts[0], max_tokens=24)  # still serving
        assert 0 < len(ids) <= 24
    finally:
        assert server.stop() == 0, server.log_tail()


def test_sizes_the_model_cannot_take_are_one_line_errors():
    moe_serve = str(Path(sys.executable).parent / "moe-serve")
    for args, words in ((["--tensor-parallel-size", "3"], "num_attention_heads (4)"),
                        (["--tensor-parallel-size", "16", "--enable-expert-parallel"], "not divisible"),
                        (["--data-parallel-size", "0"], "data-parallel size must be >= 1")):
        r = subprocess.run([moe_serve, *args], capture_output=True, text=True, timeout=60)
        assert r.returncode == 2, r.stderr
        errors = [line for line in r.stderr.splitlines() if "error" in line]
        assert len(errors) == 1 and words in errors[0] and "Traceback" not in r.stderr, r.stderr
