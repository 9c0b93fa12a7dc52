"""Programmatic dependent launch (PDL): a forward's Triton kernels start while the kernel before them runs.

A batch-1 decode step of Qwen3-30B-A3B is ~500 kernels of a few microseconds each, and between two of them the
GPU sits idle while the next one is launched and its programs are scheduled (~0.7 ms of a 3.9 ms step on an
H200: loadtest/reports/real_shape_h200.md). With PDL (Hopper and later) a kernel launched with CUDA's
programmatic-stream-serialization attribute may begin as soon as every program of the kernel before it has
signalled ``griddepcontrol.launch_dependents``; CUDA graph capture keeps the attribute as a programmatic edge.

The contract every kernel launched this way keeps (``wait_for_inputs`` first thing in the kernel):

* ``griddepcontrol.wait`` before any load or store: it blocks until the previous kernel has completed and its
  writes are visible, so nothing is read early and nothing is overwritten while a predecessor still reads it.
  Completion is transitive (a kernel completes only after its own wait returned), so the order of the whole
  stream is kept.
* ``griddepcontrol.launch_dependents`` right after the wait: the next kernel may launch while this one computes;
  its programs then wait in turn. The only work before a wait is address arithmetic and, in dense_gemm, an L2
  prefetch of the kernel's own weights (``prefetch_l2``), which no kernel writes during a forward.

Kernels of torch or cuBLAS in between keep the ordinary full dependency (they never signal early). Off under
Triton's interpreter and on GPUs before Hopper (the wait and signal are then not compiled in); ``MOE_PDL=0``
turns it off (to time the difference).
"""
from __future__ import annotations

import functools
import os

import torch

try:
    import triton
    import triton.language as tl
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # CPU wheels of torch do not bring Triton
    triton = None

ENV = "MOE_PDL"
ENABLED = os.environ.get(ENV, "1") != "0"


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.lru_cache(maxsize=None)
def _hopper_or_later(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def enabled(device: torch.device) -> bool:
    """Whether kernels on this device launch with PDL."""
    if not ENABLED or triton is None or _interpreting() or device.type != "cuda":
        return False
    return _hopper_or_later(device.index if device.index is not None else torch.cuda.current_device())


def launch_options(args) -> dict:
    """The launch keywords of a kernel that takes ``PDL: tl.constexpr``: the constexpr, and Triton's
    ``launch_pdl`` option where PDL is on (the device is that of the first tensor argument)."""
    device = next((a.device for a in args if isinstance(a, torch.Tensor)), None)
    on = device is not None and enabled(device)
    return {"PDL": on, "launch_pdl": True} if on else {"PDL": False}


if triton is not None:

    @triton.jit
    def wait_for_inputs(PDL: tl.constexpr):
        """First statement of every kernel launched with ``launch_options``: see the module docstring."""
        if PDL:
            gdc_wait()
            gdc_launch_dependents()

    @triton.jit
    def prefetch_l2(ptrs, PDL: tl.constexpr):
        """Ask L2 for the lines at ``ptrs`` (one address per 128-byte line is enough), without waiting: read-only
        data no kernel of the forward writes (weights), fetched while the previous kernel still runs."""
        if PDL:
            tl.inline_asm_elementwise("prefetch.global.L2::evict_last [$1]; // $0", "=r,l", [ptrs],
                                      dtype=tl.int32, is_pure=False, pack=1)
