"""Helpers shared by the tests/integration/test_openai_*.py files."""
from __future__ import annotations

import io
import time
import urllib.request

import numpy as np
import pybase64 as base64

# The embedded tiny model (moe_engine.tiny): Mixtral layout, 4 layers, 8 experts, top-2.
NUM_LOCAL_EXPERTS = 8
NUM_EXPERTS_PER_TOK = 2
NUM_HIDDEN_LAYERS = 4


def decode(encoded: str) -> np.ndarray:
    """The one-liner vLLM documents for clients."""
    return np.load(io.BytesIO(base64.b64decode(encoded)))


def assert_valid_routed_experts(encoded: str | None, rows: int | None = None) -> np.ndarray:
    assert encoded is not None
    arr = decode(encoded)
    assert arr.ndim == 3
    num_tokens, num_layers, topk = arr.shape
    assert num_tokens > 0
    assert num_layers == NUM_HIDDEN_LAYERS
    assert topk == NUM_EXPERTS_PER_TOK
    assert arr.dtype == np.uint8
    assert (arr >= 0).all() and (arr < NUM_LOCAL_EXPERTS).all()
    if rows is not None:
        assert num_tokens == rows
    return arr


def extra(obj, name):
    """A vLLM extension field of an openai SDK object (kept in model_extra)."""
    return (obj.model_extra or {}).get(name)


def metric_value(url: str, prefix: str) -> float:
    """Sum of the samples whose line starts with ``prefix`` on a Prometheus endpoint."""
    with urllib.request.urlopen(url, timeout=5) as r:
        text = r.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(prefix))


def wait_until(cond, timeout: float = 10.0, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(interval)
    return False
