"""The small-step dense GEMM (moe_engine/dense_gemm.py) against the exact product and torch's F.linear.

Only the float32 summation order differs from cuBLAS's, so every element must lie within one rounding of the
model dtype (plus float32 summation error) of the exact product, and nearly all of them be the exact product
rounded. Runs under Triton's interpreter on CPU (tests/conftest.py); ``MOE_TEST_DEVICE=cuda`` runs the compiled
kernel on a GPU.
"""
from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn.functional as F

from moe_engine import dense_gemm, kernels
from moe_engine.fused_moe import TileConfig

DEVICE = os.environ.get("MOE_TEST_DEVICE", "cpu")
UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
# N and K deliberately not multiples of the tiles (wrapped column tiles, K tails)
N, K = 72, 200
SMALL = TileConfig(BLOCK_M=16, BLOCK_N=32, BLOCK_K=64, num_warps=4, num_stages=2)

pytestmark = pytest.mark.skipif(not kernels.available(DEVICE), reason="Triton not available for this device")


def operands(M: int, dtype: torch.dtype, bias: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g)
    w = torch.randn(N, K, generator=g) / K**0.5
    b = torch.randn(N, generator=g) if bias else None
    return x.to(DEVICE, dtype), w.to(DEVICE, dtype), None if b is None else b.to(DEVICE, dtype)


def exact(x, w, b):
    y = x.double() @ w.double().T
    return y if b is None else y + b.double()


def assert_within_one_rounding(y, x, w, b):
    """|y - exact| <= u|exact| (the final rounding) + K * 2^-24 * (|x| @ |w|^T) (float32 sums in any order)."""
    ref = exact(x, w, b)
    u = UNIT_ROUNDOFF[y.dtype]
    mag = x.double().abs() @ w.double().abs().T + (0 if b is None else b.double().abs())
    bound = u * ref.abs() + K * 2.0**-24 * mag + 1e-12
    err = (y.double() - ref).abs()
    assert (err <= bound).all(), f"error {(err / bound).max().item():.2f}x the bound"
    if y.dtype != torch.float32:  # the exact product rounded, but for rounding near-ties
        assert (y == ref.to(y.dtype)).float().mean().item() >= 0.98


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("M", [1, 7, 16, 21, 64])
def test_gemm_equals_the_exact_product_within_one_rounding(dtype, M):
    for bias in (False, True):
        x, w, b = operands(M, dtype, bias, seed=M)
        y = dense_gemm.gemm(x, w, b, SMALL)
        assert y.shape == (M, N) and y.dtype == dtype
        assert_within_one_rounding(y, x, w, b)
        if dtype == torch.float32:
            torch.testing.assert_close(y, F.linear(x, w, b), rtol=1e-5, atol=1e-5)


def test_gemm_reads_strided_rows_and_writes_into_a_given_output():
    """Attention's output is a view; the q/k/v weight a view of one storage: strided rows either side."""
    x, w, b = operands(5, torch.float32, True)
    wide = torch.zeros(5, 2 * K, device=DEVICE)
    wide[:, :K] = x
    out = torch.full((5, N), float("nan"), device=DEVICE)
    y = dense_gemm.gemm(wide[:, :K], w, b, SMALL, out=out)
    assert y.data_ptr() == out.data_ptr()
    torch.testing.assert_close(out, F.linear(x, w, b), rtol=1e-5, atol=1e-5)


def test_a_rows_result_does_not_depend_on_the_other_rows_of_its_step():
    """Decode batches pad to CUDA-graph buckets and mix sequences: a row must come out the same bits alone,
    among other rows and after padding rows (one config, as within one bucket)."""
    x, w, _ = operands(13, torch.bfloat16, False)
    together = dense_gemm.gemm(x, w, None, SMALL)
    for r in (0, 6, 12):
        assert torch.equal(dense_gemm.gemm(x[r:r + 1], w, None, SMALL)[0], together[r])
    padded = torch.cat([x, torch.randn(3, K, device=DEVICE).to(x.dtype)])
    assert torch.equal(dense_gemm.gemm(padded, w, None, SMALL)[:13], together)


def test_mismatched_shapes_are_refused():
    x, w, _ = operands(3, torch.float32, False)
    with pytest.raises(ValueError, match="do not fit"):
        dense_gemm.gemm(x[:, :-1], w, None, SMALL)
    with pytest.raises(ValueError, match="do not fit"):
        dense_gemm.gemm(x, w, torch.zeros(N + 1, device=DEVICE), SMALL)


def test_linear_takes_the_kernel_only_for_small_steps(monkeypatch):
    calls = []
    gemm = dense_gemm.gemm
    monkeypatch.setattr(dense_gemm, "gemm", lambda *a, **kw: calls.append(a[0].shape[0]) or gemm(*a, **kw))
    for M in (1, dense_gemm.DEFAULT_MAX_ROWS, dense_gemm.DEFAULT_MAX_ROWS + 1, dense_gemm.MAX_ROWS + 1):
        x, w, b = operands(M, torch.float32, True)
        torch.testing.assert_close(dense_gemm.linear(x, w, b), F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    # untuned shape: the default config up to DEFAULT_MAX_ROWS rows, cuBLAS (F.linear) above
    assert calls == [1, dense_gemm.DEFAULT_MAX_ROWS]


def test_tuned_table_chooses_config_or_cublas_per_bucket(tmp_path, monkeypatch):
    path = tmp_path / "dense.json"
    monkeypatch.setenv(dense_gemm.CONFIG_ENV, str(path))
    x, w, _ = operands(1, torch.float32, False)
    key = dense_gemm.table_key(dense_gemm.device_name(x.device), N, K, torch.float32)
    dense_gemm.write_table(path, key, {"1-16": None, "17-32": SMALL, "33-64": SMALL})
    dense_gemm.write_table(path, dict(key, N=N + 1), {"1-16": SMALL, "17-32": None, "33-64": None})  # kept apart
    assert len(json.loads(path.read_text())["tables"]) == 2
    try:
        assert dense_gemm.config_for(1, w) is None  # cuBLAS was faster there
        assert dense_gemm.config_for(17, w) == SMALL and dense_gemm.config_for(64, w) == SMALL
        assert dense_gemm.config_for(65, w) is None
        path.write_text("{not json")
        dense_gemm._table.cache_clear()
        with pytest.warns(UserWarning, match="ignoring tile configs"):
            assert dense_gemm.config_for(1, w) == dense_gemm.DEFAULT_CONFIG
    finally:
        dense_gemm._table.cache_clear()


def test_committed_table_parses_and_every_config_is_launchable():
    """The tuned table in the repository: every entry a config this module can launch (on a small shape)."""
    path = dense_gemm.CONFIG_FILE
    if not path.is_file():
        pytest.skip("no tuned table committed")
    x, w, _ = operands(3, torch.bfloat16, False)
    for entry in json.loads(path.read_text())["tables"]:
        assert set(entry["buckets"]) == {name for name, _ in dense_gemm.BUCKETS}
        for cfg in entry["buckets"].values():
            if cfg is not None:
                assert_within_one_rounding(dense_gemm.gemm(x, w, None, TileConfig.from_dict(cfg)), x, w, None)
