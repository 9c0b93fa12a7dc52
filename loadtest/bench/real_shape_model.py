"""The real-shape benchmark's model: Qwen3-30B-A3B's shape with random weights built on the device, and the
bytes and FLOPs its steps must move (the rooflines the benchmark reports against).

- ``SHAPES``: Hugging Face ``config.json`` dicts. ``qwen3-30b-a3b`` is the real model's config (48 layers,
  hidden 2048, 32 query / 4 KV heads of 128, 128 experts top-8, expert width 768, vocabulary 151,936);
  ``gpt-oss-120b-8l`` GPT-OSS-120B's cut to 8 of 36 layers (sinks, sliding windows, biased clamped experts);
  ``gpt-oss-120b`` all 36 layers, built with MXFP4 experts only (``MXFP4_ONLY``: 234 GB in bf16);
  ``tiny`` (4 layers, hidden 256, 16 experts top-4, vocabulary 1024) runs on a CPU in seconds, as ``tiny-*``.
- ``build_engine_model`` / ``build_hf_model``: moe_engine's ``MoEForCausalLM`` / transformers' model built on
  the ``meta`` device, moved with ``to_empty`` (one allocation per parameter, no checkpoint, no second copy),
  every parameter filled in place by ``fill_random_``. Parameter names are the same in both (moe_engine uses
  HF's v5 names) and each parameter's values depend only on (seed, init, name, shape, dtype, device), so the
  two models built with one seed hold identical weights. ``mxfp4=True`` (GPT-OSS): each layer's experts are
  built, filled, quantised to MXFP4 and packed before the next layer's exist, so the bf16 experts of only one
  layer are ever on the device (the full GPT-OSS-120B's 36 layers fit one 80 GB GPU packed).
- Initialisation and routing. With every weight normal(0, 0.02) the routing of a random model collapses: past
  layer 2 nearly every token picks the same experts (measured on the CPU, bf16, with this shape's attention
  and 48 layers but 16 experts top-2: in most layers the busiest expert got every one of 384 tokens), because
  attention's near-uniform weights average the values of the whole prefix into a vector all tokens share, and
  it dominates the residual stream. A 64-token decode step would then read as few as 8 experts per layer
  instead of ~126 and look far cheaper than a real model's. ``init="balanced"`` (the default) keeps the
  residual stream token-specific: embeddings normal(0, 1), the projections that write into it (``o_proj``,
  ``down_proj``) normal(0, 0.02 / sqrt(2 * layers)) (GPT-2's scaled init), the rest normal(0, 0.02), norms 1.
  On the same test the routing is then near uniform in every layer (busiest expert 1.2-1.7x the mean, what
  random draws give). ``init="std0.02"`` is the plain one, for comparison.
  ``routing_stats`` measures what a run actually routed.
- ``weight_bytes_per_token`` (batch-1 decode reads), ``decode_step_bytes`` (a batch of B decode tokens, experts
  as uniform routing hits them), ``prefill_matmul_flops``, ``measure_copy_bandwidth`` (the HBM roofline's
  denominator), ``time_lm_head``.
- ``summarize_trace``: a torch.profiler chrome trace -> device time per op class and kernel, busy time.
- ``graph_replay_seconds``: GPU time of a callable's launches replayed from a CUDA graph (the kernel benchmarks).
"""
from __future__ import annotations

import gc
import re
import statistics
import time
import zlib
from typing import Callable

import torch
from torch import nn

QWEN3_30B_A3B = {  # Qwen/Qwen3-30B-A3B config.json
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "decoder_sparse_step": 1,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 6144,
    "max_position_embeddings": 40960,
    "max_window_layers": 48,
    "mlp_only_layers": [],
    "moe_intermediate_size": 768,
    "norm_topk_prob": True,
    "num_attention_heads": 32,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 48,
    "num_key_value_heads": 4,
    "output_router_logits": False,
    "rms_norm_eps": 1e-6,
    "rope_scaling": None,
    "rope_theta": 1000000.0,
    "router_aux_loss_coef": 0.001,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}

TINY = {
    **QWEN3_30B_A3B,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "head_dim": 64,
    "hidden_size": 256,
    "intermediate_size": 512,
    "max_window_layers": 4,
    "moe_intermediate_size": 128,
    "num_attention_heads": 4,
    "num_experts": 16,
    "num_experts_per_tok": 4,
    "num_hidden_layers": 4,
    "num_key_value_heads": 2,
    "vocab_size": 1024,
}

