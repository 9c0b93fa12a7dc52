"""DeepSeek-V2/V3 multi-head latent attention (MLA) over the paged cache of compressed latents."""
from __future__ import annotations

import torch
from torch import Tensor, nn

from ..config import AttentionSpec, RopeSpec
from . import invariant as inv
from .attend import ForwardBatch, LayerKV, attend_cached, cached_kv, store_kv
from .norm import RMSNorm
from .rotary import apply_rotary, deepseek_softmax_scale


class MLAttention(nn.Module):
    """DeepSeek-V2/V3 multi-head latent attention (HF ``DeepseekV2Attention`` / ``DeepseekV3Attention``).

    The cache holds, per token, the normalised kv latent [kv_lora_rank] (as "k") and the rotated shared rope key
    [qk_rope_head_dim] (as "v"), exactly what HF caches; every step expands the cached latents of the step's
    sequences with ``kv_b_proj`` into per-head keys (nope part + shared rope part) and values, as HF does."""

    batch_invariant = False  # deterministic inference (MoEForCausalLM.use_batch_invariant)

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
        q_rot = apply_rotary(q_rot, cos, sin, self.rope_style, self.batch_invariant)
        k_rot = apply_rotary(k_rot, cos, sin, self.rope_style, self.batch_invariant)
        query = torch.cat((q_nope, q_rot), dim=-1)  # [T, Hq, nope + R]

        store_kv(kv_latent[:, None], k_rot, cache, batch)
        latent, rot = cached_kv(cache, batch)  # [B, 1, Lk, r], [B, 1, Lk, R]
        B, Lk = latent.shape[0], latent.shape[2]
        kv = self.kv_b_proj(latent[:, 0]).view(B, Lk, Hq, self.nope + self.v_dim).transpose(1, 2)
        k_nope, values = torch.split(kv, [self.nope, self.v_dim], dim=-1)  # [B, Hq, Lk, nope], [B, Hq, Lk, V]
        keys = torch.cat((k_nope, rot.expand(B, Hq, Lk, self.rope)), dim=-1)  # [B, Hq, Lk, nope + R]
        if not self.batch_invariant:
            out = attend_cached(query, keys, values, batch, self.scale)  # [T, Hq, V]
        elif query.is_cuda:
            from ..kernels import batch_invariant as bi_kernels

            out = bi_kernels.attention_dense(query, keys, values, batch, self.scale)
        else:
            out = inv.attention(query, keys, values, batch, self.scale)
        return self.o_proj(out.reshape(T, Hq * self.v_dim))  # [T, H]
