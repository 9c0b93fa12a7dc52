"""Prefix caching through the real server: a prompt served from the cache gets exactly what a cold run gets.

What a trainer's author checks: for /v1/completions, /v1/chat/completions and /inference/v1/generate, a cold run,
a warm run (prompt fully or partly cached) and a run after the cached blocks were evicted return identical tokens,
logprobs and routed experts (rows of cached tokens included, none missing, none stale), also with
``routed_experts_prompt_start``, with n = 2, with streaming, and for requests preempted while sharing cached
blocks. Prefix-cache counters on Triton's metrics port prove each case did what it claims: a warm run hit the
cache for every full block it shares (block size 16, moe-serve's default on CPU; the prompt's last token is always
forwarded), a cold one or one after eviction hit nothing, and preemption happened.

Servers: the shared ``moe_server`` (cache on, room to spare) for cold / warm runs; two of this module's own,
started together: ``ref`` with ``--no-enable-prefix-caching`` (what an engine that never caches returns: the
reference for partly cached prompts and for preempted requests) and ``tight`` with a 40-block KV cache and the
cache on (eviction and preemption). The tiny model runs in float32, where a request's results do not depend on
what shares its engine steps.
"""
from __future__ import annotations

import concurrent.futures
import json
import os
import random
import re
import time
import urllib.request
from dataclasses import dataclass

import httpx
import numpy as np
import openai
import pytest

from ..tolerances import approx_across_batches
from .conftest import start_moe_serve
from .openai_helpers import NUM_EXPERTS_PER_TOK, NUM_HIDDEN_LAYERS, decode, extra

BLOCK = 16  # moe-serve's default --block-size on CPU (64 on Hopper GPUs)
TIGHT_BLOCKS = 40  # the tight server's KV cache (640 tokens); one sequence may reach TIGHT_LEN
TIGHT_LEN = 320
ENDPOINTS = ("completions", "chat", "generate")
_WORDS = ("router expert token layer model cache block prefix agent turn reply trainer replay rollout policy "
          "gradient batch serve prompt quick brown fox jumps over lazy dog paris story robot code value").split()


# ----------------------------------------------------------------------------- servers


def _kv_gib(checkpoint_dir: str, blocks: int) -> float:
    """--kv-cache-memory (GiB) for ``blocks`` float32 KV blocks of the tiny model, plus the null block."""
    cfg = json.loads(open(f"{checkpoint_dir}/config.json").read())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    per_block = cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * 2 * head_dim * BLOCK * 4
    return (blocks + 1) * per_block / 2**30


@pytest.fixture(scope="module")
def own_servers(tmp_path_factory, tiny_checkpoint):
    """(ref, tight), started in parallel (each takes about 10 s to load)."""
    log_dir = tmp_path_factory.mktemp("prefix_cache")
    flags = {  # both report usage.prompt_tokens_details (the shared server does not)
        "ref": ["--no-enable-prefix-caching", "--enable-prompt-tokens-details"],
        "tight": ["--kv-cache-memory", f"{_kv_gib(str(tiny_checkpoint), TIGHT_BLOCKS):.9f}",
                  "--max-model-len", str(TIGHT_LEN), "--max-num-seqs", "8", "--enable-prompt-tokens-details"],
    }
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        futures = {name: pool.submit(start_moe_serve, log_dir, f) for name, f in flags.items()}
        started = {}
        try:
            for name, fut in futures.items():
                started[name] = fut.result()
        finally:
            if len(started) < len(futures):  # one failed to start: stop the other, raise
                for fut in futures.values():
                    if fut.exception() is None:
                        fut.result().stop()
    yield started["ref"], started["tight"]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        codes = list(pool.map(lambda server: server.stop(), started.values()))
    for server, code in zip(started.values(), codes):
        assert code == 0, f"moe-serve exited with {code}:\n{server.log_tail()}"


@pytest.fixture(scope="module")
def ref(own_servers):
    return own_servers[0]


@pytest.fixture(scope="module")
def tight(own_servers):
    return own_servers[1]


