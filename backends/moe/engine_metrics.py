"""The engine's gauges and counters on Triton's /metrics (custom metrics of the python backend), refreshed by the
response thread every poll. moe-serve copies them into the API's /metrics, and its watchdog reads them: steps must
grow while the engine holds requests, unless it is paused, sleeping or running a control operation on purpose."""
from __future__ import annotations

import json

import triton_python_backend_utils as pb_utils

# (family name, kind, description, {stats key: labels})
FAMILIES = (
    ("moe_engine_requests", "gauge", "Requests in the moe engine by state",
     {"running": {"state": "running"}, "waiting": {"state": "waiting"}}),
    ("moe_engine_kv_blocks", "gauge", "KV-cache blocks: total, free (cached ones included), holding a cached prefix",
     {"num_blocks": {"state": "total"}, "free_blocks": {"state": "free"}, "cached_blocks": {"state": "cached"}}),
    ("moe_engine_kv_block_size", "gauge", "Tokens per KV-cache block (the prefix cache reuses whole blocks)",
     {"block_size": {}}),
    ("moe_engine_kv_cache_bytes_per_token", "gauge", "KV-cache bytes one token takes in all layers (MLA models: "
     "the compressed latent and the rope key, never expanded K/V)", {"kv_bytes_per_token": {}}),
    ("moe_engine_kv_cache_usage", "gauge", "Share of KV-cache blocks in use by running sequences",
     {"kv_cache_usage": {}}),
    ("moe_engine_preemptions", "counter", "Sequences preempted (KV blocks freed, recomputed later)",
     {"num_preemptions": {}}),
    ("moe_engine_prefix_cache_queries", "counter", "Prompt tokens looked up in the prefix cache",
     {"prefix_cache_queries": {}}),
    ("moe_engine_prefix_cache_hits", "counter", "Prompt tokens served from the prefix cache",
     {"prefix_cache_hits": {}}),
    # Liveness and progress, for moe-serve's watchdog: steps must grow while requests are in the engine.
    ("moe_engine_steps", "gauge", "Engine steps run since the model was loaded", {"steps": {}}),
    ("moe_engine_alive", "gauge", "1 while the engine thread runs, 0 once it died", {"alive": {}}),
    # Why steps may stop on purpose (the watchdog does not count these as stalls).
    ("moe_engine_paused", "gauge", "1 while generation is paused (pause_generation)", {"paused": {}}),
    ("moe_engine_sleeping", "gauge", "1 while memory is released (release_memory_occupation, /sleep)",
     {"sleeping": {}}),
    ("moe_engine_control_ops", "gauge", "Control operations the engine thread runs now (a weight update holds "
     "steps back while it loads)", {"control_ops": {}}),
    ("moe_engine_weights_lost", "gauge", "1 while generation is refused because a restart could not bring the "
     "served weights back (pushed again: 0)", {"weights_lost": {}}),
)


class EngineMetrics:
    """One model instance's series of every family (with data parallelism, labelled by instance)."""

    def __init__(self, args: dict):
        labels = {"model": args["model_name"], "version": args["model_version"]}
        groups = json.loads(args["model_config"]).get("instance_group", [])
        if sum(int(g.get("count", 1)) for g in groups) > 1:  # data parallelism: one series per instance (engine)
            labels["instance"] = args.get("model_instance_name", "")
        self._families = []  # families must outlive their metrics: kept here
        self._metrics: dict[str, tuple[str, object]] = {}
        self._last: dict[str, float] = {}
        for name, kind, description, keys in FAMILIES:
            family = pb_utils.MetricFamily(
                name=name, description=description,
                kind=pb_utils.MetricFamily.COUNTER if kind == "counter" else pb_utils.MetricFamily.GAUGE,
            )
            self._families.append(family)
            for key, extra in keys.items():
                self._metrics[key] = (kind, family.Metric(labels={**labels, **extra}))

    def update(self, stats: dict) -> None:
        """Set the gauges and advance the counters to ``stats`` (keys without a series are ignored)."""
        for key, value in stats.items():
            if key not in self._metrics:
                continue
            kind, metric = self._metrics[key]
            if kind == "counter":  # Triton counters only increment
                last = self._last.get(key, 0)
                if value > last:
                    metric.increment(value - last)
                self._last[key] = value
            else:
                metric.set(value)
