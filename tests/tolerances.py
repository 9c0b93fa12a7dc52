"""How far float32 results of one request may move when it runs in batches of other shapes.

The same request computed alone, beside other requests, in another step size or in an overlapped step goes
through GEMMs and reductions of other row counts, which the BLAS library (AVX2 or AVX-512 kernels, on this
CPU or that) and the GPU (split-K chosen by size) block differently: the sums are the same numbers added in
another order. Float32 keeps 24 bits (unit roundoff u = 2**-24 = 6.0e-8); a dot product of n terms summed in
two orders can differ by up to about n * u times the sum of the terms' magnitudes (Higham's gamma_n). The test
models' dot products have 64-128 terms (hidden and expert widths), so each is good to ~8e-6 of its terms'
magnitude; four layers and the log-softmax over the vocabulary compound a few of those, and logprobs of
magnitude 1-10 end up a few 1e-5 apart (1.0e-5 seen on an AMD EPYC with AVX-512). The bound below is that
with a margin: 1e-4 relative plus 1e-4 absolute.

It is still three orders of magnitude below what a real fault changes: another request's logprobs, a token's
logprob from another position or a stale step differ by 1e-2 or more. Where paths are meant to be identical to
the bit (same shapes, replay, the bit-exact kernels), tests compare with ``==``, not with this.
"""
from __future__ import annotations

import numpy as np
import pytest

FP32_ACROSS_BATCHES = dict(rel=1e-4, abs=1e-4)


def approx_across_batches(expected):
    """``pytest.approx`` of float32 values computed in batches of other shapes (see the module docstring)."""
    return pytest.approx(expected, **FP32_ACROSS_BATCHES)


def assert_close_across_batches(actual, expected, err_msg: str = "") -> None:
    """``np.testing.assert_allclose`` with the across-batches float32 bound (see the module docstring)."""
    np.testing.assert_allclose(np.asarray(actual, dtype=np.float64), np.asarray(expected, dtype=np.float64),
                               rtol=FP32_ACROSS_BATCHES["rel"], atol=FP32_ACROSS_BATCHES["abs"], err_msg=err_msg)