# ----------------------------------------------------------------------------- counters


def engine_counters(server) -> dict[str, float]:
    """Prefix-cache queries and hits (tokens), preemptions, KV blocks by state, from Triton's metrics port."""
    text = urllib.request.urlopen(server.triton_metrics_url, timeout=5).read().decode()
    out = {}
    for key, pattern in (("queries", r"moe_engine_prefix_cache_queries\{[^}]*\}"),
                         ("hits", r"moe_engine_prefix_cache_hits\{[^}]*\}"),
                         ("preemptions", r"moe_engine_preemptions\{[^}]*\}"),
                         ("cached_blocks", r'moe_engine_kv_blocks\{[^}]*state="cached"[^}]*\}'),
                         ("total_blocks", r'moe_engine_kv_blocks\{[^}]*state="total"[^}]*\}')):
        m = re.search(r"^%s (\S+)$" % pattern, text, re.M)
        out[key] = float(m.group(1)) if m else 0.0
    return out


class Counters:
    """Deltas of the engine counters across requests. The backend refreshes Triton's metrics every 0.2 s, so a
    reading counts only once it held for longer than that (the baseline too: a request that just finished may
    still be on its way in), and a delta waits until the queries counter has grown by what the requests looked
    up (prompt tokens of every choice)."""

    SETTLE_S = 0.3

    def __init__(self, server):
        self.server = server
        self.last = self._settled()

    def _settled(self) -> dict[str, float]:
        prev = engine_counters(self.server)
        while True:
            time.sleep(self.SETTLE_S)
            now = engine_counters(self.server)
            if now == prev:
                return now
            prev = now

    def delta(self, min_queries: int, timeout: float = 15.0) -> dict[str, float]:
        deadline = time.monotonic() + timeout
        while engine_counters(self.server)["queries"] < self.last["queries"] + min_queries:
            if time.monotonic() > deadline:
                raise AssertionError(f"prefix-cache queries did not grow by {min_queries}: {self.last} -> "
                                     f"{engine_counters(self.server)}")
            time.sleep(0.05)
        now = self._settled()
        d = {k: now[k] - self.last[k] for k in ("queries", "hits", "preemptions")}
        self.last = now
        return d


def full_blocks_hit(prompt_len: int, shared: int) -> int:
    """Tokens a prompt takes from the cache when its first ``shared`` tokens are cached: whole blocks only, and
    never the block of its last token (that token is forwarded for the logits)."""
    return min(shared // BLOCK, (prompt_len - 1) // BLOCK) * BLOCK


# ----------------------------------------------------------------------------- requests


@dataclass
class Choice:
    tokens: list[int]
    logprobs: list[float]
    rows: np.ndarray | None
    prompt_ids: list[int]
    text: str = ""
    start: int = 0  # routed_experts_prompt_start: rows[i] is the routing of position start + i


def token_prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 512) for _ in range(n)]


def words(seed: int, n: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(_WORDS) for _ in range(n))


