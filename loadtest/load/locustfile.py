"""Locust load test of moe-serve's OpenAI-compatible API with routed experts on.

User classes (equal weights, closed loop: each user sends its next request as soon
as the previous one ends, so ``-u N`` = N requests in flight):

- ``CompletionsUser``  POST /v1/completions, non-streaming, text prompt.
- ``ChatStreamUser``   POST /v1/chat/completions, ``stream: true`` with
                       ``stream_options.include_usage``.
- ``GenerateUser``     POST /inference/v1/generate (token ids in/out), half
                       non-streaming, half streaming.

Every request asks for ``return_token_ids`` and a fixed number of output tokens
(``ignore_eos``), seeded sampling (one seed per prompt). Every response is checked
(``common.RoutingVerifier``): ``routed_experts`` decodes as vLLM documents, has
dtype and shape ``(prompt + output - 1, num_hidden_layers, top_k)`` (layers, top-k,
experts and dtype from GET /v1/models), ids < num_experts, k distinct ids per
row, dense layers 0; the same request (same prompt ids and seed) is compared
with its first occurrence: bitwise equality is counted (the engine is not
bitwise batch-invariant on every model), a gross disagreement (rows of another
request, rows shifted) fails; token counts agree with ``usage``; streaming: the
array arrives once, on the final chunk. Any violation is ``response.failure(...)``.

Custom metrics, fired as ``request_type="METRIC"`` (they show up in locust's
tables next to the requests; "response time" column = the value):

- ``ttft_ms <endpoint>``: time to the first chunk carrying generated token ids
  (streaming only; byte-level tokens can produce chunks with empty text, so
  token ids, not text, mark the first token).
- ``itl_ms <endpoint>``: (last token time - first token time) / (tokens - 1).
- ``ms_per_output_token <endpoint>``: end-to-end latency / output tokens.
- ``output_tok_per_s <endpoint>``: value = this request's output tokens / its
  latency; content size = its output tokens (so sum of sizes = tokens generated).
- ``routed_experts_bytes <endpoint>``: base64 length of the routed_experts string.

Locust's own time for streaming requests is replaced by the full time to
``[DONE]`` (locust would otherwise stop the clock at the response headers).

Options (also env vars): ``--max-tokens`` (64), ``--prompt-tokens`` (64-192),
``--num-prompts`` (32), ``--temperature`` (1.0), ``--api-key``,
``--no-consistency``, ``--request-log FILE`` (a CSV row per request, written at
the end), ``--verify-report FILE`` (JSON: responses verified, failures by reason).

    .venv/bin/locust -f loadtest/load/locustfile.py --headless -u 32 -r 32 -t 60s --host http://127.0.0.1:9000
"""
from __future__ import annotations

import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: loadtest.* when run by path

from locust import HttpUser, constant, events, task  # noqa: E402

from loadtest.bench.common import (  # noqa: E402
    RoutingVerifier, VerifyError, fetch_model_info, iter_sse, parse_range, text_prompts, token_prompts,
)

TIMEOUT = (10, 900)  # connect, read (s)


class _State:
    info = None
    verifier: RoutingVerifier | None = None
    text: list[str] = []
    tokens: list[list[int]] = []
    max_tokens = 64
    temperature = 1.0
    headers: dict = {}
    records: list[tuple] = []


S = _State()


@events.init_command_line_parser.add_listener
def _options(parser):
    parser.add_argument("--max-tokens", type=int, default=64, env_var="LOADTEST_MAX_TOKENS",
                        help="output tokens per request (ignore_eos)")
    parser.add_argument("--prompt-tokens", default="64-192", env_var="LOADTEST_PROMPT_TOKENS",
                        help="prompt length range in tokens, e.g. 64-192 (text prompts: about that many tokens)")
    parser.add_argument("--num-prompts", type=int, default=32, env_var="LOADTEST_NUM_PROMPTS")
    parser.add_argument("--temperature", type=float, default=1.0, env_var="LOADTEST_TEMPERATURE")
    parser.add_argument("--api-key", default="", env_var="LOADTEST_API_KEY")
    parser.add_argument("--no-consistency", action="store_true", default=False, env_var="LOADTEST_NO_CONSISTENCY",
                        help="skip the comparison with earlier identical requests")
    parser.add_argument("--request-log", default="", env_var="LOADTEST_REQUEST_LOG",
                        help="CSV file: one row per request (written when the test stops)")
    parser.add_argument("--verify-report", default="", env_var="LOADTEST_VERIFY_REPORT",
                        help="JSON file: verification counts (written when the test stops)")


