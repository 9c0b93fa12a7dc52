"""Prometheus metrics of the API server (one registry per app).

Expert selections are kept in a numpy array ``[num_layers, num_experts]``
(per-layer ``np.bincount`` over each choice's final routed array) and exposed
through a custom collector, so a request costs a few vectorised adds rather
than thousands of labelled counter increments.

The engine's own gauges (``moe_engine_*``: requests by state, steps, and any
the moe backend adds) live on Triton's metrics port, which stays on
127.0.0.1; :class:`_EngineGauges` copies them into this registry when it is
scraped, so the API's ``/metrics`` alone shows everything.
"""

from __future__ import annotations

import bisect
import threading
import urllib.request
from collections.abc import Iterable

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from .generation import Hooks
from .triton_client import ModelInfo

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                    7.5, 10.0, 20.0, 40.0, 80.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
                2.5, 5.0)


class _ExpertSelections(Collector):
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: np.ndarray | None = None
        self._layers: tuple[int, ...] = ()

    def configure(self, model: ModelInfo) -> None:
        with self._lock:
            if self._counts is None or self._counts.shape != (model.num_hidden_layers, model.num_experts):
                self._counts = np.zeros((model.num_hidden_layers, model.num_experts), dtype=np.int64)
            self._layers = tuple(model.moe_layers)

    def add(self, routed: np.ndarray) -> None:
        """``routed``: (rows, num_layers, top_k) expert ids."""
        counts = self._counts
        if counts is None or routed.shape[0] == 0:
            return
        num_layers, num_experts = counts.shape
        # one bincount over the (MoE layer, expert) pairs: id + layer * num_experts, in 16 bits where that fits
        # (six times cheaper than the intp pairs, a millisecond per 48-layer request); ids past num_experts dropped
        layers = np.asarray(self._layers, dtype=np.intp)
        ids = routed if layers.shape[0] == routed.shape[1] else routed[:, layers, :]
        size = num_layers * num_experts
        if ids.size and int(ids.max()) < num_experts and size <= 1 << 16:
            pairs = ids.astype(np.uint16)
            pairs += (layers * num_experts).astype(np.uint16)[None, :, None]
            flat = np.bincount(pairs.ravel(), minlength=size)
        else:
            ids = ids.astype(np.intp)
            valid = ids < num_experts
            flat = np.bincount((ids + (layers * num_experts)[None, :, None])[valid], minlength=size)
        with self._lock:
            counts += flat.reshape(num_layers, num_experts)

    def snapshot(self) -> np.ndarray | None:
        with self._lock:
            return None if self._counts is None else self._counts.copy()

    def collect(self) -> Iterable[Metric]:
        fam = CounterMetricFamily(
            "moe_serve_expert_selections",
            "Times each expert was selected, per MoE layer, over the routed experts returned to clients.",
            labels=["layer", "expert"],
        )
        snap = self.snapshot()
        if snap is not None:
            for layer in self._layers:
                row = snap[layer]
                for expert in np.nonzero(row)[0].tolist():
                    fam.add_metric([str(layer), str(expert)], float(row[expert]))
        yield fam


class _EngineGauges(Collector):
    """The ``moe_engine_*`` families of Triton's metrics endpoint, fetched at each scrape (1 s timeout)."""

    def __init__(self, url: str | None) -> None:
        self.url = url

    def collect(self) -> Iterable[Metric]:
        if not self.url:
            return
        try:
            with urllib.request.urlopen(self.url, timeout=1.0) as r:
                text = r.read().decode("utf-8", "replace")
        except OSError:
            return  # Triton down or restarting: the watchdog and /health say so
        for family in text_string_to_metric_families(text):
            if family.name.startswith("moe_engine_"):
                yield family

    def describe(self) -> Iterable[Metric]:
        return ()  # families known only at scrape time


class Metrics:
    def __init__(self, triton_metrics_url: str | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "moe_serve_requests", "HTTP requests by endpoint and status code.", ["endpoint", "status"], registry=r
        )
        self.prompt_tokens = Counter("moe_serve_prompt_tokens", "Prompt tokens processed.", registry=r)
        self.generation_tokens = Counter("moe_serve_generation_tokens", "Tokens generated (returned).", registry=r)
        self.ttft = Histogram(
            "moe_serve_time_to_first_token_seconds", "Time to first token (streamed engine requests).",
            buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.itl = Histogram(
            "moe_serve_inter_token_latency_seconds", "Time between generated tokens (streamed engine requests).",
            buckets=_ITL_BUCKETS, registry=r,
        )
        self.e2e = Histogram(
            "moe_serve_request_latency_seconds", "End-to-end latency of generation requests.", ["endpoint"],
            buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.routed_bytes = Counter(
            "moe_serve_routed_experts_bytes", "Bytes of routed_experts sent (base64 text).", registry=r
        )
        self.routed_rows = Counter("moe_serve_routed_experts_rows", "Token rows of routed experts sent.", registry=r)
        self.pending = Gauge("moe_serve_pending_choices", "Choices in flight (Triton requests).", registry=r)
        self.rejected = Counter(
            "moe_serve_rejected_requests",
            "Generation requests answered 503 before any work: admission limit, engine queue full, backend "
            "unavailable, shutting down (each counted once).",
            registry=r,
        )
        self.aborted = Counter(
            "moe_serve_aborted_requests",
            "In-flight generation requests the server ended: timeout (--request-timeout), backend_failure, "
            "shutdown (past --shutdown-timeout).",
            ["reason"], registry=r,
        )
        self.backend_restarts = Counter("moe_serve_backend_restarts", "Times the watchdog restarted tritonserver.",
                                        registry=r)
        self.disconnects = Counter(
            "moe_serve_client_disconnects",
            "Requests whose client went away before the end (their Triton requests are cancelled).",
            registry=r,
        )
        self.expert_selections = _ExpertSelections()
        r.register(self.expert_selections)
        r.register(_EngineGauges(triton_metrics_url))

    def configure(self, model: ModelInfo) -> None:
        self.expert_selections.configure(model)

    def hooks(self) -> MetricsHooks:
        return MetricsHooks(self)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class MetricsHooks(Hooks):
    __slots__ = ("m",)

    def __init__(self, m: Metrics) -> None:
        self.m = m

    def on_first_token(self, seconds: float) -> None:
        self.m.ttft.observe(seconds)

    def on_tokens(self, seconds_since_last: float, num_tokens: int) -> None:
        _observe_many(self.m.itl, seconds_since_last / max(1, num_tokens), num_tokens)

    def on_routed(self, array: np.ndarray, encoded_len: int) -> None:
        self.m.routed_bytes.inc(encoded_len)
        self.m.routed_rows.inc(array.shape[0])
        self.m.expert_selections.add(array)


def _observe_many(hist: Histogram, value: float, n: int) -> None:
    """``n`` observations of ``value`` at once (a response of several tokens: one bucket and sum update, not one
    per token). prometheus_client has no weighted observe; its unlabelled Histogram keeps ``_upper_bounds``,
    ``_buckets`` and ``_sum``, else the observations go one by one."""
    if n == 1:
        hist.observe(value)
        return
    bounds, buckets, total = (getattr(hist, a, None) for a in ("_upper_bounds", "_buckets", "_sum"))
    if bounds is None or buckets is None or total is None:
        for _ in range(n):
            hist.observe(value)
        return
    total.inc(value * n)
    buckets[bisect.bisect_left(bounds, value)].inc(n)
