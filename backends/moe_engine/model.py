"""MoE decoder-only transformer (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE), gpt-fast style.

One forward step runs the tokens of all scheduled sequences flattened into one
dimension T; ``ForwardBatch`` (attention.py) says which sequence and position each
token has, and ``attend`` handles the per-sequence causal attention over the
slot-indexed KV cache. Shapes are given in comments: T tokens, H hidden size,
Hq/Hkv query/kv heads, D head dim, E experts, K experts per token, I expert width.

Numerics follow Hugging Face transformers 5.24 operation by operation (norm in
float32 then cast, RoPE tables cast to the model dtype, router logits in the model
dtype, per-expert weights applied before the cast, expert outputs summed in
ascending expert order), so that float32 runs agree with HF to rounding and bf16
runs route the same experts for all but near-tied tokens.

Module and parameter names equal HF's in-memory (v5, fused experts) names, so
checkpoint keys map one to one (checkpoint.py).

Extending (DeepSeek-V2/V3, GPT-OSS): the router is chosen by ``cfg.router``
(routing.py); which layers are MoE by ``cfg.moe_layers`` (first_k_dense_replace
goes in config.py); MLA would be another attention class picked per config, with
its own ``KVSpec`` (k_dim != v_dim) in ``kv_layout``; sinks and sliding windows
are ``attend`` arguments already; GPT-OSS experts (biases, clamped interleaved
SwiGLU) would be another ``Experts`` variant.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .attention import ForwardBatch, LayerKV, attend
from .config import MoEConfig
from .kv_cache import KVCache, KVSpec
from .routing import make_router

# Experts: a step with at most this many (token, slot) pairs (a small decode batch) gathers each
# token's expert weights and runs one batched matmul, with no host sync; larger steps group the
# token-slots by expert and run one matmul per expert (one host sync per layer for group sizes).
GATHER_MAX_SLOTS = 8
GATHER_MAX_BYTES = 256 << 20  # ... and only while the gathered weight copies stay this small


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)

    def forward(self, x: Tensor) -> Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)  # HF: weight * normed.to(input dtype)


class RotaryEmbedding(nn.Module):
    """RoPE tables per step: (cos, sin) [T, D] in the model dtype, rotate-half convention."""

    def __init__(self, cfg: MoEConfig):
        super().__init__()
        self.head_dim, self.theta, self.factor = cfg.head_dim, cfg.rope_theta, cfg.rope_factor
        self.register_buffer("inv_freq", self.compute_inv_freq(), persistent=False)  # [D/2] float32

    def compute_inv_freq(self, device: torch.device | str | None = None) -> Tensor:
        dim = self.head_dim
        inv_freq = 1.0 / (self.theta ** (torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim))
        return inv_freq / self.factor  # "linear" scaling; factor 1 for "default"

    def forward(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        freqs = positions[:, None].float() * self.inv_freq[None, :]  # [T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [T, D]
        return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [T, heads, D], cos/sin [T, D]."""
    cos, sin = cos[:, None], sin[:, None]  # [T, 1, D]
    return (x * cos) + (rotate_half(x) * sin)


