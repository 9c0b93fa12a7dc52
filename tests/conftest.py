"""Shared test set-up: every test session uses the same deterministic tiny checkpoint."""
import os

import pytest

# Keep torch to one thread per test process pair on 2-core machines: the server runs beside.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Without a GPU the fused Triton kernels are tested under Triton's interpreter (tests/unit/test_kernels.py);
# it is chosen when the kernels are defined, so before anything imports moe_engine.
if os.environ.get("MOE_TEST_DEVICE", "cpu") == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def tiny_checkpoint():
    from moe_engine.tiny import ensure_tiny_checkpoint

    return ensure_tiny_checkpoint()
