"""GLM-4.5 / 4.6 / 4.7 (``glm4_moe``) and GLM-4.7-Flash (``glm4_moe_lite``), transformers 5.24
``modeling_glm4_moe`` / ``modeling_glm4_moe_lite``.

Both route as DeepSeek-V3 does (HF ``Glm4MoeTopkRouter`` is ``DeepseekV3TopkRouter`` line for line): float32 gate
weight and logits, sigmoid scores, ``e_score_correction_bias`` (float32) added only to choose groups (sum of each
group's top 2) and experts (``topk(sorted=False)``), weights the unbiased scores, renormalised if
``norm_topk_prob`` (+1e-20), times ``routed_scaling_factor``; ungated shared experts of width
``moe_intermediate_size * n_shared_experts`` beside the routed ones (``mlp.shared_experts``).

- ``glm4_moe``: grouped-query attention with a bias on q/k/v only (``attention_bias``; o_proj has none), optional
  per-head q/k RMSNorm (``use_qk_norm``), rotary on the first ``int(head_dim * partial_rotary_factor)`` dims of
  each head (default 0.5: ``Glm4MoeConfig.__post_init__``), the first ``first_k_dense_replace`` layers dense.
- ``glm4_moe_lite``: DeepSeek-V3's multi-head latent attention (q_lora_rank, interleaved rope by default), dense
  or MoE per layer from ``mlp_layer_types`` (default: layer 0 dense).

Multi-token-prediction layers (``model.layers.{num_hidden_layers}.*``) are ignored, as HF ignores them.
"""
from __future__ import annotations

from .common import UnsupportedModelError, common, num_experts, top_k


def _router_and_experts(raw: dict, arch: str, E: int, K: int, shared_default: int, scale_default: float,
                        moe_width_default: int) -> tuple[dict, dict]:
    n_group, topk_group = int(raw.get("n_group") or 1), int(raw.get("topk_group") or 1)
    if E % n_group or not 0 < topk_group <= n_group or E // n_group < 2:
        raise UnsupportedModelError(
            f"{arch}: n_routed_experts={E} must be a multiple of n_group={n_group} with >= 2 experts per group, "
            f"and 1 <= topk_group={topk_group} <= n_group"
        )
    width = int(raw.get("moe_intermediate_size", moe_width_default))
    shared = raw.get("n_shared_experts", shared_default)
    router = dict(
        kind="deepseek_v3", num_experts=E, top_k=K, fp32=True, weights_fp32=True, topk_method="noaux_tc",
        n_group=n_group, topk_group=topk_group, norm_topk_prob=bool(raw.get("norm_topk_prob", True)),
        routed_scaling_factor=float(raw.get("routed_scaling_factor", scale_default)),
    )
    experts = dict(num_experts=E, intermediate_size=width, block="deepseek",
                   shared_intermediate_size=width * int(shared or 0))
    return router, experts


def parse_glm4_moe(raw: dict) -> dict:
    arch = "glm4_moe"
    raw = {**raw, "num_experts_per_tok": raw.get("num_experts_per_tok", 8)}
    c = common(raw, arch, default_theta=1e4, rope_types=("default", "linear", "yarn"), partial_rotary=0.5, eps=1e-5)
    n, E, K = c["num_hidden_layers"], num_experts(raw, 128), top_k(raw, arch)
    bias = bool(raw.get("attention_bias", False))
    c["attention"].update(qkv_bias=bias, o_bias=False, qk_norm="head" if raw.get("use_qk_norm", False) else "none")
    router, experts = _router_and_experts(raw, arch, E, K, shared_default=1, scale_default=1.0,
                                          moe_width_default=1408)
    first_dense = int(raw.get("first_k_dense_replace", 1) or 0)
    return dict(
        c,
        moe_layers=tuple(range(first_dense, n)),
        intermediate_size=int(raw.get("intermediate_size", 10944)),
        router=router,
        experts=experts,
    )


def parse_glm4_moe_lite(raw: dict) -> dict:
    arch = "glm4_moe_lite"
    raw = {**raw, "num_experts_per_tok": raw.get("num_experts_per_tok", 4)}
    nope = int(raw.get("qk_nope_head_dim", 192))
    rope_dim = int(raw.get("qk_rope_head_dim", 64))
    v_dim = int(raw.get("v_head_dim", 256))
    style = "interleave" if raw.get("rope_interleave", True) else "half"
    c = common(raw, arch, default_theta=1e4, head_dim_key=False, rope_dim=rope_dim,
               rope_types=("default", "linear", "yarn"), rope_style=style, eps=1e-5)
    n, E, K = c["num_hidden_layers"], num_experts(raw, 64), top_k(raw, arch)
    q_lora = raw.get("q_lora_rank", 768)
    bias = bool(raw.get("attention_bias", False))
    c["attention"].update(
        num_kv_heads=c["attention"]["num_heads"], head_dim=nope + rope_dim, qkv_bias=bias, o_bias=bias,
        mla=dict(kv_lora_rank=int(raw.get("kv_lora_rank", 512)), qk_nope_head_dim=nope, qk_rope_head_dim=rope_dim,
                 v_head_dim=v_dim, q_lora_rank=int(q_lora) if q_lora else None),
    )
    kinds = raw.get("mlp_layer_types") or ["dense"] + ["sparse"] * (n - 1)
    if len(kinds) != n or set(kinds) - {"dense", "sparse"}:
        raise UnsupportedModelError(f"{arch}: mlp_layer_types {kinds} not understood (one 'dense'/'sparse' per layer)")
    router, experts = _router_and_experts(raw, arch, E, K, shared_default=1, scale_default=1.8,
                                          moe_width_default=1536)
    return dict(
        c,
        moe_layers=tuple(i for i, kind in enumerate(kinds) if kind == "sparse"),
        intermediate_size=int(raw.get("intermediate_size", 10240)),
        router=router,
        experts=experts,
    )
