"""Gated DeltaNet kernels (layers/linear_attention.py): a step's causal convolution and gated delta rule, every
sequence of the step at once (varlen), the per-sequence states read and written in place at their slots.

- ``causal_conv``: each token's depthwise convolution over its last ``K`` inputs (those before the step's chunk come
  from the sequence's conv state, or are zeros when it starts at position 0), SiLU; then ``conv_state_update``
  writes each sequence's last ``K`` inputs back as its new state.
- ``gated_delta_rule``: one program per (sequence, value head, block of value dims) holds its [head_k_dim, BV]
  block of the state in registers and runs the recurrent form of the rule over the sequence's tokens (L2 norms,
  decay, delta update, output), then stores the block back. A decode token is one iteration; a prompt chunk is a
  loop over its tokens (the chunked form, which runs a prompt's tokens through tensor-core GEMMs, is the next
  step for long prompts: FLA's ``chunk_gated_delta_rule``).

Equal to the op-by-op layer within float32 rounding (the recurrent form where HF uses the chunked one for prompts,
its own summation order), with the same expert ids downstream (tests/unit/test_kernels.py under the interpreter).
No host sync: the lengths, slots and "starts at position 0" flags are read on the device (CUDA-graph safe).
"""
from __future__ import annotations

import torch

from .support import _DT, _launch, _pow2, triton

if triton is not None:
    import triton.language as tl

    from .support import _round

    @triton.jit
    def _causal_conv_kernel(
        x_ptr, sx, w_ptr, bias_ptr, conv_ptr, sc0, sc1, tok_seq_ptr, tok_idx_ptr, slots_ptr, fresh_ptr,
        out_ptr, so, C,
        K: tl.constexpr, BLOCK_C: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr, DT: tl.constexpr,
    ):
        t = tl.program_id(0)
        c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        cm = c < C
        b = tl.load(tok_seq_ptr + t)
        j = tl.load(tok_idx_ptr + t)  # the token's index in its sequence's chunk
        slot = tl.load(slots_ptr + b)
        keep = tl.load(fresh_ptr + b) == 0  # the sequence continues: its conv state holds the inputs before
        acc = tl.zeros([BLOCK_C], dtype=tl.float32)
        for k in tl.static_range(K):
            i = j - (K - 1) + k  # input index within the chunk (< 0: from the state, whose last entry is i = -1)
            xv = tl.load(x_ptr + (t - (K - 1) + k) * sx + c, mask=cm & (i >= 0), other=0.0).to(tl.float32)
            sv = tl.load(conv_ptr + slot * sc0 + c * sc1 + (K + i), mask=cm & (i < 0) & keep, other=0.0).to(tl.float32)
            w = tl.load(w_ptr + c * K + k, mask=cm, other=0.0).to(tl.float32)
            acc += w * (xv + sv)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + c, mask=cm, other=0.0).to(tl.float32)
        y = _round(acc, DT)
        if SILU:
            y = _round(y / (1.0 + tl.exp(-y)), DT)
        tl.store(out_ptr + t * so + c, y.to(out_ptr.dtype.element_ty), mask=cm)

    @triton.jit
    def _conv_state_kernel(
        x_ptr, sx, conv_ptr, sc0, sc1, cu_ptr, slots_ptr, fresh_ptr, C,
        K: tl.constexpr, KP: tl.constexpr, BLOCK_C: tl.constexpr,
    ):
        """A sequence's new conv state: the last K inputs of [state (or zeros), chunk], read whole, then written."""
        bseq = tl.program_id(0)
        c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)[:, None]
        k = tl.arange(0, KP)[None, :]
        start = tl.load(cu_ptr + bseq)
        n = tl.load(cu_ptr + bseq + 1) - start
        slot = tl.load(slots_ptr + bseq)
        keep = tl.load(fresh_ptr + bseq) == 0
        i = n - K + k  # chunk index of state entry k (< 0: an older input, from the old state's entry K + i)
        m = (c < C) & (k < K)
        xv = tl.load(x_ptr + (start + i) * sx + c, mask=m & (i >= 0), other=0.0)
        sv = tl.load(conv_ptr + slot * sc0 + c * sc1 + (K + i), mask=m & (i < 0) & keep, other=0.0)
        new = tl.where(i >= 0, xv.to(conv_ptr.dtype.element_ty), sv)
        tl.debug_barrier()
        tl.store(conv_ptr + slot * sc0 + c * sc1 + k, new, mask=m)

    @triton.jit
    def _gated_delta_kernel(
        qkv_ptr, sq, b_ptr, sb, a_ptr, sa, a_log_ptr, dt_bias_ptr, ssm_ptr, ss0, ss1, ss2,
        cu_ptr, slots_ptr, fresh_ptr, out_ptr, so0, so1, scale,
        KEY_DIM, GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, DKP: tl.constexpr, BV: tl.constexpr,
        DT: tl.constexpr,
    ):
        bseq = tl.program_id(0)
        hv = tl.program_id(1)
        hk = hv // GROUP  # the key head this value head shares (HF's repeat_interleave)
        dk = tl.arange(0, DKP)
        dv = tl.program_id(2) * BV + tl.arange(0, BV)
        mk = dk < DK
        mv = dv < DV
        start = tl.load(cu_ptr + bseq)
        end = tl.load(cu_ptr + bseq + 1)
        slot = tl.load(slots_ptr + bseq)
        keep = tl.load(fresh_ptr + bseq) == 0
        sptr = ssm_ptr + slot * ss0 + hv * ss1 + dk[:, None] * ss2 + dv[None, :]
        sm = mk[:, None] & mv[None, :]
        S = tl.load(sptr, mask=sm & keep, other=0.0)  # [DKP, BV] float32
        A = -tl.exp(tl.load(a_log_ptr + hv).to(tl.float32))
        dt_bias = tl.load(dt_bias_ptr + hv).to(tl.float32)
        for t in range(start, end):
            q = tl.load(qkv_ptr + t * sq + hk * DK + dk, mask=mk, other=0.0).to(tl.float32)
            k = tl.load(qkv_ptr + t * sq + KEY_DIM + hk * DK + dk, mask=mk, other=0.0).to(tl.float32)
            v = tl.load(qkv_ptr + t * sq + 2 * KEY_DIM + hv * DV + dv, mask=mv, other=0.0).to(tl.float32)
            b = tl.load(b_ptr + t * sb + hv).to(tl.float32)
            beta = _round(1.0 / (1.0 + tl.exp(-b)), DT)  # HF: b.sigmoid() in the model dtype
            x = tl.load(a_ptr + t * sa + hv).to(tl.float32) + dt_bias
            softplus = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))  # torch's threshold 20
            decay = tl.exp(A * softplus)
            q = q / tl.sqrt(tl.sum(q * q, axis=0) + 1e-6) * scale
            k = k / tl.sqrt(tl.sum(k * k, axis=0) + 1e-6)
            S = S * decay
            kv_mem = tl.sum(S * k[:, None], axis=0)  # [BV]
            delta = (v - kv_mem) * beta
            S = S + k[:, None] * delta[None, :]
            o = tl.sum(S * q[:, None], axis=0)
            tl.store(out_ptr + t * so0 + hv * so1 + dv, o.to(out_ptr.dtype.element_ty), mask=mv)
        tl.store(sptr, S, mask=sm)


