"""Hugging Face config.json -> one normalised MoE config for every architecture.

No torch import here: the CLI and the frontend use this module to compute
metadata (which layers are MoE, expert count, top-k) without loading PyTorch.

Each supported ``model_type`` has a parser that reads that architecture's keys
(with the defaults of transformers 5.24's config class) and fills the same
``MoEConfig``. Architecture differences the model needs are carried as plain
fields (``router``, ``qk_norm``, ``router_weights_fp32``, shared expert sizes,
per-layer sliding windows, ...) so that model.py never branches on the name.

Adding an architecture: write ``_parse_<type>``, register it in ``_PARSERS``, add
its router to routing.py and its key layout to checkpoint.py. DeepSeek-V2/V3 (MLA
attention, grouped routers, dense first layers) and GPT-OSS (sinks, alternating
sliding windows, biased clamped experts, MXFP4) are described by the fields under
"attention", "router" and "experts" below.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Callable


class UnsupportedModelError(ValueError):
    """The checkpoint's architecture or one of its options is not supported."""


DTYPE_ALIASES = {  # accepted spellings -> canonical name
    "float32": "float32", "fp32": "float32", "float": "float32",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
    "float16": "float16", "fp16": "float16", "half": "float16",
}


@dataclass(frozen=True)
class MoEConfig:
    architecture: str  # HF model_type, e.g. "mixtral"
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    num_experts: int
    num_experts_per_tok: int
    moe_layers: tuple[int, ...]  # global indices of MoE layers (dense layers excluded)
    max_position_embeddings: int
    torch_dtype: str  # checkpoint dtype from config ("bfloat16", "float32", ...)
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    tie_word_embeddings: bool

    # --- normalisation / positions
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_type: str = "default"  # "default" | "linear" | "yarn"
    rope_factor: float = 1.0  # linear / yarn scaling factor
    hidden_act: str = "silu"
    rope_dim: int = 0  # rotary dims per head; 0 = head_dim (MLA: qk_rope_head_dim)
    # How q/k are rotated (all three follow HF op by op):
    #   "half": rotate_half on cos/sin tables in the model dtype (Llama style; Mixtral, Qwen, OLMoE, GPT-OSS);
    #   "interleave": pairs (x0, x1), (x2, x3) rotated on even/odd slices, output de-interleaved (DeepSeek-V3);
    #   "complex": pairs as complex numbers in float32 (DeepSeek-V2's view_as_complex).
    rope_style: str = "half"
    rope_attention_factor: float = 1.0  # yarn: cos/sin are multiplied by this (HF attention_scaling)
    yarn_low: float = 0.0  # yarn correction range (rotary dims), computed as HF's find_correction_range
    yarn_high: float = 0.0

    # --- attention
    qkv_bias: bool = False  # bias on q/k/v projections
    o_bias: bool = False  # bias on the output projection
    qk_norm: str = "none"  # "none" | "head" (RMSNorm per head, Qwen3) | "full" (over all heads, OLMoE)
    clip_qkv: float | None = None  # OLMoE: clamp q, k, v to [-clip, clip]
    sliding_windows: tuple[int | None, ...] = ()  # per layer; None = full attention
    attention: str = "gqa"  # "gqa" (grouped-query) | "mla" (DeepSeek multi-head latent attention)
    attention_scale: float = 0.0  # softmax scale; 0 = head_dim ** -0.5
    attention_sinks: bool = False  # GPT-OSS: a learned per-head logit joins each softmax
    # MLA (DeepSeek-V2/V3); head_dim is then qk_nope_head_dim + qk_rope_head_dim
    q_lora_rank: int | None = None  # None: q_proj; else q_a_proj -> q_a_layernorm -> q_b_proj
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    norm_fp32_weight: bool = False  # GPT-OSS RMSNorm: (weight * x_fp32).to(dtype) instead of weight * x.to(dtype)

    # --- MLPs
    moe_intermediate_size: int = 0  # per routed expert
    intermediate_size: int = 0  # dense (non-MoE) layers' MLP
    shared_expert_intermediate_size: int = 0  # 0 = no shared expert
    shared_expert_gate: bool = False  # Qwen2-MoE: sigmoid(Linear(H, 1)) scales the shared expert
    mlp_bias: bool = False  # DeepSeek-V2 mlp_bias: biases on dense / shared-expert MLPs
    # MoE block layout (module names as HF): "default" (mlp.gate, mlp.experts, mlp.shared_expert[_gate]),
    # "deepseek" (mlp.gate, mlp.experts, mlp.shared_experts), "gpt_oss" (mlp.router, mlp.experts with biases,
    # transposed [E, H, 2I] / [E, I, H], interleaved gate/up, clamped SwiGLU)
    moe_block: str = "default"
    swiglu_limit: float = 7.0  # GPT-OSS clamp
    swiglu_alpha: float = 1.702  # GPT-OSS sigmoid gain
    expert_quant: str = "none"  # "none" | "mxfp4" (GPT-OSS *_blocks/*_scales, dequantised at load)

    # --- router
    router: str = "softmax_topk"  # routing.py key
    norm_topk_prob: bool = True  # renormalise the top-k probabilities to sum to 1
    router_weights_fp32: bool = False  # Mixtral keeps top-k weights fp32; Qwen/OLMoE cast to the logits' dtype
    router_bias: bool = False  # GPT-OSS router has a bias
    router_fp32: bool = False  # DeepSeek: gate weight (and e_score_correction_bias) kept fp32, logits in fp32
    topk_method: str = "greedy"  # DeepSeek-V2: "greedy" | "group_limited_greedy"; DeepSeek-V3: "noaux_tc"
    n_group: int = 1  # DeepSeek expert groups
    topk_group: int = 1  # groups kept per token
    routed_scaling_factor: float = 1.0  # DeepSeek: routed-expert weights multiplied by this

    @property
    def dense_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_hidden_layers) if i not in set(self.moe_layers))

    @property
    def routed_experts_dtype(self) -> str:
        return "uint8" if self.num_experts <= 256 else "uint16"

    def metadata(self) -> dict:
        """What a client needs to interpret routed experts arrays (JSON-able)."""
        return {
            "architecture": self.architecture,
            "num_hidden_layers": self.num_hidden_layers,
            "moe_layers": list(self.moe_layers),
            "num_experts": self.num_experts,
            "num_experts_per_tok": self.num_experts_per_tok,
            "routed_experts_dtype": self.routed_experts_dtype,
        }

    def to_dict(self) -> dict:
        return asdict(self)


