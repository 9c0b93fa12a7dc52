"""DeepSeek-V2 / V3 (transformers 5.24 ``modeling_deepseek_v2/v3``): MLA attention, first_k_dense_replace
dense layers, shared experts, fp32 router (V2 softmax greedy / group_limited_greedy, V3 sigmoid with
e_score_correction_bias and groups). The softmax scale's yarn mscale is derived in layers/rotary.py."""
from __future__ import annotations

from .common import UnsupportedModelError, common, num_experts, top_k

_DEFAULTS = {  # the transformers config classes' defaults
    "deepseek_v3": dict(
        n_routed_experts=256, n_shared_experts=1, first_k_dense_replace=3, n_group=8, topk_group=4,
        norm_topk_prob=True, routed_scaling_factor=2.5, q_lora_rank=1536, moe_intermediate_size=2048,
        intermediate_size=18432, num_experts_per_tok=8,
    ),
    "deepseek_v2": dict(
        n_routed_experts=64, n_shared_experts=2, first_k_dense_replace=0, n_group=None, topk_group=None,
        norm_topk_prob=False, routed_scaling_factor=1.0, q_lora_rank=1536, moe_intermediate_size=1407,
        intermediate_size=11008, num_experts_per_tok=None,
    ),
}


def parse_deepseek_v2(raw: dict) -> dict:
    return _parse(raw, "deepseek_v2")


def parse_deepseek_v3(raw: dict) -> dict:
    return _parse(raw, "deepseek_v3")


def _routing(raw: dict, arch: str, num_experts: int, n_group, topk_group) -> tuple[str, int, int]:
    """(topk_method, n_group, topk_group), checked: V3 always routes "noaux_tc" (bias-corrected grouped top-k;
    HF ignores the key), V2 greedy or grouped."""
    v3 = arch == "deepseek_v3"
    topk_method = "noaux_tc" if v3 else (raw.get("topk_method") or "greedy")
    if not v3 and topk_method not in ("greedy", "group_limited_greedy"):
        raise UnsupportedModelError(
            f"{arch}: topk_method {topk_method!r} is not supported (supported: greedy, group_limited_greedy)"
        )
    if topk_method == "group_limited_greedy" or v3:
        n_group, topk_group = int(n_group or 1), int(topk_group or 1)
        if num_experts % n_group or not 0 < topk_group <= n_group:
            raise UnsupportedModelError(
                f"{arch}: n_routed_experts={num_experts} must be a multiple of n_group={n_group} "
                f"and 1 <= topk_group={topk_group} <= n_group"
            )
        if v3 and num_experts // n_group < 2:
            raise UnsupportedModelError(f"{arch}: each expert group needs >= 2 experts (group score = top-2 sum)")
        return topk_method, n_group, topk_group
    return topk_method, 1, 1


def _parse(raw: dict, arch: str) -> dict:
    v3 = arch == "deepseek_v3"
    defaults = _DEFAULTS[arch]

    def get(key):
        return raw[key] if key in raw else defaults[key]

    raw = {**raw, "num_experts_per_tok": raw.get("num_experts_per_tok", defaults["num_experts_per_tok"])}
    nope = int(raw.get("qk_nope_head_dim", 128))
    rope_dim = int(raw.get("qk_rope_head_dim", 64))
    v_dim = int(raw.get("v_head_dim") or 128)
    rope_style = ("interleave" if raw.get("rope_interleave", True) else "half") if v3 else "complex"
    c = common(raw, arch, default_theta=1e4, head_dim_key=False, rope_dim=rope_dim,
               rope_types=("default", "linear", "yarn"), rope_style=rope_style)
    K = top_k(raw, arch)
    n = c["num_hidden_layers"]
    if raw.get("moe_layer_freq", 1) not in (None, 1):
        raise UnsupportedModelError(f"{arch}: moe_layer_freq={raw['moe_layer_freq']} is not supported (HF ignores it)")
    E = num_experts(raw, defaults["n_routed_experts"])
    first_dense = int(get("first_k_dense_replace") or 0)
    topk_method, n_group, topk_group = _routing(raw, arch, E, get("n_group"), get("topk_group"))
    q_lora = get("q_lora_rank")
    bias = bool(raw.get("attention_bias", False))
    mlp_bias = bool(raw.get("mlp_bias", False)) and not v3  # V3's MLP has no bias option
    c["attention"].update(
        num_kv_heads=c["attention"]["num_heads"],  # MLA expands the latent into one key/value head per query head
        head_dim=nope + rope_dim,
        qkv_bias=bias,
        o_bias=bias,
        mla=dict(kv_lora_rank=int(raw.get("kv_lora_rank", 512)), qk_nope_head_dim=nope, qk_rope_head_dim=rope_dim,
                 v_head_dim=v_dim, q_lora_rank=int(q_lora) if q_lora else None),
    )
    return dict(
        c,
        moe_layers=tuple(range(first_dense, n)),
        intermediate_size=int(get("intermediate_size")),
        mlp_bias=mlp_bias,
        router=dict(
            kind=arch, num_experts=E, top_k=K, fp32=True, weights_fp32=True,
            topk_method=topk_method, n_group=n_group, topk_group=topk_group,
            routed_scaling_factor=float(get("routed_scaling_factor")),
            norm_topk_prob=bool(get("norm_topk_prob")) if v3 else False,  # HF V2 ignores norm_topk_prob
        ),
        experts=dict(
            num_experts=E, intermediate_size=int(get("moe_intermediate_size")), block="deepseek",
            shared_intermediate_size=int(get("moe_intermediate_size")) * int(get("n_shared_experts") or 0),
            shared_bias=mlp_bias,
        ),
    )
