"""Mamba-2 kernels (layers/mamba.py): a step's causal convolution (kernels/gated_delta.py's ``causal_conv``) and
selective scan for every sequence at once (varlen), the per-sequence states read and written in place at their
slots.

``selective_scan``: one program per (sequence, head, block of head dims) holds its [BP, state_size] block of the
state in registers and runs the recurrence over the sequence's tokens (dt = softplus(dt + dt_bias), clamped to
[time_step_min, inf) for prompt tokens as HF's chunked scan does, not for decode tokens as HF's single-step update
does; S <- exp(dt A) S + dt x B^T; y = S C + D x), then stores the block back. Its output is float32 (HF's chunked
scan's dtype). Equal to the op-by-op layer within float32 rounding; no host sync (CUDA-graph safe).
"""
from __future__ import annotations

import torch

from .gated_delta import causal_conv, step_layout
from .support import _launch, _pow2, triton

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _selective_scan_kernel(
        xbc_ptr, sx, dt_ptr, sdt, a_log_ptr, dt_bias_ptr, d_ptr, ssm_ptr, ss0, ss1, ss2,
        cu_ptr, slots_ptr, fresh_ptr, out_ptr, so, dt_min,
        I, GN, HEADS_PER_GROUP: tl.constexpr, P: tl.constexpr, N: tl.constexpr, BP: tl.constexpr,
        NP: tl.constexpr,
    ):
        bseq = tl.program_id(0)
        h = tl.program_id(1)
        g = h // HEADS_PER_GROUP
        p = tl.program_id(2) * BP + tl.arange(0, BP)
        n = tl.arange(0, NP)
        mp = p < P
        mn = n < N
        start = tl.load(cu_ptr + bseq)
        end = tl.load(cu_ptr + bseq + 1)
        slot = tl.load(slots_ptr + bseq)
        keep = tl.load(fresh_ptr + bseq) == 0
        decode = keep & (end - start == 1)  # HF's single-step update: dt not clamped
        lo = tl.where(decode, -float("inf"), dt_min)
        sptr = ssm_ptr + slot * ss0 + h * ss1 + p[:, None] * ss2 + n[None, :]
        sm = mp[:, None] & mn[None, :]
        S = tl.load(sptr, mask=sm & keep, other=0.0)  # [BP, NP] float32
        A = -tl.exp(tl.load(a_log_ptr + h).to(tl.float32))
        dt_bias = tl.load(dt_bias_ptr + h).to(tl.float32)
        D = tl.load(d_ptr + h).to(tl.float32)
        for t in range(start, end):
            x = tl.load(xbc_ptr + t * sx + h * P + p, mask=mp, other=0.0).to(tl.float32)
            B = tl.load(xbc_ptr + t * sx + I + g * N + n, mask=mn, other=0.0).to(tl.float32)
            C = tl.load(xbc_ptr + t * sx + I + GN + g * N + n, mask=mn, other=0.0).to(tl.float32)
            v = tl.load(dt_ptr + t * sdt + h).to(tl.float32) + dt_bias
            dt = tl.where(v > 20.0, v, tl.log(1.0 + tl.exp(tl.minimum(v, 20.0))))  # softplus, torch's threshold
            dt = tl.maximum(dt, lo)
            S = S * tl.exp(dt * A) + (dt * x)[:, None] * B[None, :]
            y = tl.sum(S * C[None, :], axis=1) + D * x
            tl.store(out_ptr + t * so + h * P + p, y, mask=mp)
        tl.store(sptr, S, mask=sm)


def selective_scan(xbc: torch.Tensor, dt: torch.Tensor, layer, ssm: torch.Tensor, batch, fresh: torch.Tensor
                   ) -> torch.Tensor:
    """xbc [T, conv_dim] after the convolution, dt [T, heads] -> y [T, heads * head_dim] float32."""
    s = layer.spec
    T = xbc.shape[0]
    out = torch.empty(T, s.num_heads * s.head_dim, dtype=torch.float32, device=xbc.device)
    if T == 0:
        return out
    if dt.stride(-1) != 1:
        dt = dt.contiguous()
    B = batch.state_slots.shape[0]
    BP = min(_pow2(s.head_dim), 16)
    _launch(_selective_scan_kernel, (B, s.num_heads, triton.cdiv(s.head_dim, BP)), xbc, xbc.stride(0), dt,
            dt.stride(0), layer.A_log, layer.dt_bias, layer.D, ssm, ssm.stride(0), ssm.stride(1), ssm.stride(2),
            batch.cu_seqlens_q, batch.state_slots, fresh, out, out.stride(0), float(s.time_step_min),
            s.intermediate_size, s.n_groups * s.state_size, HEADS_PER_GROUP=s.num_heads // s.n_groups, P=s.head_dim,
            N=s.state_size, BP=BP, NP=_pow2(s.state_size))
    return out


def mamba_step(layer, xbc: torch.Tensor, dt: torch.Tensor, batch, state) -> torch.Tensor:
    """A Mamba-2 layer's convolution and scan for a whole step: y [T, heads * head_dim] float32."""
    _, fresh = step_layout(batch)
    conv = causal_conv(xbc, layer.conv1d.weight, layer.conv1d.bias, state.conv, batch, fresh)
    return selective_scan(conv, dt, layer, state.ssm, batch, fresh)
