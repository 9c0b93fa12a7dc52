"""Helpers the per-architecture parsers share: required keys, dtype, expert count, rope keys, the fields
every architecture reads. No torch import (the CLI and the frontend parse configs without PyTorch)."""
from __future__ import annotations

from typing import Any


class UnsupportedModelError(ValueError):
    """The checkpoint's architecture or one of its options is not supported."""


DTYPE_ALIASES = {  # accepted spellings -> canonical name
    "float32": "float32", "fp32": "float32", "float": "float32",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
    "float16": "float16", "fp16": "float16", "half": "float16",
}


def req(raw: dict, key: str, arch: str) -> Any:
    if raw.get(key) is None:
        raise UnsupportedModelError(f"{arch} config.json lacks required key {key!r}")
    return raw[key]


def int_list(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def checkpoint_dtype(raw: dict) -> str:
    value = raw.get("dtype", raw.get("torch_dtype")) or "float32"  # vLLM: no dtype -> float32
    name = str(value).removeprefix("torch.")
    if name not in DTYPE_ALIASES:
        raise UnsupportedModelError(f"unsupported checkpoint dtype {value!r}; supported: float32, bfloat16, float16")
    return DTYPE_ALIASES[name]


def num_experts(raw: dict, default: int) -> int:
    """Expert count: key names differ per arch and transformers version (attribute_map aliases)."""
    for key in ("num_experts", "num_local_experts", "n_routed_experts"):
        if raw.get(key) is not None:
            return int(raw[key])
    return default


def top_k(raw: dict, arch: str) -> int:
    return int(req(raw, "num_experts_per_tok", arch))


def rope_params(raw: dict) -> dict:
    """rope_parameters (transformers v5) or the legacy rope_scaling dict."""
    return dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})


def rope(
    raw: dict,
    default_theta: float,
    arch: str,
    dim: int,
    allowed: tuple[str, ...] = ("default", "linear"),
    default_params: dict | None = None,
    style: str = "half",
    partial_rotary: float | None = None,
) -> dict:
    """``RopeSpec`` fields from rope_parameters (transformers v5) or legacy rope_theta + rope_scaling; ``dim`` =
    head dims the rotary could cover. yarn keys get the defaults of transformers' ``_compute_yarn_parameters``
    (layers/rotary.py derives the correction range and attention factor from them). ``partial_rotary``: the
    family rotates only the first ``int(dim * partial_rotary_factor)`` dims (GLM-4.5, Qwen3-Next; the factor from
    rope_parameters or the top level, else this default); None: a factor other than 1 is refused."""
    params = rope_params(raw) or dict(default_params or {})
    theta = params.get("rope_theta", raw.get("rope_theta", default_theta))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in allowed:
        raise UnsupportedModelError(
            f"{arch}: rope type {rope_type!r} is not supported (supported: {', '.join(allowed)})"
        )
    prf = params.get("partial_rotary_factor", raw.get("partial_rotary_factor"))
    if partial_rotary is not None:
        dim = int(dim * float(prf if prf is not None else partial_rotary))  # HF: int(head_dim * factor)
        if dim <= 0 or dim % 2:
            raise UnsupportedModelError(f"{arch}: partial_rotary_factor={prf} gives {dim} rotary dims (need even > 0)")
    elif prf not in (None, 1, 1.0):
        raise UnsupportedModelError(f"{arch}: partial_rotary_factor={prf} is not supported")
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    out = dict(
        dim=int(dim), theta=float(theta), type=rope_type, factor=1.0, style=style,
        mscale=None if mscale is None else float(mscale),
        mscale_all_dim=None if mscale_all_dim is None else float(mscale_all_dim),
    )
    if rope_type == "linear":
        out["factor"] = float(params.get("factor", 1.0))
    elif rope_type == "yarn":
        # HF: a top-level original_max_position_embeddings wins, else the dict's, else max_position_embeddings
        original_max = raw.get("original_max_position_embeddings") or params.get("original_max_position_embeddings")
        original_max = original_max or raw.get("max_position_embeddings") or 4096
        factor = params.get("factor")
        if factor is None:
            factor = (raw.get("max_position_embeddings") or 4096) / original_max
        attention_factor = params.get("attention_factor")
        out.update(
            factor=float(factor),
            original_max_position_embeddings=float(original_max),
            attention_factor=None if attention_factor is None else float(attention_factor),
            beta_fast=float(params.get("beta_fast") or 32),
            beta_slow=float(params.get("beta_slow") or 1),
            truncate=bool(params.get("truncate", True)),
        )
    return out