# ----------------------------------------------------------------------------- helpers


def _req(raw: dict, key: str, arch: str) -> Any:
    if raw.get(key) is None:
        raise UnsupportedModelError(f"{arch} config.json lacks required key {key!r}")
    return raw[key]


def _int_list(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _dtype(raw: dict) -> str:
    value = raw.get("dtype", raw.get("torch_dtype")) or "float32"  # vLLM: no dtype -> float32
    name = str(value).removeprefix("torch.")
    if name not in DTYPE_ALIASES:
        raise UnsupportedModelError(f"unsupported checkpoint dtype {value!r}; supported: float32, bfloat16, float16")
    return DTYPE_ALIASES[name]


def _yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def _rope(
    raw: dict,
    default_theta: float,
    arch: str,
    dim: int,
    allowed: tuple[str, ...] = ("default", "linear"),
    default_params: dict | None = None,
) -> dict:
    """rope_parameters (transformers v5) or legacy rope_theta + rope_scaling; ``dim`` = rotary dims per head.

    yarn follows transformers' ``_compute_yarn_parameters`` (factor, attention_factor from mscale /
    mscale_all_dim, beta_fast / beta_slow, truncate, original_max_position_embeddings)."""
    params = _rope_params(raw) or dict(default_params or {})
    theta = params.get("rope_theta", raw.get("rope_theta", default_theta))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in allowed:
        raise UnsupportedModelError(
            f"{arch}: rope type {rope_type!r} is not supported (supported: {', '.join(allowed)})"
        )
    prf = params.get("partial_rotary_factor", raw.get("partial_rotary_factor"))
    if prf not in (None, 1, 1.0):
        raise UnsupportedModelError(f"{arch}: partial_rotary_factor={prf} is not supported")
    out = {"rope_theta": float(theta), "rope_type": rope_type, "rope_factor": 1.0}
    if rope_type == "linear":
        out["rope_factor"] = float(params.get("factor", 1.0))
    elif rope_type == "yarn":
        base = float(theta)
        # HF: a top-level original_max_position_embeddings wins, else the dict's, else max_position_embeddings
        original_max = raw.get("original_max_position_embeddings") or params.get("original_max_position_embeddings")
        original_max = original_max or raw.get("max_position_embeddings") or 4096
        factor = params.get("factor")
        if factor is None:
            factor = (raw.get("max_position_embeddings") or 4096) / original_max
        attention_factor = params.get("attention_factor")
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        if attention_factor is None:
            if mscale and mscale_all_dim:
                attention_factor = float(_yarn_get_mscale(factor, mscale) / _yarn_get_mscale(factor, mscale_all_dim))
            else:
                attention_factor = _yarn_get_mscale(factor)
        beta_fast = params.get("beta_fast") or 32
        beta_slow = params.get("beta_slow") or 1

        def correction_dim(num_rotations):
            return (dim * math.log(original_max / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

        low, high = correction_dim(beta_fast), correction_dim(beta_slow)
        if params.get("truncate", True):
            low, high = math.floor(low), math.ceil(high)
        out.update(
            rope_factor=float(factor),
            rope_attention_factor=float(attention_factor),
            yarn_low=float(max(low, 0)),
            yarn_high=float(min(high, dim - 1)),
        )
    return out


def _rope_params(raw: dict) -> dict:
    return dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})


def _common(
    raw: dict,
    arch: str,
    default_theta: float,
    head_dim_key: bool = True,
    rope_dim: int | None = None,
    rope_types: tuple[str, ...] = ("default", "linear"),
    default_rope: dict | None = None,
    allow_quant: tuple[str, ...] = (),
) -> dict:
    hidden = int(_req(raw, "hidden_size", arch))
    heads = int(_req(raw, "num_attention_heads", arch))
    kv_heads = raw.get("num_key_value_heads") or heads
    head_dim = (raw.get("head_dim") if head_dim_key else None) or hidden // heads
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise UnsupportedModelError(f"{arch}: hidden_act {act!r} is not supported (supported: silu)")
    if raw.get("quantization_config"):
        method = raw["quantization_config"].get("quant_method", "?")
        if method not in allow_quant:
            raise UnsupportedModelError(f"{arch}: quantized checkpoints ({method}) are not supported")
    layers = int(_req(raw, "num_hidden_layers", arch))
    rope = _rope(raw, default_theta, arch, int(rope_dim or head_dim), rope_types, default_rope)
    return dict(
        architecture=arch,
        vocab_size=int(_req(raw, "vocab_size", arch)),
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=int(kv_heads),
        head_dim=int(head_dim),
        num_experts_per_tok=int(_req(raw, "num_experts_per_tok", arch)),
        max_position_embeddings=int(raw.get("max_position_embeddings") or 4096),
        torch_dtype=_dtype(raw),
        eos_token_ids=_int_list(raw.get("eos_token_id")),
        bos_token_id=raw.get("bos_token_id"),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        hidden_act=act,
        sliding_windows=(None,) * layers,
        **rope,
    )


def _num_experts(raw: dict, default: int) -> int:
    """Expert count: key names differ per arch and transformers version (attribute_map aliases)."""
    for key in ("num_experts", "num_local_experts", "n_routed_experts"):
        if raw.get(key) is not None:
            return int(raw[key])
    return default


def _qwen_moe_layers(raw: dict, num_layers: int, num_experts: int) -> tuple[int, ...]:
    """HF Qwen2/3-MoE: not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0."""
    mlp_only = set(raw.get("mlp_only_layers") or [])
    step = int(raw.get("decoder_sparse_step", 1) or 1)
    if num_experts <= 0:
        return ()
    return tuple(i for i in range(num_layers) if i not in mlp_only and (i + 1) % step == 0)


# ----------------------------------------------------------------------------- per architecture


def _parse_mixtral(raw: dict) -> dict:
    c = _common(raw, "mixtral", default_theta=1e6)
    window = raw.get("sliding_window")  # HF: one window for every layer when set
    c.update(
        num_experts=_num_experts(raw, 8),
        moe_layers=tuple(range(c["num_hidden_layers"])),
        moe_intermediate_size=int(raw.get("intermediate_size", 14336)),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-5)),
        sliding_windows=(int(window) if window else None,) * c["num_hidden_layers"],
        norm_topk_prob=True,
        router_weights_fp32=True,
    )
    return c


