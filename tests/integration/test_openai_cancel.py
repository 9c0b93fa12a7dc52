"""A client that goes away cancels its Triton requests; the server keeps serving."""
from __future__ import annotations

import httpx
import pytest

from .openai_helpers import metric_value, wait_until

RUNNING = 'moe_engine_requests{model="moe",state="running",version="1"}'


def cancelled_in_log(moe_server, request_id: str) -> bool:
    # the moe backend logs "request <engine id>:<triton request id> cancelled by the client; aborting"
    return any(f":{request_id}" in line and "cancelled" in line for line in moe_server.log_tail(400).splitlines())


def engine_idle(moe_server) -> bool:
    return metric_value(moe_server.triton_metrics_url, RUNNING) == 0


def test_closing_a_stream_cancels_every_choice(openai_client, moe_server):
    stream = openai_client.completions.create(model=moe_server.model, prompt="Tell me a long story", n=2,
                                              max_tokens=900, stream=True, extra_body={"ignore_eos": True})
    it = iter(stream)
    first = next(it)
    next(it), next(it)
    stream.close()
    assert wait_until(lambda: cancelled_in_log(moe_server, f"{first.id}-0")
                      and cancelled_in_log(moe_server, f"{first.id}-1")), moe_server.log_tail(30)
    assert wait_until(lambda: engine_idle(moe_server))
    assert metric_value(moe_server.root_url + "/metrics", "moe_serve_client_disconnects_total") >= 1
    r = openai_client.completions.create(model=moe_server.model, prompt="still there?", max_tokens=2)
    assert r.choices[0].finish_reason in ("length", "stop")


def test_disconnect_during_non_streaming_request_cancels_it(moe_server, openai_client):
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(moe_server.base_url + "/chat/completions", timeout=0.5,
                   headers={"Authorization": f"Bearer {moe_server.api_key}"},
                   json={"model": moe_server.model, "messages": [{"role": "user", "content": "long"}],
                         "max_tokens": 900, "ignore_eos": True})
    assert wait_until(lambda: "chatcmpl-" in moe_server.log_tail(400) and engine_idle(moe_server))
    assert any("chatcmpl-" in line and "cancelled" in line for line in moe_server.log_tail(400).splitlines())
    assert openai_client.chat.completions.create(model=moe_server.model, max_tokens=1,
                                                 messages=[{"role": "user", "content": "hi"}]).choices


def test_stop_string_cancels_the_engine_request(openai_client, moe_server):
    full = openai_client.completions.create(model=moe_server.model, prompt="abc", max_tokens=40, temperature=0,
                                            extra_body={"ignore_eos": True}).choices[0].text
    stop = next(full[i:i + 2] for i in range(2, len(full) - 2) if "\ufffd" not in full[i:i + 2])
    r = openai_client.completions.create(model=moe_server.model, prompt="abc", max_tokens=900, temperature=0,
                                         stop=[stop], extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "stop"
    assert wait_until(lambda: cancelled_in_log(moe_server, f"{r.id}-0"))
    assert r.usage.completion_tokens < 40


def test_health_and_metrics(moe_server):
    assert httpx.get(moe_server.root_url + "/health").status_code == 200
    text = httpx.get(moe_server.root_url + "/metrics").text
    for name in ("moe_serve_requests_total", "moe_serve_prompt_tokens_total", "moe_serve_generation_tokens_total",
                 "moe_serve_time_to_first_token_seconds", "moe_serve_inter_token_latency_seconds",
                 "moe_serve_routed_experts_bytes_total", "moe_serve_expert_selections_total"):
        assert name in text
    assert 'moe_serve_requests_total{endpoint="/v1/completions",status="200"}' in text
