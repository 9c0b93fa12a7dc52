"""Small random MoE checkpoints written by transformers itself (``save_pretrained``), for parity tests.

Every architecture the engine supports has one tiny config here (hidden 64, a few layers) that
still covers its peculiarities:

- mixtral:   8 experts, top-2, sliding window 16 (shorter than prompt + generation);
- qwen2_moe: 60 experts, top-4, shared expert with sigmoid gate, mlp_only_layers=[1] (a dense layer);
- qwen3_moe: 16 experts, top-4, norm_topk_prob, decoder_sparse_step=2 (odd layers MoE),
             per-head q/k norm, head_dim 32 != hidden/heads;
- olmoe:     64 experts, top-8, full-width q/k norm, clip_qkv, tied embeddings;
- deepseek_v2: MLA with q_lora_rank=None (q_proj), v_head_dim != qk head dim, complex (pairwise) rope,
             16 experts top-4, group_limited_greedy with 4 groups / 2 kept, routed_scaling_factor 2,
             2 shared experts, first_k_dense_replace=1 (layer 0 dense);
- deepseek_v3: MLA with q_lora_rank (q_a_proj/q_a_layernorm/q_b_proj), interleaved rope, yarn (factor 4,
             mscale != mscale_all_dim, so both the rope attention factor and the softmax mscale matter),
             16 experts top-4, sigmoid scores, 4 groups / 2 kept, NON-ZERO random e_score_correction_bias,
             norm_topk_prob, routed_scaling_factor 2.5, 1 shared expert, first_k_dense_replace=1;
- gpt_oss:   8 experts top-2, router bias, random (non-zero) expert biases, swiglu_limit 0.1 (so the clamp
             bites), sinks, alternating sliding (window 8) / full layers, HF's default yarn rope.
- glm4_moe:  16 experts top-4, sigmoid router with 4 groups / 2 kept and a NON-ZERO e_score_correction_bias,
             norm_topk_prob, routed_scaling_factor 2.5, 1 shared expert, first_k_dense_replace=1, per-head q/k
             norm, q/k/v bias (random, non-zero), head_dim 32 with partial rotary (factor 0.5: 16 dims rotate);
- glm4_moe_lite: MLA with q_lora_rank, interleaved rope, 16 experts top-4, 4 groups / 2 kept, non-zero
             correction bias, 2 shared experts, mlp_layer_types dense / sparse / sparse / dense / sparse.
- qwen3_next: hybrid, layer_types linear / linear / full / linear / full (Gated DeltaNet with 2 key and 4 value
             heads, fused in_proj_qkvz / in_proj_ba), gated attention with (1 + w) q/k norms and partial rotary
             (head_dim 32, factor 0.25), 16 experts top-4 + sigmoid-gated shared expert, mlp_only_layers=[1];
- qwen3_5_moe: the multimodal checkpoint (a tiny vision tower, text weights under model.language_model.), text
             model hybrid linear / full / linear / linear / full, split in_proj_qkv / z / b / a, 16 experts top-4
             + gated shared expert. Every (1 + w) norm weight gets random values (HF initialises them to 0).
- nemotron_h: blocks Mamba-2 / MoE / attention / MLP / Mamba-2 / MoE / attention (every block kind; Mamba-2 with 4
             heads of 16 in 2 groups, state 16, chunk_size 8 so that prompts span several scan chunks, conv bias),
             attention without rotary, 16 squared-ReLU experts top-4 with a sigmoid router (4 groups / 2 kept,
             non-zero correction bias, routed_scaling_factor 2), squared-ReLU shared expert; the Hub's
             ``backbone.`` keys (transformers writes them so).
"""
from __future__ import annotations

from pathlib import Path

import torch

ARCHS = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v2", "deepseek_v3", "gpt_oss", "glm4_moe",
         "glm4_moe_lite", "qwen3_next", "qwen3_5_moe", "nemotron_h")
# Hybrids: most layers keep a recurrent state (Gated DeltaNet, Mamba-2); prefix caching is off for them.
HYBRID_ARCHS = ("qwen3_next", "qwen3_5_moe", "nemotron_h")
NEW_ARCHS = ("deepseek_v2", "deepseek_v3", "gpt_oss", "glm4_moe", "glm4_moe_lite", "qwen3_next", "qwen3_5_moe",
             "nemotron_h")
# Hybrid models (recurrent layers): no tensor parallelism, no prefix cache
HYBRID_ARCHS = ("qwen3_next", "qwen3_5_moe", "nemotron_h")
# Configs whose text model sits in ``text_config`` (keyword overrides go there)
_TEXT_CONFIG_ARCHS = ("qwen3_5_moe",)

