"""GPT-OSS's routed experts as two Triton GEMMs that read only the hit experts' weights: fused_moe.py's variant for
biased experts with interleaved gate/up columns and the clamped SwiGLU.

Same input and output as ``fused_moe.expert_mlp`` (the pairs grouped by expert by ``routing_kernels.route``: ``tok
[P]`` the token of grouped row r, ``offs [E]`` int32 row ends; ``y [P, H]`` in grouped order, which
``routing_kernels.combine`` weights and sums in HF order), but HF ``GptOssExperts``' weight layout and math:

    gate_up [E, H, 2I]  (x @ gate_up[e]: column 2j is gate j, column 2j+1 is up j),  gate_up_bias [E, 2I]
    down    [E, I, H],                                                               down_bias    [E, H]

    gu   = x @ gate_up[e] + gate_up_bias[e]              (matmul rounded, then the bias add rounded: two torch ops)
    gate = min(gu[..., ::2], limit); up = clamp(gu[..., 1::2], -limit, limit)
    h    = (up + 1) * (gate * sigmoid(gate * alpha))     (each op rounded to the model dtype, as torch)
    y    = h @ down[e] + down_bias[e]

Two launches, no host sync, CUDA-graph capturable (grid sizes from host ints only), expert tiles found on the device
as in fused_moe.py (``_expert_tile``; its tile table, by P = T*K, serves this variant too):

* ``gate_up_clamped_swiglu``: one program owns BLOCK_N columns of h for BLOCK_M rows of one expert. It loads the
  2*BLOCK_N contiguous weight columns that hold those gates and ups (interleaved: one load, one dot, no strided
  access), adds the bias in the epilogue, and splits the [BLOCK_M, 2*BLOCK_N] tile into gate and up there
  (reshape to [.., BLOCK_N, 2], split): the [P, 2I] GEMM output never reaches memory.
* ``biased_down_proj``: y[r] = round(round(h[r] @ down[e]) + down_bias[e]).

Numerics (tests/unit/test_fused_moe_gpt_oss.py): every elementwise op rounds where torch rounds (bias adds, clamp,
the scalar product gate * alpha with alpha as float32, sigmoid as torch's CUDA kernel computes it on a bf16 tensor:
float32 1 / (1 + expf(-x)) with libdevice's expf and an IEEE division, rounded; up + 1; the two products). Only the
GEMMs' float32 summation order differs from torch's, so y equals the op-by-op ``GptOssExperts`` path within a
rounding of the model dtype carried through the clamped SwiGLU, with the same expert ids (the ids are the router's;
this kernel only reads them); elements are bit-identical but for a sliver. float32 models: IEEE float32 products.

The pointer loads serve every shape (no TMA variant: the weights' K axis is their row axis, so a K tail box would
read the next expert's rows).

MXFP4 weight load (``MXFP4``, issue 50): the experts stay as the Hub stores gpt-oss, 4-bit e2m1 values with one e8m0
scale per 32 along K (checkpoint.py ``dequantize_mxfp4``; the row axis is the GEMM's output column):

    gate_up_blocks [E, 2I, H/32, 16] uint8 (byte b of group g: K index 32g + 2b in the low nibble, 32g + 2b + 1 in
                                            the high one),  gate_up_scales [E, 2I, H/32] uint8 (2^(s - 127))
    down_blocks    [E, H, I/32, 16],                        down_scales    [E, H, I/32]

Each program reads its [BLOCK_K / 2, WIDTH] bytes and their scales once per K step and decodes them in registers
(``_mxfp4_tile``): value * 2^(s - 127) in float32 (exact), one cast to the model dtype, then the nibble pairs
interleaved back into a [BLOCK_K, WIDTH] tile of the model dtype that goes to the same dot as the bf16 variant's.
The decoded tile equals ``dequantize_mxfp4``'s weights bit for bit (a product of a 2-bit mantissa and a power of
two is exact unless it leaves the dtype's range, where both round the same float32 value once), so with the same
tiles the packed GEMMs are bit-identical to this kernel run on the dequantised weights. Biases stay in the model
dtype. K (H for gate_up, I for down) must be a multiple of 32 (the checkpoint's groups), BLOCK_K at least 32.
"""
from __future__ import annotations

import warnings
from dataclasses import replace

import torch

from . import fused_moe
from . import support as kernel_support
from .fused_moe import TileConfig
from .support import _DT, _launch, interpreting, triton

