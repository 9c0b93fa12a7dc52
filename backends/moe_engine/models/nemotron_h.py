"""Nemotron-H / Nemotron-3 (``nemotron_h``), transformers 5.24 ``modeling_nemotron_h``: a hybrid of Mamba-2,
attention and MoE blocks.

- Every layer is one block: ``norm`` (RMSNorm, weight applied in float32) -> one ``mixer`` -> the residual add
  (``block_style`` "single"). ``layers_block_type`` (or the Hub's ``hybrid_override_pattern``: M = Mamba-2,
  * = attention, E = MoE, - = MLP) says which mixer; ``num_hidden_layers`` is the number of blocks.
- Mamba-2 blocks: layers/mamba.py (``mamba_num_heads`` x ``mamba_head_dim``, ``ssm_state_size``, ``n_groups``,
  ``conv_kernel``, ``chunk_size``, dt clamped to [time_step_min, inf) in prompts).
- Attention blocks: grouped-query attention without position embedding and without biases.
- MoE blocks: DeepSeek-V3's router (float32 sigmoid scores, ``e_score_correction_bias`` for the choice, groups,
  renormalised if ``norm_topk_prob``, times ``routed_scaling_factor``), ungated squared-ReLU experts
  (``up_proj`` [E, I, H], ``down_proj`` [E, H, I]) summed in float32, optionally in a latent space
  (``moe_latent_size``), plus an ungated squared-ReLU shared expert (``moe_shared_expert_intermediate_size``).
- MLP blocks: ungated squared-ReLU (``intermediate_size``).

The layer axis of ``routed_experts`` counts every block (the global layer index, as vLLM); only the MoE blocks route
(``moe_layers``), the others' columns stay 0. Checkpoint keys: the Hub's ``backbone.*`` or transformers' ``model.*``;
MTP layers (``mtp.*``) are ignored, as HF ignores them.
"""
from __future__ import annotations

from .common import UnsupportedModelError, common, num_experts, top_k

_PATTERN = {"M": "linear_attention", "E": "moe", "*": "full_attention", "-": "mlp"}
_KIND = {"linear_attention": "mamba", "full_attention": "attention", "moe": "none", "mlp": "none"}


def block_types(raw: dict) -> list[str]:
    types = raw.get("layers_block_type") or raw.get("layer_types")
    if types is None and raw.get("hybrid_override_pattern"):
        try:
            types = [_PATTERN[c] for c in raw["hybrid_override_pattern"]]
        except KeyError as e:
            raise UnsupportedModelError(f"nemotron_h: hybrid_override_pattern has an unknown block {e}") from None
    types = list(types or ["linear_attention", "moe", "full_attention", "mlp"])
    types = ["linear_attention" if t == "mamba" else "full_attention" if t == "attention" else t for t in types]
    if set(types) - set(_KIND):
        raise UnsupportedModelError(f"nemotron_h: layers_block_type {types} not understood "
                                    f"(linear_attention, full_attention, moe, mlp)")
    return types


def parse(raw: dict) -> dict:
    arch = "nemotron_h"
    types = block_types(raw)
    n = len(types)
    # (transformers 5.24 reads neither sliding_window nor residual_in_fp32 for this model: full causal attention,
    # residuals in the model dtype; so the engine ignores them too)
    act = raw.get("mlp_hidden_act", "relu2")
    raw = {**raw, "num_hidden_layers": n, "hidden_act": act, "head_dim": raw.get("head_dim", 128),
           "num_key_value_heads": raw.get("num_key_value_heads") or raw.get("num_attention_heads", 32),
           "num_attention_heads": raw.get("num_attention_heads", 32),
           "num_experts_per_tok": raw.get("num_experts_per_tok", 2)}
    c = common(raw, arch, default_theta=1e4, acts=("relu2",))
    c["rms_norm_eps"] = float(raw.get("layer_norm_epsilon", 1e-5))
    c["attention"].update(rotary=False)
    if raw.get("mamba_hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"{arch}: mamba_hidden_act {raw['mamba_hidden_act']!r} is not supported (silu)")
    heads, head_dim = int(raw.get("mamba_num_heads", 128)), int(raw.get("mamba_head_dim", 64))
    groups = int(raw.get("n_groups", raw.get("mamba_n_groups", 8)))
    if heads % groups:
        raise UnsupportedModelError(f"{arch}: mamba_num_heads={heads} must be a multiple of n_groups={groups}")
    E, K = num_experts(raw, 8), top_k(raw, arch)
    n_group, topk_group = int(raw.get("n_group") or 1), int(raw.get("topk_group") or 1)
    if E % n_group or not 0 < topk_group <= n_group or E // n_group < 2:
        raise UnsupportedModelError(f"{arch}: n_routed_experts={E} must be a multiple of n_group={n_group} with >= 2 "
                                    f"experts per group, and 1 <= topk_group={topk_group} <= n_group")
    mlp_bias = bool(raw.get("mlp_bias", False))
    return dict(
        c,
        layer_types=tuple(_KIND[t] for t in types),
        block_style="single",
        moe_layers=tuple(i for i, t in enumerate(types) if t == "moe"),
        intermediate_size=int(raw.get("intermediate_size", 21504)),
        mlp_bias=mlp_bias,
        norm_fp32_weight=True,
        mamba=dict(
            num_heads=heads, head_dim=head_dim, state_size=int(raw.get("ssm_state_size", 128)), n_groups=groups,
            conv_kernel=int(raw.get("conv_kernel", raw.get("mamba_d_conv", 4))),
            conv_bias=bool(raw.get("use_conv_bias", raw.get("mamba_conv_bias", True))),
            proj_bias=bool(raw.get("use_bias", False)), chunk_size=int(raw.get("chunk_size", 128)),
            time_step_min=float(raw.get("time_step_min", raw.get("mamba_dt_min", 0.001))),
        ),
        router=dict(
            kind="deepseek_v3", num_experts=E, top_k=K, fp32=True, weights_fp32=True, topk_method="noaux_tc",
            n_group=n_group, topk_group=topk_group, norm_topk_prob=bool(raw.get("norm_topk_prob", True)),
            routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.0)),
        ),
        experts=dict(
            num_experts=E, intermediate_size=int(raw.get("moe_intermediate_size", 7688)), block="nemotron_h",
            activation="relu2", latent_size=int(raw.get("moe_latent_size") or 0),
            shared_intermediate_size=int(raw.get("moe_shared_expert_intermediate_size", 7688)), shared_bias=mlp_bias,
        ),
        key_prefixes=(("model.", "backbone."),),
        ignored_keys=(r"^mtp\.",),
    )