@events.test_start.add_listener
def _test_start(environment, **_kw):
    o = environment.parsed_options
    S.headers = {"Authorization": f"Bearer {o.api_key}"} if o.api_key else {}
    S.info = fetch_model_info(environment.host, o.api_key or None)
    if not S.info.routed_experts_enabled:
        raise SystemExit("the server has routed experts off (--disable-routed-experts); this load test needs them")
    S.verifier = RoutingVerifier(S.info, consistency=not o.no_consistency)
    lo, hi = parse_range(o.prompt_tokens)
    # The tiny tokenizer gives about 2.2 tokens per word of this word list (chat adds ~8 template tokens).
    S.text = text_prompts(o.num_prompts, max(1, lo * 10 // 22), max(1, hi * 10 // 22), seed=1)
    S.tokens = token_prompts(o.num_prompts, lo, hi, S.info.vocab_size, seed=2)
    S.max_tokens, S.temperature = o.max_tokens, o.temperature
    S.records = []


@events.test_stop.add_listener
def _test_stop(environment, **_kw):
    o = environment.parsed_options
    if o.request_log:
        with open(o.request_log, "w") as f:
            f.write("t_end,endpoint,ok,e2e_s,ttft_s,itl_s,prompt_tokens,output_tokens,routed_bytes,error\n")
            for r in S.records:
                f.write(",".join("" if v is None else str(v) for v in r) + "\n")
    if o.verify_report and S.verifier is not None:
        rep = S.verifier.summary()
        rep["model"] = S.info.__dict__ if S.info else None
        rep["requests_recorded"] = len(S.records)
        rep["requests_ok"] = sum(1 for r in S.records if r[2])
        with open(o.verify_report, "w") as f:
            json.dump(rep, f, indent=1, default=list)


def metric(name: str, value: float, length: int = 0) -> None:
    events.request.fire(request_type="METRIC", name=name, response_time=value, response_length=length,
                        exception=None, context={})


def _sampling(i: int) -> dict:
    return {"max_tokens": S.max_tokens, "temperature": S.temperature, "seed": 1000 + i, "ignore_eos": True,
            "return_token_ids": True}


def _consistency_key(i: int) -> tuple:
    return (1000 + i, S.max_tokens, S.temperature)


class _Base(HttpUser):
    abstract = True
    wait_time = constant(0)

    def _finish(self, r, name, t0, prompt_ids, out_ids, routed, usage, finish_reason, i,
                t_first=None, t_last=None, nbytes=None):
        """Checks after the body is read; raises VerifyError. Fires the metrics, records the request."""
        t_end = time.perf_counter()
        e2e = t_end - t0
        if nbytes is not None:  # streaming: locust measured only up to the headers
            r.request_meta["response_time"] = e2e * 1000
            r.request_meta["response_length"] = nbytes
        if out_ids is None or len(out_ids) != S.max_tokens:
            raise VerifyError(f"expected {S.max_tokens} output tokens, got {None if out_ids is None else len(out_ids)}")
        if finish_reason != "length":
            raise VerifyError(f"finish_reason {finish_reason!r}, expected 'length'")
        if usage is None:
            raise VerifyError("usage missing")
        if usage.get("completion_tokens") != len(out_ids) or usage.get("prompt_tokens") != len(prompt_ids or ()):
            raise VerifyError("usage disagrees with token_ids/prompt_token_ids")
        S.verifier.check(routed, prompt_ids, out_ids, key=_consistency_key(i))
        n = len(out_ids)
        ttft = itl = None
        if t_first is not None:
            ttft = t_first - t0
            metric(f"ttft_ms {name}", ttft * 1000)
            if n > 1 and t_last is not None:
                itl = (t_last - t_first) / (n - 1)
                metric(f"itl_ms {name}", itl * 1000)
        metric(f"ms_per_output_token {name}", e2e * 1000 / n)
        metric(f"output_tok_per_s {name}", n / e2e, n)
        metric(f"routed_experts_bytes {name}", len(routed), len(routed))
        S.records.append((round(time.time(), 3), name, 1, round(e2e, 5), None if ttft is None else round(ttft, 5),
                          None if itl is None else round(itl, 6), len(prompt_ids), n, len(routed), ""))
        r.success()

    def _fail(self, r, name, t0, msg):
        msg = msg.replace(",", ";")[:300]
        S.records.append((round(time.time(), 3), name, 0, round(time.perf_counter() - t0, 5), None, None, None,
                          None, None, msg))
        r.failure(msg)

    def _post(self, path, name, body, i, stream, prompt_ids_known=None):
        t0 = time.perf_counter()
        with self.client.post(path, json=body, name=name, stream=stream, catch_response=True, timeout=TIMEOUT,
                              headers=S.headers) as r:
            try:
                if r.status_code != 200:
                    text = r.text if not stream else r.raw.read(300).decode(errors="replace")
                    raise VerifyError(f"HTTP {r.status_code}: {text[:200]}")
                if stream:
                    self._read_stream(r, name, t0, i, prompt_ids_known)
                else:
                    d = r.json()
                    ch = d["choices"][0]
                    prompt_ids = ch.get("prompt_token_ids") or prompt_ids_known
                    self._finish(r, name, t0, prompt_ids, ch.get("token_ids"), ch.get("routed_experts"),
                                 d.get("usage"), ch.get("finish_reason"), i)
            except VerifyError as e:
                self._fail(r, name, t0, str(e))
            except Exception as e:  # noqa: BLE001 - a broken stream or body is a failed request
                self._fail(r, name, t0, f"{type(e).__name__}: {e}")

    def _read_stream(self, r, name, t0, i, prompt_ids_known):
        prompt_ids = prompt_ids_known
        out: list[int] = []
        routed = usage = finish = t_first = t_last = None
        nbytes = 0

        def lines():
            nonlocal nbytes
            for line in r.iter_lines(chunk_size=None):
                nbytes += len(line) + 1
                yield line

        for t, ev in iter_sse(lines()):
            if ev.get("usage"):
                usage = ev["usage"]
            for ch in ev.get("choices") or ():
                if ch.get("index", 0) != 0:
                    raise VerifyError("unexpected choice index")
                if ch.get("prompt_token_ids"):
                    if prompt_ids_known is not None and ch["prompt_token_ids"] != prompt_ids_known:
                        raise VerifyError("prompt_token_ids differ from the token_ids sent")
                    prompt_ids = ch["prompt_token_ids"]
                ids = ch.get("token_ids") or ()
                if ids:
                    if finish is not None:
                        raise VerifyError("tokens after the final chunk")
                    out.extend(ids)
                    t_last = t
                    if t_first is None:
                        t_first = t
                if ch.get("routed_experts") is not None:
                    if routed is not None:
                        raise VerifyError("routed_experts on more than one chunk")
                    if ch.get("finish_reason") is None:
                        raise VerifyError("routed_experts before the final chunk")
                    routed = ch["routed_experts"]
                if ch.get("finish_reason"):
                    finish = ch["finish_reason"]
        self._finish(r, name, t0, prompt_ids, out, routed, usage, finish, i, t_first, t_last, nbytes)


class CompletionsUser(_Base):
    NAME = "/v1/completions"

    @task
    def completion(self):
        i = random.randrange(len(S.text))
        body = {"model": S.info.id, "prompt": S.text[i], **_sampling(i)}
        self._post("/v1/completions", self.NAME, body, i, stream=False)


class ChatStreamUser(_Base):
    NAME = "/v1/chat/completions [stream]"

    @task
    def chat(self):
        i = random.randrange(len(S.text))
        body = {"model": S.info.id, "messages": [{"role": "user", "content": S.text[i]}], "stream": True,
                "stream_options": {"include_usage": True}, **_sampling(i)}
        self._post("/v1/chat/completions", self.NAME, body, i, stream=True)


class GenerateUser(_Base):
    @task
    def generate(self):
        i = random.randrange(len(S.tokens))
        body = {"model": S.info.id, "token_ids": S.tokens[i], "sampling_params": _sampling(i)}
        self._post("/inference/v1/generate", "/inference/v1/generate", body, i, stream=False,
                   prompt_ids_known=S.tokens[i])

    @task
    def generate_stream(self):
        i = random.randrange(len(S.tokens))
        body = {"model": S.info.id, "token_ids": S.tokens[i], "sampling_params": _sampling(i), "stream": True,
                "stream_options": {"include_usage": True}}
        self._post("/inference/v1/generate", "/inference/v1/generate [stream]", body, i, stream=True,
                   prompt_ids_known=S.tokens[i])
