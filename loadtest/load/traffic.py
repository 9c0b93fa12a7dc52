"""Mixed OpenAI traffic with strict bookkeeping, for the reliability runs (soak.py, fault_injection.py).

Every request is one of: completion (JSON), chat completion (SSE), generate with token ids (JSON or SSE),
8 to 64 output tokens, routed experts on. Each gets a client-side limit (``hang_after_s``); a request that
has not ended by then is a *hang*. Every outcome is recorded: HTTP status, the OpenAI error code (for SSE,
the code of an error event), whether a stream ended with ``data: [DONE]``, latency.

"Allowed" outcomes: 200 (streams ending with [DONE]); 503 with Retry-After (codes ``overloaded``,
``backend_unavailable``, ``shutting_down``), also as an SSE error event followed by [DONE]; client
disconnects we caused ourselves. Anything else (another 5xx, a stream cut without [DONE], a hang) is a
failure the reports count.
"""
from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx

ALLOWED_503 = {"overloaded", "backend_unavailable", "shutting_down"}


@dataclass
class Outcome:
    kind: str
    status: int  # HTTP status; 0 = transport error, -1 = hang (client limit), -2 = we disconnected
    code: str | None = None  # error code (JSON body or SSE error event)
    done: bool = True  # streams: ended with [DONE]
    retry_after: bool = True  # 503s: carried Retry-After
    start: float = 0.0
    end: float = 0.0
    detail: str = ""

    @property
    def ok(self) -> bool:
        if self.status == 200:
            return self.done and (self.code is None or self.code in ALLOWED_503)
        if self.status == 503:
            return self.code in ALLOWED_503 and self.retry_after
        return self.status == -2


@dataclass
class Ledger:
    outcomes: list[Outcome] = field(default_factory=list)

    def add(self, o: Outcome) -> None:
        self.outcomes.append(o)

    def summary(self, since: float = 0.0, until: float = float("inf")) -> dict:
        os_ = [o for o in self.outcomes if since <= o.start < until]
        statuses = Counter(str(o.status) for o in os_)
        codes = Counter(o.code for o in os_ if o.code)
        bad = [o for o in os_ if not o.ok]
        lat = sorted(o.end - o.start for o in os_ if o.status == 200 and o.code is None)
        return {
            "requests": len(os_),
            "statuses": dict(statuses),
            "error_codes": dict(codes),
            "hangs": sum(o.status == -1 for o in os_),
            "streams_without_done": sum(o.status == 200 and not o.done for o in os_),
            "other_5xx": sum(o.status >= 500 and o.status != 503 for o in os_),
            "503_without_retry_after": sum(o.status == 503 and not o.retry_after for o in os_),
            "transport_errors": sum(o.status == 0 for o in os_),
            "not_allowed": len(bad),
            "not_allowed_examples": [f"{o.kind} {o.status} {o.code} {o.detail[:120]}" for o in bad[:5]],
            "p50_s": lat[len(lat) // 2] if lat else None,
            "p99_s": lat[int(len(lat) * 0.99)] if lat else None,
        }


class Traffic:
    def __init__(self, root_url: str, api_key: str | None, model: str, hang_after_s: float = 120.0,
                 vocab_size: int = 500, seed: int = 0) -> None:
        self.root = root_url
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.model = model
        self.hang_after_s = hang_after_s
        self.vocab_size = vocab_size
        self.rng = random.Random(seed)
        self.ledger = Ledger()
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(hang_after_s, connect=10),
                                        limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))

    async def aclose(self) -> None:
        await self.client.aclose()

    def _request(self) -> tuple[str, str, dict, bool]:
        r = self.rng.random()
        n_out = self.rng.randint(8, 64)
        words = " ".join(self.rng.choice(["moe", "expert", "route", "token", "layer", "GPU"]) for _ in range(20))
        if r < 0.3:
            return "completion", "/v1/completions", {"model": self.model, "prompt": words, "max_tokens": n_out}, False
        if r < 0.6:
            body = {"model": self.model, "messages": [{"role": "user", "content": words}], "max_tokens": n_out,
                    "stream": True}
            return "chat_stream", "/v1/chat/completions", body, True
        ids = [self.rng.randrange(3, self.vocab_size) for _ in range(self.rng.randint(16, 96))]
        stream = r >= 0.8
        body = {"model": self.model, "token_ids": ids, "sampling_params": {"max_tokens": n_out}, "stream": stream}
        return "generate" + ("_stream" if stream else ""), "/inference/v1/generate", body, stream

    async def one(self, disconnect_after_first: bool = False) -> Outcome:
        kind, path, body, stream = self._request()
        if disconnect_after_first and not stream:
            kind, path, body, stream = "chat_stream", "/v1/chat/completions", {
                "model": self.model, "messages": [{"role": "user", "content": "a long story"}], "max_tokens": 400,
                "stream": True, "ignore_eos": True}, True
        o = Outcome(kind=kind, status=0, start=time.monotonic())
        try:
            await asyncio.wait_for(self._run(o, path, body, stream, disconnect_after_first), self.hang_after_s)
        except asyncio.TimeoutError:
            o.status, o.detail = -1, "no end within the client limit"
        except (httpx.HTTPError, OSError) as e:
            o.status, o.detail = 0, f"{type(e).__name__}: {e}"
        o.end = time.monotonic()
        self.ledger.add(o)
        return o

    async def _run(self, o: Outcome, path: str, body: dict, stream: bool, disconnect: bool) -> None:
        if not stream:
            r = await self.client.post(self.root + path, json=body, headers=self.headers)
            o.status = r.status_code
            o.retry_after = "retry-after" in r.headers
            if r.status_code != 200:
                o.code = _code(r.text)
                o.detail = r.text[:200]
            return
        async with self.client.stream("POST", self.root + path, json=body, headers=self.headers) as r:
            o.status = r.status_code
            o.retry_after = "retry-after" in r.headers
            if r.status_code != 200:
                o.code = _code((await r.aread()).decode(errors="replace"))
                return
            o.done = False
            async for line in r.aiter_lines():
                if disconnect:
                    o.status = -2
                    return  # leaving the block closes the connection mid-stream
                if line == "data: [DONE]":
                    o.done = True
                elif line.startswith('data: {"error"'):
                    o.code = _code(line[6:])
                    o.detail = line[:200]

    async def workers(self, concurrency: int, stop_at: float) -> None:
        async def worker():
            while time.monotonic() < stop_at:
                o = await self.one()
                if o.status in (503, 0):
                    await asyncio.sleep(0.2)  # as a client honouring Retry-After would (shortened)

        await asyncio.gather(*(worker() for _ in range(concurrency)))

    async def burst(self, n: int, disconnect_after_first: bool = False) -> list[Outcome]:
        return list(await asyncio.gather(*(self.one(disconnect_after_first) for _ in range(n))))

    async def health(self) -> int:
        try:
            return (await self.client.get(self.root + "/health", timeout=5)).status_code
        except httpx.HTTPError:
            return 0

    async def metrics(self) -> str:
        try:
            return (await self.client.get(self.root + "/metrics", timeout=10)).text
        except httpx.HTTPError:
            return ""


def _code(text: str) -> str | None:
    try:
        return json.loads(text)["error"].get("code")
    except (ValueError, KeyError, TypeError, AttributeError):
        return None


def metric(text: str, series: str) -> float | None:
    """The value of one series of Prometheus text, e.g. 'moe_engine_requests{model="moe",state="running",...}'."""
    for line in text.splitlines():
        if not line.startswith("#") and line.rsplit(" ", 1)[0] == series:
            return float(line.rsplit(" ", 1)[1])
    return None
