"""The serving path around an engine stand-in (moe_engine/standin.py: real engine thread and step loop, tokens and
routed experts of a known function) at rates a GPU reaches: every token and routing row arrives exactly and in
order, whatever the stream interval and however the backend coalesces steps; a closed stream cancels its request."""
from __future__ import annotations

import base64
import io
import json

import httpx
import numpy as np
import pytest

from moe_engine.standin import standin_row_table, standin_rows, standin_tokens
from openai_frontend.server_process import start_server

from .openai_helpers import metric_value, wait_until

L, K, E = 24, 8, 128


@pytest.fixture(scope="module")
def standin_server(tmp_path_factory, tiny_checkpoint):
    ckpt = tmp_path_factory.mktemp("standin_ckpt")
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        (ckpt / name).write_bytes((tiny_checkpoint / name).read_bytes())
    cfg = json.loads((tiny_checkpoint / "config.json").read_text())
    cfg.update(num_hidden_layers=L, num_local_experts=E, num_experts_per_tok=K)
    (ckpt / "config.json").write_text(json.dumps(cfg))
    server = start_server(tmp_path_factory.mktemp("standin_serve"),
                          ["--model", str(ckpt), "--served-model-name", "standin", "--max-model-len", "4096",
                           "--standin-engine", json.dumps({"step_interval_s": 0.0005}), "--stream-interval", "3"],
                          model_name="standin", triton_api_key=None)
    server.vocab = cfg["vocab_size"]
    yield server
    assert server.stop() == 0, server.log_tail()


def sse(lines):
    for line in lines:
        if line.startswith("data: ") and line != "data: [DONE]":
            yield json.loads(line[6:])


def test_every_token_and_row_in_order_at_concurrency(standin_server):
    """32 concurrent streams of 200 tokens: tokens and rows equal the stand-in's; the stream interval holds."""
    import concurrent.futures

    table = standin_row_table(L, K, E)
    prompt = list(range(5, 69))

    def one(seed: int) -> tuple[int, int]:
        body = {"model": "standin", "token_ids": prompt, "stream": True,
                "sampling_params": {"max_tokens": 200, "seed": seed, "ignore_eos": True,
                                    "return_routed_experts": True, "routed_experts_prompt_start": 10}}
        ids, sizes, routed = [], [], None
        with httpx.stream("POST", standin_server.root_url + "/inference/v1/generate", json=body, timeout=60) as r:
            assert r.status_code == 200
            for ev in sse(r.iter_lines()):
                ch = ev["choices"][0]
                if ch["token_ids"]:
                    sizes.append(len(ch["token_ids"]))
                ids += ch["token_ids"]
                routed = ch.get("routed_experts") or routed
        assert ids == standin_tokens(seed, len(prompt), 200, standin_server.vocab)
        rows = np.load(io.BytesIO(base64.b64decode(routed)))
        assert rows.dtype == np.uint8 and np.array_equal(rows, standin_rows(table, 10, len(prompt) + 199))
        # --stream-interval 3: the first token alone at once, then at least 3 a response but for the last (paced
        # rounds may put all the rest in one response: no middle ones then)
        assert sizes[0] == 1 and all(n >= 3 for n in sizes[1:-1]), sizes
        return len(sizes), sum(sizes)

    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        results = list(pool.map(one, range(32)))
    assert all(n == 200 for _, n in results)


def test_non_streaming_and_chat(standin_server):
    table = standin_row_table(L, K, E)
    r = httpx.post(standin_server.root_url + "/v1/completions", timeout=60, json={
        "model": "standin", "prompt": [7, 8, 9], "max_tokens": 50, "seed": 3, "ignore_eos": True,
        "return_token_ids": True})
    ch = r.json()["choices"][0]
    assert ch["token_ids"] == standin_tokens(3, 3, 50, standin_server.vocab)
    assert np.array_equal(np.load(io.BytesIO(base64.b64decode(ch["routed_experts"]))), standin_rows(table, 0, 52))
    with httpx.stream("POST", standin_server.root_url + "/v1/chat/completions", timeout=60, json={
            "model": "standin", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 40, "seed": 1,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}) as r:
        events = list(sse(r.iter_lines()))
    usage = events[-1]["usage"]
    routed = next(c["routed_experts"] for e in events for c in e["choices"] if c.get("routed_experts"))
    rows = np.load(io.BytesIO(base64.b64decode(routed)))
    assert usage["completion_tokens"] == 40
    assert np.array_equal(rows, standin_rows(table, 0, usage["prompt_tokens"] + 39))


def test_closing_a_stream_cancels_it(standin_server):
    running = 'moe_engine_requests{model="moe",state="running",version="1"}'
    body = {"model": "standin", "token_ids": [5, 6, 7], "stream": True, "request_id": "cancel-me",
            "sampling_params": {"max_tokens": 4000, "ignore_eos": True}}
    with httpx.stream("POST", standin_server.root_url + "/inference/v1/generate", json=body, timeout=60) as r:
        for i, _ in enumerate(sse(r.iter_lines())):
            if i == 3:
                break

    def cancelled() -> bool:
        return any(":cancel-me-0" in line and "cancelled" in line for line in standin_server.log_tail(400).splitlines())

    assert wait_until(cancelled), standin_server.log_tail(30)
    assert wait_until(lambda: metric_value(standin_server.triton_metrics_url, running) == 0)
