"""The engine's gauges and counters on Triton's /metrics (custom metrics of the python backend), refreshed by the
response thread every poll. moe-serve copies them into the API's /metrics, and its watchdog reads them: steps must
grow while the engine holds requests, unless it is paused, sleeping or running a control operation on purpose.

The expert load (moe_engine/core/expert_load.py) adds a counter of routed tokens and three gauges per MoE layer (never
per expert: the series are the MoE layers x 3, fixed by the model), each over the sliding window."""
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
    # expert load (present while it is on)
    ("moe_engine_routed_tokens", "counter", "Tokens forwarded through the MoE layers (once per step a token is "
     "forwarded in; prompt tokens served from the prefix cache are not forwarded)", {"routed_tokens": {}}),
    ("moe_engine_expert_load_window_seconds", "gauge", "Seconds of the window the per-layer expert-load gauges count "
     "over (--expert-load-window)", {"expert_load_window_seconds": {}}),
)

# (family name, stats key: a list with one value per MoE layer, in the order of stats["layers"], description)
LAYER_FAMILIES = (
    ("moe_engine_expert_load_imbalance", "expert_load_imbalance", "Per MoE layer over the window: tokens of its "
     "busiest expert / mean tokens per expert (1 = balanced; 0 while the window saw no tokens)"),
    ("moe_engine_expert_load_entropy", "expert_load_entropy", "Per MoE layer over the window: entropy of the "
     "routing distribution over the experts / log(experts) (1 = uniform; 0 while the window saw no tokens)"),
    ("moe_engine_expert_load_top10_share", "expert_load_top10_share", "Per MoE layer over the window: share of "
     "the expert selections that went to the busiest 10% of its experts"),
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
        self._labels = labels
        self._layer_families = {}  # stats key -> family; its per-layer series made at the first update
        self._layer_metrics: dict[str, list] = {}
        for name, kind, description, keys in FAMILIES:
            family = pb_utils.MetricFamily(
                name=name, description=description,
                kind=pb_utils.MetricFamily.COUNTER if kind == "counter" else pb_utils.MetricFamily.GAUGE,
            )
            self._families.append(family)
            for key, extra in keys.items():
                self._metrics[key] = (kind, family.Metric(labels={**labels, **extra}))
        for name, key, description in LAYER_FAMILIES:
            family = pb_utils.MetricFamily(name=name, description=description, kind=pb_utils.MetricFamily.GAUGE)
            self._families.append(family)
            self._layer_families[key] = family

    def update(self, stats: dict) -> None:
        """Set the gauges and advance the counters to ``stats`` (keys without a series are ignored)."""
        layers = stats.get("layers")
        for key, value in stats.items():
            if key in self._layer_families and layers is not None:
                self._update_layers(key, layers, value)
                continue
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

    def _update_layers(self, key: str, layers, values) -> None:
        metrics = self._layer_metrics.get(key)
        if metrics is None:  # one series per MoE layer, labelled with its global index
            family = self._layer_families[key]
            metrics = self._layer_metrics[key] = [family.Metric(labels={**self._labels, "layer": str(layer)})
                                                  for layer in layers]
        for metric, value in zip(metrics, values):
            metric.set(float(value))