def _parse_qwen2_moe(raw: dict) -> dict:
    c = _common(raw, "qwen2_moe", default_theta=1e4)
    n = c["num_hidden_layers"]
    num_experts = _num_experts(raw, 60)
    # HF: sliding_window applies only with use_sliding_window, to layers whose layer_types entry says so
    window = raw.get("sliding_window") if raw.get("use_sliding_window", False) else None
    layer_types = raw.get("layer_types") or [
        "sliding_attention" if (i + 1) % 2 and i < raw.get("max_window_layers", 28) and window else "full_attention"
        for i in range(n)
    ]
    shared = int(raw.get("shared_expert_intermediate_size", 5632) or 0)
    c.update(
        num_experts=num_experts,
        moe_layers=_qwen_moe_layers(raw, n, num_experts),
        moe_intermediate_size=int(raw.get("moe_intermediate_size", 1408)),
        intermediate_size=int(raw.get("intermediate_size", 5632)),
        shared_expert_intermediate_size=shared,
        shared_expert_gate=shared > 0,
        qkv_bias=bool(raw.get("qkv_bias", True)),
        sliding_windows=tuple(
            int(window) if window and layer_types[i] == "sliding_attention" else None for i in range(n)
        ),
        norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
    )
    return c


def _parse_qwen3_moe(raw: dict) -> dict:
    c = _common(raw, "qwen3_moe", default_theta=1e4)
    n = c["num_hidden_layers"]
    num_experts = _num_experts(raw, 128)
    window = raw.get("sliding_window") if raw.get("use_sliding_window", False) else None
    bias = bool(raw.get("attention_bias", False))
    c.update(
        num_experts=num_experts,
        moe_layers=_qwen_moe_layers(raw, n, num_experts),
        moe_intermediate_size=int(raw.get("moe_intermediate_size", 768)),
        intermediate_size=int(raw.get("intermediate_size", 6144)),
        qkv_bias=bias,
        o_bias=bias,
        qk_norm="head",
        sliding_windows=(int(window) if window else None,) * n,
        norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
    )
    return c


