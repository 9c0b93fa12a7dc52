"""GPT-OSS (transformers 5.24 ``modeling_gpt_oss``): router with bias, top-k then softmax in the model dtype,
biased experts with interleaved gate/up and clamped SwiGLU (MXFP4 on the Hub), attention sinks, sliding /
full layers, yarn."""
from __future__ import annotations

from .common import UnsupportedModelError, common, num_experts, top_k

DEFAULT_ROPE = {  # GptOssConfig when config.json has neither rope_parameters nor rope_scaling
    "rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
    "original_max_position_embeddings": 4096,
}


def parse(raw: dict) -> dict:
    quant = (raw.get("quantization_config") or {}).get("quant_method")
    # GptOssConfig defaults for keys a hand-written config.json may leave out
    raw = {**raw, "head_dim": raw.get("head_dim") or 64, "num_key_value_heads": raw.get("num_key_value_heads", 8),
           "num_experts_per_tok": raw.get("num_experts_per_tok", 4)}
    c = common(raw, "gpt_oss", default_theta=150000.0, rope_types=("default", "linear", "yarn"),
               default_rope=DEFAULT_ROPE, allow_quant=("mxfp4", "fp8"), eps=1e-5)
    n, E, K = c["num_hidden_layers"], num_experts(raw, 128), top_k(raw, "gpt_oss")
    window = raw.get("sliding_window", 128)
    layer_types = raw.get("layer_types") or [
        "sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n)
    ]
    if len(layer_types) != n or set(layer_types) - {"sliding_attention", "full_attention"}:
        raise UnsupportedModelError(f"gpt_oss: layer_types {layer_types} not understood")
    bias = bool(raw.get("attention_bias", True))
    c["attention"].update(
        qkv_bias=bias,
        o_bias=bias,
        sliding_windows=tuple(
            int(window) if window and layer_types[i] == "sliding_attention" else None for i in range(n)
        ),
        sinks=True,
    )
    return dict(
        c,
        moe_layers=tuple(range(n)),
        norm_fp32_weight=True,
        router=dict(kind="gpt_oss", num_experts=E, top_k=K, bias=True),
        experts=dict(
            num_experts=E, intermediate_size=int(raw.get("intermediate_size", 2880)), block="gpt_oss",
            swiglu_limit=float(raw.get("swiglu_limit", 7.0)), swiglu_alpha=float(raw.get("swiglu_alpha", 1.702)),
            quant="mxfp4" if quant == "mxfp4" else "none",
        ),
    )