# Qwen3.5-35B-A3B's text model as transformers' Qwen3_5MoeTextConfig defaults give it (the vision tower is out of
# scope): 40 layers, 3 of 4 Gated DeltaNet (16 key / 32 value heads of 128), full attention 16 q / 2 kv heads of 256
# with an output gate and rotary on a quarter of each head, 256 experts top-8 of width 512 plus a gated shared
# expert of 512, vocabulary 248,320.
QWEN3_5_35B_A3B = {
    "architectures": ["Qwen3_5MoeForCausalLM"],
    "model_type": "qwen3_5_moe_text",
    "vocab_size": 248320, "hidden_size": 2048, "num_hidden_layers": 40, "num_attention_heads": 16,
    "num_key_value_heads": 2, "head_dim": 256, "hidden_act": "silu", "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "attention_bias": False,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
    "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
    "linear_num_key_heads": 16, "linear_num_value_heads": 32, "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512, "num_experts_per_tok": 8, "num_experts": 256,
    "layer_types": ["linear_attention" if (i + 1) % 4 else "full_attention" for i in range(40)],
    "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16",
}

# Nemotron-3-Nano-30B-A3B's config.json, abridged to what the engine and transformers read: 52 blocks (23 Mamba-2,
# 23 MoE, 6 attention), hidden 2688, Mamba-2 64 heads of 64 with state 128 in 8 groups, 128 squared-ReLU experts top-6
# of width 1856 plus a shared expert of 3712, vocabulary 131,072 (~32B parameters: 63 GB in bf16, one H200)
NEMOTRON_3_NANO_30B_A3B = {
    "architectures": ["NemotronHForCausalLM"],
    "model_type": "nemotron_h", "vocab_size": 131072, "hidden_size": 2688,
    "hybrid_override_pattern": "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME", "num_hidden_layers": 52,
    "num_attention_heads": 32, "num_key_value_heads": 2, "head_dim": 128, "mamba_num_heads": 64,
    "mamba_head_dim": 64, "ssm_state_size": 128, "n_groups": 8, "conv_kernel": 4, "chunk_size": 128,
    "use_conv_bias": True, "use_bias": False, "mamba_hidden_act": "silu", "mlp_hidden_act": "relu2",
    "n_routed_experts": 128, "num_experts_per_tok": 6, "moe_intermediate_size": 1856,
    "moe_shared_expert_intermediate_size": 3712, "n_group": 1, "topk_group": 1, "routed_scaling_factor": 2.5,
    "norm_topk_prob": True, "intermediate_size": 1856, "layer_norm_epsilon": 1e-5, "time_step_min": 0.001,
    "max_position_embeddings": 262144, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "bos_token_id": 1,
    "eos_token_id": 2, "num_nextn_predict_layers": 0, "residual_in_fp32": False, "mlp_bias": False,
}

TINY_QWEN3_5 = {
    **QWEN3_5_35B_A3B, "vocab_size": 1024, "hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4,
    "head_dim": 64, "linear_key_head_dim": 32, "linear_value_head_dim": 32, "linear_num_key_heads": 2,
    "linear_num_value_heads": 4, "moe_intermediate_size": 128, "shared_expert_intermediate_size": 128,
    "num_experts": 16, "num_experts_per_tok": 4,
    "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"],
}

TINY_NEMOTRON_H = {
    **NEMOTRON_3_NANO_30B_A3B, "vocab_size": 1024, "hidden_size": 256, "hybrid_override_pattern": "ME*E",
    "num_hidden_layers": 4, "num_attention_heads": 4, "head_dim": 64, "mamba_num_heads": 8, "mamba_head_dim": 32,
    "ssm_state_size": 32, "n_groups": 2, "chunk_size": 32, "n_routed_experts": 16, "num_experts_per_tok": 4,
    "moe_intermediate_size": 128, "moe_shared_expert_intermediate_size": 128, "intermediate_size": 256,
}

# GPT-OSS-120B's config.json (openai/gpt-oss-120b) in bf16 (no quantization_config), cut to 8 of its 36 layers:
# hidden 2880, 64 query / 8 KV heads of 64 with sinks, sliding window 128 on alternate layers (the even ones), 128
# biased experts top-4 of width 2880 with the clamped SwiGLU, yarn rope, vocabulary 201,088. ~53 GB of weights (8 x
# 6.4 GB of experts, 2 x 0.58 GB of embedding and lm_head): it fits an 80 GB H100 with room for the KV cache.
GPT_OSS_120B_8L = {
    "architectures": ["GptOssForCausalLM"],
    "model_type": "gpt_oss", "vocab_size": 201088, "hidden_size": 2880, "num_hidden_layers": 8,
    "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64, "intermediate_size": 2880,
    "num_local_experts": 128, "num_experts_per_tok": 4, "experts_per_token": 4, "sliding_window": 128,
    "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(8)],
    "attention_bias": True, "attention_dropout": 0.0, "hidden_act": "silu", "swiglu_limit": 7.0,
    "rms_norm_eps": 1e-5, "rope_theta": 150000.0, "max_position_embeddings": 131072, "initial_context_length": 4096,
    "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                     "original_max_position_embeddings": 4096},
    "router_aux_loss_coef": 0.9, "output_router_logits": False, "tie_word_embeddings": False,
    "eos_token_id": 200002, "pad_token_id": 199999, "bos_token_id": 199998, "torch_dtype": "bfloat16",
    "use_cache": True, "initializer_range": 0.02,
}