def ask(server, endpoint: str, prompt, *, stream: bool = False, n: int = 1, prompt_start: int | None = None,
        max_tokens: int = 8, seed: int | None = None) -> list[Choice]:
    """One request; its choices (tokens, logprobs, decoded rows, prompt ids), in index order.

    ``prompt``: token ids (completions, generate) or chat messages. Greedy unless ``seed`` is given (then
    temperature 1, each choice seeded seed + index)."""
    sampling = {"max_tokens": max_tokens, "temperature": 0.0 if seed is None else 1.0, "ignore_eos": True}
    if seed is not None:
        sampling["seed"] = seed
    options = {"return_token_ids": True, "ignore_eos": True}
    if prompt_start is not None:
        options["routed_experts_prompt_start"] = prompt_start
    if endpoint == "generate":
        return _generate(server, prompt, stream, n, prompt_start or 0,
                         {**sampling, "logprobs": 1, "n": n, "routed_experts_prompt_start": prompt_start or 0})
    kw = dict(model=server.model, n=n, max_tokens=max_tokens, temperature=sampling["temperature"], seed=seed,
              stream=stream, extra_body=options)
    got = {i: Choice([], [], None, [], start=prompt_start or 0) for i in range(n)}
    with openai.OpenAI(base_url=server.base_url, api_key=server.api_key, max_retries=0, timeout=120) as client:
        if endpoint == "completions":
            resp = client.completions.create(prompt=prompt, logprobs=1, **kw)
        else:
            resp = client.chat.completions.create(messages=prompt, logprobs=True, top_logprobs=1, **kw)
        for chunk in resp if stream else [resp]:
            for c in chunk.choices:
                g = got[c.index]
                g.tokens += extra(c, "token_ids") or []
                g.prompt_ids = extra(c, "prompt_token_ids") or g.prompt_ids
                if endpoint == "completions":
                    g.text += c.text or ""
                else:
                    g.text += (c.delta.content if stream else c.message.content) or ""
                if c.logprobs is not None:
                    g.logprobs += (c.logprobs.token_logprobs if endpoint == "completions"
                                   else [x.logprob for x in c.logprobs.content or []])
                if c.finish_reason is not None:
                    assert c.finish_reason == "length"
                    g.rows = decode(extra(c, "routed_experts"))
                elif stream:
                    assert extra(c, "routed_experts") is None  # the whole array comes with the final chunk
    return [got[i] for i in range(n)]


def _generate(server, token_ids, stream, n, start, sampling) -> list[Choice]:
    body = {"model": server.model, "token_ids": token_ids, "stream": stream,
            "sampling_params": {**sampling, "return_token_ids": True}}
    headers = {"Authorization": f"Bearer {server.api_key}"}
    url = server.root_url + "/inference/v1/generate"
    if stream:
        with httpx.stream("POST", url, json=body, headers=headers, timeout=120) as r:
            assert r.status_code == 200, r.read()
            chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")
                      and line != "data: [DONE]"]
    else:
        r = httpx.post(url, json=body, headers=headers, timeout=120)
        assert r.status_code == 200, r.text
        chunks = [r.json()]
    got = {i: Choice([], [], None, list(token_ids), start=start) for i in range(n)}
    for chunk in chunks:
        for c in chunk["choices"]:
            g = got[c["index"]]
            g.tokens += c["token_ids"]
            g.logprobs += [x["logprob"] for x in (c["logprobs"] or {}).get("content", [])]
            if c["finish_reason"] is not None:
                assert c["finish_reason"] == "length"
                g.rows = decode(c["routed_experts"])
            else:
                assert c["routed_experts"] is None
    return [got[i] for i in range(n)]


def assert_same(got: list[Choice], want: list[Choice]) -> None:
    """Equal tokens and routed experts (position by position: ``got`` may start its rows later); logprobs equal up
    to float32 rounding (relative differences of about 1e-5: a warm prefill multiplies fewer rows at once than a
    cold one, and matmuls of different shapes round differently)."""
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.tokens == w.tokens and g.prompt_ids == w.prompt_ids
        assert g.logprobs == approx_across_batches(w.logprobs) and len(g.logprobs) == len(w.tokens)
        for c in (g, w):  # a row for every position from the prompt start on, but the last sampled token's
            assert c.rows.shape == (len(c.prompt_ids) + len(c.tokens) - 1 - c.start, NUM_HIDDEN_LAYERS,
                                    NUM_EXPERTS_PER_TOK)
        assert g.start >= w.start and g.rows.dtype == w.rows.dtype == np.uint8
        np.testing.assert_array_equal(g.rows, w.rows[g.start - w.start :])


def chat(seed: int, turns: int = 1, reply: str | None = None) -> list[dict]:
    """A conversation: a user message of ~60 words; with turns=2, the assistant's reply and a second message."""
    msgs = [{"role": "user", "content": words(seed, 60)}]
    if turns == 2:
        msgs += [{"role": "assistant", "content": reply}, {"role": "user", "content": words(seed + 1, 40)}]
    return msgs


def prompt_for(endpoint: str, seed: int):
    return chat(seed) if endpoint == "chat" else token_prompt(seed, 100)


