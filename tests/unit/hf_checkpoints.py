"""Small random MoE checkpoints written by transformers itself (``save_pretrained``), for parity tests.

Every architecture the engine supports has one tiny config here (hidden 64, a few layers) that
still covers its peculiarities:

- mixtral:   8 experts, top-2, sliding window 16 (shorter than prompt + generation);
- qwen2_moe: 60 experts, top-4, shared expert with sigmoid gate, mlp_only_layers=[1] (a dense layer);
- qwen3_moe: 16 experts, top-4, norm_topk_prob, decoder_sparse_step=2 (odd layers MoE),
             per-head q/k norm, head_dim 32 != hidden/heads;
- olmoe:     64 experts, top-8, full-width q/k norm, clip_qkv, tied embeddings;
- deepseek_v2: MLA with q_lora_rank=None (q_proj), v_head_dim != qk head dim, complex (pairwise) rope,
             16 experts top-4, group_limited_greedy with 4 groups / 2 kept, routed_scaling_factor 2,
             2 shared experts, first_k_dense_replace=1 (layer 0 dense);
- deepseek_v3: MLA with q_lora_rank (q_a_proj/q_a_layernorm/q_b_proj), interleaved rope, yarn (factor 4,
             mscale != mscale_all_dim, so both the rope attention factor and the softmax mscale matter),
             16 experts top-4, sigmoid scores, 4 groups / 2 kept, NON-ZERO random e_score_correction_bias,
             norm_topk_prob, routed_scaling_factor 2.5, 1 shared expert, first_k_dense_replace=1;
- gpt_oss:   8 experts top-2, router bias, random (non-zero) expert biases, swiglu_limit 0.1 (so the clamp
             bites), sinks, alternating sliding (window 8) / full layers, HF's default yarn rope.
"""
from __future__ import annotations

from pathlib import Path

import torch

ARCHS = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v2", "deepseek_v3", "gpt_oss")
NEW_ARCHS = ("deepseek_v2", "deepseek_v3", "gpt_oss")

_MLA = dict(kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, num_key_value_heads=4)

_COMMON = dict(
    vocab_size=256,
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)


def hf_config(arch: str):
    from transformers import (
        DeepseekV2Config, DeepseekV3Config, GptOssConfig, MixtralConfig, OlmoeConfig, Qwen2MoeConfig, Qwen3MoeConfig,
    )

    if arch == "mixtral":
        return MixtralConfig(
            **_COMMON, num_hidden_layers=3, intermediate_size=32, num_local_experts=8, num_experts_per_tok=2,
            sliding_window=16,
        )
    if arch == "qwen2_moe":
        return Qwen2MoeConfig(
            **_COMMON, num_hidden_layers=3, intermediate_size=48, moe_intermediate_size=16,
            shared_expert_intermediate_size=32, num_experts=60, num_experts_per_tok=4, mlp_only_layers=[1],
            norm_topk_prob=False,
        )
    if arch == "qwen3_moe":
        return Qwen3MoeConfig(
            **_COMMON, num_hidden_layers=4, head_dim=32, intermediate_size=48, moe_intermediate_size=16,
            num_experts=16, num_experts_per_tok=4, decoder_sparse_step=2, norm_topk_prob=True,
        )
    if arch == "olmoe":
        return OlmoeConfig(
            **_COMMON, num_hidden_layers=2, intermediate_size=16, num_experts=64, num_experts_per_tok=8,
            clip_qkv=0.3, tie_word_embeddings=True,
        )
    if arch == "deepseek_v2":
        return DeepseekV2Config(
            **{**_COMMON, **_MLA}, num_hidden_layers=3, intermediate_size=48, moe_intermediate_size=16,
            n_routed_experts=16, n_shared_experts=2, num_experts_per_tok=4, first_k_dense_replace=1,
            topk_method="group_limited_greedy", n_group=4, topk_group=2, routed_scaling_factor=2.0, q_lora_rank=None,
        )
    if arch == "deepseek_v3":
        return DeepseekV3Config(
            **{**_COMMON, **_MLA}, num_hidden_layers=3, intermediate_size=48, moe_intermediate_size=16,
            n_routed_experts=16, n_shared_experts=1, num_experts_per_tok=4, first_k_dense_replace=1,
            n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5, q_lora_rank=24,
            rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                             "mscale": 1.0, "mscale_all_dim": 0.8, "beta_fast": 32, "beta_slow": 1,
                             "rope_theta": 10000.0},
        )
    if arch == "gpt_oss":
        return GptOssConfig(
            **_COMMON, head_dim=16, num_hidden_layers=3, intermediate_size=32, num_local_experts=8,
            num_experts_per_tok=2, sliding_window=8, swiglu_limit=0.1,
        )
    raise ValueError(arch)


