"""Grouped-query attention (Mixtral, Qwen, OLMoE, GPT-OSS): q/k/v projections, optional q/k RMSNorm (per head or
full width), qkv clipping, rotary, attention sinks and sliding windows, over the paged KV cache (attend.py)."""
from __future__ import annotations

import torch
from torch import Tensor, nn

from ..config import AttentionSpec, RopeSpec
from ..kernels import norm as norm_kernels
from ..kernels import rotary as rotary_kernels
from ..kernels import small_linear as linear_kernels
from . import invariant as inv
from .attend import ForwardBatch, LayerKV, attend, attend_stored
from .fp8_linear import Fp8Linear
from .norm import RMSNorm
from .rotary import apply_rotary


class Attention(nn.Module):
    """Grouped-query attention with optional q/k RMSNorm (per head: Qwen3; full width: OLMoE), qkv clipping,
    and attention sinks (GPT-OSS)."""

    # deterministic inference (MoEForCausalLM.use_batch_invariant): batch-invariant GEMMs (Triton ones when
    # ``bi_kernels``) and attention
    batch_invariant = False
    bi_kernels = False

    def __init__(self, spec: AttentionSpec, rope: RopeSpec, hidden_size: int, norm_eps: float, layer_idx: int):
        super().__init__()
        H, D = hidden_size, spec.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = spec.num_heads, spec.num_kv_heads, D
        self.scale = D**-0.5
        self.rope_style = rope.style
        self.sliding_window = spec.sliding_windows[layer_idx] if spec.sliding_windows else None
        self.clip_qkv = spec.clip_qkv
        self.qk_norm = spec.qk_norm
        self.output_gate, self.rotary = spec.output_gate, spec.rotary
        # output_gate (Qwen3-Next): q_proj yields [query (D), gate (D)] per head
        self.q_proj = nn.Linear(H, self.num_heads * D * (2 if spec.output_gate else 1), bias=spec.qkv_bias)
        self.k_proj = nn.Linear(H, self.num_kv_heads * D, bias=spec.qkv_bias)
        self.v_proj = nn.Linear(H, self.num_kv_heads * D, bias=spec.qkv_bias)
        self.o_proj = nn.Linear(self.num_heads * D, H, bias=spec.o_bias)
        if spec.qk_norm == "head":
            self.q_norm = RMSNorm(D, norm_eps, offset=spec.norm_offset)
            self.k_norm = RMSNorm(D, norm_eps, offset=spec.norm_offset)
        elif spec.qk_norm == "full":
            self.q_norm = RMSNorm(self.num_heads * D, norm_eps)
            self.k_norm = RMSNorm(self.num_kv_heads * D, norm_eps)
        self.sinks = nn.Parameter(torch.empty(self.num_heads), requires_grad=False) if spec.sinks else None
        self.eps = norm_eps
        self.fused = False  # kernels/rotary.py, small_linear.py (set by MoEForCausalLM.use_fused_kernels)
        # one GEMM for q/k/v and norms summed in-kernel: equal within rounding (set by use_fused_kernels)
        self.within_rounding = False
        # Tensor parallelism (sharding.py): this rank's heads; a full-width q/k norm gathers every head first.
        self.tp = None
        self.tp_slices: tuple | None = None  # ((q start, q stop), (k start, k stop)) columns of this rank

    @property
    def dense_prefill_shape(self) -> tuple[int, int, int, int] | None:
        """(Hq, Hkv, Dk, Dv) of this rank's heads if attend.py may run a prompt's prefill through dense causal
        SDPA (no window, no sinks); None otherwise. The runner warms cuDNN's plans for these shapes."""
        if self.sliding_window is not None or self.sinks is not None:
            return None
        return self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, batch: ForwardBatch, cache: LayerKV) -> Tensor:
        T = x.shape[0]
        q, k, v = self._qkv(x)  # [T, Hq*D], [T, Hkv*D], [T, Hkv*D]
        if self.output_gate or not self.rotary:
            return self._forward_gated(q, k, v, cos, sin, batch, cache)
        if self.fused and self.rope_style == "half" and self.clip_qkv is None and cos.shape[-1] <= self.head_dim \
                and self.tp_slices is None:
            # [T, Hq, D], [T, Hkv, D]; k and v written into the cache by the same launch
            q, k = self._fused_norm_rope(q, k, cos, sin, cache.store_args(v, batch.slot_mapping))
            v = v.view(T, self.num_kv_heads, self.head_dim)
            out = attend_stored(q, k, v, cache, batch, self.scale, self.sliding_window, self.sinks,
                                self.batch_invariant).reshape(T, self.num_heads * self.head_dim)
            if self.batch_invariant:
                return self.o_proj(out)
            return self._o_proj(out)  # [T, H]
        if self.qk_norm == "full":
            q, k = self._full_norm(q, k)
        if self.clip_qkv is not None:
            q, k, v = (t.clamp(min=-self.clip_qkv, max=self.clip_qkv) for t in (q, k, v))
        q = q.view(T, self.num_heads, self.head_dim)  # [T, Hq, D]
        k = k.view(T, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        v = v.view(T, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rotary(q, cos, sin, self.rope_style, self.batch_invariant)
        k = apply_rotary(k, cos, sin, self.rope_style, self.batch_invariant)
        out = attend(q, k, v, cache, batch, self.scale, self.sliding_window, self.sinks,
                     self.batch_invariant)  # [T, Hq, D]
        return self.o_proj(out.reshape(T, self.num_heads * self.head_dim))  # [T, H]

    def _forward_gated(self, q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor, batch: ForwardBatch,
                       cache: LayerKV) -> Tensor:
        """Qwen3-Next / Qwen3.5 (HF ``Qwen3NextAttention``): q and its gate from one projection, per-head q/k norms
        (their own modules: (1 + weight) norms), rotary of the first R dims, attention, ``out * sigmoid(gate)``,
        o_proj; Nemotron-H: no rotary. Fused: the norms' kernels, then rotary and the KV-cache write in one
        ``qk_norm_rope`` launch (no norm in it), bit for bit the op-by-op values."""
        T, Hq, D = q.shape[0], self.num_heads, self.head_dim
        gate = None
        if self.output_gate:
            q, gate = q.view(T, Hq, 2 * D).chunk(2, dim=-1)  # [T, Hq, D] each
            gate = gate.reshape(T, Hq * D)
        q = q.reshape(T, Hq, D)
        k = k.view(T, self.num_kv_heads, D)
        v = v.view(T, self.num_kv_heads, D)
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rotary and self.fused and self.rope_style == "half" and self.tp_slices is None:
            q, k = rotary_kernels.qk_norm_rope(q, k, cos, sin, D, kv_cache=cache.store_args(v, batch.slot_mapping))
            out = attend_stored(q, k, v, cache, batch, self.scale, self.sliding_window, self.sinks)
        else:
            if self.rotary:
                q, k = apply_rotary(q, cos, sin, self.rope_style), apply_rotary(k, cos, sin, self.rope_style)
            out = attend(q, k, v, cache, batch, self.scale, self.sliding_window, self.sinks)  # [T, Hq, D]
        out = out.reshape(T, Hq * D)
        if gate is not None:
            out = out * torch.sigmoid(gate)
        return self._o_proj(out)  # [T, H]

    def _o_proj(self, out: Tensor) -> Tensor:
        """[T, Hq*D] -> [T, H]: ``small_linear`` for few tokens, cuBLAS beyond; an FP8 o_proj runs its own GEMM."""
        if isinstance(self.o_proj, Fp8Linear):
            return self.o_proj(out)
        return linear_kernels.decode_linear(out, self.o_proj.weight, self.o_proj.bias, self.within_rounding,
                                            linear_kernels.O_PROJ_SMALL_LINEAR_TOKENS)

    def _qkv(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """The q, k and v projections: one GEMM over [Wq; Wk; Wv] when ``fuse_qkv`` laid the three weights out
        as one tensor (k/v alone are GEMMs too small for the GPU: cuBLAS splits them over K and adds a pass);
        ``linear_kernels.small_linear`` for a one-token step."""
        fused = self.within_rounding and self._qkv_weight()
        if fused:
            w, b = fused
            if isinstance(self.q_proj, Fp8Linear):  # one W8A8 GEMM: x quantised once for the three
                qkv = self.q_proj.w8a8(x, w, self._joined("weight_scale_inv"), b)
            elif self.batch_invariant:
                qkv = inv.linear(x, w, b, self.bi_kernels)
            else:  # [T, Nq + 2 Nkv]
                qkv = linear_kernels.decode_linear(x, w, b, True, linear_kernels.QKV_SMALL_LINEAR_TOKENS)
            return qkv.split([p.weight.shape[0] for p in (self.q_proj, self.k_proj, self.v_proj)], -1)
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)

    def _qkv_weight(self) -> tuple[Tensor, Tensor | None] | None:
        """[Nq + 2 Nkv, H] (and the bias) viewing the three projections' parameters, if they lie back to back in
        one storage (fuse_qkv; weight updates write into them in place, move_weights keeps the layout); else
        None. A view, not a copy: nothing to keep in sync."""
        views = []
        for attr in ("weight", "bias") + (("weight_scale_inv",) if isinstance(self.q_proj, Fp8Linear) else ()):
            ps = [getattr(p, attr) for p in (self.q_proj, self.k_proj, self.v_proj)]
            if ps[0] is None:
                views.append(None)
                continue
            view = self._joined(attr)
            if view is None:
                return None
            views.append(view)
        return views[0], views[1]

    def _joined(self, attr: str) -> Tensor | None:
        """q/k/v's ``attr`` parameters as one tensor [rows of the three, ...] if back to back in one storage."""
        ps = [getattr(p, attr) for p in (self.q_proj, self.k_proj, self.v_proj)]
        if not all(p.is_contiguous() for p in ps) or any(
                b.data_ptr() != a.data_ptr() + a.nbytes or b.untyped_storage().data_ptr() !=
                a.untyped_storage().data_ptr() for a, b in zip(ps, ps[1:])):
            return None
        rows = sum(p.shape[0] for p in ps)
        return ps[0].as_strided((rows, *ps[0].shape[1:]), ps[0].stride())

    @torch.no_grad()
    def fuse_qkv(self) -> None:
        """Lay the q/k/v weights (and biases) out back to back in one tensor, each projection's parameter a view
        of its rows, so that ``_qkv`` runs one GEMM. Idempotent. FP8 projections (all three, their scale rows
        stacking: q's and k's rows whole blocks) are joined with their scales into one W8A8 GEMM; others stay apart."""
        projs = (self.q_proj, self.k_proj, self.v_proj)
        fp8 = [isinstance(p, Fp8Linear) for p in projs]
        if any(fp8) and not (all(fp8) and len({p.block for p in projs}) == 1
                             and all(p.out_features % p.block[0] == 0 for p in projs[:2])):
            return
        if self._qkv_weight() is not None:
            return
        for attr in ("weight", "bias") + (("weight_scale_inv",) if all(fp8) else ()):
            projs = (self.q_proj, self.k_proj, self.v_proj)
            if getattr(self.q_proj, attr) is None:
                continue
            joined = torch.cat([getattr(p, attr) for p in projs])
            for p, part in zip(projs, joined.split([getattr(p, attr).shape[0] for p in projs])):
                setattr(p, attr, nn.Parameter(part, requires_grad=False))

    def _full_norm(self, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
        """The full-width q/k norms (OLMoE); under tensor parallelism over every rank's heads, gathered."""
        if self.tp_slices is None:
            return self.q_norm(q), self.k_norm(k)
        (q0, q1), (k0, k1) = self.tp_slices
        W, T = self.tp.world_size, q.shape[0]
        full_q = self.tp.all_gather(q).view(W, T, -1).permute(1, 0, 2).reshape(T, -1)  # [T, Hq_all*D]
        full_k = self.tp.all_gather(k).view(W, T, -1).permute(1, 0, 2).reshape(T, -1)
        return self.q_norm(full_q)[:, q0:q1].contiguous(), self.k_norm(full_k)[:, k0:k1].contiguous()

    def _fused_norm_rope(self, q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, kv_cache) -> tuple[Tensor, Tensor]:
        """The q/k norms (if any) and the rotary of both in three launches (squares, torch's means, the rest; one
        without norms or within rounding), the last one also writing k and v into the cache (``kv_cache``: see
        ``rotary_kernels.qk_norm_rope``)."""
        if self.qk_norm == "none":
            return rotary_kernels.qk_norm_rope(q, k, cos, sin, self.head_dim, kv_cache=kv_cache)
        if self.within_rounding:  # one launch: the means summed in the kernel
            return rotary_kernels.qk_norm_rope(q, k, cos, sin, self.head_dim, self.qk_norm, q_weight=self.q_norm.weight,
                                        k_weight=self.k_norm.weight, eps=self.eps, kv_cache=kv_cache)
        T, D = q.shape[0], self.head_dim
        _, q_sq, k_sq = norm_kernels.add_square(q, x2=k)  # [T, Hq*D], [T, Hkv*D] float32
        if self.qk_norm == "head":
            q_sq, k_sq = q_sq.view(T, self.num_heads, D), k_sq.view(T, self.num_kv_heads, D)
        return rotary_kernels.qk_norm_rope(
            q, k, cos, sin, D, self.qk_norm, q_sq.mean(-1, keepdim=True), k_sq.mean(-1, keepdim=True),
            self.q_norm.weight, self.k_norm.weight, self.eps, kv_cache=kv_cache,
        )
