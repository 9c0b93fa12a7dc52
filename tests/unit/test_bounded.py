"""Bounded work per request (openai_frontend/bounded.py, issue 47) on the real app over an in-process fake engine:
the response-size budget counts what the response would carry (prompt logprobs once per prompt where the response
has one list, once per choice where each choice repeats them) and refuses before any work; trusted chat templates
render in workers, so /health keeps answering while four slow ones run; the RL paths the key guards are the
router's."""
from __future__ import annotations

import statistics
import threading
import time

import httpx
import pytest

from openai_frontend.app import create_app
from openai_frontend.config import FrontendConfig
from tests.unit.conftest import API_KEY, MODEL, ServerThread, make_model_info
from tests.unit.fake_engine import FakeEngine

AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def server(fe_checkpoint_dir, fe_tokenizer):
    engine = FakeEngine(info=make_model_info(), script=fe_tokenizer.encode("one two three four", add_special_tokens=False))
    cfg = FrontendConfig(triton_grpc_url="unused:0", served_model_name=MODEL, checkpoint_dir=fe_checkpoint_dir,
                         api_key=API_KEY, max_response_logprobs=1000, trust_request_chat_template=True)
    app = create_app(cfg, engine=engine)
    with ServerThread(app) as srv:
        srv.app = app
        yield srv


def post(srv, path, body):
    return httpx.post(srv.root_url + path, json=body, headers=AUTH, timeout=60)


def test_the_budget_counts_prompt_logprobs_as_often_as_the_response_carries_them(server):
    prompt = [5 + i for i in range(60)]  # 60 tokens x (1 + 4) = 300 entries per copy
    # /inference/v1/generate: one top-level prompt_logprobs list, whatever n: 300 of 1,000.
    r = post(server, "/inference/v1/generate", {"token_ids": prompt, "sampling_params": {
        "n": 4, "max_tokens": 2, "prompt_logprobs": 4}})
    assert r.status_code == 200, r.text
    # /v1/completions repeats them on each of the 4 choices: 1,200 > 1,000, refused before the engine sees it.
    r = post(server, "/v1/completions", {"prompt": prompt, "n": 4, "max_tokens": 2, "prompt_logprobs": 4})
    err = r.json()["error"]
    assert r.status_code == 400 and err["code"] == "response_too_large" and err["param"] == "prompt_logprobs"
    assert "1,200" in err["message"] and "1,000" in err["message"] and "--max-response-logprobs" in err["message"]
    r = post(server, "/v1/completions", {"prompt": prompt, "n": 3, "max_tokens": 2, "prompt_logprobs": 4})
    assert r.status_code == 200, r.text
    # Token logprobs: choices x max_tokens x (1 + top): 2 x 100 x 6 = 1,200 refused, naming logprobs; 2 x 80 x 6 fits.
    r = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 2,
                                              "max_tokens": 100, "logprobs": True, "top_logprobs": 5})
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs", r.text
    r = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 2,
                                              "max_tokens": 80, "logprobs": True, "top_logprobs": 5})
    assert r.status_code == 200, r.text


# A template that takes about a quarter of a second to render alone (well inside the 2 s cap, also four at a time
# on a busy machine), then renders the conversation.
SLOW_TEMPLATE = ("{% set ns = namespace(x=0) %}{% for i in range(120) %}{% for j in range(300) %}"
                 "{% set ns.x = ns.x + i * j %}{% endfor %}{% endfor %}{% for m in messages %}{{ m.content }}{% endfor %}")


def test_trusted_chat_templates_render_off_the_event_loop(server):
    t0 = time.perf_counter()
    r = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                                              "chat_template": SLOW_TEMPLATE})
    one = time.perf_counter() - t0
    assert r.status_code == 200, r.text
    assert one > 0.15  # the template really is slow: on the loop, four of them would stall /health for a second
    results = []
    threads = [threading.Thread(target=lambda: results.append(post(server, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "chat_template": SLOW_TEMPLATE})))
        for _ in range(4)]
    for t in threads:
        t.start()
    latencies = []
    watch = time.perf_counter()
    with httpx.Client(timeout=10) as probe:
        while any(t.is_alive() for t in threads):
            t1 = time.perf_counter()
            assert probe.get(server.root_url + "/health").status_code == 200
            latencies.append(time.perf_counter() - t1)
            time.sleep(0.02)
    watched = time.perf_counter() - watch
    for t in threads:
        t.join()
    assert [r.status_code for r in results] == [200] * 4, [r.text for r in results]
    # the probe watched the four renders throughout (they outlast one alone), often enough to see a stall; a count
    # of probes alone depends on how fast this machine answers them (two pytest workers share its two cores)
    assert watched > one and len(latencies) >= 5, (watched, one, len(latencies))
    assert max(latencies) < 0.25, (statistics.median(latencies), sorted(latencies)[-3:])


def test_the_key_guards_every_control_path_the_router_serves(server):
    from openai_frontend.serving_expert_load import PROTECTED_PATHS as EXPERT_LOAD_PATHS
    from openai_frontend.serving_weights import RL_PATHS

    others = {"/health", "/metrics", "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"}
    routed = set(server.app.openapi()["paths"]) - others
    control = set(RL_PATHS) | set(EXPERT_LOAD_PATHS)
    assert {p for p in routed if not p.startswith(("/v1/", "/inference/"))} == control
    for path in sorted(control):  # no key, a broken body: 401 before anything reads it
        r = httpx.post(server.root_url + path, content=b"{", headers={"Content-Type": "application/json"})
        assert r.status_code == 401, path
