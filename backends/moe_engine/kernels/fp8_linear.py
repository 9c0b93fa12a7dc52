"""Dense projections in W8A8 block FP8 (vLLM's ``w8a8_block_fp8_matmul``, DeepSeek's ``fp8_gemm``):

    linear_fp8(x [T, K] model dtype, w_q e4m3 [N, K], w_s float32 [ceil(N / bm), ceil(K / bn)], bias [N] | None)
        -> [T, N] model dtype

x is quantised per token and per bn channels on the fly (kernels/fp8_quant.py), then one program per [BLOCK_M,
BLOCK_N] output tile adds ``dot(x_q, w_q) * x_scale[row] * w_scale[column]`` per K tile of BLOCK_K (dividing bn) in
float32, adds the bias in float32 and rounds once to the model dtype: equal to ``moe_engine.fp8.
w8a8_linear_reference`` within float32 summation order. Tiles: decode (T <= 16) 16 x 64 column tiles, so that a
batch-1 projection still spreads over the SMs; larger steps 64 x 128 grouped by GROUP_M (vLLM's default for block
FP8); at decode the column tiles narrow until every SM has a program (the weights are read once).
"""
from __future__ import annotations

import torch

from .. import fp8 as fp8_ref
from . import support as kernel_support
from .fp8_quant import quantize_activations
from .fused_moe import TileConfig
from .support import _DT, _launch, triton

if triton is not None:
    import triton.language as tl

    from .support import _await_inputs, _grouped_tile, _round

    @triton.jit
    def _w8a8_linear_kernel(
        a_ptr, as_ptr, w_ptr, ws_ptr, b_ptr, out_ptr, M, N, K,
        s_a, s_as, s_wn, s_wsn, s_out,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
        GROUP_N: tl.constexpr, GROUP_K: tl.constexpr, EVEN_K: tl.constexpr, HAS_BIAS: tl.constexpr,
        DT: tl.constexpr, PDL: tl.constexpr,
    ):
        _await_inputs(PDL)
        pid = tl.program_id(0)
        num_pid_m = tl.cdiv(M, BLOCK_M)
        num_pid_n = tl.cdiv(N, BLOCK_N)
        pid_m, pid_n = _grouped_tile(pid, num_pid_m, num_pid_n, GROUP_M)
        rows = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        rmask = rows < M
        offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N  # wrapped, in bounds; the store masks them
        offs_k = tl.arange(0, BLOCK_K)
        a_ptrs = a_ptr + rows[:, None] * s_a + offs_k[None, :]
        as_ptrs = as_ptr + rows * s_as
        w_ptrs = w_ptr + offs_n[None, :].to(tl.int64) * s_wn + offs_k[:, None]  # [BK, BN]
        ws_ptrs = ws_ptr + (offs_n // GROUP_N) * s_wsn
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k in range(0, tl.cdiv(K, BLOCK_K)):
            kg = (k * BLOCK_K) // GROUP_K
            if EVEN_K:
                a = tl.load(a_ptrs, mask=rmask[:, None], other=0.0)
                w = tl.load(w_ptrs)
            else:
                kmask = offs_k < K - k * BLOCK_K
                a = tl.load(a_ptrs, mask=rmask[:, None] & kmask[None, :], other=0.0)
                w = tl.load(w_ptrs, mask=kmask[:, None], other=0.0)
            a_s = tl.load(as_ptrs + kg, mask=rmask, other=0.0)
            w_s = tl.load(ws_ptrs + kg)
            acc += tl.dot(a, w) * a_s[:, None] * w_s[None, :]
            a_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n).to(tl.float32)[None, :]
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        tl.store(out_ptr + rows[:, None] * s_out + cols[None, :], _round(acc, DT).to(out_ptr.dtype.element_ty),
                 mask=rmask[:, None] & (cols[None, :] < N))


DECODE_CONFIG = TileConfig(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=4)
PREFILL_CONFIG = TileConfig(BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, GROUP_M=8, num_warps=4, num_stages=3)


def linear_fp8(x: torch.Tensor, w_q: torch.Tensor, w_s: torch.Tensor, bias: torch.Tensor | None = None,
               block: tuple[int, int] = (128, 128), config: TileConfig | None = None) -> torch.Tensor:
    """x [..., K] -> [..., N] in x's dtype (see the module docstring)."""
    N, K = w_q.shape
    bm, bn = block
    if x.shape[-1] != K or w_s.shape != (-(-N // bm), -(-K // bn)) or w_q.dtype != fp8_ref.FP8_DTYPE:
        raise ValueError(f"linear_fp8: x {tuple(x.shape)}, w {tuple(w_q.shape)} {w_q.dtype}, scales "
                         f"{tuple(w_s.shape)} do not fit block {block}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, K)
    M = x2.shape[0]
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0:
        return out.reshape(*lead, N)
    cfg = config or (DECODE_CONFIG if M <= 16 else PREFILL_CONFIG)
    cap = lambda b, n: min(b, max(16, kernel_support._pow2(n)))  # noqa: E731
    block_k = min(cap(cfg.BLOCK_K, K), bn)
    while bn % block_k:
        block_k //= 2
    block_n = cap(cfg.BLOCK_N, N)
    if config is None and M <= 16 and x.is_cuda:
        # decode reads the weights once: narrower column tiles until every SM has a program (o_proj of
        # Qwen3-30B-A3B, N 2048: 16 wide, 128 programs; q/k/v, N 5120: 32 wide, 160 programs)
        from .batch_invariant import num_sms

        while block_n > 16 and triton.cdiv(N, block_n) < num_sms(x.device):
            block_n //= 2
    xq, xs = quantize_activations(x2, bn)
    w_q = w_q if w_q.stride(1) == 1 else w_q.contiguous()
    w_s = w_s.contiguous()
    grid = (triton.cdiv(M, cfg.BLOCK_M) * triton.cdiv(N, block_n),)
    _launch(
        _w8a8_linear_kernel, grid, xq, xs, w_q, w_s, bias if bias is not None else w_s, out, M, N, K,
        xq.stride(0), xs.stride(0), w_q.stride(0), w_s.stride(0), out.stride(0),
        BLOCK_M=cfg.BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=cfg.GROUP_M, GROUP_N=bm, GROUP_K=bn,
        EVEN_K=K % block_k == 0, HAS_BIAS=bias is not None, DT=_DT[x.dtype], PDL=kernel_support.pdl(x.device),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out.reshape(*lead, N)
