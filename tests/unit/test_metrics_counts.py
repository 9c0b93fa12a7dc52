"""The API's per-response metric updates: expert selections counted in one bincount, the inter-token latency of a
response of several tokens observed at once; both equal to counting one by one."""
from __future__ import annotations

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from openai_frontend.metrics import _ExpertSelections, _observe_many


class _Model:
    num_hidden_layers = 6
    num_experts = 10

    def __init__(self, moe_layers):
        self.moe_layers = moe_layers


@pytest.mark.parametrize("moe_layers", [[1, 2, 4, 5], [0, 1, 2, 3, 4, 5]])
@pytest.mark.parametrize("dtype", [np.uint8, np.uint16])
def test_expert_selections_equal_per_layer_counts(moe_layers, dtype):
    sel = _ExpertSelections()
    sel.configure(_Model(moe_layers))
    rng = np.random.default_rng(1)
    a = rng.integers(0, 10, (50, 6, 3)).astype(dtype)
    b = a.copy()
    b[0, 1, 0] = 200  # out of range: dropped (the slow path)
    want = np.zeros((6, 10), np.int64)
    for x in (a, b, a[:0]):
        sel.add(x)
        for layer in moe_layers:
            v = x[:, layer, :].ravel()
            want[layer] += np.bincount(v[v < 10], minlength=10)
    assert np.array_equal(sel.snapshot(), want)


def test_observe_many_equals_observing_one_by_one():
    buckets = (0.001, 0.01, 0.1, 1.0)
    r1, r2 = CollectorRegistry(), CollectorRegistry()
    h1 = Histogram("x", "x", buckets=buckets, registry=r1)
    h2 = Histogram("x", "x", buckets=buckets, registry=r2)
    for value, n in [(0.0005, 3), (0.01, 2), (0.05, 7), (5.0, 4), (0.001, 1), (0.1, 5)]:
        _observe_many(h1, value, n)
        for _ in range(n):
            h2.observe(value)

    def counts(r):
        return [line for line in generate_latest(r).decode().splitlines() if "_bucket" in line or "_count" in line]

    assert counts(r1) == counts(r2)
    assert h1._sum.get() == pytest.approx(h2._sum.get())
