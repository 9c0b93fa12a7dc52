"""Gated DeltaNet, the linear-attention layers of Qwen3-Next and Qwen3.5 (transformers 5.24 ``*GatedDeltaNet``).

Per token: projections to q, k, v (through a short causal convolution with SiLU, layers/recurrent.py), the output
gate z, b (-> beta = sigmoid(b)) and a (-> the decay g = -exp(A_log) * softplus(a + dt_bias), float32). The state
S [num_v_heads, head_k_dim, head_v_dim] (float32, one per sequence) follows the gated delta rule

    S <- exp(g) S;   S <- S + k (beta (v - S^T k))^T;   o = S^T q / sqrt(head_k_dim)

with q and k L2-normalised, and the layer returns out_proj(RMSNorm(o) * silu(z)).

As in HF, a prompt chunk (or a 1-token prompt) runs the chunked form of the rule (``chunk_gated_delta_rule``,
chunks of 64 with a triangular solve inside each) and a decode token the recurrent form
(``recurrent_gated_delta_rule``), each operation by operation as HF's torch implementation, so that float32 agrees
to rounding. A prompt longer than a step's budget is prefilled over several steps, the state carried between them.
On CUDA with the fused kernels on, ``kernels/gated_delta.py`` runs the convolution and the recurrence for the whole
step (varlen, in place on the slots; equal within float32 rounding).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..config import LinearAttentionSpec
from ..kernels import gated_delta
from .attend import ForwardBatch
from .recurrent import Conv1d, LayerState, StateSpec, conv_decode, conv_prefill


def l2norm(x: Tensor, dim: int = -1, eps: float = 1e-6) -> Tensor:
    """HF's (and FLA's) L2 norm."""
    return x * torch.rsqrt((x * x).sum(dim=dim, keepdim=True) + eps)


def _heads_first_normalised(query, key, value, g, beta):
    """The prologue HF's two reference rules share: k heads repeated to v's, [B, T, H, D] -> [B, H, T, D] float32,
    q/k L2-normalised (their query scalings differ in how they round: each rule applies its own)."""
    Hk, Hv = key.shape[2], value.shape[2]
    if Hk != Hv:
        query = query.repeat_interleave(Hv // Hk, dim=2)
        key = key.repeat_interleave(Hv // Hk, dim=2)
    query, key, value, beta, decay = [
        x.transpose(1, 2).to(torch.float32, memory_format=torch.contiguous_format)
        for x in (query, key, value, beta, g)
    ]
    return l2norm(query, dim=-1, eps=1e-6), l2norm(key, dim=-1, eps=1e-6), value, beta, decay


def chunk_gated_delta_rule(
    query: Tensor, key: Tensor, value: Tensor, g: Tensor, beta: Tensor, chunk_size: int = 64,
    initial_state: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """HF ``torch_chunk_gated_delta_rule`` (q/k L2-normalised in it), operation by operation. query/key [B, T, Hk, Dk],
    value [B, T, Hv, Dv], g/beta [B, T, Hv]; initial_state [B, Hv, Dk, Dv] or None -> (out [B, T, Hv, Dv] in the
    query's dtype, final state [B, Hv, Dk, Dv] float32)."""
    initial_dtype = query.dtype
    B, T, _, Dk = key.shape
    Hv, Dv = value.shape[-2:]
    query, key, value, beta, decay = _heads_first_normalised(query, key, value, g, beta)
    query = query * query.shape[-1] ** -0.5

    pad = (chunk_size - T % chunk_size) % chunk_size
    query, key, value = (F.pad(x, (0, 0, 0, pad)) for x in (query, key, value))
    beta, decay = (F.pad(x, (0, pad)) for x in (beta, decay))
    num_chunks = (T + pad) // chunk_size
    v_beta = value * beta.unsqueeze(-1)
    k_beta = key * beta.unsqueeze(-1)
    query, key, k_beta, v_beta = [
        x.reshape(x.shape[0], x.shape[1], -1, chunk_size, x.shape[-1]) for x in (query, key, k_beta, v_beta)
    ]
    decay = decay.reshape(decay.shape[0], decay.shape[1], -1, chunk_size)
    upper = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=query.device).triu(1)
    cum_decay = decay.cumsum(dim=3)
    pairwise = (cum_decay.unsqueeze(4) - cum_decay.unsqueeze(3)).masked_fill(upper, float("-inf")).exp()
    ut_system = (k_beta @ key.transpose(-1, -2)) * pairwise
    intra = (query @ key.transpose(-1, -2)) * pairwise
    decayed_k_beta = k_beta * cum_decay.exp().unsqueeze(-1)
    new_values = torch.linalg.solve_triangular(ut_system, v_beta, upper=False, unitriangular=True)
    k_cumdecay = torch.linalg.solve_triangular(ut_system, decayed_k_beta, upper=False, unitriangular=True)
    if initial_state is None:
        state = torch.zeros(B, Hv, Dk, Dv, dtype=new_values.dtype, device=new_values.device)
    else:
        state = initial_state.to(new_values)
    out = torch.zeros_like(new_values)
    query = query * cum_decay.exp().unsqueeze(-1)
    key = key * (cum_decay[..., -1:] - cum_decay).exp().unsqueeze(-1)
    chunk_decay = cum_decay[..., -1].exp()[..., None, None]
    for i in range(num_chunks):
        v_new = new_values[:, :, i] - k_cumdecay[:, :, i] @ state
        out[:, :, i] = query[:, :, i] @ state + intra[:, :, i] @ v_new
        state = state * chunk_decay[:, :, i] + key[:, :, i].transpose(-1, -2) @ v_new
    out = out.reshape(B, Hv, -1, Dv)[:, :, :T]
    return out.transpose(1, 2).to(initial_dtype, memory_format=torch.contiguous_format), state