if triton is not None:

    @triton.jit
    def _gated_norm_kernel(
        x_ptr, sx, z_ptr, sz, w_ptr, out_ptr, so, eps,
        G: tl.constexpr, BLOCK: tl.constexpr, GATE_FIRST: tl.constexpr, DT_X: tl.constexpr, DT: tl.constexpr,
    ):
        """Row program_id(0), group program_id(1) of G columns. GATE_FIRST (Mamba-2): x * silu(z), RMSNorm over the
        group, weight * normed (x's dtype); else (Gated DeltaNet): weight * RMSNorm(x).to(dtype), times silu(z)."""
        row = tl.program_id(0)
        c = tl.program_id(1) * G + tl.arange(0, BLOCK)
        m = tl.arange(0, BLOCK) < G
        x = tl.load(x_ptr + row * sx + c, mask=m, other=0.0).to(tl.float32)
        z = tl.load(z_ptr + row * sz + c, mask=m, other=0.0).to(tl.float32)
        gate = z / (1.0 + tl.exp(-z))
        if GATE_FIRST:
            x = x * gate
        rstd = tl.math.rsqrt(tl.sum(x * x, axis=0) / G + eps)
        # Mamba-2's weight spans every group (GATE_FIRST); Gated DeltaNet's is one head's, shared by the heads
        w = tl.load(w_ptr + (c if GATE_FIRST else tl.arange(0, BLOCK)), mask=m, other=0.0).to(tl.float32)
        y = _round(w * _round(x * rstd, DT_X), DT_X)
        if not GATE_FIRST:
            y = y * gate
        tl.store(out_ptr + row * so + c, y.to(out_ptr.dtype.element_ty), mask=m)


