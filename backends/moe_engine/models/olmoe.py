"""OLMoE (transformers 5.24 ``OlmoeConfig``): q/k RMSNorm over all heads, optional qkv clipping."""
from __future__ import annotations

from .common import UnsupportedModelError, common, num_experts, top_k


def parse(raw: dict) -> dict:
    c = common(raw, "olmoe", default_theta=1e4, eps=1e-5)
    E, K = num_experts(raw, 64), top_k(raw, "olmoe")
    attn = c["attention"]
    if attn["head_dim"] * attn["num_heads"] != c["hidden_size"]:
        raise UnsupportedModelError("olmoe: head_dim * num_attention_heads must equal hidden_size (HF q_norm width)")
    bias = bool(raw.get("attention_bias", False))
    clip = raw.get("clip_qkv")
    attn.update(qkv_bias=bias, o_bias=bias, qk_norm="full", clip_qkv=float(clip) if clip is not None else None)
    return dict(
        c,
        moe_layers=tuple(range(c["num_hidden_layers"])),
        router=dict(kind="softmax_topk", num_experts=E, top_k=K, norm_topk_prob=bool(raw.get("norm_topk_prob", False))),
        experts=dict(num_experts=E, intermediate_size=int(raw.get("intermediate_size", 2048))),
    )