# All 36 layers (the published model, its experts MXFP4 as openai/gpt-oss-120b ships them): ~61 GiB of packed
# experts, ~3 GiB of attention, embedding and lm_head.
GPT_OSS_120B = {**GPT_OSS_120B_8L, "num_hidden_layers": 36,
                "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(36)]}

TINY_GPT_OSS = {
    **GPT_OSS_120B_8L, "vocab_size": 1024, "hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4,
    "num_key_value_heads": 2, "intermediate_size": 128, "num_local_experts": 16, "sliding_window": 32,
    "layer_types": ["sliding_attention", "full_attention"] * 2, "bos_token_id": 1, "eos_token_id": 2,
    "pad_token_id": 0,
}

# moonshotai/Moonlight-16B-A3B's config.json (deepseek_v3): hidden 2048, 27 layers (the first dense, width 11,264),
# 64 routed experts top-6 of width 1408 + 2 shared, sigmoid router with correction bias, one group,
# routed_scaling_factor 2.446; MLA with kv_lora_rank 512, q_lora_rank null (q_proj), qk 128 + 64 rope, v 128, 16
# heads; vocabulary 163,840. The KV cache holds 512 + 64 values per token and layer.
MOONLIGHT_16B_A3B = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3", "vocab_size": 163840, "hidden_size": 2048, "intermediate_size": 11264,
    "moe_intermediate_size": 1408, "num_hidden_layers": 27, "num_attention_heads": 16, "num_key_value_heads": 16,
    "n_shared_experts": 2, "n_routed_experts": 64, "ep_size": 1, "routed_scaling_factor": 2.446,
    "kv_lora_rank": 512, "q_lora_rank": None, "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128,
    "topk_method": "noaux_tc", "n_group": 1, "topk_group": 1, "num_experts_per_tok": 6, "moe_layer_freq": 1,
    "first_k_dense_replace": 1, "norm_topk_prob": True, "scoring_func": "sigmoid", "hidden_act": "silu",
    "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 50000.0, "rope_scaling": None,
    "attention_bias": False, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "bos_token_id": 163584,
    "eos_token_id": 163585, "pad_token_id": 163839,
}

TINY_MOONLIGHT = {  # the same architecture on a CPU in seconds (MLA, sigmoid router with groups, shared experts)
    **MOONLIGHT_16B_A3B, "vocab_size": 1024, "hidden_size": 256, "intermediate_size": 512, "moe_intermediate_size": 128,
    "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 4, "n_routed_experts": 16,
    "num_experts_per_tok": 4, "n_group": 4, "topk_group": 2, "kv_lora_rank": 64, "qk_rope_head_dim": 16,
    "qk_nope_head_dim": 32, "v_head_dim": 32, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
}

SHAPES = {"qwen3-30b-a3b": QWEN3_30B_A3B, "tiny": TINY, "qwen3.5-35b-a3b": QWEN3_5_35B_A3B,
          "nemotron-3-nano-30b-a3b": NEMOTRON_3_NANO_30B_A3B, "tiny-qwen3.5": TINY_QWEN3_5,
          "tiny-nemotron-h": TINY_NEMOTRON_H, "moonlight": MOONLIGHT_16B_A3B, "tiny-moonlight": TINY_MOONLIGHT,
          "gpt-oss-120b-8l": GPT_OSS_120B_8L, "gpt-oss-120b": GPT_OSS_120B, "tiny-gpt-oss": TINY_GPT_OSS}
REAL_SHAPE = "qwen3-30b-a3b"
MXFP4_ONLY = {"gpt-oss-120b"}  # shapes whose bf16 experts fit no single GPU: built packed (build_engine_model)

Log = Callable[[str], None]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_device_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


# ----------------------------------------------------------------------------- building


INITS = ("balanced", "std0.02")


def init_std(name: str, init: str, num_layers: int) -> float | None:
    """Standard deviation of a parameter's normal init (None: fill with 1.0, the norms); see the docstring."""
    if name.endswith("norm.weight"):
        return None
    if init == "balanced":
        if "embed_tokens" in name or name.endswith("embeddings.weight"):
            return 1.0
        if name.endswith(("o_proj.weight", "out_proj.weight", "down_proj", "down_proj.weight")):
            return 0.02 / (2 * num_layers) ** 0.5
    elif init != "std0.02":
        raise ValueError(f"unknown init {init!r}; known: {', '.join(INITS)}")
    return 0.02