_LINEAR = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
               linear_conv_kernel_dim=4)

_MLA = dict(kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, num_key_value_heads=4)

_COMMON = dict(
    vocab_size=256,
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)


_YARN_V3 = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "mscale": 1.0,
            "mscale_all_dim": 0.8, "beta_fast": 32, "beta_slow": 1, "rope_theta": 10000.0}

# arch -> (transformers config class name, kwargs)
_CONFIGS: dict[str, tuple[str, dict]] = {
    "mixtral": ("MixtralConfig", dict(
        **_COMMON, num_hidden_layers=3, intermediate_size=32, num_local_experts=8, num_experts_per_tok=2,
        sliding_window=16,
    )),
    "qwen2_moe": ("Qwen2MoeConfig", dict(
        **_COMMON, num_hidden_layers=3, intermediate_size=48, moe_intermediate_size=16,
        shared_expert_intermediate_size=32, num_experts=60, num_experts_per_tok=4, mlp_only_layers=[1],
        norm_topk_prob=False,
    )),
    "qwen3_moe": ("Qwen3MoeConfig", dict(
        **_COMMON, num_hidden_layers=4, head_dim=32, intermediate_size=48, moe_intermediate_size=16,
        num_experts=16, num_experts_per_tok=4, decoder_sparse_step=2, norm_topk_prob=True,
    )),
    "olmoe": ("OlmoeConfig", dict(
        **_COMMON, num_hidden_layers=2, intermediate_size=16, num_experts=64, num_experts_per_tok=8,
        clip_qkv=0.3, tie_word_embeddings=True,
    )),
    "deepseek_v2": ("DeepseekV2Config", dict(
        **{**_COMMON, **_MLA}, num_hidden_layers=3, intermediate_size=48, moe_intermediate_size=16,
        n_routed_experts=16, n_shared_experts=2, num_experts_per_tok=4, first_k_dense_replace=1,
        topk_method="group_limited_greedy", n_group=4, topk_group=2, routed_scaling_factor=2.0, q_lora_rank=None,
    )),
    "deepseek_v3": ("DeepseekV3Config", dict(
        **{**_COMMON, **_MLA}, num_hidden_layers=3, intermediate_size=48, moe_intermediate_size=16,
        n_routed_experts=16, n_shared_experts=1, num_experts_per_tok=4, first_k_dense_replace=1,
        n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5, q_lora_rank=24,
        rope_parameters=_YARN_V3,
    )),
    "glm4_moe": ("Glm4MoeConfig", dict(
        **_COMMON, head_dim=32, num_hidden_layers=3, intermediate_size=48, moe_intermediate_size=16,
        n_routed_experts=16, n_shared_experts=1, num_experts_per_tok=4, first_k_dense_replace=1, n_group=4,
        topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5, use_qk_norm=True, attention_bias=True,
    )),
    "glm4_moe_lite": ("Glm4MoeLiteConfig", dict(
        **{**_COMMON, **_MLA}, num_hidden_layers=5, intermediate_size=48, moe_intermediate_size=16,
        n_routed_experts=16, n_shared_experts=2, num_experts_per_tok=4, n_group=4, topk_group=2,
        routed_scaling_factor=1.8, q_lora_rank=24, mlp_layer_types=["dense", "sparse", "sparse", "dense", "sparse"],
    )),
    "qwen3_next": ("Qwen3NextConfig", dict(
        **_COMMON, **_LINEAR, head_dim=32, num_hidden_layers=5, intermediate_size=48, moe_intermediate_size=16,
        shared_expert_intermediate_size=24, num_experts=16, num_experts_per_tok=4, norm_topk_prob=True,
        mlp_only_layers=[1],
        layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention", "full_attention"],
    )),
    "qwen3_5_moe": ("Qwen3_5MoeConfig", dict(
        text_config=dict(
            **_COMMON, **_LINEAR, head_dim=32, num_hidden_layers=5, moe_intermediate_size=16,
            shared_expert_intermediate_size=24, num_experts=16, num_experts_per_tok=4,
            layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention",
                         "full_attention"],
        ),
        vision_config=dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=64),
        tie_word_embeddings=False,
    )),
    "nemotron_h": ("NemotronHConfig", dict(
        **_COMMON, head_dim=16,
        layers_block_type=["linear_attention", "moe", "full_attention", "mlp", "linear_attention", "moe",
                           "full_attention"],
        mamba_num_heads=4, mamba_head_dim=16, ssm_state_size=16, n_groups=2, conv_kernel=4, chunk_size=8,
        intermediate_size=48, moe_intermediate_size=16, moe_shared_expert_intermediate_size=24, n_routed_experts=16,
        num_experts_per_tok=4, n_group=4, topk_group=2, routed_scaling_factor=2.0, norm_topk_prob=True,
    )),
    "gpt_oss": ("GptOssConfig", dict(
        **_COMMON, head_dim=16, num_hidden_layers=3, intermediate_size=32, num_local_experts=8,
        num_experts_per_tok=2, sliding_window=8, swiglu_limit=0.1,
    )),
}