def _parse_olmoe(raw: dict) -> dict:
    c = _common(raw, "olmoe", default_theta=1e4)
    if c["head_dim"] * c["num_attention_heads"] != c["hidden_size"]:
        raise UnsupportedModelError("olmoe: head_dim * num_attention_heads must equal hidden_size (HF q_norm width)")
    bias = bool(raw.get("attention_bias", False))
    clip = raw.get("clip_qkv")
    c.update(
        num_experts=_num_experts(raw, 64),
        moe_layers=tuple(range(c["num_hidden_layers"])),
        moe_intermediate_size=int(raw.get("intermediate_size", 2048)),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-5)),
        qkv_bias=bias,
        o_bias=bias,
        qk_norm="full",
        clip_qkv=float(clip) if clip is not None else None,
        norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
    )
    return c


def _parse_deepseek(raw: dict, arch: str) -> dict:
    """DeepSeek-V2 / V3 (transformers 5.24 ``modeling_deepseek_v2/v3``): MLA attention, first_k_dense_replace
    dense layers, shared experts, fp32 router (V2 softmax greedy / group_limited_greedy, V3 sigmoid with
    e_score_correction_bias and groups)."""
    v3 = arch == "deepseek_v3"
    defaults = (  # the transformers config classes' defaults
        dict(n_routed_experts=256, n_shared_experts=1, first_k_dense_replace=3, n_group=8, topk_group=4,
             norm_topk_prob=True, routed_scaling_factor=2.5, q_lora_rank=1536, moe_intermediate_size=2048,
             intermediate_size=18432, num_experts_per_tok=8)
        if v3 else
        dict(n_routed_experts=64, n_shared_experts=2, first_k_dense_replace=0, n_group=None, topk_group=None,
             norm_topk_prob=False, routed_scaling_factor=1.0, q_lora_rank=1536, moe_intermediate_size=1407,
             intermediate_size=11008, num_experts_per_tok=None)
    )

    def get(key):
        return raw[key] if key in raw else defaults[key]

    raw = {**raw, "num_experts_per_tok": raw.get("num_experts_per_tok", defaults["num_experts_per_tok"])}
    nope = int(raw.get("qk_nope_head_dim", 128))
    rope_dim = int(raw.get("qk_rope_head_dim", 64))
    v_dim = int(raw.get("v_head_dim") or 128)
    c = _common(raw, arch, default_theta=1e4, head_dim_key=False, rope_dim=rope_dim,
                rope_types=("default", "linear", "yarn"))
    params = _rope_params(raw)
    n = c["num_hidden_layers"]
    heads = c["num_attention_heads"]
    if raw.get("moe_layer_freq", 1) not in (None, 1):
        raise UnsupportedModelError(f"{arch}: moe_layer_freq={raw['moe_layer_freq']} is not supported (HF ignores it)")
    num_experts = _num_experts(raw, defaults["n_routed_experts"])
    first_dense = int(get("first_k_dense_replace") or 0)
    n_group, topk_group = get("n_group"), get("topk_group")
    # V3 always routes "noaux_tc" (bias-corrected grouped top-k; HF ignores the key), V2 greedy or grouped
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
    else:
        n_group, topk_group = 1, 1
    scale = (nope + rope_dim) ** (-0.5)
    if c["rope_type"] != "default":  # HF yarn_apply_mscale: softmax scale * mscale(factor, mscale_all_dim)^2
        mscale_all_dim = params.get("mscale_all_dim", 0)
        if mscale_all_dim:
            mscale = _yarn_get_mscale(params.get("factor") or c["rope_factor"], mscale_all_dim)
            scale = scale * mscale * mscale
    q_lora = get("q_lora_rank")
    bias = bool(raw.get("attention_bias", False))
    c.update(
        num_key_value_heads=heads,  # MLA expands the latent into one key/value head per query head
        head_dim=nope + rope_dim,
        num_experts=num_experts,
        moe_layers=tuple(range(first_dense, n)),
        moe_intermediate_size=int(get("moe_intermediate_size")),
        intermediate_size=int(get("intermediate_size")),
        shared_expert_intermediate_size=int(get("moe_intermediate_size")) * int(get("n_shared_experts") or 0),
        mlp_bias=bool(raw.get("mlp_bias", False)) and not v3,  # V3's MLP has no bias option
        qkv_bias=bias,
        o_bias=bias,
        attention="mla",
        attention_scale=scale,
        q_lora_rank=int(q_lora) if q_lora else None,
        kv_lora_rank=int(raw.get("kv_lora_rank", 512)),
        qk_nope_head_dim=nope,
        qk_rope_head_dim=rope_dim,
        v_head_dim=v_dim,
        rope_dim=rope_dim,
        rope_style=("interleave" if raw.get("rope_interleave", True) else "half") if v3 else "complex",
        moe_block="deepseek",
        router="deepseek_v3" if v3 else "deepseek_v2",
        router_fp32=True,
        router_weights_fp32=True,
        topk_method=topk_method,
        n_group=n_group,
        topk_group=topk_group,
        routed_scaling_factor=float(get("routed_scaling_factor")),
        norm_topk_prob=bool(get("norm_topk_prob")) if v3 else False,  # HF V2 ignores norm_topk_prob
    )
    return c