@torch.no_grad()
def fill_random_(model: nn.Module, seed: int, init: str = "balanced", log: Log | None = None,
                 chunk_elems: int = 1 << 27, prefix: str = "", num_layers: int | None = None,
                 exclude: set[str] = frozenset()) -> int:
    """Fill every parameter in place (``init_std``) from a generator seeded by (seed, parameter name), chunk by
    chunk so no temporary of a parameter's size exists. Returns the bytes filled; logs about every 10 GB.
    ``prefix``: ``model`` is the submodule of that name (its parameters get the values they get in the whole
    model); ``num_layers`` then comes from the caller. ``exclude``: submodules left alone (filled already)."""
    params = [(prefix + n, p) for n, p in model.named_parameters()]  # a tied weight appears once
    # transformers keeps the correction bias of sigmoid routers (DeepSeek-V3, GLM, Nemotron-H) as a buffer, the engine
    # as a parameter: filled alike by name (to_empty left the buffer uninitialised)
    params += [(prefix + n, b) for n, b in model.named_buffers() if n.endswith("e_score_correction_bias")]
    params = [(n, p) for n, p in params if not any(n.startswith(m + ".") for m in exclude)]
    num_layers = num_layers or model.config.num_hidden_layers
    total = sum(p.nbytes for _, p in params)
    done, next_report, start = 0, 10e9, time.perf_counter()
    for name, p in params:
        std = init_std(name, init, num_layers)
        if std is None:
            p.fill_(1.0)
        else:
            gen = torch.Generator(device=p.device)
            gen.manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (1 << 62))
            flat = p.view(-1)
            for lo in range(0, flat.numel(), chunk_elems):
                flat[lo : lo + chunk_elems].normal_(0.0, std, generator=gen)
        done += p.nbytes
        if log is not None and (done >= next_report or done == total):
            _sync(p.device)
            log(f"  filled {done / 1e9:6.1f} / {total / 1e9:.1f} GB ({time.perf_counter() - start:5.1f} s)")
            next_report = done + 10e9
    return total


def _check_materialised(model: nn.Module) -> None:
    left = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    if left:
        raise RuntimeError(f"tensors left on the meta device after building: {', '.join(left[:5])}")


def build_engine_model(raw: dict, device: torch.device, dtype: torch.dtype, seed: int, init: str = "balanced",
                       log: Log | None = None, mxfp4: bool = False):
    """(moe_engine MoEForCausalLM with random weights on ``device``, its MoEConfig). ``mxfp4`` (GPT-OSS): the
    experts quantised to MXFP4 and kept packed, one layer at a time (the module docstring)."""
    from moe_engine.config import config_from_dict
    from moe_engine.models.decoder import MoEForCausalLM

    cfg = config_from_dict(raw)
    with torch.device("meta"):
        model = MoEForCausalLM(cfg)
    model.to(dtype)  # on meta: no memory; the dtype of the parameters to_empty allocates
    for name, p in list(model.named_parameters()):  # HF's keep-in-fp32 rules (e.g. DeepSeek's router)
        want = model.param_dtype(name, dtype)
        if p.dtype != want:
            module_name, _, attr = name.rpartition(".")
            setattr(model.get_submodule(module_name), attr,
                    nn.Parameter(torch.empty(p.shape, dtype=want, device="meta"), requires_grad=False))
    packed = _build_packed_experts(model, device, seed, init, log) if mxfp4 else set()
    for name, m in model.named_modules():  # everything else: one allocation per parameter
        if not any(name == p or name.startswith(p + ".") for p in packed):
            m.to_empty(device=device, recurse=False)
    if cfg.tie_word_embeddings:  # to_empty gives each module its own tensor
        model.lm_head.weight = model.model.embed_tokens.weight
    fill_random_(model, seed, init, log, exclude=packed)
    model.init_buffers(device)  # RoPE tables (non-persistent buffers)
    _check_materialised(model)
    return model.eval(), cfg


def _build_packed_experts(model: nn.Module, device: torch.device, seed: int, init: str, log: Log | None) -> set[str]:
    """Materialise, fill and pack every GPT-OSS experts module, layer by layer (their bf16 weights the same values
    a bf16 build gives them, then MXFP4 as mxfp4_load.pack_in_memory rounds them). Returns their module names."""
    from moe_engine import mxfp4_load
    from moe_engine.layers.experts import GptOssExperts

    experts = [(n, m) for n, m in model.named_modules() if isinstance(m, GptOssExperts)]
    if not experts:
        raise ValueError("MXFP4 packing needs GPT-OSS experts (its expert format); this model has none")
    start = time.perf_counter()
    for i, (name, m) in enumerate(experts):
        m.to_empty(device=device)
        fill_random_(m, seed, init, prefix=name + ".", num_layers=model.config.num_hidden_layers)
        mxfp4_load.pack_in_memory(m)
        if log is not None and ((i + 1) % 6 == 0 or i + 1 == len(experts)):
            _sync(device)
            log(f"  experts of {i + 1} / {len(experts)} layers filled and packed ({time.perf_counter() - start:5.1f} s)")
    free_device_memory(device)
    return {n for n, _ in experts}