# ----------------------------------------------------------------------------- the model card


def test_models_endpoint_says_whether_prefix_caching_is_on_and_its_block_size(moe_server, ref):
    """Whether the cache is on, and the KV block size the engine chose at start (its granularity: 16 on CPU)."""
    for server, on in ((moe_server, True), (ref, False)):
        r = httpx.get(server.base_url + "/models", headers={"Authorization": f"Bearer {server.api_key}"}, timeout=10)
        card = r.json()["data"][0]
        assert card["prefix_caching_enabled"] is on and card["routed_experts_enabled"] is True
        assert card["kv_block_size"] == BLOCK


def test_metrics_say_how_many_tokens_a_kv_block_holds(moe_server):
    """The block size sets the prefix cache's granularity (a new turn forwards its history's last partial block
    again): the engine reports it on Triton's metrics port and on the API's /metrics (16, the CPU default), as
    /v1/models does (the test above)."""
    def reported(text: str) -> float | None:
        m = re.search(r"^moe_engine_kv_block_size\{[^}]*\} (\S+)$", text, re.M)
        return float(m.group(1)) if m else None

    deadline = time.monotonic() + 10  # the backend refreshes its gauges every 0.2 s
    while reported(urllib.request.urlopen(moe_server.triton_metrics_url, timeout=5).read().decode()) != BLOCK:
        assert time.monotonic() < deadline, "moe_engine_kv_block_size never reported 16"
        time.sleep(0.2)
    assert reported(httpx.get(moe_server.root_url + "/metrics", timeout=10).text) == BLOCK


# ----------------------------------------------------------------------------- warm = cold


# Completions: a prompt longer than a prefill step (512 tokens on CPU), cached from two steps' rows; generate: an
# exact multiple of the block size (its last block is recomputed for the logits); chat: ~80 tokens of template + text.
FULL_PROMPTS = {"completions": lambda seed: token_prompt(seed, 600), "chat": chat,
                "generate": lambda seed: token_prompt(seed, 6 * BLOCK)}


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_fully_cached_prompt_returns_the_cold_results(moe_server, ref, endpoint):
    prompt = FULL_PROMPTS[endpoint](1000 + ENDPOINTS.index(endpoint))
    counters = Counters(moe_server)
    cold = ask(moe_server, endpoint, prompt)
    p = len(cold[0].prompt_ids)
    assert counters.delta(p)["hits"] == 0  # nothing of it was cached: a true cold run
    assert_same(cold, ask(ref, endpoint, prompt))  # as an engine that never caches

    warm = ask(moe_server, endpoint, prompt)
    assert counters.delta(p)["hits"] == full_blocks_hit(p, p) > 0
    assert_same(warm, cold)
    warm_stream = ask(moe_server, endpoint, prompt, stream=True)
    assert counters.delta(p)["hits"] == full_blocks_hit(p, p)
    assert_same(warm_stream, cold)
    # Routing from a prompt start inside the cached blocks, and from one in the forwarded tail.
    for start in (20, p - 2):
        assert_same(ask(moe_server, endpoint, prompt, prompt_start=start, stream=start == 20), cold)
        assert counters.delta(p)["hits"] == full_blocks_hit(p, p)


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_partly_cached_prompt_returns_the_results_of_an_engine_without_cache(moe_server, ref, endpoint):
    """The first request's prompt and the 30 tokens it generated are cached (blocks filled by decode steps
    included). Completions: a prompt sharing its first 70 tokens (a hit ending inside a block). Generate: the
    agent's next turn (that prompt, the reply's tokens, 40 new tokens). Chat: the next turn as messages (the
    reply goes back as text, so the cached part ends where its tokenisation differs)."""
    seed = 2000 + ENDPOINTS.index(endpoint)
    prompt = prompt_for(endpoint, seed)
    counters = Counters(moe_server)
    first = ask(moe_server, endpoint, prompt, max_tokens=30)
    assert counters.delta(len(first[0].prompt_ids))["hits"] == 0
    second_prompt = {
        "completions": lambda: prompt[:70] + token_prompt(seed + 1, 40),
        "generate": lambda: prompt + first[0].tokens + token_prompt(seed + 1, 40),
        "chat": lambda: chat(seed, turns=2, reply=first[0].text),
    }[endpoint]()
    cached = first[0].prompt_ids + first[0].tokens[:-1]  # every position the first request forwarded
    want = ask(ref, endpoint, second_prompt, stream=True)
    p2 = len(want[0].prompt_ids)
    shared = len(os.path.commonprefix([want[0].prompt_ids, cached]))
    assert shared >= BLOCK, "the test's prompts must share at least a block"
    if endpoint == "generate":
        assert full_blocks_hit(p2, shared) > len(prompt)  # blocks that hold generated tokens are hit too

    got = ask(moe_server, endpoint, second_prompt)
    assert counters.delta(p2)["hits"] == full_blocks_hit(p2, shared)
    assert_same(got, want)
    # The same prompt again is cached through its last full block; a prompt start past the shared part.
    again = ask(moe_server, endpoint, second_prompt, prompt_start=shared + 3)
    assert counters.delta(p2)["hits"] == full_blocks_hit(p2, p2)
    assert_same(again, want)


