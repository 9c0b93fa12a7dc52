"""Dense projections of decode-sized steps (a few tokens) on the expert-GEMM kernel of fused_moe.py.

At batch 1 a projection is a matrix-vector product: all its time is reading the weight. cuBLAS picks split-K
kernels for these shapes that stream the weight at 40-70% of HBM bandwidth plus a reduction pass (profile of a
Qwen3-30B-A3B decode step, loadtest/reports/real_shape/profile_a_run8.md: q/k/v 7.8 us for 20 MB, o 6.1 us for
16 MB, the 128-expert router 4.0 us for 0.5 MB). A dense linear is the expert GEMM with one expert that owns
every row, so ``fused_moe``'s kernel, which reads the hit experts' weights at ~88% of the roofline, does it:

    linear(x [T, K], weight [N, K]) -> y [T, N]      (T <= MAX_TOKENS, no bias; else F.linear)

y equals ``F.linear`` within float32 summation order (accumulated in float32, rounded once to the model dtype,
as cuBLAS does). Column tiles are as narrow as it takes to give every SM a program. CUDA-graph capturable: the
kernel's expert offsets are a slice of a per-device table made on the first (eager) call.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import fused_moe, kernels

MAX_TOKENS = 16  # one row tile: up to here every program reads its weight tile once for all tokens
_NUM_SMS = 132  # H100/H200; only sets how narrow column tiles get
_OFFSETS: dict[torch.device, torch.Tensor] = {}  # device -> arange(MAX_TOKENS + 1) int32: offs[T] = T rows


def _config(N: int, K: int) -> fused_moe.TileConfig:
    """BLOCK_N: the widest of 16..64 that still gives at least one program per SM."""
    block_n = 16
    while block_n < 64 and N // (2 * block_n) >= _NUM_SMS:
        block_n *= 2
    return fused_moe.TileConfig(BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=4)


def _offsets(device: torch.device) -> torch.Tensor | None:
    table = _OFFSETS.get(device)
    if table is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None  # never allocate inside a graph's pool: this call takes F.linear
        table = _OFFSETS[device] = torch.arange(MAX_TOKENS + 1, dtype=torch.int32, device=device)
    return table


def applies(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    return (bias is None and x.dim() == 2 and 0 < x.shape[0] <= MAX_TOKENS and kernels.available(x.device)
            and x.dtype in kernels._DT and weight.dtype == x.dtype and weight.dim() == 2
            and weight.stride(-1) == 1 and x.shape[1] == weight.shape[1])


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) for x [T, K]: on the expert-GEMM kernel when ``applies``, else F.linear."""
    if not applies(x, weight, bias):
        return F.linear(x, weight, bias)
    offsets = _offsets(x.device)
    if offsets is None:
        return F.linear(x, weight, bias)
    T = x.shape[0]
    N, K = weight.shape
    return fused_moe.down_proj(x, weight.unsqueeze(0), offsets[T : T + 1], _config(N, K))