def build_hf_model(raw: dict, device: torch.device, dtype: torch.dtype, seed: int, init: str = "balanced",
                   log: Log | None = None, attn_implementation: str | None = None,
                   experts_implementation: str | None = None):
    """transformers' model for ``raw`` (e.g. Qwen3MoeForCausalLM) with the same random weights as
    ``build_engine_model`` gives for the same seed."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = type(AutoConfig.for_model(raw["model_type"])).from_dict(dict(raw))
    kw = {"dtype": dtype}
    if attn_implementation:
        kw["attn_implementation"] = attn_implementation
    if experts_implementation:
        kw["experts_implementation"] = experts_implementation
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, **kw)
    model.to_empty(device=device)
    if getattr(model.config, "tie_word_embeddings", False):
        model.tie_weights()
    model.requires_grad_(False)
    fill_random_(model, seed, init, log)
    # Non-persistent buffers (the RoPE inverse frequencies) were computed on meta and to_empty left them
    # uninitialised: rebuild them from the config (on the CPU, as HF computes them at init).
    for module in model.modules():
        names = getattr(module, "_non_persistent_buffers_set", ())
        if names:
            fresh = type(module)(model.config)
            for n in names:
                setattr(module, n, getattr(fresh, n).to(device))
    _check_materialised(model)
    return model.eval()


# ----------------------------------------------------------------------------- rooflines


def _mixer_elems(cfg) -> dict[str, int]:
    """Weight elements of every layer's token mixer (attention projections and q/k norms; Gated DeltaNet and Mamba-2
    projections, convolutions and small parameters) and of the layers' norms."""
    H, D, Hq, Hkv = cfg.hidden_size, cfg.attention.head_dim, cfg.attention.num_heads, cfg.attention.num_kv_heads
    n_att = len(cfg.attention_layers)
    att = cfg.attention
    q_out = Hq * D * (2 if att.output_gate else 1)  # Qwen3-Next / 3.5: q_proj also yields the output gate
    qkv_bias = (q_out + 2 * Hkv * D) if att.qkv_bias else 0
    qk_norm = {"head": 2 * D, "full": (Hq + Hkv) * D}.get(att.qk_norm, 0)
    norms = (2 if cfg.block_style == "pair" else 1) * cfg.num_hidden_layers + 1
    out = {
        "attention q/k/v/o projections": n_att * (H * q_out + 2 * H * Hkv * D + Hq * D * H + qkv_bias),
        "q/k norms": n_att * qk_norm,
        f"layer norms ({'2 per layer' if cfg.block_style == 'pair' else '1 per block'}) + final norm": norms * H,
    }
    if att.mla is not None:  # q (or q_a, its norm, q_b), kv_a_proj_with_mqa, its norm, kv_b_proj, o_proj
        m = att.mla
        q = H * Hq * D if m.q_lora_rank is None else H * m.q_lora_rank + m.q_lora_rank + m.q_lora_rank * Hq * D
        kv = H * (m.kv_lora_rank + m.qk_rope_head_dim) + m.kv_lora_rank + m.kv_lora_rank * Hq * (
            m.qk_nope_head_dim + m.v_head_dim)
        del out["attention q/k/v/o projections"], out["q/k norms"]
        out = {"MLA q / kv_a / kv_b / o projections (+ their norms)": n_att * (q + kv + Hq * m.v_head_dim * H), **out}
    n_lin = sum(cfg.layer_type(i) == "linear_attention" for i in range(cfg.num_hidden_layers))
    if n_lin:
        la = cfg.linear_attention
        value = la.num_v_heads * la.head_v_dim
        per = H * (la.conv_dim + value + 2 * la.num_v_heads) + la.conv_dim * la.conv_kernel + value * H
        out["Gated DeltaNet projections, conv, out_proj"] = n_lin * (per + 2 * la.num_v_heads + la.head_v_dim)
    n_mamba = sum(cfg.layer_type(i) == "mamba" for i in range(cfg.num_hidden_layers))
    if n_mamba:
        m = cfg.mamba
        per = H * (m.intermediate_size + m.conv_dim + m.num_heads) + m.conv_dim * m.conv_kernel + m.intermediate_size * H
        out["Mamba-2 projections, conv, out_proj"] = n_mamba * (per + 3 * m.num_heads + m.intermediate_size)
    return out


def weight_bytes_per_token(cfg, elem: int, expert_bytes: float | None = None) -> dict[str, int]:
    """Weight bytes one decode token reads (batch 1): per layer its token mixer (attention projections and q/k norms,
    or a hybrid's Gated DeltaNet / Mamba-2 projections), norms, router, the K chosen experts (SwiGLU gate_up + down;
    Nemotron-H's ungated up + down) and any shared expert; then the final norm, lm_head and one embedding row. (A
    dense MLP layer, if any, reads its whole MLP.) ``expert_bytes``: bytes per routed-expert weight when they are
    stored otherwise (MXFP4: 17/32); default ``elem``."""
    H = cfg.hidden_size
    n_moe = len(cfg.moe_layers)
    n_dense = sum(cfg.has_mlp(i) and i not in cfg.moe_layers for i in range(cfg.num_hidden_layers))
    mats = 2 if cfg.experts.activation == "relu2" else 3  # ungated: up + down
    width = cfg.experts.latent_size or H
    per_expert = mats * cfg.experts.intermediate_size * width
    shared = cfg.experts.shared_intermediate_size * H * mats + (H if cfg.experts.shared_gate else 0)
    latent = 2 * H * cfg.experts.latent_size
    router_elem = 4 / elem if cfg.router.fp32 else 1  # DeepSeek's routers keep a float32 weight
    elems = {
        **_mixer_elems(cfg),
        "routers": n_moe * cfg.num_experts * H * router_elem,
        f"experts ({cfg.num_experts_per_tok} of {cfg.num_experts} per layer, "
        f"{'up + down' if mats == 2 else 'gate_up + down'})": n_moe * cfg.num_experts_per_tok * per_expert
        * (expert_bytes / elem if expert_bytes else 1),
        "shared experts": n_moe * (shared + latent),
        "dense MLP layers": n_dense * (2 if cfg.hidden_act == "relu2" else 3) * cfg.intermediate_size * H,
        "lm_head": cfg.vocab_size * H,
        "embedding row": H,
    }
    return {k: int(v * elem) for k, v in elems.items() if v}


