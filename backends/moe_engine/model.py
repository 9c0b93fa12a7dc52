"""MoE decoder-only transformer (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, DeepSeek-V2/V3, GPT-OSS), gpt-fast style.

One forward step runs the tokens of all scheduled sequences flattened into one
dimension T; ``ForwardBatch`` (attention.py) says which sequence and position each
token has, and ``attend`` handles the per-sequence causal attention over the
paged KV cache. Shapes are given in comments: T tokens, H hidden size,
Hq/Hkv query/kv heads, D head dim, E experts, K experts per token, I expert width.

Numerics follow Hugging Face transformers 5.24 operation by operation (norm in
float32 then cast, RoPE tables cast to the model dtype, router logits in the model
dtype, per-expert weights applied before the cast, expert outputs summed in
ascending expert order), so that float32 runs agree with HF to rounding and bf16
runs route the same experts for all but near-tied tokens.

Module and parameter names equal HF's in-memory (v5, fused experts) names, so
checkpoint keys map one to one (checkpoint.py).

Tensor parallelism: sharding.py shrinks the modules to one rank's heads / widths / experts / vocabulary rows
before the weights load; each decoder layer then all-reduces its attention and MLP outputs (partial sums).

Architecture differences come from the config's specs, never from the name, and each
module is built from its spec alone: the router (``cfg.router``, routing.py), the
attention (``cfg.attention``: grouped-query, or with ``attention.mla`` DeepSeek's
multi-head latent attention whose cache holds the compressed latent and the rotated
shared key, expanded by ``kv_b_proj`` every step as HF does), the MoE block layout
(``cfg.experts.block``: default / DeepSeek shared experts / GPT-OSS biased clamped
experts), rope style and yarn (``cfg.rope``, rope.py), sinks and per-layer sliding
windows. The experts and the ways to run them are experts.py's (which also says where
routing capture is written). Dense layers (DeepSeek's first_k_dense_replace, Qwen's
mlp_only_layers) are part of the layer dimension; their capture rows are never written.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import kernels
from .attention import ForwardBatch, LayerKV, attend, attend_cached, attend_stored, cached_kv, store_kv
from .config import AttentionSpec, ExpertsSpec, MoEConfig, RopeSpec, RouterSpec
from .experts import (NO_ROUTING, TRITON_GEMM_MAX_PAIRS, ExpertOutputs, Experts, GptOssExperts, LayerRouting,
                      StepRouting)
from .kv_cache import KVCache, KVSpec
from .rope import RotaryEmbedding, apply_rotary, deepseek_softmax_scale
from .routing import Router, make_router

class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, fp32_weight: bool = False):
        super().__init__()
        self.eps = eps
        self.fp32_weight = fp32_weight
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.fused = False  # kernels.py (set by MoEForCausalLM.use_fused_kernels)
        self.within_rounding = False  # one-pass kernel, equal within float32 summation order (ditto)

    def forward(self, x: Tensor) -> Tensor:
        if self.fused and self.within_rounding:
            return kernels.rms_norm(x, self.weight, self.eps, self.fp32_weight)[1]
        if self.fused and x.is_contiguous():
            _, squares, _ = kernels.add_square(x)
            return self._fused_tail(x, squares)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.fp32_weight:  # GPT-OSS: (weight * normed).to(input dtype), the product in float32
            return (self.weight * x).to(dtype)
        return self.weight * x.to(dtype)  # HF: weight * normed.to(input dtype)

    def add_forward(self, x: Tensor, delta: Tensor | ExpertOutputs | None) -> tuple[Tensor, Tensor]:
        """(x + delta, norm(x + delta)): the residual add before a norm (one kernel with it when fused; with the
        MoE combine too when delta is a MoE layer's ``ExpertOutputs``)."""
        if delta is None:
            return x, self(x)
        if isinstance(delta, ExpertOutputs):
            if self.fused and self.within_rounding:
                return kernels.combine_rms_norm(delta.y, delta.ids, delta.pos, delta.weights, x, self.weight,
                                                self.eps, self.fp32_weight)
            delta = delta.combine(x.dtype)
        if self.fused and self.within_rounding:
            return kernels.rms_norm(x, self.weight, self.eps, self.fp32_weight, delta)
        if self.fused and x.is_contiguous() and delta.is_contiguous():
            s, squares, _ = kernels.add_square(x, delta)
            return s, self._fused_tail(s, squares)
        s = x + delta
        return s, self(s)

    def _fused_tail(self, x: Tensor, squares: Tensor) -> Tensor:
        # torch's own mean over the same float32 squares: the summation order of the op-by-op path
        return kernels.rms_norm_tail(x, squares.mean(-1, keepdim=True), self.weight, self.eps, self.fp32_weight)


class Attention(nn.Module):
    """Grouped-query attention with optional q/k RMSNorm (per head: Qwen3; full width: OLMoE), qkv clipping,
    and attention sinks (GPT-OSS)."""

    def __init__(self, spec: AttentionSpec, rope: RopeSpec, hidden_size: int, norm_eps: float, layer_idx: int):
        super().__init__()
        H, D = hidden_size, spec.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = spec.num_heads, spec.num_kv_heads, D
        self.scale = D**-0.5
        self.rope_style = rope.style
        self.sliding_window = spec.sliding_windows[layer_idx] if spec.sliding_windows else None
        self.clip_qkv = spec.clip_qkv
        self.qk_norm = spec.qk_norm
        self.q_proj = nn.Linear(H, self.num_heads * D, bias=spec.qkv_bias)
        self.k_proj = nn.Linear(H, self.num_kv_heads * D, bias=spec.qkv_bias)
        self.v_proj = nn.Linear(H, self.num_kv_heads * D, bias=spec.qkv_bias)
        self.o_proj = nn.Linear(self.num_heads * D, H, bias=spec.o_bias)
        if spec.qk_norm == "head":
            self.q_norm = RMSNorm(D, norm_eps)
            self.k_norm = RMSNorm(D, norm_eps)
        elif spec.qk_norm == "full":
            self.q_norm = RMSNorm(self.num_heads * D, norm_eps)
            self.k_norm = RMSNorm(self.num_kv_heads * D, norm_eps)
        self.sinks = nn.Parameter(torch.empty(self.num_heads), requires_grad=False) if spec.sinks else None
        self.eps = norm_eps
        self.fused = False  # kernels.py (set by MoEForCausalLM.use_fused_kernels)
        # one GEMM for q/k/v and norms summed in-kernel: equal within rounding (set by use_fused_kernels)
        self.within_rounding = False
        # Tensor parallelism (sharding.py): this rank's heads; a full-width q/k norm gathers every head first.
        self.tp = None
        self.tp_slices: tuple | None = None  # ((q start, q stop), (k start, k stop)) columns of this rank

    @property
    def dense_prefill_shape(self) -> tuple[int, int, int, int] | None:
        """(Hq, Hkv, Dk, Dv) of this rank's heads if attention.py may run a prompt's prefill through dense causal
        SDPA (no window, no sinks); None otherwise. The runner warms cuDNN's plans for these shapes."""
        if self.sliding_window is not None or self.sinks is not None:
            return None
        return self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, batch: ForwardBatch, cache: LayerKV) -> Tensor:
        T = x.shape[0]
        q, k, v = self._qkv(x)  # [T, Hq*D], [T, Hkv*D], [T, Hkv*D]
        if self.fused and self.rope_style == "half" and self.clip_qkv is None and cos.shape[-1] == self.head_dim \
                and self.tp_slices is None:
            # [T, Hq, D], [T, Hkv, D]; k and v written into the cache by the same launch
            q, k = self._fused_norm_rope(q, k, cos, sin, (v, cache.k, cache.v, batch.slot_mapping))
            v = v.view(T, self.num_kv_heads, self.head_dim)
            out = attend_stored(q, k, v, cache, batch, self.scale, self.sliding_window, self.sinks)
            return kernels.decode_linear(out.reshape(T, self.num_heads * self.head_dim), self.o_proj.weight,
                                         self.o_proj.bias, self.within_rounding,
                                         kernels.O_PROJ_SMALL_LINEAR_TOKENS)  # [T, H]
        if self.qk_norm == "full":
            q, k = self._full_norm(q, k)
        if self.clip_qkv is not None:
            q, k, v = (t.clamp(min=-self.clip_qkv, max=self.clip_qkv) for t in (q, k, v))
        q = q.view(T, self.num_heads, self.head_dim)  # [T, Hq, D]
        k = k.view(T, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        v = v.view(T, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, cos, sin, self.rope_style), apply_rotary(k, cos, sin, self.rope_style)
        out = attend(q, k, v, cache, batch, self.scale, self.sliding_window, self.sinks)  # [T, Hq, D]
        return self.o_proj(out.reshape(T, self.num_heads * self.head_dim))  # [T, H]

    def _qkv(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """The q, k and v projections: one GEMM over [Wq; Wk; Wv] when ``fuse_qkv`` laid the three weights out
        as one tensor (k/v alone are GEMMs too small for the GPU: cuBLAS splits them over K and adds a pass);
        ``kernels.small_linear`` for a one-token step."""
        fused = self.within_rounding and self._qkv_weight()
        if fused:
            w, b = fused
            qkv = kernels.decode_linear(x, w, b, True, kernels.QKV_SMALL_LINEAR_TOKENS)  # [T, Nq + 2 Nkv]
            return qkv.split([p.weight.shape[0] for p in (self.q_proj, self.k_proj, self.v_proj)], -1)
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)

    def _qkv_weight(self) -> tuple[Tensor, Tensor | None] | None:
        """[Nq + 2 Nkv, H] (and the bias) viewing the three projections' parameters, if they lie back to back in
        one storage (fuse_qkv; weight updates write into them in place, move_weights keeps the layout); else
        None. A view, not a copy: nothing to keep in sync."""
        views = []
        for attr in ("weight", "bias"):
            ps = [getattr(p, attr) for p in (self.q_proj, self.k_proj, self.v_proj)]
            if ps[0] is None:
                views.append(None)
                continue
            if not all(p.is_contiguous() for p in ps) or any(
                    b.data_ptr() != a.data_ptr() + a.nbytes or b.untyped_storage().data_ptr() !=
                    a.untyped_storage().data_ptr() for a, b in zip(ps, ps[1:])):
                return None
            rows = sum(p.shape[0] for p in ps)
            views.append(ps[0].as_strided((rows, *ps[0].shape[1:]), ps[0].stride()))
        return views[0], views[1]

    @torch.no_grad()
    def fuse_qkv(self) -> None:
        """Lay the q/k/v weights (and biases) out back to back in one tensor, each projection's parameter a view
        of its rows, so that ``_qkv`` runs one GEMM. Idempotent."""
        if self._qkv_weight() is not None:
            return
        for attr in ("weight", "bias"):
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
        ``kernels.qk_norm_rope``)."""
        if self.qk_norm == "none":
            return kernels.qk_norm_rope(q, k, cos, sin, self.head_dim, kv_cache=kv_cache)
        if self.within_rounding:  # one launch: the means summed in the kernel
            return kernels.qk_norm_rope(q, k, cos, sin, self.head_dim, self.qk_norm, q_weight=self.q_norm.weight,
                                        k_weight=self.k_norm.weight, eps=self.eps, kv_cache=kv_cache)
        T, D = q.shape[0], self.head_dim
        _, q_sq, k_sq = kernels.add_square(q, x2=k)  # [T, Hq*D], [T, Hkv*D] float32
        if self.qk_norm == "head":
            q_sq, k_sq = q_sq.view(T, self.num_heads, D), k_sq.view(T, self.num_kv_heads, D)
        return kernels.qk_norm_rope(
            q, k, cos, sin, D, self.qk_norm, q_sq.mean(-1, keepdim=True), k_sq.mean(-1, keepdim=True),
            self.q_norm.weight, self.k_norm.weight, self.eps, kv_cache=kv_cache,
        )


class MLAttention(nn.Module):
    """DeepSeek-V2/V3 multi-head latent attention (HF ``DeepseekV2Attention`` / ``DeepseekV3Attention``).

    The cache holds, per token, the normalised kv latent [kv_lora_rank] (as "k") and the rotated shared rope key
    [qk_rope_head_dim] (as "v"), exactly what HF caches; every step expands the cached latents of the step's
    sequences with ``kv_b_proj`` into per-head keys (nope part + shared rope part) and values, as HF does."""

    def __init__(self, spec: AttentionSpec, rope: RopeSpec, hidden_size: int, norm_eps: float, layer_idx: int):
        super().__init__()
        mla = spec.mla
        H, self.num_heads = hidden_size, spec.num_heads
        self.nope, self.rope, self.v_dim = mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.v_head_dim
        self.kv_lora_rank = mla.kv_lora_rank
        self.qk_head_dim = self.nope + self.rope
        self.scale = deepseek_softmax_scale(rope, self.qk_head_dim)
        self.rope_style = rope.style
        bias = spec.qkv_bias
        if mla.q_lora_rank is None:
            self.q_proj = nn.Linear(H, self.num_heads * self.qk_head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(H, mla.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, 1e-6)  # HF: default eps, not rms_norm_eps
            self.q_b_proj = nn.Linear(mla.q_lora_rank, self.num_heads * self.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(H, self.kv_lora_rank + self.rope, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, 1e-6)
        self.kv_b_proj = nn.Linear(self.kv_lora_rank, self.num_heads * (self.nope + self.v_dim), bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.v_dim, H, bias=spec.o_bias)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor | None, batch: ForwardBatch, cache: LayerKV) -> Tensor:
        T, Hq = x.shape[0], self.num_heads
        if hasattr(self, "q_proj"):
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_rot = torch.split(q.view(T, Hq, self.qk_head_dim), [self.nope, self.rope], dim=-1)
        kv_latent, k_rot = torch.split(self.kv_a_proj_with_mqa(x), [self.kv_lora_rank, self.rope], dim=-1)
        kv_latent = self.kv_a_layernorm(kv_latent)  # [T, r]
        k_rot = k_rot.view(T, 1, self.rope)  # [T, 1, R]: one rope key shared by all heads
        q_rot, k_rot = apply_rotary(q_rot, cos, sin, self.rope_style), apply_rotary(k_rot, cos, sin, self.rope_style)
        query = torch.cat((q_nope, q_rot), dim=-1)  # [T, Hq, nope + R]

        store_kv(kv_latent[:, None], k_rot, cache, batch)
        latent, rot = cached_kv(cache, batch)  # [B, 1, Lk, r], [B, 1, Lk, R]
        B, Lk = latent.shape[0], latent.shape[2]
        kv = self.kv_b_proj(latent[:, 0]).view(B, Lk, Hq, self.nope + self.v_dim).transpose(1, 2)
        k_nope, values = torch.split(kv, [self.nope, self.v_dim], dim=-1)  # [B, Hq, Lk, nope], [B, Hq, Lk, V]
        keys = torch.cat((k_nope, rot.expand(B, Hq, Lk, self.rope)), dim=-1)  # [B, Hq, Lk, nope + R]
        out = attend_cached(query, keys, values, batch, self.scale)  # [T, Hq, V]
        return self.o_proj(out.reshape(T, Hq * self.v_dim))  # [T, H]


class MLP(nn.Module):
    """SwiGLU MLP: dense layers and shared experts (Qwen2-MoE, DeepSeek)."""

    def __init__(self, hidden: int, intermediate: int, bias: bool = False):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.up_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MoEBlock(nn.Module):
    """Router -> routed experts (+ optional shared expert, sigmoid-gated in Qwen2-MoE)."""

    def __init__(self, router: RouterSpec, experts: ExpertsSpec, hidden_size: int):
        super().__init__()
        self.gate = make_router(router, hidden_size)
        self.experts = Experts(experts, hidden_size)
        width = experts.shared_intermediate_size
        self.shared_expert = MLP(hidden_size, width) if width else None
        self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False) if experts.shared_gate else None

    def forward(self, x: Tensor, routing: LayerRouting = NO_ROUTING,
                defer_combine: bool = False) -> Tensor | ExpertOutputs:
        """x [T, H] -> the layer's output [T, H]; ``defer_combine`` (a block without shared experts, on the
        fused path): the routed experts' ``ExpertOutputs``, for the next norm's launch to sum."""
        # [T, K] int64, [T, K]; for the fused experts, a one-token step's expert-grouped order from the router's
        # launch (which then also copies the ids into the capture buffer)
        grouped = None
        if self.experts.takes_fused_path(x, self.gate.top_k):
            ids, weights, grouped = self.gate.forward_grouped(x, routing.forced, routing.ids)
        else:
            ids, weights = self.gate(x, routing.forced)
        # the experts write exactly the ids (and weights) they use into the step's capture buffers
        out = self.experts(x, ids, weights, routing.ids, routing.weights, grouped=grouped,
                           defer_combine=defer_combine and self.shared_expert is None)
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
            out = out + shared
        return out


class DeepseekMoE(nn.Module):
    """DeepSeek-V2/V3 (HF ``DeepseekV2Moe`` / ``DeepseekV3MoE``): fp32 router -> routed experts (fp32 weights,
    outputs cast to the model dtype) + ungated shared experts."""

    def __init__(self, router: RouterSpec, experts: ExpertsSpec, hidden_size: int):
        super().__init__()
        self.gate = make_router(router, hidden_size)
        self.experts = Experts(experts, hidden_size)
        width = experts.shared_intermediate_size
        self.shared_experts = MLP(hidden_size, width, bias=experts.shared_bias) if width else None

    def forward(self, x: Tensor, routing: LayerRouting = NO_ROUTING) -> Tensor:
        ids, weights = self.gate(x, routing.forced)  # [T, K] int64 (unsorted, as HF's topk(sorted=False)), fp32
        out = self.experts(x, ids, weights, routing.ids, routing.weights)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out


class GptOssMoE(nn.Module):
    """GPT-OSS (HF ``GptOssMLP``): biased router, top-k then softmax in the model dtype -> biased clamped experts."""

    def __init__(self, router: RouterSpec, experts: ExpertsSpec, hidden_size: int):
        super().__init__()
        self.router = make_router(router, hidden_size)
        self.experts = GptOssExperts(experts, hidden_size)

    def forward(self, x: Tensor, routing: LayerRouting = NO_ROUTING) -> Tensor:
        ids, weights = self.router(x, routing.forced)  # [T, K] sorted descending, [T, K] model dtype
        return self.experts(x, ids, weights, routing.ids, routing.weights)


MOE_BLOCKS: dict[str, type[nn.Module]] = {"default": MoEBlock, "deepseek": DeepseekMoE, "gpt_oss": GptOssMoE}
ATTENTIONS: dict[str, type[nn.Module]] = {"gqa": Attention, "mla": MLAttention}


class DecoderLayer(nn.Module):
    def __init__(self, cfg: MoEConfig, layer_idx: int):
        super().__init__()
        self.is_moe = layer_idx in cfg.moe_layers
        attention = ATTENTIONS[cfg.attention.kind]
        self.self_attn = attention(cfg.attention, cfg.rope, cfg.hidden_size, cfg.rms_norm_eps, layer_idx)
        if self.is_moe:
            self.mlp = MOE_BLOCKS[cfg.experts.block](cfg.router, cfg.experts, cfg.hidden_size)
        else:
            self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_fp32_weight)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_fp32_weight)
        self.tp = None  # tensor parallelism (sharding.py): attention and MLP outputs are this rank's partial sums

    def _reduce(self, partial: Tensor) -> Tensor:
        return partial if self.tp is None else self.tp.all_reduce(partial.contiguous())

    def forward(
        self,
        x: Tensor,  # [T, H] residual stream
        delta: Tensor | None,  # [T, H] previous layer's output, not yet added to x (None before layer 0)
        cos: Tensor,
        sin: Tensor,
        batch: ForwardBatch,
        cache: LayerKV,
        routing: LayerRouting,
    ) -> tuple[Tensor, Tensor | ExpertOutputs]:  # (residual stream, this layer's MLP output to add to it)
        # x + delta and x + attention are each added right before the norm that reads them (same values as
        # HF's adds at the end of a layer; the fused norm does the add in its first kernel). A MoE layer's
        # output reaches the next norm (the next layer's, or the final one: RMSNorms share their kernel
        # settings) as ExpertOutputs when that norm's one-pass kernel can also do the combine.
        x, normed = self.input_layernorm.add_forward(x, delta)
        attn = self._reduce(self.self_attn(normed, cos, sin, batch, cache))
        h, normed = self.post_attention_layernorm.add_forward(x, attn)
        if not self.is_moe:
            return h, self._reduce(self.mlp(normed))
        if isinstance(self.mlp, MoEBlock) and self.tp is None:
            norm = self.post_attention_layernorm
            defer = norm.fused and norm.within_rounding and normed.shape[0] >= kernels.COMBINE_NORM_MIN_TOKENS
            return h, self.mlp(normed, routing, defer_combine=defer)
        return h, self._reduce(self.mlp(normed, routing))


class MoEModel(nn.Module):
    def __init__(self, cfg: MoEConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_fp32_weight)
        self.rotary_emb = RotaryEmbedding(cfg.rope)


class MoEForCausalLM(nn.Module):
    def __init__(self, cfg: MoEConfig):
        super().__init__()
        self.config = cfg
        self.model = MoEModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        for p in self.parameters():
            p.requires_grad_(False)

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    def init_buffers(self, device: torch.device | str | None = None) -> None:
        """(Re)compute non-persistent buffers, e.g. after building on the meta device."""
        rot = self.model.rotary_emb
        rot.inv_freq = rot.compute_inv_freq(device or self.device)

    def kv_layout(self) -> list[KVSpec]:
        cfg, attn = self.config, self.config.attention
        if attn.mla is not None:  # compressed latent ("k") + shared rotated rope key ("v"), one "head"
            return [KVSpec(1, attn.mla.kv_lora_rank, attn.mla.qk_rope_head_dim) for _ in range(cfg.num_hidden_layers)]
        # this rank's key/value heads (all of them unless sharded)
        return [KVSpec(layer.self_attn.num_kv_heads, attn.head_dim, attn.head_dim) for layer in self.model.layers]

    def use_fused_kernels(self, enabled: bool, within_rounding: bool | None = None) -> bool:
        """Switch the fused Triton kernels (kernels.py, bit for bit the op-by-op results; on a GPU also the expert
        GEMMs of fused_moe.py, equal within bf16 GEMM rounding) on or off for every module that has them.
        ``within_rounding`` (default: on a GPU) adds the fusions equal to the op-by-op path within rounding, with
        the same expert ids: one-pass norms, the fused softmax router, one GEMM for q/k/v (kernels.py's second
        table). Returns whether fused kernels are on: only where Triton runs for this model's device and dtype."""
        enabled = enabled and kernels.available(self.device) and kernels.supports(self.dtype)
        on_gpu = enabled and self.device.type == "cuda" and not kernels.interpreting()
        within_rounding = enabled and (on_gpu if within_rounding is None else within_rounding)
        for m in self.modules():
            if isinstance(m, (RMSNorm, Attention)) or getattr(m, "supports_fused", False):
                m.fused = enabled
            if isinstance(m, (RMSNorm, Attention, Router)):
                m.within_rounding = within_rounding
            if isinstance(m, Attention) and within_rounding:
                m.fuse_qkv()
            if isinstance(m, Experts):
                m.triton_gemm_max_pairs = TRITON_GEMM_MAX_PAIRS if on_gpu else 0
        return enabled

    def graph_unsafe_reason(self) -> str | None:
        """Why a decode step of this model cannot be captured in a CUDA graph (a host sync inside), or None."""
        for layer in self.model.layers:
            experts = getattr(layer.mlp, "experts", None)
            reason = experts.graph_unsafe_reason(self.device, self.dtype) if experts is not None else None
            if reason is not None:
                return reason
        return None

    def prefill_graph_unsafe_reason(self) -> str | None:
        """Why a step carrying prompt tokens cannot replay a CUDA graph where a decode step can (prefill_graphs.py),
        or None: every MoE layer must take the fused path, whose grouping of a step's pairs waits for nothing (off
        it, expert parallelism and the op-by-op forward count each expert's rows on the host)."""
        for layer in self.model.layers:
            experts = getattr(layer.mlp, "experts", None)
            if experts is not None and not (getattr(experts, "fused", False) and experts.first_expert is None):
                return "an MoE layer is off the fused path (expert parallelism, or the op-by-op forward)"
        return None

    def param_dtype(self, name: str, dtype: torch.dtype) -> torch.dtype:
        """dtype a parameter is loaded in when the model runs in ``dtype`` (HF's keep-in-fp32 rules):
        DeepSeek's router weight and e_score_correction_bias always float32 (``_keep_in_fp32_modules_strict``);
        GPT-OSS norms float32 when the model runs in float16 (``_keep_in_fp32_modules``)."""
        cfg = self.config
        if cfg.router.fp32 and (name.endswith(".mlp.gate.weight") or name.endswith(".e_score_correction_bias")):
            return torch.float32
        if cfg.norm_fp32_weight and dtype == torch.float16 and name.endswith("norm.weight"):
            return torch.float32
        return dtype

    def forward(
        self,
        input_ids: Tensor,  # [T] long, tokens of all sequences flattened
        batch: ForwardBatch,  # attention layout for this step
        kv: KVCache | list[LayerKV],  # kv[layer] -> LayerKV
        capture: Tensor | None = None,  # [>=T, num_hidden_layers, K] int32 step buffer (routing.ids)
        routing: StepRouting | None = None,  # capture buffers and forced routing (experts.py)
    ) -> Tensor:  # [T, H] final hidden states (after the final norm)
        T = input_ids.shape[0]
        if routing is None:
            routing = StepRouting(ids=capture)
        x = self.model.embed_tokens(input_ids)  # [T, H]
        cos, sin = self.model.rotary_emb(batch.positions, x.dtype)  # [T, R] each (complex style: [T, R/2], None)
        delta = None
        for i, layer in enumerate(self.model.layers):
            layer_routing = routing.layer(i, T) if layer.is_moe else NO_ROUTING
            x, delta = layer(x, delta, cos, sin, batch, kv[i], layer_routing)
        return self.model.norm.add_forward(x, delta)[1]

    def compute_logits(self, hidden: Tensor, out: Tensor | None = None) -> Tensor:
        """[N, H] -> [N, V] float32 (the matmul runs in the model dtype, as HF), into ``out`` when given."""
        logits = self.lm_head(hidden)
        return logits.float() if out is None else out.copy_(logits)


@torch.inference_mode()
def reference_forward(model: MoEForCausalLM, token_ids: list[int]) -> tuple[Tensor, Tensor]:
    """Whole sequence in one step on a fresh cache: (logits [T, V] float32, routed ids [T, L, K] int32)."""
    cfg, device, T = model.config, model.device, len(token_ids)
    cache = KVCache.for_sequences(model.kv_layout(), num_seqs=1, max_len=T, dtype=model.dtype, device=device)
    batch = ForwardBatch.build([cache.sequence_blocks(0)], [0], [T], device, cache.block_size)
    capture = torch.zeros(T, cfg.num_hidden_layers, cfg.num_experts_per_tok, dtype=torch.int32, device=device)
    hidden = model(torch.tensor(token_ids, dtype=torch.long, device=device), batch, cache, capture)
    return model.compute_logits(hidden), capture