def gated_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float, group: int, gate_first: bool,
               out_dtype: torch.dtype) -> torch.Tensor:
    """The recurrent layers' gated RMSNorms in one launch (equal to the op-by-op norms within float32 summation
    order): x, z [rows, n] -> [rows, n] in ``out_dtype``. Gated DeltaNet (``gate_first`` False, group = head_v_dim):
    HF ``Qwen3NextRMSNormGated``; Mamba-2 (True, group = n / n_groups): HF ``NemotronHRMSNormGated``."""
    rows, n = x.shape
    out = torch.empty(rows, n, dtype=out_dtype, device=x.device)
    if rows == 0:
        return out
    if x.stride(-1) != 1:
        x = x.contiguous()
    if z.stride(-1) != 1:
        z = z.contiguous()
    _launch(_gated_norm_kernel, (rows, n // group), x, x.stride(0), z, z.stride(0), weight, out, out.stride(0), eps,
            G=group, BLOCK=_pow2(group), GATE_FIRST=gate_first, DT_X=_DT[x.dtype], DT=_DT[out_dtype])
    return out


def step_layout(batch) -> tuple[torch.Tensor, torch.Tensor]:
    """(cu_seqlens [B + 1], fresh [B] int32: the sequence starts at position 0) of a step, on the device."""
    cu = batch.cu_seqlens_q
    fresh = (batch.positions[cu[:-1].clamp(max=max(batch.positions.shape[0] - 1, 0))] == 0).to(torch.int32)
    return cu, fresh


def causal_conv(
    x: torch.Tensor,  # [T, C] the step's inputs (model dtype)
    weight: torch.Tensor,  # [C, 1, K]
    bias: torch.Tensor | None,  # [C]
    conv: torch.Tensor,  # [slots + 1, C, K] the layer's conv states (read, then updated in place)
    batch, fresh: torch.Tensor, silu: bool = True,
) -> torch.Tensor:  # [T, C]
    T, C = x.shape
    K = weight.shape[-1]
    out = torch.empty_like(x)
    if T == 0:
        return out
    if x.stride(-1) != 1:
        x = x.contiguous()
    w = weight.reshape(C, K).contiguous()
    BLOCK_C = min(_pow2(C), 256)
    _launch(_causal_conv_kernel, (T, triton.cdiv(C, BLOCK_C)), x, x.stride(0), w, bias if bias is not None else w,
            conv, conv.stride(0), conv.stride(1), batch.token_seq, batch.token_qidx, batch.state_slots, fresh,
            out, out.stride(0), C, K=K, BLOCK_C=BLOCK_C, HAS_BIAS=bias is not None, SILU=silu, DT=_DT[x.dtype])
    B = batch.state_slots.shape[0]
    _launch(_conv_state_kernel, (B, triton.cdiv(C, BLOCK_C)), x, x.stride(0), conv, conv.stride(0), conv.stride(1),
            batch.cu_seqlens_q, batch.state_slots, fresh, C, K=K, KP=_pow2(K), BLOCK_C=BLOCK_C)
    return out


def gated_delta_rule(
    qkv: torch.Tensor,  # [T, 2 Hk Dk + Hv Dv] after the convolution
    b: torch.Tensor, a: torch.Tensor,  # [T, Hv]
    A_log: torch.Tensor, dt_bias: torch.Tensor,  # [Hv]
    ssm: torch.Tensor,  # [slots + 1, Hv, Dk, Dv] float32 (updated in place)
    batch, fresh: torch.Tensor, num_k_heads: int, head_k_dim: int, head_v_dim: int,
) -> torch.Tensor:  # [T, Hv, Dv] in qkv's dtype
    T = qkv.shape[0]
    Hv = ssm.shape[1]
    out = torch.empty(T, Hv, head_v_dim, dtype=qkv.dtype, device=qkv.device)
    if T == 0:
        return out
    if b.stride(-1) != 1:
        b = b.contiguous()
    if a.stride(-1) != 1:
        a = a.contiguous()
    B = batch.state_slots.shape[0]
    BV = min(_pow2(head_v_dim), 32)
    _launch(_gated_delta_kernel, (B, Hv, triton.cdiv(head_v_dim, BV)), qkv, qkv.stride(0), b, b.stride(0), a,
            a.stride(0), A_log, dt_bias, ssm, ssm.stride(0), ssm.stride(1), ssm.stride(2), batch.cu_seqlens_q,
            batch.state_slots, fresh, out, out.stride(0), out.stride(1), head_k_dim ** -0.5, num_k_heads * head_k_dim,
            GROUP=Hv // num_k_heads, DK=head_k_dim, DV=head_v_dim, DKP=_pow2(head_k_dim), BV=BV, DT=_DT[qkv.dtype])
    return out


def gated_delta_step(layer, mixed: torch.Tensor, b: torch.Tensor, a: torch.Tensor, batch, state) -> torch.Tensor:
    """A Gated DeltaNet layer's convolution and recurrence for a whole step: [T, Hv, Dv]."""
    s = layer.spec
    _, fresh = step_layout(batch)
    qkv = causal_conv(mixed, layer.conv1d.weight, layer.conv1d.bias, state.conv, batch, fresh)
    return gated_delta_rule(qkv, b, a, layer.A_log, layer.dt_bias, state.ssm, batch, fresh, s.num_k_heads,
                            s.head_k_dim, s.head_v_dim)