def kv_bytes_per_token(cfg, elem: int) -> int:
    """K and V of one token in every attention layer (grouped-query attention); MLA: its latent and rope key (576
    values per layer for V2/V3 shapes), what the absorbed decode reads."""
    att = cfg.attention
    if att.mla is not None:
        return len(cfg.attention_layers) * (att.mla.kv_lora_rank + att.mla.qk_rope_head_dim) * elem
    return len(cfg.attention_layers) * 2 * att.num_kv_heads * att.head_dim * elem


def expanded_kv_bytes_per_token(cfg, elem: int) -> int:
    """What an MLA model's KV would take per token if the cache held expanded per-head keys and values (qk + v dims
    per head), as an engine without latent caching stores it: the capacity comparison of the startup log."""
    att = cfg.attention
    m = att.mla
    return len(cfg.attention_layers) * att.num_heads * (m.qk_nope_head_dim + m.qk_rope_head_dim + m.v_head_dim) * elem


def kv_bytes_read(cfg, elem: int, context: float) -> float:
    """K and V bytes (MLA: latent and rope key) one decode token reads at ``context`` tokens: a sliding-window layer
    (GPT-OSS) only its last ``window`` tokens'."""
    windows = cfg.attention.sliding_windows
    per_layer = kv_bytes_per_token(cfg, elem) // max(len(cfg.attention_layers), 1)
    return sum(per_layer * (min(context, windows[i]) if windows and windows[i] else context)
               for i in cfg.attention_layers)


def state_bytes_per_sequence(cfg, elem: int) -> int:
    """A hybrid model's recurrent states of one sequence (conv inputs in the model dtype, the recurrence's state
    float32), every recurrent layer: what a decode step reads and writes back per sequence."""
    total = 0
    for i in cfg.recurrent_layers:
        if cfg.layer_type(i) == "linear_attention":
            la = cfg.linear_attention
            total += la.conv_dim * la.conv_kernel * elem + la.num_v_heads * la.head_k_dim * la.head_v_dim * 4
        else:
            m = cfg.mamba
            total += m.conv_dim * m.conv_kernel * elem + m.num_heads * m.head_dim * m.state_size * 4
    return total


def expected_distinct_experts(cfg, tokens: int) -> float:
    """Experts per MoE layer that at least one of ``tokens`` tokens picks, if each picks K of E uniformly."""
    E, K = cfg.num_experts, cfg.num_experts_per_tok
    return E * (1.0 - (1.0 - K / E) ** tokens)


def decode_step_bytes(cfg, elem: int, batch: int, mean_context: float) -> dict[str, float]:
    """Bytes a decode step of ``batch`` sequences must read: the weights (experts: the expected number hit
    under uniform routing) and the KV cache of every sequence at ``mean_context`` tokens."""
    per_token = weight_bytes_per_token(cfg, elem)
    experts_key = next(k for k in per_token if k.startswith("experts"))
    one_expert_all_layers = per_token[experts_key] / cfg.num_experts_per_tok
    weights = sum(per_token.values()) - per_token[experts_key]
    weights += one_expert_all_layers * expected_distinct_experts(cfg, batch) + (batch - 1) * cfg.hidden_size * elem
    kv = batch * kv_bytes_read(cfg, elem, mean_context)
    states = 2 * batch * state_bytes_per_sequence(cfg, elem)  # hybrids: read and written back
    out = {"weights": weights, "kv_cache": kv, "total": weights + kv + states}
    if states:
        out["recurrent_states"] = states
    return out