# quantization_config values the loader reads (anything else is refused with this list)
FP8_SUPPORTED = ("quant_method 'fp8' (e4m3 weights with weight_scale_inv per weight_block_size block, or per "
                 "tensor when weight_block_size is null; activation_scheme 'dynamic'; scale_fmt 'float')")


def quantization(raw: dict, arch: str, allow: tuple[str, ...]) -> dict:
    """``QuantSpec`` fields from config.json's ``quantization_config`` (none: unquantized). FP8 as DeepSeek-V3,
    Qwen3-*-FP8 and GLM-*-FP8 publish it (transformers' ``FineGrainedFP8Config``); MXFP4 where ``allow`` says so
    (GPT-OSS). A method, activation scheme or scale format the loader cannot read is refused, naming what is
    supported, rather than loaded wrong."""
    qc = raw.get("quantization_config")
    if not qc:
        return dict(method="none")
    supported = "; ".join(([FP8_SUPPORTED] if "fp8" in allow else [])
                          + (["quant_method 'mxfp4' (*_blocks / *_scales experts)"] if "mxfp4" in allow else []))
    if not isinstance(qc, dict):
        raise UnsupportedModelError(f"{arch}: quantization_config must be an object; supported: {supported}")
    method = str(qc.get("quant_method", "?"))
    if method not in allow:
        raise UnsupportedModelError(
            f"{arch}: quantized checkpoints ({method}) are not supported; supported: {supported or 'none'}")
    if method == "mxfp4":
        return dict(method="mxfp4")
    problems = []
    if str(qc.get("activation_scheme", "dynamic")).lower() != "dynamic":
        problems.append(f"activation_scheme {qc.get('activation_scheme')!r} (static activation scales)")
    if str(qc.get("fmt", "e4m3")).lower() != "e4m3":
        problems.append(f"fmt {qc.get('fmt')!r}")
    if str(qc.get("scale_fmt", "float") or "float") != "float":
        problems.append(f"scale_fmt {qc.get('scale_fmt')!r}")
    if str(qc.get("expert_dtype", "fp8")) != "fp8":
        problems.append(f"expert_dtype {qc.get('expert_dtype')!r}")
    block = qc.get("weight_block_size")
    if block is not None and (not isinstance(block, (list, tuple)) or len(block) != 2
                              or not all(isinstance(b, int) and b > 0 for b in block)):
        problems.append(f"weight_block_size {block!r} (need two positive integers or null)")
    if problems:
        raise UnsupportedModelError(f"{arch}: quantization_config with {', '.join(problems)} is not supported; "
                                    f"supported: {supported}")
    return dict(method="fp8", weight_block_size=tuple(block) if block is not None else None)


def common(
    raw: dict,
    arch: str,
    default_theta: float,
    head_dim_key: bool = True,
    rope_dim: int | None = None,
    rope_types: tuple[str, ...] = ("default", "linear"),
    default_rope: dict | None = None,
    rope_style: str = "half",
    allow_quant: tuple[str, ...] = ("fp8",),
    eps: float = 1e-6,
    partial_rotary: float | None = None,
    acts: tuple[str, ...] = ("silu",),
) -> dict:
    """The fields every architecture reads: MoEConfig's top level, ``rope`` and ``attention`` (grouped-query
    shape, full attention in every layer). ``eps`` is the config class's default rms_norm_eps."""
    hidden = int(req(raw, "hidden_size", arch))
    heads = int(req(raw, "num_attention_heads", arch))
    kv_heads = raw.get("num_key_value_heads") or heads
    head_dim = (raw.get("head_dim") if head_dim_key else None) or hidden // heads
    act = raw.get("hidden_act", acts[0])
    if act not in acts:
        raise UnsupportedModelError(f"{arch}: hidden_act {act!r} is not supported (supported: {', '.join(acts)})")
    quant = quantization(raw, arch, allow_quant)
    layers = int(req(raw, "num_hidden_layers", arch))
    rope_fields = rope(raw, default_theta, arch, int(rope_dim or head_dim), rope_types, default_rope, rope_style,
                       partial_rotary)
    return dict(
        architecture=arch,
        vocab_size=int(req(raw, "vocab_size", arch)),
        hidden_size=hidden,
        num_hidden_layers=layers,
        max_position_embeddings=int(raw.get("max_position_embeddings") or 4096),
        torch_dtype=checkpoint_dtype(raw),
        eos_token_ids=int_list(raw.get("eos_token_id")),
        bos_token_id=raw.get("bos_token_id"),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        rms_norm_eps=float(raw.get("rms_norm_eps", eps)),
        hidden_act=act,
        quantization=quant,
        rope=rope_fields,
        attention=dict(
            num_heads=heads, num_kv_heads=int(kv_heads), head_dim=int(head_dim), sliding_windows=(None,) * layers,
        ),
    )
