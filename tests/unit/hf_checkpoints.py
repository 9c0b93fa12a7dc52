"""Small random MoE checkpoints written by transformers itself (``save_pretrained``), for parity tests.

Every architecture the engine supports has one tiny config here (hidden 64, a few layers) that
still covers its peculiarities:

- mixtral:   8 experts, top-2, sliding window 16 (shorter than prompt + generation);
- qwen2_moe: 60 experts, top-4, shared expert with sigmoid gate, mlp_only_layers=[1] (a dense layer);
- qwen3_moe: 16 experts, top-4, norm_topk_prob, decoder_sparse_step=2 (odd layers MoE),
             per-head q/k norm, head_dim 32 != hidden/heads;
- olmoe:     64 experts, top-8, full-width q/k norm, clip_qkv, tied embeddings.
"""
from __future__ import annotations

from pathlib import Path

import torch

ARCHS = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")

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
    from transformers import MixtralConfig, OlmoeConfig, Qwen2MoeConfig, Qwen3MoeConfig

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
    raise ValueError(arch)


def make_hf_model(arch: str, seed: int = 0, dtype: torch.dtype = torch.float32):
    """A random HF model (transformers' own init), eager attention and experts."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = hf_config(arch)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", experts_implementation="eager")
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
    """layer index -> HF router module (``mlp.gate``, a *TopKRouter) for every MoE layer."""
    out = {}
    for i, layer in enumerate(model.model.layers):
        gate = getattr(layer.mlp, "gate", None)
        if gate is not None and type(gate).__name__.endswith("TopKRouter"):
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