def prefill_matmul_flops(cfg, prompt_len: int, num_seqs: int) -> dict[str, float]:
    """Matmul FLOPs of prefilling ``num_seqs`` prompts of ``prompt_len`` tokens: 2 x weights touched per token
    (projections, router, K experts, shared experts, dense MLPs), causal attention QK^T and PV in the attention
    layers, a hybrid's recurrences (Gated DeltaNet: ~6 Dk Dv per value head and token; Mamba-2: ~4 P N per head and
    token), and lm_head for the last token."""
    H, D, Hq = cfg.hidden_size, cfg.attention.head_dim, cfg.attention.num_heads
    if cfg.attention.mla is not None:  # expanded prefill: QK^T over qk dims, PV over v dims (D: their mean)
        D = (cfg.attention.head_dim + cfg.attention.mla.v_head_dim) / 2
    per_token = sum(v for k, v in weight_bytes_per_token(cfg, 1).items()
                    if k not in ("lm_head", "embedding row", "q/k norms") and not k.startswith("layer norms"))
    linear = 2.0 * per_token * prompt_len * num_seqs
    attention = 2.0 * Hq * D * prompt_len * (prompt_len + 1) * len(cfg.attention_layers) * num_seqs  # causal half
    recurrent = 0.0
    for i in cfg.recurrent_layers:
        if cfg.layer_type(i) == "linear_attention":
            la = cfg.linear_attention
            recurrent += 6.0 * la.num_v_heads * la.head_k_dim * la.head_v_dim
        else:
            recurrent += 4.0 * cfg.mamba.num_heads * cfg.mamba.head_dim * cfg.mamba.state_size
    recurrent *= prompt_len * num_seqs
    lm_head = 2.0 * cfg.vocab_size * H * num_seqs
    out = {"linear": linear, "attention": attention, "lm_head": lm_head,
           "total": linear + attention + lm_head + recurrent}
    if recurrent:
        out["recurrent"] = recurrent
    return out


def bf16_dense_peak_flops(device: torch.device) -> float | None:
    """Published dense bf16 tensor-core peak of the GPU, where known (H100/H200 SXM: 989 TFLOP/s)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, peak in (("H200", 989e12), ("H100", 989e12), ("A100", 312e12)):
        if key in name:
            return peak
    return None


def measure_copy_bandwidth(device: torch.device, nbytes: int | None = None, iters: int = 10) -> dict:
    """Device-to-device copy bandwidth: (bytes read + bytes written) / time of one large ``copy_``; median of
    ``iters`` copies after 3 warm-up copies."""
    nbytes = nbytes or ((2 << 30) if device.type == "cuda" else (64 << 20))
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    _sync(device)
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - t0)
    del src, dst
    free_device_memory(device)
    med = statistics.median(times)
    return {"bytes_per_s": 2 * nbytes / med, "best_bytes_per_s": 2 * nbytes / min(times), "buffer_bytes": nbytes,
            "iters": iters, "method": "copy_ of one buffer into another; (read + written bytes) / median time"}


def graph_replay_seconds(run: Callable[[], None], reps: int) -> float:
    """Median seconds of one replay of a CUDA graph of ``run()`` (warmed and compiled on a side stream first,
    then captured once): the GPU time of a sequence of small launches without the host's launch latency, as the
    engine's decode graphs run them."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


@torch.no_grad()
def time_lm_head(model, rows: int, iters: int = 20) -> float | None:
    """Seconds of the engine's ``compute_logits`` (lm_head matmul + float32 logits) for ``rows`` hidden rows
    alone (CUDA only): the profile's cross-check of what its lm_head class should add up to per step."""
    device = model.device
    if device.type != "cuda":
        return None
    x = torch.randn(rows, model.config.hidden_size, device=device, dtype=model.dtype)
    for _ in range(3):
        model.compute_logits(x)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(iters):
        start.record()
        model.compute_logits(x)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def routing_stats(rows, cfg, batch: int, seed: int = 0) -> dict:
    """Routing rows [R, L, K] (numpy) -> expert load per MoE layer (busiest and idlest expert over the mean,
    worst layer) and the mean number of distinct experts per layer that random groups of ``batch`` rows hit
    (what a decode step of ``batch`` sequences reads), next to the uniform-routing expectation."""
    import numpy as np

    E, layers = cfg.num_experts, list(cfg.moe_layers)
    loads = [np.bincount(rows[:, layer].ravel(), minlength=E) for layer in layers]
    order = np.random.default_rng(seed).permutation(rows.shape[0])
    groups = [order[i : i + batch] for i in range(0, len(order) - batch + 1, batch)][:64] or [order]
    distinct = [len(np.unique(rows[g][:, layer])) for g in groups for layer in layers]
    return {"rows": int(rows.shape[0]), "max_over_mean": float(max(c.max() / c.mean() for c in loads)),
            "min_over_mean": float(min(c.min() / c.mean() for c in loads)),
            "distinct_per_step": float(np.mean(distinct)), "distinct_uniform": expected_distinct_experts(cfg, batch)}


# ----------------------------------------------------------------------------- profile traces