def hf_config(arch: str, **overrides):
    """The tiny transformers config of ``arch`` (``overrides`` replace / add keyword arguments)."""
    import transformers

    if arch not in _CONFIGS:
        raise ValueError(arch)
    cls_name, kwargs = _CONFIGS[arch]
    kwargs = {k: (dict(v) if isinstance(v, dict) else v) for k, v in kwargs.items()}  # configs mutate dicts
    if arch in _TEXT_CONFIG_ARCHS:
        top = {k: overrides.pop(k) for k in list(overrides) if k == "tie_word_embeddings"}
        kwargs = {**kwargs, **top, "text_config": {**kwargs["text_config"], **overrides}}
        overrides = {}
    return getattr(transformers, cls_name)(**{**kwargs, **overrides})


def hf_default_attn(arch: str) -> str:
    """HF's default attention implementation on CPU (GPT-OSS does not support sdpa: eager)."""
    return "eager" if arch == "gpt_oss" else "sdpa"


@torch.no_grad()
def _randomize_zero_inits(model, seed: int) -> None:
    """DeepSeek / GPT-OSS: parameters HF initialises to zero get random values, so that they matter in the
    comparison: DeepSeek-V3's e_score_correction_bias, GPT-OSS expert biases, and every (zero-initialised)
    Linear bias (GPT-OSS attention, DeepSeek attention_bias / mlp_bias variants); RMSNorm weights (all ones
    at init) get 1 + noise, so that the norm's dtype pipeline (GPT-OSS multiplies the weight in float32)
    shows."""
    if model.config.model_type not in NEW_ARCHS:
        return
    g = torch.Generator().manual_seed(seed + 1000)
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if name.endswith("bias") and not t.any():
            t.copy_(torch.randn(t.shape, generator=g) * 0.05)
        elif name.endswith("norm.weight") and bool((t == 1).all()):
            t.copy_(1 + torch.randn(t.shape, generator=g) * 0.1)
        elif name.endswith("norm.weight") and not t.any():  # Qwen3-Next's (1 + w) norms start at 0
            t.copy_(torch.randn(t.shape, generator=g) * 0.1)