def recurrent_gated_delta_rule(
    query: Tensor, key: Tensor, value: Tensor, g: Tensor, beta: Tensor, initial_state: Tensor,
) -> tuple[Tensor, Tensor]:
    """HF ``torch_recurrent_gated_delta_rule`` (q/k L2-normalised), operation by operation; same shapes as
    ``chunk_gated_delta_rule`` (initial_state required)."""
    initial_dtype = query.dtype
    T = key.shape[1]
    query, key, value, beta, decay = _heads_first_normalised(query, key, value, g, beta)
    query = query / (query.shape[-1] ** 0.5)
    state = initial_state.to(value)
    out = torch.zeros_like(value)
    for i in range(T):
        q_t, k_t, v_t = query[:, :, i], key[:, :, i], value[:, :, i]
        state = state * decay[:, :, i].exp()[..., None, None]
        kv_mem = (state * k_t.unsqueeze(-1)).sum(dim=-2)
        delta = (v_t - kv_mem) * beta[:, :, i].unsqueeze(-1)
        state = state + k_t.unsqueeze(-1) * delta.unsqueeze(-2)
        out[:, :, i] = (state * q_t.unsqueeze(-1)).sum(dim=-2)
    return out.transpose(1, 2).contiguous().to(initial_dtype), state


class GatedRMSNorm(nn.Module):
    """HF ``Qwen3NextRMSNormGated``: (weight * normed.to(dtype)) * silu(gate.float()), cast to the input dtype."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)

    def forward(self, x: Tensor, gate: Tensor) -> Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        x = self.weight * x.to(dtype)
        return (x * F.silu(gate.to(torch.float32))).to(dtype)


class GatedDeltaNet(nn.Module):
    """One Gated DeltaNet layer (parameter names as HF's ``linear_attn``)."""

    def __init__(self, spec: LinearAttentionSpec, hidden_size: int, eps: float):
        super().__init__()
        self.spec = spec
        Hk, Hv, Dk, Dv = spec.num_k_heads, spec.num_v_heads, spec.head_k_dim, spec.head_v_dim
        self.key_dim, self.value_dim = Hk * Dk, Hv * Dv
        self.conv_dim = spec.conv_dim
        if spec.projections == "qkvz":  # Qwen3-Next
            self.in_proj_qkvz = nn.Linear(hidden_size, 2 * self.key_dim + 2 * self.value_dim, bias=False)
            self.in_proj_ba = nn.Linear(hidden_size, 2 * Hv, bias=False)
        else:  # Qwen3.5
            self.in_proj_qkv = nn.Linear(hidden_size, self.conv_dim, bias=False)
            self.in_proj_z = nn.Linear(hidden_size, self.value_dim, bias=False)
            self.in_proj_b = nn.Linear(hidden_size, Hv, bias=False)
            self.in_proj_a = nn.Linear(hidden_size, Hv, bias=False)
        self.conv1d = Conv1d(self.conv_dim, spec.conv_kernel, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(Hv), requires_grad=False)
        self.A_log = nn.Parameter(torch.zeros(Hv), requires_grad=False)
        self.norm = GatedRMSNorm(Dv, eps)
        self.out_proj = nn.Linear(self.value_dim, hidden_size, bias=False)
        # kernels/gated_delta.py, equal to the op-by-op path within rounding: on with the fused kernels' within-
        # rounding set (set by MoEForCausalLM.use_fused_kernels; a GPU's default, not --exact-kernels)
        self.fused = False
        self.within_rounding = False

    supports_fused = True

    def state_spec(self) -> StateSpec:
        s = self.spec
        return StateSpec(self.conv_dim, s.conv_kernel, (s.num_v_heads, s.head_k_dim, s.head_v_dim))

    def _projections(self) -> list[nn.Linear]:
        if self.spec.projections == "qkvz":
            return [self.in_proj_qkvz, self.in_proj_ba]
        return [self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a]

    def _joined_weight(self) -> Tensor | None:
        """[sum of out features, H] viewing the input projections' weights when ``fuse_projections`` laid them out
        back to back in one storage (a view: weight updates written into the parameters reach it), else None."""
        ws = [p.weight for p in self._projections()]
        if not all(w.is_contiguous() for w in ws) or any(
                b.data_ptr() != a.data_ptr() + a.nbytes or b.untyped_storage().data_ptr() != a.untyped_storage().data_ptr()
                for a, b in zip(ws, ws[1:])):
            return None
        return ws[0].as_strided((sum(w.shape[0] for w in ws), ws[0].shape[1]), ws[0].stride())

    @torch.no_grad()
    def fuse_projections(self) -> None:
        """Lay the input projections' weights out back to back in one tensor (each parameter a view of its rows), so
        that ``_project`` runs one GEMM instead of two (Qwen3-Next) or four (Qwen3.5). Idempotent."""
        if self._joined_weight() is not None:
            return
        projs = self._projections()
        joined = torch.cat([p.weight for p in projs])
        for p, part in zip(projs, joined.split([p.weight.shape[0] for p in projs])):
            p.weight = nn.Parameter(part, requires_grad=False)

    def _project(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """x [T, H] -> (q|k|v before the convolution [T, conv_dim], z [T, Hv, Dv], b [T, Hv], a [T, Hv])."""
        s, T = self.spec, x.shape[0]
        Hk, Hv, Dk, Dv = s.num_k_heads, s.num_v_heads, s.head_k_dim, s.head_v_dim
        joined = self._joined_weight() if self.within_rounding else None
        if joined is not None:  # one GEMM (equal within rounding: the GEMM's N differs)
            outs = F.linear(x, joined).split([p.weight.shape[0] for p in self._projections()], -1)
        else:
            outs = [p(x) for p in self._projections()]
        if s.projections == "qkvz":  # HF fix_query_key_value_ordering: grouped per key head
            r = Hv // Hk
            qkvz = outs[0].reshape(T, Hk, 2 * Dk + 2 * r * Dv)
            ba = outs[1].reshape(T, Hk, 2 * r)
            q, k, v, z = torch.split(qkvz, [Dk, Dk, r * Dv, r * Dv], dim=2)
            b, a = torch.split(ba, [r, r], dim=2)
            mixed = torch.cat((q.reshape(T, -1), k.reshape(T, -1), v.reshape(T, -1)), dim=-1)
            return mixed, z.reshape(T, Hv, Dv), b.reshape(T, Hv), a.reshape(T, Hv)
        qkv, z, b, a = outs
        return qkv, z.reshape(T, Hv, Dv), b, a

    def _split(self, mixed: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """[n, conv_dim] after the convolution -> q [1, n, Hk, Dk], k, v [1, n, Hv, Dv] (HF's reshapes)."""
        s, n = self.spec, mixed.shape[0]
        q, k, v = torch.split(mixed, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        return (q.reshape(1, n, -1, s.head_k_dim), k.reshape(1, n, -1, s.head_k_dim),
                v.reshape(1, n, -1, s.head_v_dim))

    def _gates(self, b: Tensor, a: Tensor) -> tuple[Tensor, Tensor]:
        beta = b.sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        return beta, g

    def forward(self, x: Tensor, batch: ForwardBatch, state: LayerState) -> Tensor:
        T = x.shape[0]
        mixed, z, b, a = self._project(x)
        if self.fused and self.within_rounding:
            core = gated_delta.gated_delta_step(self, mixed, b, a, batch, state)  # [T, Hv, Dv]
            Dv = core.shape[-1]
            core = gated_delta.gated_norm(core.view(T, -1), z.reshape(T, -1), self.norm.weight, self.norm.eps, Dv,
                                          gate_first=False, out_dtype=x.dtype)
            return self.out_proj(core)
        core = self._reference(mixed, b, a, batch, state)
        core = self.norm(core.reshape(-1, core.shape[-1]), z.reshape(-1, z.shape[-1]))
        return self.out_proj(core.reshape(T, self.value_dim))

    def _reference(self, mixed: Tensor, b: Tensor, a: Tensor, batch: ForwardBatch, state: LayerState) -> Tensor:
        """The op-by-op path: decode rows together (recurrent form), every other sequence on its own (chunked)."""
        s, T = self.spec, mixed.shape[0]
        beta, g = self._gates(b, a)
        out = mixed.new_empty(T, s.num_v_heads, s.head_v_dim)
        w = self.conv1d.weight
        if batch.context_lens is None:  # a captured decode step: one token per row, slots on the device only
            return self._decode(mixed, beta, g, batch.state_slots, state, fresh=batch.positions == 0)
        starts, ctx, slots = batch.query_starts, batch.context_lens, batch.state_slots_host
        decode = [i for i, n in enumerate(batch.query_lens) if n == 1 and ctx[i] > 0]
        if decode:
            rows = [starts[i] for i in decode]
            if len(decode) == T:
                out[:] = self._decode(mixed, beta, g, batch.state_slots, state)
            else:
                idx = torch.tensor(rows, device=mixed.device)
                sl = torch.tensor([slots[i] for i in decode], device=mixed.device)
                out[idx] = self._decode(mixed[idx], beta[idx], g[idx], sl, state)
        done = set(decode)
        for i, n in enumerate(batch.query_lens):
            if i in done or n == 0:
                continue
            lo, hi, slot = starts[i], starts[i] + n, slots[i]
            first = ctx[i] == 0
            conv_out, conv_state = conv_prefill(mixed[lo:hi], None if first else state.conv[slot], w, None, "silu")
            q, k, v = self._split(conv_out)
            init = None if first else state.ssm[slot][None]
            o, final = chunk_gated_delta_rule(q, k, v, g[None, lo:hi], beta[None, lo:hi], initial_state=init)
            state.conv[slot] = conv_state
            state.ssm[slot] = final[0]
            out[lo:hi] = o[0]
        return out

    def _decode(self, mixed: Tensor, beta: Tensor, g: Tensor, slots: Tensor, state: LayerState,
                fresh: Tensor | None = None) -> Tensor:
        """One token of each of n sequences at ``slots`` [n]: HF's decode path (``causal_conv1d_update`` and the
        recurrent rule), batched; states read and written in place. ``fresh`` [n] bool: rows that start their
        sequence here (a captured step's one-token prompts) start from zero states."""
        conv, ssm = state.conv[slots], state.ssm[slots]  # [n, C, K], [n, Hv, Dk, Dv]
        if fresh is not None:
            conv = torch.where(fresh[:, None, None], 0, conv)
            ssm = torch.where(fresh[:, None, None, None], 0, ssm)
        conv_out, conv_new = conv_decode(mixed, conv, self.conv1d.weight, None, "silu")
        s, n = self.spec, mixed.shape[0]
        q, k, v = torch.split(conv_out, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q, k = q.reshape(n, 1, -1, s.head_k_dim), k.reshape(n, 1, -1, s.head_k_dim)
        v = v.reshape(n, 1, -1, s.head_v_dim)
        o, final = recurrent_gated_delta_rule(q, k, v, g[:, None], beta[:, None], initial_state=ssm)
        state.conv[slots] = conv_new
        state.ssm[slots] = final
        return o[:, 0]