def hf_default_attn(arch: str) -> str:
    """HF's default attention implementation on CPU (GPT-OSS does not support sdpa: eager)."""
    return "eager" if arch == "gpt_oss" else "sdpa"


@torch.no_grad()
def _randomize_zero_inits(model, seed: int) -> None:
    """Parameters HF initialises to zero get random values, so that they matter in the comparison:
    DeepSeek-V3's e_score_correction_bias, GPT-OSS expert biases."""
    g = torch.Generator().manual_seed(seed + 1000)
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if name.endswith("e_score_correction_bias"):
            t.copy_(torch.randn(t.shape, generator=g) * 0.05)
        elif name.endswith(("experts.gate_up_proj_bias", "experts.down_proj_bias")):
            t.copy_(torch.randn(t.shape, generator=g) * 0.05)


def make_hf_model(arch: str, seed: int = 0, dtype: torch.dtype = torch.float32):
    """A random HF model (transformers' own init), eager attention and experts."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = hf_config(arch)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", experts_implementation="eager")
    _randomize_zero_inits(model, seed)
    return model.to(dtype).eval()


def save_hf_checkpoint(model, out: Path, *, fused: bool = False, max_shard_size: str | None = None) -> Path:
    """save_pretrained: per-expert Hub layout by default, fused 3-D experts with ``fused=True``."""
    kwargs = {"save_original_format": not fused}
    if max_shard_size is not None:
        kwargs["max_shard_size"] = max_shard_size
    model.save_pretrained(out, **kwargs)
    return Path(out)


def load_hf(path: Path, dtype: torch.dtype = torch.float32, attn_implementation: str = "eager"):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        path, dtype=dtype, attn_implementation=attn_implementation, experts_implementation="eager"
    ).eval()


def hf_router_modules(model) -> dict[int, torch.nn.Module]:
    """layer index -> HF router module (``mlp.gate``, or GPT-OSS ``mlp.router``; a *TopKRouter / *TopkRouter
    returning (logits, weights, ids)) for every MoE layer."""
    out = {}
    for i, layer in enumerate(model.model.layers):
        gate = getattr(layer.mlp, "gate", None) or getattr(layer.mlp, "router", None)
        if gate is not None and type(gate).__name__.lower().endswith("topkrouter"):
            out[i] = gate
    return out


@torch.no_grad()
def hf_forward_with_routing(model, input_ids: torch.Tensor) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """HF logits [B, T, V] float32 and, per MoE layer, the router's own top-k ids [B*T, K], captured with
    forward hooks on the router modules (computed by HF, not by the engine)."""
    routed: dict[int, torch.Tensor] = {}
    hooks = []
    for i, gate in hf_router_modules(model).items():
        def hook(_module, _inputs, output, i=i):
            routed[i] = output[2].detach().clone()  # (router_logits, router_scores, router_indices)

        hooks.append(gate.register_forward_hook(hook))
    try:
        logits = model(input_ids).logits.float()
    finally:
        for h in hooks:
            h.remove()
    return logits, routed