def make_hf_model(arch: str, seed: int = 0, dtype: torch.dtype = torch.float32, **overrides):
    """A random HF model (transformers' own init), eager attention and experts."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = hf_config(arch, **overrides)
    if arch == "qwen3_5_moe":  # with its vision tower, as the Hub's checkpoints are
        from transformers import Qwen3_5MoeForConditionalGeneration as cls
        model = cls._from_config(cfg, attn_implementation="eager", experts_implementation="eager")
    else:
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", experts_implementation="eager")
    _randomize_zero_inits(model, seed)
    return model.to(dtype).eval()


def save_hf_checkpoint(model, out: Path, *, fused: bool = False, max_shard_size: str | None = None) -> Path:
    """save_pretrained: per-expert Hub layout by default, fused 3-D experts with ``fused=True``."""
    kwargs = {"save_original_format": not fused}
    if max_shard_size is not None:
        kwargs["max_shard_size"] = max_shard_size
    model.save_pretrained(out, **kwargs)
    return Path(out)


def load_hf(path: Path, dtype: torch.dtype = torch.float32, attn_implementation: str = "eager"):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        path, dtype=dtype, attn_implementation=attn_implementation, experts_implementation="eager"
    ).eval()


def hf_router_modules(model) -> dict[int, torch.nn.Module]:
    """layer index -> HF router module (``mlp.gate``, or GPT-OSS ``mlp.router``; a *TopKRouter / *TopkRouter
    returning (logits, weights, ids)) for every MoE layer."""
    out = {}
    for i, layer in enumerate(model.model.layers):
        block = getattr(layer, "mlp", None) or getattr(layer, "mixer", None)  # Nemotron-H: the block's mixer
        gate = getattr(block, "gate", None) or getattr(block, "router", None)
        if gate is not None and type(gate).__name__.lower().endswith("topkrouter"):
            out[i] = gate
    return out


@torch.no_grad()
def hf_forward_with_routing(model, input_ids: torch.Tensor) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """HF logits [B, T, V] float32 and, per MoE layer, the router's own top-k ids [B*T, K], captured with
    forward hooks on the router modules (computed by HF, not by the engine)."""
    routed: dict[int, torch.Tensor] = {}
    hooks = []
    for i, gate in hf_router_modules(model).items():
        def hook(_module, _inputs, output, i=i):
            routed[i] = output[2].detach().clone()  # (router_logits, router_scores, router_indices)

        hooks.append(gate.register_forward_hook(hook))
    try:
        logits = model(input_ids).logits.float()
    finally:
        for h in hooks:
            h.remove()
    return logits, routed


# ----------------------------------------------------------------------------- MXFP4 (GPT-OSS)

MXFP4_QUANT_CONFIG = {  # as in openai/gpt-oss-20b's config.json
    "quant_method": "mxfp4",
    "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"],
}


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of transformers' MXFP4 dequantisation: w [E, R, C] (C, the reduction dim, a multiple of 32) ->
    blocks uint8 [E, R, C/32, 16] (low nibble = even column), scales uint8 [E, R, C/32] (exponent + 127)
    (checkpoint.py's round-to-nearest quantiser)."""
    from moe_engine.checkpoint import quantize_mxfp4 as quantize

    return quantize(w)


