"""Mixtral (transformers 5.24 ``MixtralConfig``): every layer MoE, softmax top-k router keeping fp32 weights."""
from __future__ import annotations

from .common import common, num_experts, top_k


def parse(raw: dict) -> dict:
    c = common(raw, "mixtral", default_theta=1e6, eps=1e-5)
    n, E, K = c["num_hidden_layers"], num_experts(raw, 8), top_k(raw, "mixtral")
    window = raw.get("sliding_window")  # HF: one window for every layer when set
    c["attention"]["sliding_windows"] = (int(window) if window else None,) * n
    return dict(
        c,
        moe_layers=tuple(range(n)),
        router=dict(kind="softmax_topk", num_experts=E, top_k=K, norm_topk_prob=True, weights_fp32=True),
        experts=dict(num_experts=E, intermediate_size=int(raw.get("intermediate_size", 14336))),
    )
