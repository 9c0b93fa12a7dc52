"""Qwen3-Next (``qwen3_next``) and Qwen3.5 / 3.6 MoE (``qwen3_5_moe``, its text model ``qwen3_5_moe_text``),
transformers 5.24 ``modeling_qwen3_next`` / ``modeling_qwen3_5_moe``: hybrids of Gated DeltaNet and gated full
attention.

- ``layer_types``: "linear_attention" (Gated DeltaNet: short causal convolution, gated delta rule over a
  per-sequence matrix state, gated RMSNorm; layers/linear_attention.py) or "full_attention" (q_proj also yields a
  per-head output gate, per-head q/k RMSNorm, rotary on the first ``partial_rotary_factor`` (0.25) of each head);
  default: every ``full_attention_interval``-th (4th) layer full.
- RMSNorms (decoder, final, q/k) compute ``x_normed * (1 + weight)`` in float32 (``norm_offset``).
- MoE: softmax top-k router (Qwen3-Next: renormalised if ``norm_topk_prob``; Qwen3.5: always), plus a shared
  expert scaled by ``sigmoid(shared_expert_gate(x))``. Qwen3-Next picks MoE layers by ``mlp_only_layers`` /
  ``decoder_sparse_step``; Qwen3.5's layers are all MoE.
- Qwen3-Next's GDN projects q/k/v/z with one ``in_proj_qkvz`` and b/a with ``in_proj_ba`` (grouped per key head);
  Qwen3.5 has ``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a``.
- A ``qwen3_5_moe`` checkpoint with a vision tower serves its text model: ``text_config`` is read, its weights
  are ``model.language_model.*`` (the tower ``model.visual.*`` is ignored, as are the MTP layers ``mtp.*``). Text
  positions are the same on mrope's three axes, so the rotary is the plain one.
"""
from __future__ import annotations

from .common import UnsupportedModelError, common, num_experts, top_k
from .qwen_moe import moe_layers


def _layer_types(raw: dict, arch: str, n: int) -> tuple[str, ...]:
    types = raw.get("layer_types")
    if types is None:
        interval = int(raw.get("full_attention_interval", 4) or 4)
        types = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(n)]
    if len(types) != n or set(types) - {"linear_attention", "full_attention"}:
        raise UnsupportedModelError(f"{arch}: layer_types {types} not understood (linear_attention / full_attention)")
    return tuple("attention" if t == "full_attention" else "linear_attention" for t in types)


def _hybrid(raw: dict, arch: str, E_default: int, K_default: int, projections: str) -> dict:
    raw = {**raw, "num_experts_per_tok": raw.get("num_experts_per_tok", K_default), "head_dim": raw.get("head_dim", 256),
           "num_key_value_heads": raw.get("num_key_value_heads", 2)}
    c = common(raw, arch, default_theta=1e4, rope_types=("default", "linear", "yarn"), partial_rotary=0.25)
    n, E, K = c["num_hidden_layers"], num_experts(raw, E_default), top_k(raw, arch)
    bias = bool(raw.get("attention_bias", False))
    c["attention"].update(qkv_bias=bias, o_bias=bias, qk_norm="head", output_gate=True, norm_offset=True)
    linear = dict(
        num_k_heads=int(raw.get("linear_num_key_heads", 16)), num_v_heads=int(raw.get("linear_num_value_heads", 32)),
        head_k_dim=int(raw.get("linear_key_head_dim", 128)), head_v_dim=int(raw.get("linear_value_head_dim", 128)),
        conv_kernel=int(raw.get("linear_conv_kernel_dim", 4)), projections=projections,
    )
    if linear["num_v_heads"] % linear["num_k_heads"]:
        raise UnsupportedModelError(f"{arch}: linear_num_value_heads must be a multiple of linear_num_key_heads")
    shared = int(raw.get("shared_expert_intermediate_size", 512) or 0)
    return dict(
        c,
        layer_types=_layer_types(raw, arch, n),
        linear_attention=linear,
        norm_offset=True,
        router=dict(kind="softmax_topk", num_experts=E, top_k=K, norm_topk_prob=True),
        experts=dict(num_experts=E, intermediate_size=int(raw.get("moe_intermediate_size", 512)),
                     shared_intermediate_size=shared, shared_gate=shared > 0),
        ignored_keys=(r"^mtp\.",),
    )


def parse_qwen3_next(raw: dict) -> dict:
    out = _hybrid(raw, "qwen3_next", E_default=512, K_default=10, projections="qkvz")
    n, E = out["num_hidden_layers"], out["router"]["num_experts"]
    out["router"]["norm_topk_prob"] = bool(raw.get("norm_topk_prob", True))
    return dict(out, moe_layers=moe_layers(raw, n, E), intermediate_size=int(raw.get("intermediate_size", 5632)))


def parse_qwen3_5_moe_text(raw: dict, arch: str = "qwen3_5_moe_text") -> dict:
    out = _hybrid(raw, arch, E_default=256, K_default=8, projections="split")
    return dict(out, moe_layers=tuple(range(out["num_hidden_layers"])))


def parse_qwen3_5_moe(raw: dict) -> dict:
    """The multimodal config: its ``text_config`` (a text-only config.json is read as it is), the weights under
    ``model.language_model.``."""
    if raw.get("text_config") is None:
        return parse_qwen3_5_moe_text(raw, "qwen3_5_moe")
    text = dict(raw["text_config"])
    for key in ("tie_word_embeddings", "dtype", "torch_dtype", "quantization_config"):  # the top level's, as the multimodal model reads
        if key in raw and (key == "tie_word_embeddings" or key not in text):
            text[key] = raw[key]
    out = parse_qwen3_5_moe_text(text, "qwen3_5_moe")
    return dict(out, key_prefixes=(("model.", "model.language_model."),),
                ignored_keys=out["ignored_keys"] + (r"^model\.visual\.",))