def save_gpt_oss_mxfp4(model, out: Path) -> Path:
    """save_pretrained, then rewrite the experts as the Hub stores gpt-oss: ``*_blocks`` / ``*_scales`` of the
    [E, out, in] (transposed) weights, with the mxfp4 quantization_config."""
    import json

    from safetensors.torch import load_file, save_file

    model.save_pretrained(out)
    out = Path(out)
    tensors = load_file(out / "model.safetensors")
    for key in [k for k in tensors if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        blocks, scales = quantize_mxfp4(tensors.pop(key).transpose(1, 2))
        tensors[f"{key}_blocks"], tensors[f"{key}_scales"] = blocks, scales
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"] = MXFP4_QUANT_CONFIG
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


def load_hf_mxfp4(path: Path, dtype: torch.dtype = torch.float32):
    """HF's own MXFP4 path on CPU: dequantise at load (integrations/mxfp4.py)."""
    from transformers import AutoModelForCausalLM, Mxfp4Config

    return AutoModelForCausalLM.from_pretrained(
        path, dtype=dtype, quantization_config=Mxfp4Config(dequantize=True), attn_implementation="eager",
        experts_implementation="eager",
    ).eval()


# ----------------------------------------------------------------------------- FP8 block-scaled (DeepSeek-V3 style)

FP8_QUANT_CONFIG = {  # as in deepseek-ai/DeepSeek-V3's and Qwen/Qwen3-30B-A3B-FP8's config.json
    "activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128],
}
# Tensors the published FP8 checkpoints keep in the model dtype: embeddings, lm_head, norms, routers (and their
# biases), Qwen's shared-expert gate; everything else 2-D named *.weight (and fused 3-D experts) is FP8.
_FP8_KEEP = ("embed_tokens", "lm_head", "norm", ".mlp.gate.", ".mixer.gate.", ".router.", "shared_expert_gate",
             "e_score_correction_bias", ".visual.")


def fp8_quantized_key(key: str, t: torch.Tensor) -> bool:
    if any(k in key for k in _FP8_KEEP):
        return False
    return (key.endswith(".weight") and t.dim() == 2) or key.endswith(("experts.gate_up_proj", "experts.down_proj"))


def naive_dequantize_fp8(q: torch.Tensor, scale_inv: torch.Tensor, block) -> torch.Tensor:
    """Block by block, with plain slicing (independent of the engine's fp8.py): float32 [..., R, C]."""
    bm, bn = block
    out = q.float().clone()
    R, C = q.shape[-2:]
    for i in range(0, R, bm):
        for j in range(0, C, bn):
            out[..., i : i + bm, j : j + bn] *= scale_inv[..., i // bm, j // bn, None, None]
    return out


def save_fp8_checkpoint(model, out: Path, *, block=(128, 128), fused: bool = False, not_convert=True) -> Path:
    """save_pretrained, then every tensor the published checkpoints store in FP8 rewritten as float8_e4m3fn
    ``X.weight`` + float32 ``X.weight_scale_inv`` [ceil(R/bm), ceil(C/bn)] (fused experts:
    ``..._scale_inv`` [E, ., .]), with the fp8 quantization_config (Qwen3-FP8 also lists the kept modules)."""
    return rewrite_as_fp8(save_hf_checkpoint(model, Path(out), fused=fused), block=block, not_convert=not_convert)


def rewrite_as_fp8(out: Path, *, block=(128, 128), not_convert=True) -> Path:
    """A checkpoint directory's tensors rewritten in place into the published FP8 layout (save_fp8_checkpoint)."""
    import json

    from safetensors.torch import load_file, save_file

    from moe_engine.fp8 import quantize_fp8_blocks

    out = Path(out)
    for f in sorted(out.glob("*.safetensors")):
        tensors = load_file(f)
        for key in [k for k, t in tensors.items() if fp8_quantized_key(k, t)]:
            q, s = quantize_fp8_blocks(tensors[key], tuple(block) if block else tuple(tensors[key].shape[-2:]))
            tensors[key] = q
            tensors[key[: -len("weight")] + "weight_scale_inv" if key.endswith(".weight") else key + "_scale_inv"] = s
        save_file(tensors, str(f), metadata={"format": "pt"})
    index = out / "model.safetensors.index.json"
    if index.is_file():  # the scales live beside their weights
        data = json.loads(index.read_text())
        for f in out.glob("*.safetensors"):
            for key in load_file(f):
                data["weight_map"][key] = f.name
        index.write_text(json.dumps(data, indent=2))
    cfg = json.loads((out / "config.json").read_text())
    qc = dict(FP8_QUANT_CONFIG, weight_block_size=list(block) if block is not None else None)
    if not_convert:
        qc["modules_to_not_convert"] = ["lm_head"] + [f"model.layers.{i}.mlp.gate" for i in range(cfg.get(
            "num_hidden_layers", 0))]
    cfg["quantization_config"] = qc
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


def save_dequantized_copy(fp8_dir: Path, out: Path, dtype: torch.dtype = torch.float32) -> Path:
    """The FP8 checkpoint dequantised block by block (naive_dequantize_fp8) into a plain checkpoint without
    quantization_config, for transformers' own loader: the dequantised model run by transformers."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((Path(fp8_dir) / "config.json").read_text())
    block = cfg["quantization_config"]["weight_block_size"]
    cfg.pop("quantization_config")
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    for name in ("generation_config.json", "model.safetensors.index.json"):
        if (Path(fp8_dir) / name).is_file():
            shutil.copyfile(Path(fp8_dir) / name, out / name)
    for f in sorted(Path(fp8_dir).glob("*.safetensors")):
        tensors = load_file(f)
        plain = {}
        for key, t in tensors.items():
            if key.endswith("_scale_inv"):
                continue
            if t.dtype == torch.float8_e4m3fn:
                s = tensors[key[: -len("weight")] + "weight_scale_inv" if key.endswith(".weight") else key + "_scale_inv"]
                b = block if block is not None else t.shape[-2:]
                t = naive_dequantize_fp8(t, s, b).to(dtype)
            plain[key] = t
        save_file(plain, str(out / f.name), metadata={"format": "pt"})
    if (out / "model.safetensors.index.json").is_file():
        data = json.loads((out / "model.safetensors.index.json").read_text())
        data["weight_map"] = {k: v for k, v in data["weight_map"].items() if not k.endswith("_scale_inv")}
        (out / "model.safetensors.index.json").write_text(json.dumps(data, indent=2))
    return out


# ----------------------------------------------------------------------------- servable checkpoints


def write_servable_checkpoint(arch: str, out: Path, seed: int = 0, dtype: torch.dtype = torch.float32, **overrides) -> Path:
    """A tiny random ``arch`` checkpoint written by transformers, plus the embedded tiny model's tokenizer
    (tokenizer.json, tokenizer_config.json with a chat template), so that ``moe-serve --model <out>`` serves
    it. The vocabulary (512) matches that tokenizer."""
    import shutil

    from moe_engine.tiny import ensure_tiny_checkpoint

    tok_dir = ensure_tiny_checkpoint()
    overrides = {"vocab_size": 512, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, **overrides}
    out = save_hf_checkpoint(make_hf_model(arch, seed=seed, dtype=dtype, **overrides), Path(out))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(tok_dir / name, out / name)
    return out