def test_prompt_cached_by_a_request_without_routed_experts_still_returns_every_row(moe_server, ref):
    """Routing is captured for every step while the cache is on, so a block cached by a request that opted out
    of routed experts holds rows for the next request that wants them."""
    prompt = token_prompt(2500, 90)
    r = httpx.post(moe_server.root_url + "/inference/v1/generate", timeout=60,
                   headers={"Authorization": f"Bearer {moe_server.api_key}"},
                   json={"token_ids": prompt, "sampling_params": {"max_tokens": 4, "temperature": 0,
                                                                  "return_routed_experts": False}})
    assert r.status_code == 200 and r.json()["choices"][0]["routed_experts"] is None
    counters = Counters(moe_server)
    got = ask(moe_server, "generate", prompt)
    assert counters.delta(len(prompt))["hits"] == full_blocks_hit(len(prompt), len(prompt)) > 0
    assert_same(got, ask(ref, "generate", prompt))


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_n2_choices_prefill_the_prompt_once_and_match_an_engine_without_cache(moe_server, ref, endpoint):
    seed = 3000 + ENDPOINTS.index(endpoint)
    prompt = prompt_for(endpoint, seed)
    counters = Counters(moe_server)
    cold = ask(moe_server, endpoint, prompt, n=2, seed=seed)
    p = len(cold[0].prompt_ids)
    assert counters.delta(2 * p)["hits"] == full_blocks_hit(p, p)  # the second choice took the first one's blocks
    assert cold[0].tokens != cold[1].tokens  # two samples (seed + index), not one answer twice
    assert_same(cold, ask(ref, endpoint, prompt, n=2, seed=seed))
    warm = ask(moe_server, endpoint, prompt, n=2, seed=seed, stream=True, prompt_start=p // 2)
    assert counters.delta(2 * p)["hits"] == 2 * full_blocks_hit(p, p)
    assert_same(warm, cold)


# ----------------------------------------------------------------------------- usage.prompt_tokens_details


def usage_of(server, endpoint: str, prompt, *, stream: bool = False, n: int = 1) -> list[dict]:
    """The usage objects of one request as sent (raw JSON): non-streaming, its ``usage``; streaming (with
    ``include_usage`` and ``continuous_usage_stats``), every chunk's, the final usage-only chunk's last."""
    path = {"completions": "/v1/completions", "chat": "/v1/chat/completions", "generate": "/inference/v1/generate"}
    body = {"model": server.model, "stream": stream}
    sampling = {"n": n, "max_tokens": 4, "temperature": 0.0, "ignore_eos": True}
    if endpoint == "generate":
        body.update(token_ids=prompt, sampling_params=sampling)
    else:
        body.update({"prompt" if endpoint == "completions" else "messages": prompt, **sampling})
    if stream:
        body["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    headers = {"Authorization": f"Bearer {server.api_key}"}
    url = server.root_url + path[endpoint]
    if not stream:
        r = httpx.post(url, json=body, headers=headers, timeout=60)
        assert r.status_code == 200, r.text
        return [r.json()["usage"]]
    with httpx.stream("POST", url, json=body, headers=headers, timeout=60) as r:
        assert r.status_code == 200, r.read()
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")
                  and line != "data: [DONE]"]
    assert not chunks[-1]["choices"]  # the usage-only chunk
    return [c["usage"] for c in chunks if c.get("usage") is not None]


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_usage_says_how_many_prompt_tokens_came_from_the_cache(moe_server, tight, ref, endpoint):
    """--enable-prompt-tokens-details (vLLM's flag): ``usage.prompt_tokens_details.cached_tokens`` is the
    prompt tokens served from the prefix cache: 0 cold, the whole blocks of a repeated prompt warm (the same
    count as the engine's hit counter), 0 on a server without the cache; for n = 2 the request's (a cold
    prompt's second choice takes the first one's blocks, which were not in the cache when the request came).
    Without the flag the field is absent, as before."""
    prompt = prompt_for(endpoint, 6000 + ENDPOINTS.index(endpoint))  # seeds no other test of this module uses
    counters = Counters(tight)
    (cold,) = usage_of(tight, endpoint, prompt)
    p = cold["prompt_tokens"]
    assert cold["prompt_tokens_details"] == {"cached_tokens": 0} and counters.delta(p)["hits"] == 0
    hit = full_blocks_hit(p, p)
    assert hit > 0
    *per_chunk, final = usage_of(tight, endpoint, prompt, stream=True)
    assert counters.delta(p)["hits"] == hit
    assert final["prompt_tokens_details"] == {"cached_tokens": hit} and final["prompt_tokens"] == p
    assert per_chunk and all(u["prompt_tokens_details"] == {"cached_tokens": hit} for u in per_chunk)
    (warm2,) = usage_of(tight, endpoint, prompt, n=2)
    assert warm2["prompt_tokens_details"] == {"cached_tokens": hit} and counters.delta(2 * p)["hits"] == 2 * hit
    (cold2,) = usage_of(tight, endpoint, prompt_for(endpoint, 6100 + ENDPOINTS.index(endpoint)), n=2)
    assert cold2["prompt_tokens_details"] == {"cached_tokens": 0}
    for _ in range(2):  # no cache, no hits: the same prompt twice
        (u,) = usage_of(ref, endpoint, prompt)
        assert u["prompt_tokens_details"] == {"cached_tokens": 0} and u["prompt_tokens"] == p
    (plain,) = usage_of(moe_server, endpoint, prompt)
    assert plain == {"prompt_tokens": p, "completion_tokens": 4, "total_tokens": p + 4}


# ----------------------------------------------------------------------------- eviction and preemption

# Per endpoint, the request sent cold, warm and after eviction: every variant at least once.
EVICTION_VARIANTS = {"completions": dict(n=2, seed=7, prompt_start=30), "chat": dict(stream=True),
                     "generate": dict(stream=True, prompt_start=50)}


def test_after_eviction_prompts_are_recomputed_with_identical_results(tight):
    counters = Counters(tight)
    prompts = {ep: prompt_for(ep, 4000 + i) for i, ep in enumerate(ENDPOINTS)}
    cold, cold_hits, plen = {}, {}, {}
    for ep in ENDPOINTS:
        v = EVICTION_VARIANTS[ep]
        cold[ep] = ask(tight, ep, prompts[ep], **v)
        plen[ep] = len(cold[ep][0].prompt_ids)
        cold_hits[ep] = counters.delta(plen[ep] * len(cold[ep]))["hits"]
        # Choices after the first share the first one's blocks; nothing else was cached.
        assert cold_hits[ep] == (len(cold[ep]) - 1) * full_blocks_hit(plen[ep], plen[ep])
    for ep in ENDPOINTS:  # all three prompts fit the 40 blocks: each is served from the cache
        warm = ask(tight, ep, prompts[ep], **EVICTION_VARIANTS[ep])
        assert counters.delta(plen[ep] * len(warm))["hits"] == len(warm) * full_blocks_hit(plen[ep], plen[ep])
        assert_same(warm, cold[ep])

    # Other prompts take every block of the cache, least recently used first: 5 x 13 blocks > 40.
    for i in range(5):
        ask(tight, "generate", token_prompt(4100 + i, 200), max_tokens=1)
    assert counters.delta(5 * 200)["hits"] == 0

    for ep in ENDPOINTS:
        again = ask(tight, ep, prompts[ep], **EVICTION_VARIANTS[ep])
        assert counters.delta(plen[ep] * len(again))["hits"] == cold_hits[ep]  # recomputed: evicted, not stale
        assert_same(again, cold[ep])


def test_requests_preempted_while_sharing_cached_blocks_return_what_an_unpreempted_engine_returns(tight, ref):
    """Four sequences share a cached 96-token prefix (6 blocks) and grow to 310 tokens each: 6 + 4 x 14 blocks do
    not fit 40 (nor do 6 + 3 x 14, should one finish before another starts on a loaded machine), so running
    sequences are preempted (their own blocks freed, the shared ones kept) and recomputed from the cache."""
    shared = token_prompt(5000, 6 * BLOCK)
    counters = Counters(tight)
    ask(tight, "generate", shared + token_prompt(5001, 4), max_tokens=2)  # caches the shared blocks
    counters.delta(100)
    requests = [
        ("generate", shared + token_prompt(5002, 34), dict(max_tokens=180)),
        ("generate", shared + token_prompt(5003, 34), dict(max_tokens=180, stream=True, prompt_start=50)),
        ("completions", shared + token_prompt(5004, 34), dict(max_tokens=180, n=2, seed=3)),
    ]

    def run_all(server):
        with concurrent.futures.ThreadPoolExecutor(len(requests)) as pool:
            futures = [pool.submit(ask, server, ep, prompt, **kw) for ep, prompt, kw in requests]
            return [f.result() for f in futures]

    got = run_all(tight)
    d = counters.delta(4 * 130)
    assert d["preemptions"] >= 1, d
    assert d["hits"] >= 4 * len(shared)  # every sequence started from the shared cached blocks
    want = run_all(ref)
    for g, w in zip(got, want):
        assert_same(g, w)


def test_cache_salt_shares_cached_prefixes_only_within_one_salt(moe_server, ref):
    """vLLM's cache_salt: a tenant's prompts never hit blocks another salt (or no salt) computed."""
    prompt = token_prompt(4242, 130)
    counters = Counters(moe_server)

    def generate(salt):
        body = {"token_ids": prompt, "sampling_params": {"max_tokens": 3, "temperature": 0}}
        if salt is not None:
            body["cache_salt"] = salt
        r = httpx.post(f"{moe_server.base_url.removesuffix('/v1')}/inference/v1/generate", json=body,
                       headers={"Authorization": f"Bearer {moe_server.api_key}"}, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]

    first = generate("tenant-a")
    assert counters.delta(len(prompt))["hits"] == 0
    assert generate("tenant-b")["token_ids"] == first["token_ids"]
    assert counters.delta(len(prompt))["hits"] == 0  # another salt: computed again
    assert generate(None)["token_ids"] == first["token_ids"]
    assert counters.delta(len(prompt))["hits"] == 0
    same = generate("tenant-a")
    assert counters.delta(len(prompt))["hits"] == full_blocks_hit(len(prompt), len(prompt)) > 0
    assert same["routed_experts"] == first["routed_experts"]


def test_empty_cache_salt_is_refused(moe_server):
    r = httpx.post(f"{moe_server.base_url}/completions", json={"model": "tiny-mixtral", "prompt": "hi",
                   "max_tokens": 1, "cache_salt": ""}, headers={"Authorization": f"Bearer {moe_server.api_key}"})
    assert r.status_code == 400 and "cache_salt" in r.text