def _parse_deepseek_v2(raw: dict) -> dict:
    return _parse_deepseek(raw, "deepseek_v2")


def _parse_deepseek_v3(raw: dict) -> dict:
    return _parse_deepseek(raw, "deepseek_v3")


_GPT_OSS_DEFAULT_ROPE = {  # GptOssConfig when config.json has neither rope_parameters nor rope_scaling
    "rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
    "original_max_position_embeddings": 4096,
}


def _parse_gpt_oss(raw: dict) -> dict:
    """GPT-OSS (transformers 5.24 ``modeling_gpt_oss``): router with bias, top-k then softmax in the model dtype,
    biased experts with interleaved gate/up and clamped SwiGLU, attention sinks, sliding / full layers, yarn."""
    quant = (raw.get("quantization_config") or {}).get("quant_method")
    # GptOssConfig defaults for keys a hand-written config.json may leave out
    raw = {**raw, "head_dim": raw.get("head_dim") or 64, "num_key_value_heads": raw.get("num_key_value_heads", 8),
           "num_experts_per_tok": raw.get("num_experts_per_tok", 4)}
    c = _common(raw, "gpt_oss", default_theta=150000.0, rope_types=("default", "linear", "yarn"),
                default_rope=_GPT_OSS_DEFAULT_ROPE, allow_quant=("mxfp4",))
    n = c["num_hidden_layers"]
    window = raw.get("sliding_window", 128)
    layer_types = raw.get("layer_types") or [
        "sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n)
    ]
    if len(layer_types) != n or set(layer_types) - {"sliding_attention", "full_attention"}:
        raise UnsupportedModelError(f"gpt_oss: layer_types {layer_types} not understood")
    bias = bool(raw.get("attention_bias", True))
    c.update(
        num_experts=_num_experts(raw, 128),
        moe_layers=tuple(range(n)),
        moe_intermediate_size=int(raw.get("intermediate_size", 2880)),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-5)),
        qkv_bias=bias,
        o_bias=bias,
        sliding_windows=tuple(
            int(window) if window and layer_types[i] == "sliding_attention" else None for i in range(n)
        ),
        attention_sinks=True,
        norm_fp32_weight=True,
        moe_block="gpt_oss",
        router="gpt_oss",
        router_bias=True,
        swiglu_limit=float(raw.get("swiglu_limit", 7.0)),
        swiglu_alpha=float(raw.get("swiglu_alpha", 1.702)),
        expert_quant="mxfp4" if quant == "mxfp4" else "none",
    )
    return c