class Attention(nn.Module):
    """Grouped-query attention with optional q/k RMSNorm (per head: Qwen3; full width: OLMoE) and qkv clipping."""

    def __init__(self, cfg: MoEConfig, layer_idx: int):
        super().__init__()
        H, D = cfg.hidden_size, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, D
        self.scale = D**-0.5
        self.sliding_window = cfg.sliding_windows[layer_idx] if cfg.sliding_windows else None
        self.clip_qkv = cfg.clip_qkv
        self.qk_norm = cfg.qk_norm
        self.q_proj = nn.Linear(H, self.num_heads * D, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(H, self.num_kv_heads * D, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(H, self.num_kv_heads * D, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.num_heads * D, H, bias=cfg.o_bias)
        if cfg.qk_norm == "head":
            self.q_norm = RMSNorm(D, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(D, cfg.rms_norm_eps)
        elif cfg.qk_norm == "full":
            self.q_norm = RMSNorm(self.num_heads * D, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.num_kv_heads * D, cfg.rms_norm_eps)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, batch: ForwardBatch, cache: LayerKV) -> Tensor:
        T = x.shape[0]
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)  # [T, Hq*D], [T, Hkv*D], [T, Hkv*D]
        if self.qk_norm == "full":
            q, k = self.q_norm(q), self.k_norm(k)
        if self.clip_qkv is not None:
            q, k, v = (t.clamp(min=-self.clip_qkv, max=self.clip_qkv) for t in (q, k, v))
        q = q.view(T, self.num_heads, self.head_dim)  # [T, Hq, D]
        k = k.view(T, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        v = v.view(T, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = attend(q, k, v, cache, batch, self.scale, self.sliding_window)  # [T, Hq, D]
        return self.o_proj(out.reshape(T, self.num_heads * self.head_dim))  # [T, H]


class MLP(nn.Module):
    """SwiGLU MLP: dense layers and the Qwen2-MoE shared expert."""

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Experts(nn.Module):
    """E SwiGLU experts as 3-D weights (HF v5 fused layout): gate_up_proj [E, 2I, H] (gate rows, then up rows),
    down_proj [E, H, I]."""

    def __init__(self, cfg: MoEConfig):
        super().__init__()
        E, H, I = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.num_experts = E
        self.gate_up_proj = nn.Parameter(torch.empty(E, 2 * I, H), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(E, H, I), requires_grad=False)

    def forward(self, x: Tensor, ids: Tensor, weights: Tensor) -> Tensor:
        """x [T, H], ids [T, K], weights [T, K] -> sum_k weights[t, k] * expert_{ids[t, k]}(x[t])  [T, H]."""
        T, K = ids.shape
        if T == 0:
            return torch.zeros_like(x)
        slot_bytes = self.gate_up_proj[0].nbytes + self.down_proj[0].nbytes
        if T * K <= GATHER_MAX_SLOTS and T * K * slot_bytes <= GATHER_MAX_BYTES:
            return self._forward_gather(x, ids, weights)
        return self._forward_grouped(x, ids, weights)

    def _forward_grouped(self, x: Tensor, ids: Tensor, weights: Tensor) -> Tensor:
        T, K = ids.shape
        # Token-slots in HF's order: by expert, then slot k, then token (HF loops over experts and takes
        # torch.where(one_hot[e]) of a [K, T] mask), so every expert sees the same rows in the same order.
        flat = ids.t().reshape(-1)  # [K*T] slot-major
        order = torch.argsort(flat, stable=True)  # [K*T] grouped by expert
        tok, slot = order % T, order // T  # [K*T] token index and slot of each grouped row
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()  # the one host sync of this layer
        xs = x[tok]  # [K*T, H]
        outs = []
        for e, rows in enumerate(torch.split(xs, counts)):
            if rows.shape[0] == 0:
                continue
            gate, up = F.linear(rows, self.gate_up_proj[e]).chunk(2, dim=-1)  # [n, I] each
            outs.append(F.linear(F.silu(gate) * up, self.down_proj[e]))  # [n, H]
        y = (torch.cat(outs) * weights[tok, slot, None]).to(x.dtype)  # [K*T, H]; fp32 weights promote (Mixtral)
        # Back to [T, K, H] with each token's K outputs in ascending expert order, then summed in that order.
        rank = torch.argsort(torch.argsort(ids, dim=-1), dim=-1)  # [T, K] rank of each slot's expert id
        per_token = torch.empty(T, K, x.shape[1], dtype=x.dtype, device=x.device)
        per_token[tok, rank[tok, slot]] = y
        return self._sum_in_order(per_token)

    def _forward_gather(self, x: Tensor, ids: Tensor, weights: Tensor) -> Tensor:
        gate, up = torch.einsum("th,tkoh->tko", x, self.gate_up_proj[ids]).chunk(2, dim=-1)  # [T, K, I] each
        y = torch.einsum("tki,tkhi->tkh", F.silu(gate) * up, self.down_proj[ids])  # [T, K, H]
        y = (y * weights[..., None]).to(x.dtype)
        order = torch.argsort(ids, dim=-1)  # [T, K] slots in ascending expert order
        return self._sum_in_order(y.gather(1, order[..., None].expand_as(y)))

    @staticmethod
    def _sum_in_order(per_token: Tensor) -> Tensor:
        """[T, K, H] -> [T, H], adding the K outputs one at a time in the model dtype. HF accumulates with one
        index_add_ per expert in ascending expert order (rounding after each add); a single index_add_ or a
        sum() would round differently in bf16."""
        out = torch.zeros_like(per_token[:, 0])
        for j in range(per_token.shape[1]):
            out = out + per_token[:, j]
        return out


class MoEBlock(nn.Module):
    """Router -> routed experts (+ optional shared expert, sigmoid-gated in Qwen2-MoE)."""

    def __init__(self, cfg: MoEConfig):
        super().__init__()
        self.gate = make_router(cfg)
        self.experts = Experts(cfg)
        self.shared_expert = MLP(cfg.hidden_size, cfg.shared_expert_intermediate_size) if cfg.shared_expert_intermediate_size else None
        self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False) if cfg.shared_expert_gate else None

    def forward(self, x: Tensor, capture: Tensor | None = None) -> Tensor:
        ids, weights = self.gate(x)  # [T, K] int64, [T, K]
        if capture is not None:
            capture.copy_(ids)  # [T, K] int32 view of the step buffer: exactly the ids used below
        out = self.experts(x, ids, weights)
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
            out = out + shared
        return out


class DecoderLayer(nn.Module):
    def __init__(self, cfg: MoEConfig, layer_idx: int):
        super().__init__()
        self.is_moe = layer_idx in cfg.moe_layers
        self.self_attn = Attention(cfg, layer_idx)
        self.mlp = MoEBlock(cfg) if self.is_moe else MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self, x: Tensor, cos: Tensor, sin: Tensor, batch: ForwardBatch, cache: LayerKV, capture: Tensor | None
    ) -> Tensor:
        h = x + self.self_attn(self.input_layernorm(x), cos, sin, batch, cache)
        normed = self.post_attention_layernorm(h)
        return h + (self.mlp(normed, capture) if self.is_moe else self.mlp(normed))


class MoEModel(nn.Module):
    def __init__(self, cfg: MoEConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(cfg)


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
        cfg = self.config
        return [KVSpec(cfg.num_key_value_heads, cfg.head_dim, cfg.head_dim) for _ in range(cfg.num_hidden_layers)]

    def forward(
        self,
        input_ids: Tensor,  # [T] long, tokens of all sequences flattened
        batch: ForwardBatch,  # attention layout for this step
        kv: KVCache | list[LayerKV],  # kv[layer] -> LayerKV
        capture: Tensor | None = None,  # [>=T, num_hidden_layers, K] int32 step buffer
    ) -> Tensor:  # [T, H] final hidden states (after the final norm)
        T = input_ids.shape[0]
        x = self.model.embed_tokens(input_ids)  # [T, H]
        cos, sin = self.model.rotary_emb(batch.positions, x.dtype)  # [T, D] each, shared by all layers
        for i, layer in enumerate(self.model.layers):
            layer_capture = capture[:T, i] if capture is not None and layer.is_moe else None  # [T, K]
            x = layer(x, cos, sin, batch, kv[i], layer_capture)
        return self.model.norm(x)

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """[N, H] -> [N, V] float32 (the matmul runs in the model dtype, as HF)."""
        return self.lm_head(hidden).float()


@torch.inference_mode()
def reference_forward(model: MoEForCausalLM, token_ids: list[int]) -> tuple[Tensor, Tensor]:
    """Whole sequence in one step on a fresh 1-slot cache: (logits [T, V] float32, routed ids [T, L, K] int32)."""
    cfg, device, T = model.config, model.device, len(token_ids)
    cache = KVCache(model.kv_layout(), num_slots=1, max_model_len=T, dtype=model.dtype, device=device)
    batch = ForwardBatch.single(T, device)
    capture = torch.zeros(T, cfg.num_hidden_layers, cfg.num_experts_per_tok, dtype=torch.int32, device=device)
    hidden = model(torch.tensor(token_ids, dtype=torch.long, device=device), batch, cache, capture)
    return model.compute_logits(hidden), capture
