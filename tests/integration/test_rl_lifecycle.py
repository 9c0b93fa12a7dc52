"""The RL rollout lifecycle on a real server: SGLang's endpoints over HTTP, through Triton into the engine.

A trainer's loop: serve checkpoint A, generate with routed experts, push B (from disk, or broadcast over gloo from a
trainer process), generate again. "What B computes" is an engine started on B in this process (the same engine
code, single-threaded float32 like the server), never numbers copied from the server. This module starts its own
moe-serve (weights change here), on a transformers-written checkpoint; every test starts by loading A again.
"""
from __future__ import annotations

import base64
import io
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from moe_engine.checkpoint import load_model
from moe_engine.config import load_config
from moe_engine.core.sampling import SamplingParams
from moe_engine.engine import Engine, EngineConfig, Request
from openai_frontend.server_process import free_ports, start_server

from ..unit.hf_checkpoints import write_servable_checkpoint

ARCH = "qwen3_moe"
KEY = "rl-key"
MAX_LEN = 256
REPO = Path(__file__).resolve().parents[2]
P = [5, 17, 33, 101, 250, 7, 7, 42, 311, 64, 9]
LONG = list(range(40, 80))  # two full KV blocks of 16: cached by its first run
ENDPOINTS = ("/update_weights_from_disk", "/init_weights_update_group", "/update_weights_from_distributed",
             "/flush_cache", "/pause_generation", "/continue_generation", "/release_memory_occupation",
             "/resume_memory_occupation", "/reset_prefix_cache", "/sleep", "/wake_up")


@pytest.fixture(scope="module")
def rl(tmp_path_factory):
    root = tmp_path_factory.mktemp("rl_ckpts")
    ckpts = {name: write_servable_checkpoint(ARCH, root / name, seed=seed) for name, seed in (("A", 1), ("B", 2))}
    ckpts["wider"] = write_servable_checkpoint(ARCH, root / "wider", seed=3, moe_intermediate_size=24)
    server = start_server(tmp_path_factory.mktemp("rl_serve"),
                          ["--model", str(ckpts["A"]), "--served-model-name", "policy", "--max-model-len",
                           str(MAX_LEN), "--num-threads", "1"], api_key=KEY, model_name="policy")
    http = httpx.Client(base_url=server.root_url, headers={"Authorization": f"Bearer {KEY}"}, timeout=120)
    yield server, http, ckpts
    http.close()
    code = server.stop()
    assert code == 0, f"moe-serve exited with {code}:\n{server.log_tail()}"


@pytest.fixture
def on_a(rl):
    """The server back on A (also shows that loading the same checkpoint again is harmless)."""
    server, http, ckpts = rl
    r = http.post("/update_weights_from_disk", json={"model_path": str(ckpts["A"])})
    assert r.status_code == 200 and r.json()["success"], r.text
    return rl


def reference(path, prompt, max_tokens=10):
    """(tokens, routing) of an engine started on ``path`` for one greedy request."""
    engine = Engine(load_model(path, dtype="float32", progress=False), load_config(path),
                    EngineConfig(max_model_len=MAX_LEN))
    out = {"tokens": [], "rows": []}

    def collect(o):
        out["tokens"] += o.new_token_ids
        if o.routed_experts is not None:
            out["rows"].append(o.routed_experts)

    engine.add_request(Request("ref", list(prompt), SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                                   ignore_eos=True), on_output=collect))
    while engine.step():
        pass
    return out["tokens"], np.concatenate(out["rows"])