# Op class of a kernel, from its name (first match wins; the top-kernel table shows each kernel's class, so a
# misfiled kernel is visible). Triton kernels of kernels.py: _add_square / _rms_norm_tail / _qk_norm_rope
# (norms/rope), _route / _combine (routing), _store_kv (attention: the KV write).
OP_CLASSES = (
    ("sampling", r"argmax|multinomial|exponential|sampl|log_?softmax|gumbel"),
    ("attention", r"flash|fmha|attn|attention|sdpa|paged|flex|store_kv|reshape_and_cache|decode_kernel"),
    ("routing", r"topk|route|router|radix|sort|combine|softmax|bincount|scatter|cumsum|scan"),
    ("expert GEMMs", r"group|moe|expert|silu|swiglu|act_and_mul"),
    ("dense GEMMs", r"gemm|gemv|xmma|nvjet|cutlass|cublas|matmul|sm90_|sm80_|splitk|wgmma"),
    ("norms/rope", r"norm|rms|rope|rotary|add_square|rsqrt|mean"),
    ("copies", r"memcpy|memset|copy|catarray"),
)
DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def op_class(name: str, cat: str = "kernel") -> str:
    if cat in ("gpu_memcpy", "gpu_memset"):
        return "copies"
    low = name.lower()
    return next((cls for cls, rx in OP_CLASSES if re.search(rx, low)), "other")


def summarize_trace(events: list[dict], steps: int, wall_s: float, lm_head_min_us: float | None) -> dict:
    """Device time per op class and per kernel, busy time (union of kernel intervals) and the idle time between
    kernels (by length, and by the pair of kernels around it), from chrome-trace events. A dense GEMM that runs at
    least ``lm_head_min_us`` (half of what reading lm_head's weights takes at the measured bandwidth: no other dense
    GEMM of a decode step reads that much) is counted as lm_head."""
    dev = [e for e in events if e.get("ph") == "X" and e.get("cat") in DEVICE_CATS and "dur" in e]
    if not dev:  # CPU: no device kernels (and a profiler sees only its own thread's CPU ops)
        dev = [e for e in events if e.get("ph") == "X" and e.get("cat") == "cpu_op" and "dur" in e]
    kernels: dict[tuple[str, str], dict] = {}  # (name, class) -> count, time
    for e in dev:
        cls = op_class(e["name"], e["cat"])
        if cls == "dense GEMMs" and lm_head_min_us and float(e["dur"]) >= lm_head_min_us:
            cls = "lm_head"
        k = kernels.setdefault((e["name"], cls), {"count": 0, "total_us": 0.0})
        k["count"] += 1
        k["total_us"] += float(e["dur"])
    busy, end, last = 0.0, None, None  # union of [ts, ts + dur]; last: the kernel that ended at ``end``
    gaps: dict[tuple[str, str], dict] = {}  # (kernel before, kernel after) -> idle between them
    bins = {"< 10 us": 0.0, "10-100 us": 0.0, "0.1-1 ms": 0.0, ">= 1 ms": 0.0}
    for start, stop, name in sorted((float(e["ts"]), float(e["ts"]) + float(e["dur"]), e["name"]) for e in dev):
        if end is None or start > end:
            if end is not None:
                idle = start - end
                g = gaps.setdefault((last, name), {"count": 0, "idle_us": 0.0})
                g["count"] += 1
                g["idle_us"] += idle
                bins[next(b for b, hi in zip(bins, (10, 100, 1000, float("inf"))) if idle < hi)] += idle
            busy += stop - start
            end, last = stop, name
        elif stop > end:
            busy += stop - end
            end, last = stop, name
    classes: dict[str, float] = {}
    for (_, cls), k in kernels.items():
        classes[cls] = classes.get(cls, 0.0) + k["total_us"]
    # Device time is divided by the steps whose kernels the trace holds: one lm_head GEMM per decode step. The
    # engine's step counter (``steps``) also counts a step launched before the profiler started (with overlapped
    # decode its graph replay records no kernels), which made every per-step device time ~10% short (runs <= 24).
    lm_launches = sum(k["count"] for (_, cls), k in kernels.items() if cls == "lm_head")
    per_dev = lm_launches or max(steps, 1)
    per = max(steps, 1)
    top = sorted(kernels.items(), key=lambda kv: -kv[1]["total_us"])[:25]
    return {"steps": steps, "trace_steps": per_dev, "wall_per_step_ms": wall_s / per * 1e3,
            "busy_per_step_ms": busy / per_dev / 1e3,
            "kernel_time_per_step_ms": sum(classes.values()) / per_dev / 1e3,
            "classes_ms_per_step": {c: t / per_dev / 1e3 for c, t in sorted(classes.items(), key=lambda kv: -kv[1])},
            "top_kernels": [{"name": n, "class": c, **k, "per_step_us": k["total_us"] / per_dev} for (n, c), k in top],
            # The device's idle time between kernels per step, by length (the >= 1 ms ones are host work between
            # steps, or a wait for it), and the kernel pairs with the most idle time between them: where the GPU
            # waited for the host inside a step (a sync, or launches slower than the kernels they start).
            "idle_per_step_ms": {b: t / per_dev / 1e3 for b, t in bins.items()},
            "top_idle": [{"before": a, "after": b, **g, "per_step_us": g["idle_us"] / per_dev}
                         for (a, b), g in sorted(gaps.items(), key=lambda kv: -kv[1]["idle_us"])[:12]]}
