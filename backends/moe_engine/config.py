"""Hugging Face config.json -> one normalised MoE config for every architecture.

No torch import here: the CLI and the frontend use this module to compute
metadata (which layers are MoE, expert count, top-k) without loading PyTorch.

Each supported ``model_type`` has a parser that reads that architecture's keys
(with the defaults of transformers 5.24's config class) and fills the same
``MoEConfig``. Architecture differences the model needs are carried as plain
fields (``router``, ``qk_norm``, ``router_weights_fp32``, shared expert sizes,
per-layer sliding windows, ...) so that model.py never branches on the name.

Adding an architecture (DeepSeek-V2/V3, GPT-OSS, ...): write ``_parse_<type>``,
register it in ``_PARSERS``, add its router to routing.py and its key layout to
checkpoint.py.
"""
from __future__ import annotations

import json
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
    rope_type: str = "default"  # "default" | "linear"
    rope_factor: float = 1.0  # linear scaling factor (positions / factor)
    hidden_act: str = "silu"

    # --- attention
    qkv_bias: bool = False  # bias on q/k/v projections
    o_bias: bool = False  # bias on the output projection
    qk_norm: str = "none"  # "none" | "head" (RMSNorm per head, Qwen3) | "full" (over all heads, OLMoE)
    clip_qkv: float | None = None  # OLMoE: clamp q, k, v to [-clip, clip]
    sliding_windows: tuple[int | None, ...] = ()  # per layer; None = full attention

    # --- MLPs
    moe_intermediate_size: int = 0  # per routed expert
    intermediate_size: int = 0  # dense (non-MoE) layers' MLP
    shared_expert_intermediate_size: int = 0  # 0 = no shared expert
    shared_expert_gate: bool = False  # Qwen2-MoE: sigmoid(Linear(H, 1)) scales the shared expert

    # --- router
    router: str = "softmax_topk"  # routing.py key
    norm_topk_prob: bool = True  # renormalise the top-k probabilities to sum to 1
    router_weights_fp32: bool = False  # Mixtral keeps top-k weights fp32; Qwen/OLMoE cast to the logits' dtype

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


def _rope(raw: dict, default_theta: float, arch: str) -> dict:
    """rope_parameters (transformers v5) or legacy rope_theta + rope_scaling."""
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    theta = params.get("rope_theta", raw.get("rope_theta", default_theta))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ("default", "linear"):
        raise UnsupportedModelError(f"{arch}: rope type {rope_type!r} is not supported (supported: default, linear)")
    factor = float(params.get("factor", 1.0)) if rope_type == "linear" else 1.0
    prf = params.get("partial_rotary_factor", raw.get("partial_rotary_factor"))
    if prf not in (None, 1, 1.0):
        raise UnsupportedModelError(f"{arch}: partial_rotary_factor={prf} is not supported")
    return {"rope_theta": float(theta), "rope_type": rope_type, "rope_factor": factor}


def _common(raw: dict, arch: str, default_theta: float, head_dim_key: bool = True) -> dict:
    hidden = int(_req(raw, "hidden_size", arch))
    heads = int(_req(raw, "num_attention_heads", arch))
    kv_heads = raw.get("num_key_value_heads") or heads
    head_dim = (raw.get("head_dim") if head_dim_key else None) or hidden // heads
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise UnsupportedModelError(f"{arch}: hidden_act {act!r} is not supported (supported: silu)")
    if raw.get("quantization_config"):
        method = raw["quantization_config"].get("quant_method", "?")
        raise UnsupportedModelError(f"{arch}: quantized checkpoints ({method}) are not supported")
    layers = int(_req(raw, "num_hidden_layers", arch))
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
        **_rope(raw, default_theta, arch),
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


_PARSERS: dict[str, Callable[[dict], dict]] = {
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
