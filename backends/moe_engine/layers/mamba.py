"""Mamba-2, the state-space layers of Nemotron-H (transformers 5.24 ``NemotronHMamba2Mixer``, its torch path).

Per token: in_proj -> (gate z [I], x B C [conv_dim], dt [heads]); x B C through the short causal convolution with
SiLU (layers/recurrent.py); then, per head h with its state S [head_dim, state_size] (float32, one per sequence):

    dt = softplus(dt + dt_bias);   S <- exp(dt A_h) S + dt x_h B^T;   y_h = S C + D_h x_h

(B and C shared by the heads of a group); y through a grouped RMSNorm gated by silu(z), then out_proj.

As in HF, a prompt chunk runs the chunked scan (``chunk_scan``: chunks of ``chunk_size``, segment sums, dt clamped
to [time_step_min, inf)) in float32, and a decode token the single-step update (``selective_state_update``: dt not
clamped, the output in the model dtype), each operation by operation as HF's torch functions, so that float32
agrees to rounding and bfloat16 bit for bit. On CUDA with the fused kernels on, ``kernels/mamba.py`` runs the
convolution and the scan for the whole step (varlen, in place on the slots; equal within rounding).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..config import MambaSpec
from ..kernels import gated_delta
from ..kernels import mamba as mamba_kernels
from .attend import ForwardBatch
from .recurrent import Conv1d, LayerState, StateSpec, conv_decode, conv_prefill


def _pad_seq(x: Tensor, pad: int) -> Tensor:
    """HF pad_tensor_by_size: zeros after the sequence (dim 1) of a 3-D or 4-D tensor."""
    shape = (0, 0, 0, 0, 0, pad, 0, 0) if x.dim() == 4 else (0, 0, 0, pad, 0, 0)
    return F.pad(x, shape, mode="constant", value=0)


def _chunks(x: Tensor, pad: int, chunk: int) -> Tensor:
    x = _pad_seq(x, pad)
    if x.dim() == 3:
        return x.reshape(x.shape[0], -1, chunk, x.shape[2])
    return x.reshape(x.shape[0], -1, chunk, x.shape[2], x.shape[3])


def segment_sum(x: Tensor) -> Tensor:
    """HF's (stable) segment sum over the last dim."""
    n = x.size(-1)
    x = x[..., None].expand(*x.size(), n)
    x = x.masked_fill(~torch.tril(torch.ones(n, n, device=x.device, dtype=torch.bool), diagonal=-1), 0)
    s = torch.cumsum(x, dim=-2)
    return s.masked_fill(~torch.tril(torch.ones(n, n, device=x.device, dtype=torch.bool), diagonal=0), -torch.inf)


