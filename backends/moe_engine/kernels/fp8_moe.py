"""The routed experts' MLPs in W8A8 block FP8: e4m3 weights with one float32 scale per 128 x 128 block, activations
quantised per token and per 128 channels on the fly (vLLM's ``fused_experts(use_fp8_w8a8=True, block_shape=[128,
128])``, DeepSeek's inference). The w8a8 variant of ``fused_moe.expert_mlp``, on the same expert-grouped rows:

    expert_mlp_fp8(x, gate_up_q, gate_up_s, down_q, down_s, pos, tok, offs, block) -> y [P, H]  (model dtype)

    gate_up_q e4m3 [E, 2I, H], gate_up_s float32 [E, ceil(2I / bm), ceil(H / bn)]  (the checkpoint's weight_scale_inv)
    down_q    e4m3 [E, H, I],  down_s    float32 [E, ceil(H / bm),  ceil(I / bn)]

Four launches: quantise x (kernels/fp8_quant.py), ``gate_up`` GEMM with the SwiGLU epilogue (h in the model dtype,
rounded as the bf16 path rounds it), quantise h, ``down`` GEMM. Each GEMM program owns [BLOCK_M rows, BLOCK_N
columns] of one expert's rows (``fused_moe._expert_tile``: the row tiles are found on the device, only hit experts'
weights are read); per K tile of BLOCK_K (which divides the scale group bn, so a tile has one activation scale per
row and one weight scale per column) it adds ``dot(a_q, w_q) * a_scale[row] * w_scale[column]`` in float32.

Numerics: equal to the op-by-op reference (``moe_engine.fp8.w8a8_linear_reference`` per expert: quantise in torch,
dequantise both operands to float32, matmul, round to the model dtype; SwiGLU as torch) within float32 summation
order: e4m3 x e4m3 products are exact in float32, only where the scales multiply differs
(tests/unit/test_fp8_kernels.py). The router never sees FP8: its logits come from the layer's input in the model
dtype, so the ids captured are those this forward used.
"""
from __future__ import annotations

import functools

import torch

from .. import fp8 as fp8_ref
from . import support as kernel_support
from .fp8_quant import quantize_activations
from .fused_moe import BUCKETS, TileConfig, bucket_of
from .support import _DT, _launch, interpreting, triton

if triton is not None:
    import triton.language as tl
    from triton.language.extra import libdevice

    from .fused_moe import _expert_tile
    from .support import _await_inputs, _grouped_tile, _round


def _tc(m: int, n: int, k: int, g: int, w: int, s: int) -> TileConfig:
    return TileConfig(BLOCK_M=m, BLOCK_N=n, BLOCK_K=k, GROUP_M=g, num_warps=w, num_stages=s)


# bucket of P = T*K pairs -> (gate_up, down). BLOCK_K 128 = the scale group. Small steps: 64-wide column tiles (vLLM
# #46642: a 128-wide N tile leaves SMs idle at decode on H100/H200); gate_up's BLOCK_N counts h columns (two
# accumulators, gate and up), so half of down's. Larger steps: vLLM's block-FP8 default (64 x 128 x 128, GROUP_M 32).
# Untuned: loadtest/bench/bench_real_shape.py --quantization fp8 measures them end to end.
DEFAULT_FP8_CONFIGS: dict[str, tuple[TileConfig, TileConfig]] = {}
for _name, _top in BUCKETS:
    if _top is not None and _top <= 128:
        DEFAULT_FP8_CONFIGS[_name] = (_tc(16, 32, 128, 1, 4, 4), _tc(16, 64, 128, 1, 4, 4))
    elif _top is not None and _top <= 2048:
        DEFAULT_FP8_CONFIGS[_name] = (_tc(32, 64, 128, 8, 4, 3), _tc(32, 128, 128, 8, 4, 3))
    else:
        DEFAULT_FP8_CONFIGS[_name] = (_tc(64, 64, 128, 32, 4, 3), _tc(64, 128, 128, 32, 4, 3))


def fp8_tile_configs(pairs: int) -> tuple[TileConfig, TileConfig]:
    return DEFAULT_FP8_CONFIGS[bucket_of(pairs)]