if triton is not None:
    import triton.language as tl
    from triton.language.extra import libdevice

    from .fused_moe import _expert_tile
    from .support import _await_inputs, _grouped_tile, _round

    @triton.jit
    def _e2m1(nib):
        """4-bit e2m1 codes (int32, 0..15) -> float32 values: sign bit 3, exponent bits 2-1, mantissa bit 0;
        exponent 0 is subnormal (0, 0.5), else (1 + m/2) * 2^(e - 1). As checkpoint.py's FP4_VALUES."""
        e = (nib >> 1) & 3
        m = nib & 1
        mant = tl.where(e == 0, m, 2 + m).to(tl.float32)  # value = mant * 2^(max(e, 1) - 2)
        pow2 = ((tl.maximum(e, 1) - 2 + 127) << 23).to(tl.float32, bitcast=True)
        v = mant * pow2
        return tl.where((nib & 8) != 0, -v, v)

    @triton.jit
    def _mxfp4_tile(b_ptrs, s_ptrs, mask, OUT: tl.constexpr, BLOCK_K: tl.constexpr, WIDTH: tl.constexpr):
        """The [BLOCK_K, WIDTH] weight tile in dtype OUT from b_ptrs [BLOCK_K / 2, WIDTH] (byte j: K rows 2j (low
        nibble) and 2j + 1 (high)) and s_ptrs [BLOCK_K / 2, WIDTH] (each byte's e8m0 scale; 32 K rows share one)."""
        packed = tl.load(b_ptrs, mask=mask, other=0).to(tl.int32)
        s = tl.load(s_ptrs, mask=mask, other=127).to(tl.int32)
        scale = tl.where(s == 0, 0x00400000, s << 23).to(tl.float32, bitcast=True)  # 2^(s - 127); s = 0: 2^-127
        lo = (_e2m1(packed & 15) * scale).to(OUT)  # even K rows
        hi = (_e2m1(packed >> 4) * scale).to(OUT)  # odd K rows
        return tl.reshape(tl.permute(tl.join(lo, hi), (0, 2, 1)), (BLOCK_K, WIDTH))  # rows 2j, 2j + 1 <- byte j

    @triton.jit(do_not_specialize=["num_pid_m"])  # varies with the step size: no recompile per step size
    def _biased_moe_gemm_kernel(
        a_ptr, w_ptr, scale_ptr, bias_ptr, out_ptr, tok_ptr, offs_ptr,
        E, N, K, num_pid_m, limit, alpha,
        s_a, s_we, s_wk, s_wn, s_se, s_sn, s_be, s_out,
        GATE_UP: tl.constexpr,  # a = x gathered by tok; w columns interleaved gate/up (2N); clamped SwiGLU epilogue
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
        BLOCK_E: tl.constexpr, EVEN_K: tl.constexpr, DT: tl.constexpr,
        UPCAST: tl.constexpr, PRECISE: tl.constexpr, PREC: tl.constexpr, PDL: tl.constexpr,
        WIDTH: tl.constexpr,  # weight columns per tile: 2 * BLOCK_N (gate_up) or BLOCK_N (down)
        MXFP4: tl.constexpr,  # w: packed e2m1 bytes [E, W, K/2] + scales [E, W, K/32] (module docstring)
    ):
        """out[r, n] for the rows r of one expert tile and BLOCK_N columns n. w: [E, K, W] with W = 2N (gate_up,
        interleaved) or N (down); strides (s_we, s_wk, s_wn). MXFP4: w the bytes [E, W, K/2], strides (s_we, 1,
        s_wn), scales [E, W, K/32], strides (s_se, 1, s_sn). bias: [E, W], stride s_be."""
        _await_inputs(PDL)  # (the weights a program reads depend on offs, an earlier kernel's output)
        pid = tl.program_id(0)
        num_pid_n = tl.cdiv(N, BLOCK_N)
        pid_m, pid_n = _grouped_tile(pid, num_pid_m, num_pid_n, GROUP_M)

        expert, row0, row_end = _expert_tile(pid_m, offs_ptr, E, BLOCK_E, BLOCK_M)
        if expert >= E:
            return
        rows = row0 + tl.arange(0, BLOCK_M)
        rmask = rows < row_end
        rows64 = rows.to(tl.int64)
        offs_k = tl.arange(0, BLOCK_K)
        if GATE_UP:  # the 2*BLOCK_N weight columns of this tile's gates and ups (pairs stay aligned: 2N is even)
            wcols = (pid_n * WIDTH + tl.arange(0, WIDTH)) % (2 * N)  # wrap instead of masking; the store masks
            toks = tl.load(tok_ptr + rows64, mask=rmask, other=0)
            a_ptrs = a_ptr + toks[:, None] * s_a + offs_k[None, :]
        else:
            wcols = (pid_n * WIDTH + tl.arange(0, WIDTH)) % N
            a_ptrs = a_ptr + rows64[:, None] * s_a + offs_k[None, :]
        if MXFP4:  # byte j of the K step: K rows 2j, 2j + 1; its scale: group j // 16
            offs_kb = tl.arange(0, BLOCK_K // 2)
            w_ptrs = w_ptr + expert.to(tl.int64) * s_we + wcols[None, :] * s_wn + offs_kb[:, None]  # [BK/2, WIDTH]
            s_ptrs = scale_ptr + expert.to(tl.int64) * s_se + wcols[None, :] * s_sn + offs_kb[:, None] // 16
        else:
            w_ptrs = w_ptr + expert.to(tl.int64) * s_we + offs_k[:, None] * s_wk + wcols[None, :] * s_wn  # [BK, WIDTH]
        acc = tl.zeros([BLOCK_M, WIDTH], dtype=tl.float32)
        for k in range(0, tl.cdiv(K, BLOCK_K)):
            if EVEN_K:
                a = tl.load(a_ptrs, mask=rmask[:, None], other=0.0)
            else:
                kmask = offs_k < K - k * BLOCK_K
                a = tl.load(a_ptrs, mask=rmask[:, None] & kmask[None, :], other=0.0)
            if MXFP4:  # K a multiple of 32: a K tail is whole bytes of whole groups
                kbmask = (offs_kb < (K - k * BLOCK_K) // 2)[:, None]
                w = _mxfp4_tile(w_ptrs, s_ptrs, kbmask, a.dtype, BLOCK_K, WIDTH)
                w_ptrs += BLOCK_K // 2
                s_ptrs += BLOCK_K // 32
            else:
                if EVEN_K:
                    w = tl.load(w_ptrs)
                else:
                    w = tl.load(w_ptrs, mask=kmask[:, None], other=0.0)
                w_ptrs += BLOCK_K * s_wk
            if UPCAST:  # the interpreter's dot reads bf16 as integers: products of the same values in float32
                a = a.to(tl.float32)
                w = w.to(tl.float32)
            acc = tl.dot(a, w, acc, input_precision=PREC)
            a_ptrs += BLOCK_K
        bias = tl.load(bias_ptr + expert.to(tl.int64) * s_be + wcols).to(tl.float32)  # [WIDTH]
        out = _round(_round(acc, DT) + bias[None, :], DT)  # torch: matmul (rounded), then + bias (rounded)
        if GATE_UP:
            gate, up = tl.split(tl.reshape(out, (BLOCK_M, BLOCK_N, 2)))  # even columns gate, odd up
            gate = tl.minimum(gate, limit)  # clamp(max=limit): exact on values of the model dtype
            up = tl.minimum(tl.maximum(up, -limit), limit)
            z = _round(gate * alpha, DT)  # torch: the scalar product in float32, rounded
            if PRECISE:
                e = libdevice.exp(-z)  # expf, as torch's sigmoid kernel; tl.exp is an approximation
            else:
                e = tl.exp(-z)
            sig = _round(tl.math.div_rn(1.0 + tl.zeros_like(z), 1.0 + e), DT)
            out = _round(_round(up + 1.0, DT) * _round(gate * sig, DT), DT)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        tl.store(out_ptr + rows64[:, None] * s_out + cols[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=rmask[:, None] & (cols[None, :] < N))


def _gemm(a, w, scales, bias, out, tok, offs, N: int, K: int, cfg: TileConfig, gate_up: bool, limit: float,
          alpha: float) -> None:
    """One launch. w: [E, K, W] in a's dtype (scales None), or MXFP4 bytes [E, W, K/32, 16] with scales
    [E, W, K/32]."""
    P, E = out.shape[0], w.shape[0]
    mxfp4 = scales is not None
    cfg = fused_moe._fit(cfg, N, K)
    if mxfp4 and cfg.BLOCK_K < 32:
        cfg = replace(cfg, BLOCK_K=32)  # a K step covers whole scale groups
    key = ("gpt_oss", gate_up, mxfp4, cfg, a.dtype, N, K)
    cfg = fused_moe._SHRUNK.get(key, cfg)
    if mxfp4:  # (s_we, s_wk, s_wn): bytes along K are contiguous within a column's row of the packed tensor
        w_strides, s_strides = (w.stride(0), 1, w.stride(1)), (scales.stride(0), scales.stride(1))
    else:
        w_strides, s_strides = (w.stride(0), w.stride(1), 1), (0, 0)
    num_pid_m = triton.cdiv(P, cfg.BLOCK_M) + min(E, P)  # >= the tiles of any split of P rows over E experts
    while True:
        grid = (num_pid_m * triton.cdiv(N, cfg.BLOCK_N),)
        try:
            _launch(
                _biased_moe_gemm_kernel, grid, a, w, scales if mxfp4 else w, bias, out, tok, offs, E, N, K,
                num_pid_m, limit, alpha, a.stride(0), *w_strides, *s_strides, bias.stride(0), out.stride(0),
                GATE_UP=gate_up, BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N, BLOCK_K=cfg.BLOCK_K, GROUP_M=cfg.GROUP_M,
                BLOCK_E=kernel_support._pow2(E), EVEN_K=K % cfg.BLOCK_K == 0, DT=_DT[a.dtype],
                UPCAST=interpreting(), PRECISE=not interpreting(),
                PREC="ieee" if a.dtype == torch.float32 else "tf32", PDL=kernel_support.pdl(a.device),
                WIDTH=(2 if gate_up else 1) * cfg.BLOCK_N, MXFP4=mxfp4, num_warps=cfg.num_warps,
                num_stages=cfg.num_stages,
            )
            return
        except triton.runtime.errors.OutOfResources as err:
            smaller = fused_moe._shrink(cfg)
            if smaller is None:
                raise
            warnings.warn(f"fused_moe_gpt_oss: {cfg} does not fit on this GPU ({err}); using {smaller}", stacklevel=3)
            fused_moe._SHRUNK[key] = cfg = smaller


def _rows_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _packed_contiguous(t: torch.Tensor) -> torch.Tensor:
    """MXFP4 bytes [E, W, G, 16] (or scales [E, W, G]): each column's K bytes (scales) contiguous."""
    if t.stride(-1) == 1 and (t.dim() == 3 or t.stride(-2) == t.shape[-1]):
        return t
    return t.contiguous()


def gate_up_clamped_swiglu(x: torch.Tensor, gate_up: torch.Tensor, gate_up_bias: torch.Tensor, tok: torch.Tensor,
                           offs: torch.Tensor, cfg: TileConfig, limit: float, alpha: float,
                           gate_up_scales: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, H], gate_up [E, H, 2I] (interleaved), gate_up_bias [E, 2I], tok [P] long, offs [E] int32 -> h [P, I]:
    the clamped SwiGLU of expert e's biased projection of x[tok[r]], every step rounded as torch's. MXFP4
    (``gate_up_scales`` [E, 2I, H/32]): gate_up is the bytes [E, 2I, H/32, 16]."""
    x, gate_up_bias = _rows_contiguous(x), _rows_contiguous(gate_up_bias)
    if gate_up_scales is None:
        gate_up = _rows_contiguous(gate_up)
        H, I = gate_up.shape[1], gate_up.shape[2] // 2
    else:
        gate_up, gate_up_scales = _packed_contiguous(gate_up), _packed_contiguous(gate_up_scales)
        H, I = gate_up.shape[2] * 32, gate_up.shape[1] // 2
    h = torch.empty(tok.shape[0], I, dtype=x.dtype, device=x.device)
    if tok.shape[0]:
        _gemm(x, gate_up, gate_up_scales, gate_up_bias, h, tok, offs, I, H, cfg, True, limit, alpha)
    return h


def biased_down_proj(h: torch.Tensor, down: torch.Tensor, down_bias: torch.Tensor, offs: torch.Tensor,
                     cfg: TileConfig, down_scales: torch.Tensor | None = None) -> torch.Tensor:
    """h [P, I] grouped rows, down [E, I, H], down_bias [E, H], offs [E] int32 -> y [P, H]:
    y[r] = round(round(h[r] @ down[e]) + down_bias[e]). MXFP4 (``down_scales`` [E, H, I/32]): down is the bytes
    [E, H, I/32, 16]."""
    h, down_bias = _rows_contiguous(h), _rows_contiguous(down_bias)
    if down_scales is None:
        down = _rows_contiguous(down)
        I, H = down.shape[1], down.shape[2]
    else:
        down, down_scales = _packed_contiguous(down), _packed_contiguous(down_scales)
        I, H = down.shape[2] * 32, down.shape[1]
    y = torch.empty(h.shape[0], H, dtype=h.dtype, device=h.device)
    if h.shape[0]:
        _gemm(h, down, down_scales, down_bias, y, offs, offs, H, I, cfg, False, 0.0, 0.0)  # tok unused: grouped
    return y


def expert_mlp(
    x: torch.Tensor,  # [T, H] model dtype
    gate_up: torch.Tensor,  # [E, H, 2I] gate/up columns interleaved; MXFP4: bytes [E, 2I, H/32, 16] uint8
    gate_up_bias: torch.Tensor,  # [E, 2I]
    down: torch.Tensor,  # [E, I, H]; MXFP4: bytes [E, H, I/32, 16] uint8
    down_bias: torch.Tensor,  # [E, H]
    pos: torch.Tensor,  # [T, K] grouped row of each (token, slot): only its shape is used (P = T*K)
    tok: torch.Tensor,  # [T*K] long: token of each grouped row
    offs: torch.Tensor,  # [E] int32: end row of each expert's group
    limit: float,  # swiglu_limit
    alpha: float,  # swiglu_alpha
    configs: tuple[TileConfig, TileConfig] | None = None,  # (gate_up, down); default: fused_moe's table, by T*K
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,  # MXFP4: (gate_up [E, 2I, H/32], down [E, H, I/32])
) -> torch.Tensor:  # [T*K, H] model dtype, grouped order (routing_kernels.combine's input)
    """GPT-OSS's routed experts on expert-grouped rows, reading only the experts that have rows (MXFP4 experts:
    their 4-bit bytes and scales, once)."""
    P = pos.numel()
    if scales is None:
        E, H, I2 = gate_up.shape
        weights_fit = down.shape == (E, I2 // 2, H)
        weight_dtypes_fit = gate_up.dtype == down.dtype == x.dtype
    else:
        E, I2, G, B = gate_up.shape
        H = G * 32
        weights_fit = (B == 16 and I2 % 64 == 0 and down.shape == (E, H, I2 // 64, 16)
                       and scales[0].shape == (E, I2, G) and scales[1].shape == (E, H, I2 // 64))
        weight_dtypes_fit = all(t.dtype == torch.uint8 for t in (gate_up, down, *scales))
    if (x.dim() != 2 or x.shape[1] != H or not weights_fit or gate_up_bias.shape != (E, I2)
            or down_bias.shape != (E, H) or tok.shape != (P,) or offs.shape != (E,)):
        raise ValueError(
            f"expert_mlp: shapes x {tuple(x.shape)}, gate_up {tuple(gate_up.shape)}, gate_up_bias "
            f"{tuple(gate_up_bias.shape)}, down {tuple(down.shape)}, down_bias {tuple(down_bias.shape)}, "
            + (f"scales {tuple(scales[0].shape)}, {tuple(scales[1].shape)}, " if scales is not None else "")
            + f"pos {tuple(pos.shape)}, tok {tuple(tok.shape)}, offs {tuple(offs.shape)} do not fit together"
        )
    if offs.dtype != torch.int32:
        raise ValueError(f"expert_mlp: offs must be int32, got {offs.dtype}")
    if x.dtype not in _DT or not weight_dtypes_fit or any(t.dtype != x.dtype for t in (gate_up_bias, down_bias)):
        raise ValueError(f"expert_mlp: x, the expert weights (or uint8 MXFP4 bytes and scales) and biases must fit "
                         f"one of {list(_DT)}")
    g_cfg, d_cfg = configs or fused_moe.tile_configs(P, x.device, E, H, I2 // 2, x.dtype)
    gu_scales, down_scales = scales if scales is not None else (None, None)
    h = gate_up_clamped_swiglu(x, gate_up, gate_up_bias, tok, offs, g_cfg, limit, alpha, gu_scales)
    return biased_down_proj(h, down, down_bias, offs, d_cfg, down_scales)