def chunk_scan(
    x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, chunk_size: int, D: Tensor, dt_bias: Tensor,
    initial_states: Tensor | None, dt_min: float,
) -> tuple[Tensor, Tensor]:
    """HF ``mamba2_chunk_scan`` (dt_softplus, dt clamped to [dt_min, inf)), operation by operation. x [b, L, H, P],
    dt [b, L, H], A [H] float32, B/C [b, L, G, N], initial_states [b, H, P, N] or None -> (y [b, L, H, P] float32,
    final state [b, H, P, N] float32)."""
    b, L, H, P = x.shape
    G = B.shape[2]
    dt = F.softplus(dt + dt_bias.to(dt.dtype))
    dt = torch.clamp(dt, min=dt_min, max=float("inf"))
    x = x.float()
    B = B.float().repeat_interleave(H // G, dim=2, output_size=H)
    C = C.float().repeat_interleave(H // G, dim=2, output_size=H)
    pad = (chunk_size - L % chunk_size) % chunk_size
    D_residual = D[..., None] * _pad_seq(x, pad)
    x = x * dt[..., None].float()
    A = A.to(x.dtype) * dt.float()
    x, A, B, C = [_chunks(t, pad, chunk_size) for t in (x, A, B, C)]
    A = A.permute(0, 3, 1, 2)
    A_cumsum = torch.cumsum(A, dim=-1)
    Lmat = torch.exp(segment_sum(A))
    Gm = torch.einsum("bclhn,bcshn->bclsh", C, B)
    M = Gm * Lmat.permute(0, 2, 3, 4, 1)
    Y_diag = torch.einsum("bclsh,bcshp->bclhp", M, x)
    decay_states = torch.exp(A_cumsum[:, :, :, -1:] - A_cumsum)
    B_decay = B * decay_states.permute(0, -2, -1, 1)[..., None]
    states = torch.einsum("bclhn,bclhp->bchpn", B_decay, x)
    previous = (initial_states[:, None].to(dtype=states.dtype, device=states.device) if initial_states is not None
                else torch.zeros_like(states[:, :1]))
    states = torch.cat([previous, states], dim=1)
    decay_chunk = torch.exp(segment_sum(F.pad(A_cumsum[:, :, :, -1], (1, 0)))).transpose(1, 3)
    new_states = torch.einsum("bzch,bzhpn->bchpn", decay_chunk, states)
    states, final = new_states[:, :-1], new_states[:, -1]
    state_decay_out = torch.exp(A_cumsum)
    Y_off = torch.einsum("bclhn,bchpn->bclhp", C, states) * state_decay_out.permute(0, 2, 3, 1)[..., None]
    y = (Y_diag + Y_off).contiguous().reshape(b, -1, H, P) + D_residual
    return y[:, :L], final


def selective_state_update(state: Tensor, x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor,
                           dt_bias: Tensor) -> tuple[Tensor, Tensor]:
    """HF ``mamba2_selective_state_update`` (dt_softplus, no clamp), operation by operation, for n sequences' one
    token each: state [n, H, P, N] float32, x [n, H, P], dt [n, H, P] (expanded), A [H, P, N], B/C [n, G, N],
    D/dt_bias [H, P] -> (y [n, H, P] in x's dtype, new state)."""
    n, H, P = x.shape
    G, N = B.shape[1], B.shape[-1]
    dt = F.softplus(dt + dt_bias.to(dt.dtype))[..., None]
    dA = torch.exp(dt.float() * A.float())
    B = B.reshape(n, G, 1, N).expand(n, G, H // G, N).contiguous().reshape(n, H, 1, N)
    dBx = dt * B * x[..., None]
    new = state * dA + dBx
    C = C.reshape(n, G, 1, N).expand(n, G, H // G, N).contiguous().reshape(n, H, N)
    y = torch.bmm(new.to(C.dtype).view(n * H, P, N), C.view(n * H, N, 1)).view(n, H, P)
    y = (y + x * D).to(y.dtype)
    return y.to(x.dtype), new.to(state.dtype)


class GroupedGatedRMSNorm(nn.Module):
    """HF ``NemotronHRMSNormGated``: x * silu(gate) in float32, RMSNorm over groups of ``group_size``, then
    ``weight * normed.to(input dtype)`` (the input dtype: float32 after a prompt's scan, the model dtype after a
    decode token's)."""

    def __init__(self, dim: int, group_size: int, eps: float):
        super().__init__()
        self.group_size, self.eps = group_size, eps
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)

    def forward(self, x: Tensor, gate: Tensor) -> Tensor:
        dtype = x.dtype
        x = x.to(torch.float32) * F.silu(gate.to(torch.float32))
        *prefix, last = x.shape
        g = x.view(*prefix, last // self.group_size, self.group_size)
        g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * g.view(*prefix, last).to(dtype)


class Mamba2Mixer(nn.Module):
    """One Mamba-2 layer (parameter names as HF's ``mixer``)."""

    supports_fused = True

    def __init__(self, spec: MambaSpec, hidden_size: int, eps: float):
        super().__init__()
        self.spec = spec
        self.intermediate = spec.intermediate_size
        self.conv_dim = spec.conv_dim
        self.in_proj = nn.Linear(hidden_size, self.intermediate + self.conv_dim + spec.num_heads, bias=spec.proj_bias)
        self.conv1d = Conv1d(self.conv_dim, spec.conv_kernel, bias=spec.conv_bias)
        self.dt_bias = nn.Parameter(torch.ones(spec.num_heads), requires_grad=False)
        self.A_log = nn.Parameter(torch.zeros(spec.num_heads), requires_grad=False)
        self.D = nn.Parameter(torch.ones(spec.num_heads), requires_grad=False)
        self.norm = GroupedGatedRMSNorm(self.intermediate, self.intermediate // spec.n_groups, eps)
        self.out_proj = nn.Linear(self.intermediate, hidden_size, bias=spec.proj_bias)
        self.fused = False  # kernels/mamba.py, within rounding (set by MoEForCausalLM.use_fused_kernels)
        self.within_rounding = False

    def state_spec(self) -> StateSpec:
        s = self.spec
        return StateSpec(self.conv_dim, s.conv_kernel, (s.num_heads, s.head_dim, s.state_size))

    def forward(self, x: Tensor, batch: ForwardBatch, state: LayerState) -> Tensor:
        s = self.spec
        dtype = x.dtype
        proj = self.in_proj(x)
        gate, xbc, dt = proj.split([self.intermediate, self.conv_dim, s.num_heads], dim=-1)
        if self.fused and self.within_rounding:
            y = mamba_kernels.mamba_step(self, xbc, dt, batch, state)  # [T, I] float32
            y = gated_delta.gated_norm(y, gate, self.norm.weight, self.norm.eps, self.norm.group_size,
                                       gate_first=True, out_dtype=dtype)
            return self.out_proj(y)
        if batch.context_lens is None:  # a captured decode step: one token per row, slots on the device only
            y = self._decode(xbc, dt, batch.state_slots, state, fresh=batch.positions == 0)
            return self.out_proj(self.norm(y, gate).to(dtype))
        T = x.shape[0]
        starts, ctx, slots = batch.query_starts, batch.context_lens, batch.state_slots_host
        out = torch.empty(T, self.intermediate, dtype=dtype, device=x.device)
        decode = [i for i, n in enumerate(batch.query_lens) if n == 1 and ctx[i] > 0]
        if decode:  # HF's decode path, batched: its outputs in the model dtype, normed as such
            if len(decode) == T:
                out[:] = self.out_proj(self.norm(self._decode(xbc, dt, batch.state_slots, state), gate).to(dtype))
            else:
                idx = torch.tensor([starts[i] for i in decode], device=x.device)
                sl = torch.tensor([slots[i] for i in decode], device=x.device)
                y = self._decode(xbc[idx], dt[idx], sl, state)
                out[idx] = self.out_proj(self.norm(y, gate[idx]).to(dtype))
        done = set(decode)
        for i, n in enumerate(batch.query_lens):
            if i in done or n == 0:
                continue
            lo, hi = starts[i], starts[i] + n
            y = self._prefill(xbc[lo:hi], dt[lo:hi], slots[i], ctx[i] == 0, state)  # [n, I] float32
            out[lo:hi] = self.out_proj(self.norm(y, gate[lo:hi]).to(dtype))
        return out

    def _split(self, conv_out: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        s = self.spec
        GN = s.n_groups * s.state_size
        return torch.split(conv_out, [self.intermediate, GN, GN], dim=-1)

    def _prefill(self, xbc: Tensor, dt: Tensor, slot: int, first: bool, state: LayerState) -> Tensor:
        s, n = self.spec, xbc.shape[0]
        conv_out, conv_state = conv_prefill(xbc, None if first else state.conv[slot], self.conv1d.weight,
                                            self.conv1d.bias, "silu")
        hs, B, C = self._split(conv_out)
        A = -torch.exp(self.A_log.float())
        y, final = chunk_scan(
            hs.view(1, n, s.num_heads, s.head_dim), dt[None], A, B.view(1, n, s.n_groups, s.state_size),
            C.view(1, n, s.n_groups, s.state_size), s.chunk_size, self.D, self.dt_bias,
            None if first else state.ssm[slot][None], s.time_step_min,
        )
        state.conv[slot] = conv_state
        state.ssm[slot] = final[0]
        return y.reshape(n, -1)

    def _decode(self, xbc: Tensor, dt: Tensor, slots: Tensor, state: LayerState, fresh: Tensor | None = None
                ) -> Tensor:
        """One token of each of n sequences at ``slots``: HF's decode path, batched; [n, I] in the model dtype."""
        s, n = self.spec, xbc.shape[0]
        conv, ssm = state.conv[slots], state.ssm[slots]
        if fresh is not None:
            conv = torch.where(fresh[:, None, None], 0, conv)
            ssm = torch.where(fresh[:, None, None, None], 0, ssm)
        conv_out, conv_new = conv_decode(xbc, conv, self.conv1d.weight, self.conv1d.bias, "silu")
        hs, B, C = self._split(conv_out)
        H, P, N = s.num_heads, s.head_dim, s.state_size
        A = (-torch.exp(self.A_log.float()))[:, None, None].expand(-1, P, N)
        y, new = selective_state_update(
            ssm, hs.view(n, H, P), dt[:, :, None].expand(-1, -1, P), A, B.view(n, s.n_groups, N),
            C.view(n, s.n_groups, N), self.D[:, None].expand(-1, P), self.dt_bias[:, None].expand(-1, P),
        )
        state.conv[slots] = conv_new
        state.ssm[slots] = new
        return y.reshape(n, -1)