if triton is not None:

    @triton.jit(do_not_specialize=["num_pid_m"])
    def _w8a8_moe_gemm_kernel(
        a_ptr, as_ptr, w_ptr, ws_ptr, out_ptr, tok_ptr, offs_ptr,
        E, N, K, num_pid_m,
        s_a, s_as, s_we, s_wn, s_wse, s_wsn, s_out,
        GATE_UP: tl.constexpr,  # a = x_q gathered by tok; w rows [0, N) gate, [N, 2N) up; SwiGLU epilogue
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
        BLOCK_E: tl.constexpr, GROUP_N: tl.constexpr, GROUP_K: tl.constexpr, EVEN_K: tl.constexpr,
        DT: tl.constexpr, PRECISE: tl.constexpr, PDL: tl.constexpr,
    ):
        """out[r, n] for the rows r of one expert tile and BLOCK_N columns n. a: e4m3 [rows, K] with float32 scales
        as [rows, cdiv(K, GROUP_K)]; w: e4m3 [E, N or 2N, K] (K contiguous) with scales ws [E, ., cdiv(K, GROUP_K)]
        (weight rows per scale: GROUP_N)."""
        _await_inputs(PDL)
        pid = tl.program_id(0)
        num_pid_n = tl.cdiv(N, BLOCK_N)
        pid_m, pid_n = _grouped_tile(pid, num_pid_m, num_pid_n, GROUP_M)

        expert, row0, row_end = _expert_tile(pid_m, offs_ptr, E, BLOCK_E, BLOCK_M)
        if expert >= E:
            return
        rows = row0 + tl.arange(0, BLOCK_M)
        rmask = rows < row_end
        if GATE_UP:
            a_rows = tl.load(tok_ptr + rows.to(tl.int64), mask=rmask, other=0).to(tl.int64)
        else:
            a_rows = rows.to(tl.int64)
        offs_k = tl.arange(0, BLOCK_K)
        offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N  # wrapped, in bounds; the store masks them
        a_ptrs = a_ptr + a_rows[:, None] * s_a + offs_k[None, :]
        as_ptrs = as_ptr + a_rows * s_as
        w_base = w_ptr + expert.to(tl.int64) * s_we
        ws_base = ws_ptr + expert.to(tl.int64) * s_wse
        w_ptrs = w_base + offs_n[None, :] * s_wn + offs_k[:, None]  # [BK, BN]
        ws_ptrs = ws_base + (offs_n // GROUP_N) * s_wsn  # [BN]: each column's scale row
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        if GATE_UP:
            u_ptrs = w_ptrs + N * s_wn
            us_ptrs = ws_base + ((offs_n + N) // GROUP_N) * s_wsn
            acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k in range(0, tl.cdiv(K, BLOCK_K)):
            kg = (k * BLOCK_K) // GROUP_K  # the scale group of this K tile (BLOCK_K divides GROUP_K)
            a_s = tl.load(as_ptrs + kg, mask=rmask, other=0.0)  # [BM]
            if EVEN_K:
                a = tl.load(a_ptrs, mask=rmask[:, None], other=0.0)
                w = tl.load(w_ptrs)
            else:
                kmask = offs_k < K - k * BLOCK_K
                a = tl.load(a_ptrs, mask=rmask[:, None] & kmask[None, :], other=0.0)
                w = tl.load(w_ptrs, mask=kmask[:, None], other=0.0)
            w_s = tl.load(ws_ptrs + kg)  # [BN]
            acc += tl.dot(a, w) * a_s[:, None] * w_s[None, :]
            if GATE_UP:
                if EVEN_K:
                    wu = tl.load(u_ptrs)
                else:
                    wu = tl.load(u_ptrs, mask=kmask[:, None], other=0.0)
                acc_up += tl.dot(a, wu) * a_s[:, None] * tl.load(us_ptrs + kg)[None, :]
                u_ptrs += BLOCK_K
            a_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        out = _round(acc, DT)
        if GATE_UP:  # torch: F.silu on the rounded gate, times the rounded up (as fused_moe's epilogue)
            if PRECISE:
                denom = 1.0 + libdevice.exp(-out)
            else:
                denom = 1.0 + tl.exp(-out)
            out = _round(_round(tl.math.div_rn(out, denom), DT) * _round(acc_up, DT), DT)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        tl.store(out_ptr + rows.to(tl.int64)[:, None] * s_out + cols[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=rmask[:, None] & (cols[None, :] < N))


@functools.lru_cache(maxsize=None)
def _fit(cfg: TileConfig, N: int, K: int, group_k: int) -> TileConfig:
    """Tiles no wider than the matrix; BLOCK_K at most the scale group (and a power of two dividing it)."""
    cap = lambda b, n: min(b, max(16, kernel_support._pow2(n)))  # noqa: E731
    block_k = min(cap(cfg.BLOCK_K, K), group_k)
    while group_k % block_k:
        block_k //= 2
    return TileConfig(cfg.BLOCK_M, cap(cfg.BLOCK_N, N), block_k, cfg.GROUP_M, cfg.num_warps, cfg.num_stages)


def _gemm(a, a_s, w, w_s, out, tok, offs, N: int, K: int, block: tuple[int, int], cfg: TileConfig,
          gate_up: bool) -> None:
    P, E = out.shape[0], w.shape[0]
    cfg = _fit(cfg, N, K, block[1])
    if w.stride(2) != 1 or w_s.stride(2) != 1:
        raise ValueError("w8a8 expert GEMM: weights and scales must be contiguous along K")
    num_pid_m = triton.cdiv(P, cfg.BLOCK_M) + min(E, P)
    grid = (num_pid_m * triton.cdiv(N, cfg.BLOCK_N),)
    _launch(
        _w8a8_moe_gemm_kernel, grid, a, a_s, w, w_s, out, tok, offs, E, N, K, num_pid_m,
        a.stride(0), a_s.stride(0), w.stride(0), w.stride(1), w_s.stride(0), w_s.stride(1), out.stride(0),
        GATE_UP=gate_up, BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N, BLOCK_K=cfg.BLOCK_K, GROUP_M=cfg.GROUP_M,
        BLOCK_E=kernel_support._pow2(E), GROUP_N=block[0], GROUP_K=block[1], EVEN_K=K % cfg.BLOCK_K == 0,
        DT=_DT[out.dtype], PRECISE=not interpreting(), PDL=kernel_support.pdl(a.device),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )


def expert_mlp_fp8(
    x: torch.Tensor,  # [T, H] model dtype
    gate_up_q: torch.Tensor,  # e4m3 [E, 2I, H]
    gate_up_s: torch.Tensor,  # float32 [E, ceil(2I / bm), ceil(H / bn)]
    down_q: torch.Tensor,  # e4m3 [E, H, I]
    down_s: torch.Tensor,  # float32 [E, ceil(H / bm), ceil(I / bn)]
    pos: torch.Tensor,  # [T, K]: only its shape is used (P = T*K)
    tok: torch.Tensor,  # [P] long: token of each grouped row
    offs: torch.Tensor,  # [E] int32: end row of each expert's group
    block: tuple[int, int] = (128, 128),
    configs: tuple[TileConfig, TileConfig] | None = None,
) -> torch.Tensor:  # [P, H] model dtype, grouped order (routing_kernels.combine's input)
    """The routed experts' SwiGLU MLPs in W8A8 block FP8 on expert-grouped rows."""
    E, I2, H = gate_up_q.shape
    I, P = I2 // 2, pos.numel()
    bm, bn = block
    if (x.dim() != 2 or x.shape[1] != H or down_q.shape != (E, H, I) or tok.shape != (P,) or offs.shape != (E,)
            or gate_up_s.shape != (E, -(-I2 // bm), -(-H // bn)) or down_s.shape != (E, -(-H // bm), -(-I // bn))):
        raise ValueError(
            f"expert_mlp_fp8: shapes x {tuple(x.shape)}, gate_up {tuple(gate_up_q.shape)} / {tuple(gate_up_s.shape)}, "
            f"down {tuple(down_q.shape)} / {tuple(down_s.shape)}, tok {tuple(tok.shape)}, offs {tuple(offs.shape)} "
            f"do not fit together with block {block}")
    if gate_up_q.dtype != fp8_ref.FP8_DTYPE or down_q.dtype != fp8_ref.FP8_DTYPE or offs.dtype != torch.int32:
        raise ValueError("expert_mlp_fp8: weights must be float8_e4m3fn and offs int32")
    g_cfg, d_cfg = configs or fp8_tile_configs(P)
    xq, xs = quantize_activations(x, bn)  # [T, H] e4m3, [T, ceil(H / bn)]
    h = torch.empty(P, I, dtype=x.dtype, device=x.device)
    y = torch.empty(P, H, dtype=x.dtype, device=x.device)
    if P:
        _gemm(xq, xs, gate_up_q, gate_up_s, h, tok, offs, I, H, block, g_cfg, gate_up=True)
        hq, hs = quantize_activations(h, bn)  # [P, I] e4m3, [P, ceil(I / bn)]
        _gemm(hq, hs, down_q, down_s, y, offs, offs, H, I, block, d_cfg, gate_up=False)
    return y
