"""Qwen2-MoE and Qwen3-MoE (transformers 5.24 ``Qwen2MoeConfig`` / ``Qwen3MoeConfig``): MoE layers chosen by
mlp_only_layers and decoder_sparse_step; Qwen2's sigmoid-gated shared expert; Qwen3's per-head q/k norm."""
from __future__ import annotations

from .common import common, num_experts, top_k


def moe_layers(raw: dict, num_layers: int, num_experts: int) -> tuple[int, ...]:
    """HF Qwen2/3-MoE: not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0."""
    mlp_only = set(raw.get("mlp_only_layers") or [])
    step = int(raw.get("decoder_sparse_step", 1) or 1)
    if num_experts <= 0:
        return ()
    return tuple(i for i in range(num_layers) if i not in mlp_only and (i + 1) % step == 0)


def parse_qwen2_moe(raw: dict) -> dict:
    c = common(raw, "qwen2_moe", default_theta=1e4)
    n, E, K = c["num_hidden_layers"], num_experts(raw, 60), top_k(raw, "qwen2_moe")
    # HF: sliding_window applies only with use_sliding_window, to layers whose layer_types entry says so
    window = raw.get("sliding_window") if raw.get("use_sliding_window", False) else None
    layer_types = raw.get("layer_types") or [
        "sliding_attention" if (i + 1) % 2 and i < raw.get("max_window_layers", 28) and window else "full_attention"
        for i in range(n)
    ]
    c["attention"].update(
        qkv_bias=bool(raw.get("qkv_bias", True)),
        sliding_windows=tuple(
            int(window) if window and layer_types[i] == "sliding_attention" else None for i in range(n)
        ),
    )
    shared = int(raw.get("shared_expert_intermediate_size", 5632) or 0)
    return dict(
        c,
        moe_layers=moe_layers(raw, n, E),
        intermediate_size=int(raw.get("intermediate_size", 5632)),
        router=dict(kind="softmax_topk", num_experts=E, top_k=K, norm_topk_prob=bool(raw.get("norm_topk_prob", False))),
        experts=dict(num_experts=E, intermediate_size=int(raw.get("moe_intermediate_size", 1408)),
                     shared_intermediate_size=shared, shared_gate=shared > 0),
    )


def parse_qwen3_moe(raw: dict) -> dict:
    c = common(raw, "qwen3_moe", default_theta=1e4)
    n, E, K = c["num_hidden_layers"], num_experts(raw, 128), top_k(raw, "qwen3_moe")
    window = raw.get("sliding_window") if raw.get("use_sliding_window", False) else None
    bias = bool(raw.get("attention_bias", False))
    c["attention"].update(
        qkv_bias=bias, o_bias=bias, qk_norm="head", sliding_windows=(int(window) if window else None,) * n,
    )
    return dict(
        c,
        moe_layers=moe_layers(raw, n, E),
        intermediate_size=int(raw.get("intermediate_size", 6144)),
        router=dict(kind="softmax_topk", num_experts=E, top_k=K, norm_topk_prob=bool(raw.get("norm_topk_prob", False))),
        experts=dict(num_experts=E, intermediate_size=int(raw.get("moe_intermediate_size", 768))),
    )