_PARSERS: dict[str, Callable[[dict], dict]] = {
    "deepseek_v2": _parse_deepseek_v2,
    "deepseek_v3": _parse_deepseek_v3,
    "gpt_oss": _parse_gpt_oss,
    "mixtral": _parse_mixtral,
    "olmoe": _parse_olmoe,
    "qwen2_moe": _parse_qwen2_moe,
    "qwen3_moe": _parse_qwen3_moe,
}
SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(sorted(_PARSERS))

# Dense model types people point the server at by mistake; named so the error can say "not MoE".
_DENSE_TYPES = {
    "llama", "mistral", "qwen2", "qwen3", "olmo", "olmo2", "gemma", "gemma2", "gemma3", "gemma3_text",
    "phi", "phi3", "gpt2", "gpt_neox", "falcon", "starcoder2", "deepseek", "granite", "cohere", "opt",
}


def config_from_dict(raw: dict) -> MoEConfig:
    """Normalise a parsed config.json (dict) into a MoEConfig."""
    supported = ", ".join(SUPPORTED_ARCHITECTURES)
    model_type = raw.get("model_type")
    if not model_type:
        raise UnsupportedModelError(f"config.json has no model_type; supported MoE architectures: {supported}")
    if model_type not in _PARSERS:
        if model_type in _DENSE_TYPES:
            raise UnsupportedModelError(
                f"model_type {model_type!r} is not a Mixture-of-Experts model; supported MoE architectures: {supported}"
            )
        raise UnsupportedModelError(f"model_type {model_type!r} is not supported; supported MoE architectures: {supported}")
    fields = _PARSERS[model_type](raw)
    if fields["num_experts"] <= 0 or not fields["moe_layers"]:
        raise UnsupportedModelError(
            f"{model_type} config has no MoE layers (num_experts={fields['num_experts']}); "
            f"this is not a Mixture-of-Experts model"
        )
    if not 0 < fields["num_experts_per_tok"] <= fields["num_experts"]:
        raise UnsupportedModelError(
            f"{model_type}: num_experts_per_tok={fields['num_experts_per_tok']} must be in 1..{fields['num_experts']}"
        )
    if fields["num_attention_heads"] % fields["num_key_value_heads"]:
        raise UnsupportedModelError(f"{model_type}: num_attention_heads must be a multiple of num_key_value_heads")
    if fields["num_experts"] > 65535:
        raise UnsupportedModelError(f"{model_type}: {fields['num_experts']} experts do not fit routed_experts uint16")
    return MoEConfig(**fields)


def load_config(path: str | os.PathLike) -> MoEConfig:
    """Read ``<path>/config.json`` (and generation_config.json's extra eos ids)."""
    root = Path(path)
    if not root.is_dir():
        raise FileNotFoundError(f"checkpoint directory not found: {root}")
    cfg_file = root / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"no config.json in checkpoint directory {root}")
    try:
        raw = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise UnsupportedModelError(f"{cfg_file} is not valid JSON: {e}") from None
    cfg = config_from_dict(raw)
    # generate() stops at generation_config's eos ids too (chat models often list several there).
    gen_file = root / "generation_config.json"
    if gen_file.is_file():
        try:
            gen_eos = _int_list(json.loads(gen_file.read_text()).get("eos_token_id"))
        except (json.JSONDecodeError, TypeError, ValueError):
            gen_eos = ()
        merged = tuple(dict.fromkeys(cfg.eos_token_ids + gen_eos))
        if merged != cfg.eos_token_ids:
            cfg = replace(cfg, eos_token_ids=merged)
    return cfg