def generate(http, prompt, max_tokens=10, **extra):
    r = http.post("/inference/v1/generate", json={"model": "policy", "token_ids": prompt, "sampling_params": {
        "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}, **extra})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    return choice["token_ids"], np.load(io.BytesIO(base64.b64decode(choice["routed_experts"]))), choice


def test_update_from_disk_serves_what_an_engine_started_on_b_serves(on_a):
    server, http, ckpts = on_a
    tokens_a, rows_a, choice = generate(http, P)
    assert choice["weight_version"] == "A"
    ref_tokens, ref_rows = reference(ckpts["A"], P)
    assert tokens_a == ref_tokens
    np.testing.assert_array_equal(rows_a, ref_rows)

    r = http.post("/update_weights_from_disk", json={"model_path": str(ckpts["B"])})
    assert r.status_code == 200
    assert r.json() == {"success": True, "message": r.json()["message"], "weight_version": "B",
                        "num_paused_requests": 0}
    tokens_b, rows_b, choice = generate(http, P)
    ref_tokens, ref_rows = reference(ckpts["B"], P)
    assert tokens_b == ref_tokens and tokens_b != tokens_a
    np.testing.assert_array_equal(rows_b, ref_rows)
    assert choice["weight_version"] == "B"
    assert http.get("/get_weight_version").json() == {"weight_version": "B"}
    assert http.get("/v1/models").json()["data"][0]["weight_version"] == "B"

    # The OpenAI endpoints carry it too: on the choice, beside routed_experts (the last chunk when streaming).
    import openai

    client = openai.OpenAI(base_url=server.base_url, api_key=KEY, max_retries=0, timeout=120)
    completion = client.completions.create(model="policy", prompt=P, max_tokens=4, temperature=0)
    assert completion.choices[0].model_extra["weight_version"] == "B"
    chunks = list(client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=4, temperature=0, stream=True))
    finals = [c.choices[0].model_extra["weight_version"] for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == ["B"]


def test_prompt_cached_under_a_is_not_served_a_rows_after_the_update(on_a):
    server, http, ckpts = on_a
    _, cold_a, _ = generate(http, LONG)
    _, warm_a, _ = generate(http, LONG)  # served from A's cached blocks and their rows
    np.testing.assert_array_equal(warm_a, cold_a)
    # flush_cache false: only the weights epoch in the cache key keeps A's blocks away from B's requests.
    r = http.post("/update_weights_from_disk", json={"model_path": str(ckpts["B"]), "flush_cache": False})
    assert r.status_code == 200
    tokens_b, rows_b, _ = generate(http, LONG)
    ref_tokens, ref_rows = reference(ckpts["B"], LONG)
    assert not np.array_equal(ref_rows[:32], cold_a[:32])  # serving A's cached rows would show
    np.testing.assert_array_equal(rows_b, ref_rows)
    assert tokens_b == ref_tokens


def test_mismatched_checkpoint_is_refused_and_the_old_weights_keep_serving(on_a):
    server, http, ckpts = on_a
    tokens_a, rows_a, _ = generate(http, P)
    r = http.post("/update_weights_from_disk", json={"model_path": str(ckpts["wider"])})
    assert r.status_code == 400
    body = r.json()
    assert body["success"] is False and body["weight_version"] == "A"
    assert "experts.intermediate_size" in body["message"] and body["error"]["message"] == body["message"]
    r = http.post("/update_weights_from_disk", json={"model_path": str(ckpts["A"]), "is_async": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "is_async"
    tokens, rows, choice = generate(http, P)
    assert tokens == tokens_a and choice["weight_version"] == "A"
    np.testing.assert_array_equal(rows, rows_a)
    # The lifecycle endpoints need the API key, as /v1 does.
    for path in ENDPOINTS:
        r = httpx.post(server.root_url + path, json={})
        assert r.status_code == 401, path
    assert httpx.get(server.root_url + "/get_weight_version").status_code == 401


def trainer(ckpt, server, *extra) -> subprocess.Popen:
    port = free_ports(1)[0]
    return subprocess.Popen([sys.executable, "-m", "tests.rl_trainer", "--checkpoint", str(ckpt), "--port",
                             str(port), "--server", server.root_url, "--api-key", KEY, *extra], cwd=REPO,
                            stdout=subprocess.PIPE, text=True)


def test_distributed_update_over_gloo_gives_the_disk_update_result(on_a):
    server, http, ckpts = on_a
    proc = trainer(ckpts["B"], server, "--weight-version", "step-7")
    out, _ = proc.communicate(timeout=120)
    init, update = (json.loads(line) for line in out.splitlines())
    assert proc.returncode == 0 and init["success"] and update["success"], out
    assert update["weight_version"] == "step-7"
    tokens, rows, choice = generate(http, P)
    ref_tokens, ref_rows = reference(ckpts["B"], P)  # = the disk update's result (previous test)
    assert tokens == ref_tokens and choice["weight_version"] == "step-7"
    np.testing.assert_array_equal(rows, ref_rows)

    # A wrong announcement: 400 naming the tensor, the trainer's broadcasts still complete, the weights stay.
    wrong = "model.layers.3.mlp.experts.2.down_proj.weight"
    proc = trainer(ckpts["A"], server, "--wrong-shape", wrong)
    out, _ = proc.communicate(timeout=120)
    init, update = (json.loads(line) for line in out.splitlines())
    assert proc.returncode == 0 and init["success"]
    assert update["status"] == 400 and wrong in update["message"] and update["weight_version"] == "step-7"
    assert generate(http, P)[0] == ref_tokens


class Requests:
    """Streaming generate requests, one thread each: ``started`` once each has its first tokens, ``results[i]`` =
    (status, finish_reason, tokens) when it ended."""

    def __init__(self, server, prompts, max_tokens):
        self.results: dict = {}
        self.started = [threading.Event() for _ in prompts]
        self.threads = [threading.Thread(target=self._one, args=(server, i, p, max_tokens), daemon=True)
                        for i, p in enumerate(prompts)]
        for t in self.threads:
            t.start()

    def _one(self, server, i, prompt, max_tokens):
        body = {"model": "policy", "token_ids": prompt, "stream": True,
                "sampling_params": {"max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}}
        tokens, finish = [], None
        with httpx.Client(timeout=120, headers={"Authorization": f"Bearer {KEY}"}) as c:
            with c.stream("POST", server.root_url + "/inference/v1/generate", json=body) as r:
                if r.status_code != 200:
                    self.results[i] = (r.status_code, None, None)
                    return
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        for ch in json.loads(line[6:])["choices"]:
                            tokens += ch["token_ids"]
                            finish = ch["finish_reason"] or finish
                        self.started[i].set()
        self.results[i] = (200, finish, tokens)

    def wait_started(self, timeout=60):
        assert all(e.wait(timeout) for e in self.started)

    def join(self, timeout=90):
        deadline = time.monotonic() + timeout
        for t in self.threads:
            t.join(max(0.0, deadline - time.monotonic()))
        assert not any(t.is_alive() for t in self.threads), "a request is hanging"


def test_pause_continue_and_release_resume_leave_no_request_hanging(on_a):
    server, http, ckpts = on_a
    prompts = [P, LONG, P[:5], LONG[:20]]
    expected = [reference(ckpts["A"], p, 200)[0] for p in prompts]
    ok = lambda r: r.status_code == 200 and r.json()["success"]  # noqa: E731

    reqs = Requests(server, prompts, 200)
    reqs.wait_started()
    assert ok(http.post("/pause_generation", json={"mode": "retract"}))
    assert ok(http.post("/pause_generation", json={"mode": "in_place"}))  # idempotent
    assert ok(http.post("/release_memory_occupation", json={"tags": ["kv_cache", "weights"]}))
    assert ok(http.post("/release_memory_occupation"))
    paused = dict(reqs.results)
    time.sleep(0.5)
    assert reqs.results == paused and len(paused) < len(prompts)  # nothing ends while paused and released
    assert ok(http.post("/resume_memory_occupation"))
    assert ok(http.post("/flush_cache"))
    assert ok(http.post("/continue_generation"))
    assert ok(http.post("/continue_generation"))
    reqs.join()
    # Retracted and recomputed: every request ends with exactly the tokens of an uninterrupted run.
    assert [reqs.results[i] for i in range(len(prompts))] == [(200, "length", e) for e in expected]

    # pause (abort): every request in flight ends at once with the tokens it had; a later one waits for continue.
    reqs = Requests(server, prompts, 200)
    reqs.wait_started()
    assert ok(http.post("/pause_generation", json={"mode": "abort"}))
    reqs.join(timeout=30)
    for i, (status, finish, tokens) in reqs.results.items():
        assert (status, finish) == (200, "abort") and tokens == expected[i][: len(tokens)]
    late = Requests(server, [P], 10)
    time.sleep(0.5)
    assert not late.results and not late.started[0].is_set()
    assert ok(http.post("/continue_generation"))
    late.join()
    assert late.results[0] == (200, "length", reference(ckpts["A"], P, 10)[0])


def test_vllm_sleep_and_wake_up_keep_every_request(on_a):
    """vLLM's names for release / resume: requests in flight stop while the server sleeps and end after wake-up
    with exactly the tokens of an uninterrupted run; /is_sleeping says which state it is in."""
    server, http, ckpts = on_a
    prompts = [P, LONG]
    expected = [reference(ckpts["A"], p, 200)[0] for p in prompts]
    reqs = Requests(server, prompts, 200)
    reqs.wait_started()
    assert http.get("/is_sleeping").json() == {"is_sleeping": False}
    assert http.post("/sleep", params={"level": 1}).status_code == 200
    assert http.get("/is_sleeping").json() == {"is_sleeping": True}
    asleep = dict(reqs.results)
    time.sleep(0.5)
    assert reqs.results == asleep and len(asleep) < len(prompts)
    assert http.post("/wake_up").status_code == 200
    assert http.get("/is_sleeping").json() == {"is_sleeping": False}
    assert http.post("/reset_prefix_cache").json()["success"]
    reqs.join()
    assert [reqs.results[i] for i in range(len(prompts))] == [(200, "length", e) for e in expected]


def test_triton_control_contract_for_tritonclient_users(on_a):
    """What a tritonclient user sends: input_ids empty, control JSON; one final response with control_result."""
    import queue

    server, http, ckpts = on_a
    answers: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(server.triton_grpc_url)
    client.start_stream(callback=lambda result, error: answers.put((result, error)),
                        headers=getattr(server, "triton_grpc_headers", None) or None)  # Triton's key, if any
    try:
        def control(body):
            ids = grpcclient.InferInput("input_ids", [0], "INT64")
            ids.set_data_from_numpy(np.empty(0, np.int64))
            ctl = grpcclient.InferInput("control", [1], "BYTES")
            ctl.set_data_from_numpy(np.array([json.dumps(body).encode()], dtype=np.object_))
            client.async_stream_infer("moe", [ids, ctl], enable_empty_final_response=True)
            return answers.get(timeout=60)

        result, error = control({"op": "get_weight_version"})
        assert error is None and result.get_response().parameters["triton_final_response"].bool_param
        assert json.loads(result.as_numpy("control_result")[0]) == {
            "success": True, "message": "weight version 'A'", "weight_version": "A"}
        result, error = control({"op": "update_weights_from_disk", "model_path": str(ckpts["wider"])})
        answer = json.loads(result.as_numpy("control_result")[0])
        assert answer["success"] is False and "experts.intermediate_size" in answer["message"]
        _, error = control({"op": "reboot"})
        assert error is not None and "unknown op 'reboot'" in str(error)
    finally:
        client.stop_stream()
        client.close()
