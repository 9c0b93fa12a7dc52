"""config.json -> MoEConfig: per-architecture keys, MoE-layer selection, metadata, clear errors, no torch."""
from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from moe_engine.config import SUPPORTED_ARCHITECTURES, MoEConfig, UnsupportedModelError, config_from_dict, load_config
from moe_engine.layers import rotary

from .hf_checkpoints import ARCHS, hf_config


def write(tmp_path, raw: dict, gen: dict | None = None):
    (tmp_path / "config.json").write_text(json.dumps(raw))
    if gen is not None:
        (tmp_path / "generation_config.json").write_text(json.dumps(gen))
    return tmp_path


def hf_written(arch, tmp_path) -> dict:
    """config.json exactly as transformers 5.24 writes it."""
    hf_config(arch).save_pretrained(tmp_path)
    return json.loads((tmp_path / "config.json").read_text())


def test_supported_list():
    assert SUPPORTED_ARCHITECTURES == (
        "deepseek_v2", "deepseek_v3", "glm4_moe", "glm4_moe_lite", "gpt_oss", "mixtral", "nemotron_h", "olmoe",
        "qwen2_moe", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_moe", "qwen3_next",
    )
    assert set(ARCHS) | {"qwen3_5_moe_text"} == set(SUPPORTED_ARCHITECTURES)  # (the text config: test_qwen3_next_fields)


def test_metadata_and_moe_layers_from_transformers_configs(tmp_path):
    expect = {  # arch -> (moe_layers, E, K, head_dim)
        "mixtral": ((0, 1, 2), 8, 2, 16),
        "qwen2_moe": ((0, 2), 60, 4, 16),  # mlp_only_layers=[1]
        "qwen3_moe": ((1, 3), 16, 4, 32),  # decoder_sparse_step=2; explicit head_dim
        "olmoe": ((0, 1), 64, 8, 16),
        "deepseek_v2": ((1, 2), 16, 4, 24),  # first_k_dense_replace=1; head_dim = qk_nope + qk_rope
        "deepseek_v3": ((1, 2), 16, 4, 24),
        "gpt_oss": ((0, 1, 2), 8, 2, 16),
        "glm4_moe": ((1, 2), 16, 4, 32),  # first_k_dense_replace=1; explicit head_dim
        "glm4_moe_lite": ((1, 2, 4), 16, 4, 24),  # mlp_layer_types; head_dim = qk_nope + qk_rope
        "qwen3_next": ((0, 2, 3, 4), 16, 4, 32),  # mlp_only_layers=[1]
        "qwen3_5_moe": ((0, 1, 2, 3, 4), 16, 4, 32),  # text_config of the multimodal config
        "nemotron_h": ((1, 5), 16, 4, 16),  # the MoE blocks of layers_block_type
    }
    for arch, (moe_layers, E, K, D) in expect.items():
        d = tmp_path / arch
        d.mkdir()
        hf_written(arch, d)
        cfg = load_config(d)
        assert isinstance(cfg, MoEConfig)
        got = (cfg.moe_layers, cfg.num_experts, cfg.num_experts_per_tok, cfg.attention.head_dim)
        assert got == (moe_layers, E, K, D), arch
        meta = cfg.metadata()
        assert meta == {
            "architecture": arch,
            "num_hidden_layers": cfg.num_hidden_layers,
            "moe_layers": list(moe_layers),
            "num_experts": E,
            "num_experts_per_tok": K,
            "routed_experts_dtype": "uint8",
            "quantization": "none",
            **({"layer_types": list(cfg.layer_types)} if cfg.is_hybrid else {}),
        }
        json.dumps(meta)
        assert cfg.torch_dtype == "float32" and cfg.eos_token_ids == (2,) and cfg.bos_token_id == 1


def test_arch_specific_fields(tmp_path):
    cfgs = {}
    for arch in ARCHS:
        (tmp_path / arch).mkdir()
        cfgs[arch] = config_from_dict(hf_written(arch, tmp_path / arch))
    mx, q2, q3, ol = cfgs["mixtral"], cfgs["qwen2_moe"], cfgs["qwen3_moe"], cfgs["olmoe"]
    assert mx.rope.theta == 1e6 and mx.attention.sliding_windows == (16, 16, 16) and mx.router.weights_fp32
    assert mx.router.norm_topk_prob
    assert q2.experts.shared_intermediate_size == 32 and q2.experts.shared_gate
    assert q2.attention.qkv_bias and not q2.attention.o_bias
    assert q2.intermediate_size == 48 and q2.experts.intermediate_size == 16 and not q2.router.norm_topk_prob
    assert q2.attention.sliding_windows == (None, None, None)  # use_sliding_window=False
    assert q3.attention.qk_norm == "head" and q3.router.norm_topk_prob and not q3.router.weights_fp32
    assert ol.attention.qk_norm == "full" and ol.attention.clip_qkv == 0.3 and ol.tie_word_embeddings


def test_legacy_hub_keys():
    """Hub configs written by transformers 4.x: torch_dtype, rope_theta, rope_scaling, num_experts naming."""
    raw = {
        "model_type": "qwen3_moe", "vocab_size": 100, "hidden_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 4, "num_experts": 128, "num_experts_per_tok": 8,
        "moe_intermediate_size": 8, "intermediate_size": 16, "torch_dtype": "bfloat16", "rope_theta": 1e6,
        "rope_scaling": None, "eos_token_id": [5, 6], "head_dim": 128, "norm_topk_prob": True,
        "use_sliding_window": False, "sliding_window": None, "max_window_layers": 48, "mlp_only_layers": [],
    }
    cfg = config_from_dict(raw)
    assert cfg.torch_dtype == "bfloat16" and cfg.rope.theta == 1e6 and cfg.eos_token_ids == (5, 6)
    assert cfg.attention.head_dim == 128 and cfg.moe_layers == (0, 1)
    linear = config_from_dict({**raw, "rope_scaling": {"type": "linear", "factor": 4.0}})
    assert (linear.rope.type, linear.rope.factor) == ("linear", 4.0)
    qwen2 = config_from_dict({**raw, "model_type": "qwen2_moe", "num_experts": 300, "decoder_sparse_step": 2,
                              "shared_expert_intermediate_size": 0, "use_sliding_window": True, "sliding_window": 8,
                              "max_window_layers": 1})
    assert qwen2.routed_experts_dtype == "uint16" and qwen2.moe_layers == (1,) and not qwen2.experts.shared_gate
    assert qwen2.attention.sliding_windows == (8, None)


def test_deepseek_and_gpt_oss_fields(tmp_path):
    cfgs = {}
    for arch in ("deepseek_v2", "deepseek_v3", "gpt_oss"):
        (tmp_path / arch).mkdir()
        cfgs[arch] = config_from_dict(hf_written(arch, tmp_path / arch))
    v2, v3, go = cfgs["deepseek_v2"], cfgs["deepseek_v3"], cfgs["gpt_oss"]
    for c in (v2, v3):
        mla = c.attention.mla
        assert c.attention.kind == "mla" and mla.kv_lora_rank == 32
        assert (mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.v_head_dim) == (16, 8, 16)
        assert c.dense_layers == (0,) and c.intermediate_size == 48 and c.experts.block == "deepseek" and c.router.fp32
        assert c.attention.num_kv_heads == c.attention.num_heads and (c.router.n_group, c.router.topk_group) == (4, 2)
    v2_scale, v3_scale = (rotary.deepseek_softmax_scale(c.rope, c.attention.head_dim) for c in (v2, v3))
    assert v2.attention.mla.q_lora_rank is None and v2.rope.style == "complex" and v2.router.kind == "deepseek_v2"
    assert v2.router.topk_method == "group_limited_greedy" and v2.router.routed_scaling_factor == 2.0
    assert not v2.router.norm_topk_prob
    assert v2.experts.shared_intermediate_size == 32 and v2.rope.type == "default" and v2_scale == 24**-0.5
    assert v3.attention.mla.q_lora_rank == 24 and v3.rope.style == "interleave" and v3.router.kind == "deepseek_v3"
    assert v3.router.norm_topk_prob
    assert v3.router.routed_scaling_factor == 2.5 and v3.experts.shared_intermediate_size == 16
    assert v3.rope.type == "yarn"
    assert v3_scale > 24**-0.5 and rotary.attention_factor(v3.rope) > 1  # mscale_all_dim / mscale at work
    assert go.router.kind == "gpt_oss" and go.experts.block == "gpt_oss" and go.attention.sinks and go.norm_fp32_weight
    assert go.attention.sliding_windows == (8, None, 8) and go.attention.qkv_bias and go.attention.o_bias
    assert go.experts.swiglu_limit == 0.1
    assert go.rope.type == "yarn" and go.rope.factor == 32.0 and go.rope.theta == 150000.0
    assert go.experts.quant == "none"


def test_qwen3_next_fields(tmp_path):
    import transformers

    cfgs = {}
    for arch in ("qwen3_next", "qwen3_5_moe"):
        (tmp_path / arch).mkdir()
        cfgs[arch] = config_from_dict(hf_written(arch, tmp_path / arch))
    nxt, q35 = cfgs["qwen3_next"], cfgs["qwen3_5_moe"]
    for c in (nxt, q35):
        assert c.is_hybrid and c.norm_offset and c.attention.output_gate and c.attention.norm_offset
        assert c.rope.dim == 8 and c.attention.head_dim == 32  # partial_rotary_factor 0.25
        assert c.experts.shared_gate and c.experts.shared_intermediate_size == 24 and c.router.norm_topk_prob
        assert c.linear_attention.num_v_heads == 4 and c.linear_attention.conv_dim == 2 * 2 * 16 + 4 * 16
        assert c.prefix_caching_off_reason is not None
    assert nxt.linear_attention.projections == "qkvz" and nxt.attention_layers == (2, 4) and nxt.dense_layers == (1,)
    assert q35.linear_attention.projections == "split" and q35.recurrent_layers == (0, 2, 3)
    assert q35.key_prefixes == (("model.", "model.language_model."),) and q35.architecture == "qwen3_5_moe"
    # Qwen3.5-35B-A3B's text model as transformers' defaults give it (the issue's real shape)
    text = config_from_dict(transformers.Qwen3_5MoeTextConfig().to_dict())
    assert (text.hidden_size, text.num_hidden_layers, text.num_experts, text.num_experts_per_tok) == (2048, 40, 256, 8)
    assert text.experts.intermediate_size == 512 and text.vocab_size == 248320 and len(text.attention_layers) == 10
    assert text.layer_types[:4] == ("linear_attention",) * 3 + ("attention",) and text.architecture == "qwen3_5_moe_text"
    default_next = config_from_dict(transformers.Qwen3NextConfig().to_dict())
    assert default_next.num_experts == 512 and default_next.num_experts_per_tok == 10
    assert default_next.routed_experts_dtype == "uint16"


# Nemotron-3-Nano-30B-A3B's config.json, abridged to what the engine reads (hybrid_override_pattern: 23 Mamba-2, 23 MoE,
# 6 attention blocks)
NEMOTRON_3_NANO = {
    "model_type": "nemotron_h", "architectures": ["NemotronHForCausalLM"], "vocab_size": 131072, "hidden_size": 2688,
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


def test_nemotron_h_fields(tmp_path):
    (tmp_path / "nh").mkdir()
    nh = config_from_dict(hf_written("nemotron_h", tmp_path / "nh"))
    assert nh.block_style == "single" and nh.layer_types == ("mamba", "none", "attention", "none", "mamba", "none",
                                                              "attention")
    assert nh.moe_layers == (1, 5) and nh.recurrent_layers == (0, 4) and nh.attention_layers == (2, 6)
    assert not nh.attention.rotary and nh.norm_fp32_weight and nh.hidden_act == "relu2"
    assert nh.experts.block == "nemotron_h" and nh.experts.activation == "relu2"
    assert nh.experts.shared_intermediate_size == 24 and nh.router.kind == "deepseek_v3"
    assert (nh.router.n_group, nh.router.topk_group, nh.router.routed_scaling_factor) == (4, 2, 2.0)
    assert nh.mamba.chunk_size == 8 and nh.mamba.conv_dim == 4 * 16 + 2 * 2 * 16 and nh.mamba.time_step_min == 0.001
    assert nh.key_prefixes == (("model.", "backbone."),)
    nano = config_from_dict(NEMOTRON_3_NANO)
    assert nano.num_hidden_layers == 52 and len(nano.moe_layers) == 23 and len(nano.recurrent_layers) == 23
    assert len(nano.attention_layers) == 6 and nano.moe_layers[:3] == (1, 3, 6)
    assert (nano.num_experts, nano.num_experts_per_tok, nano.mamba.num_heads) == (128, 6, 64)
    assert nano.metadata()["moe_layers"] == list(nano.moe_layers)
    assert nano.metadata()["layer_types"][:6] == ["mamba", "none", "mamba", "none", "mamba", "attention"]
    with pytest.raises(UnsupportedModelError, match="hybrid_override_pattern"):
        config_from_dict({**NEMOTRON_3_NANO, "hybrid_override_pattern": "MX"})


def test_glm_fields(tmp_path):
    cfgs = {}
    for arch in ("glm4_moe", "glm4_moe_lite"):
        (tmp_path / arch).mkdir()
        cfgs[arch] = config_from_dict(hf_written(arch, tmp_path / arch))
    glm, lite = cfgs["glm4_moe"], cfgs["glm4_moe_lite"]
    for c in (glm, lite):  # DeepSeek-V3's router and MoE block
        r = c.router
        assert (r.kind, r.fp32, r.n_group, r.topk_group, r.norm_topk_prob) == ("deepseek_v3", True, 4, 2, True)
        assert c.experts.block == "deepseek" and c.rms_norm_eps == 1e-5
    assert glm.attention.kind == "gqa" and glm.attention.qk_norm == "head" and glm.attention.qkv_bias
    assert not glm.attention.o_bias  # GLM's o_proj has no bias whatever attention_bias says
    assert glm.rope.dim == 16 and glm.attention.head_dim == 32  # partial_rotary_factor 0.5 (HF's default)
    assert glm.router.routed_scaling_factor == 2.5 and glm.experts.shared_intermediate_size == 16
    assert lite.attention.kind == "mla" and lite.rope.style == "interleave" and lite.rope.dim == 8
    assert lite.dense_layers == (0, 3) and lite.experts.shared_intermediate_size == 32
    assert lite.router.routed_scaling_factor == 1.8
    full = config_from_dict({**hf_written("glm4_moe", tmp_path / "glm4_moe"), "partial_rotary_factor": 1.0,
                             "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}})
    assert full.rope.dim == 32 and full.rope.theta == 1e6
    with pytest.raises(UnsupportedModelError, match="n_group"):
        config_from_dict({**hf_written("glm4_moe", tmp_path / "glm4_moe"), "n_group": 3})
    with pytest.raises(UnsupportedModelError, match="mlp_layer_types"):
        config_from_dict({**hf_written("glm4_moe_lite", tmp_path / "glm4_moe_lite"), "mlp_layer_types": ["dense"]})


def test_glm_shapes_of_transformers_defaults():
    """GLM-4.5 (Glm4MoeConfig()'s defaults, head_dim as its Hub config) and GLM-4.7-Flash (Glm4MoeLiteConfig()'s), as transformers writes them;
    GLM-4.5-Air's Hub config.json (abridged)."""
    import transformers

    glm = config_from_dict(transformers.Glm4MoeConfig(head_dim=128).to_dict())  # the Hub config states head_dim
    assert glm.moe_layers == tuple(range(1, 46)) and (glm.num_experts, glm.num_experts_per_tok) == (128, 8)
    assert glm.attention.head_dim == 128 and glm.rope.dim == 64 and glm.attention.num_kv_heads == 8
    lite = config_from_dict(transformers.Glm4MoeLiteConfig().to_dict())
    assert lite.moe_layers == tuple(range(1, 47)) and (lite.num_experts, lite.num_experts_per_tok) == (64, 4)
    assert lite.attention.mla.q_lora_rank == 768 and lite.attention.head_dim == 256 and lite.rope.dim == 64
    assert lite.experts.shared_intermediate_size == 1536 and lite.router.routed_scaling_factor == 1.8
    air = config_from_dict({
        "model_type": "glm4_moe", "architectures": ["Glm4MoeForCausalLM"], "attention_bias": True, "head_dim": 128,
        "hidden_act": "silu", "hidden_size": 4096, "intermediate_size": 10944, "max_position_embeddings": 131072,
        "moe_intermediate_size": 1408, "n_group": 1, "n_routed_experts": 128, "n_shared_experts": 1,
        "norm_topk_prob": True, "num_attention_heads": 96, "num_experts_per_tok": 8, "first_k_dense_replace": 1,
        "num_hidden_layers": 46, "num_key_value_heads": 8, "num_nextn_predict_layers": 1,
        "partial_rotary_factor": 0.5, "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 1000000,
        "routed_scaling_factor": 1.0, "topk_group": 1, "torch_dtype": "bfloat16", "use_qk_norm": False,
        "vocab_size": 151552, "eos_token_id": [151329, 151336, 151338], "pad_token_id": 151329,
    })
    assert air.rope.dim == 64 and air.rope.theta == 1e6 and air.attention.qkv_bias and air.attention.qk_norm == "none"
    assert air.moe_layers == tuple(range(1, 46)) and air.eos_token_ids == (151329, 151336, 151338)


# Hub config.json files of the real checkpoints (as published; values abridged to what the engine reads).
DEEPSEEK_V2_LITE = {
    "model_type": "deepseek_v2", "vocab_size": 102400, "hidden_size": 2048, "intermediate_size": 10944,
    "moe_intermediate_size": 1408, "num_hidden_layers": 27, "num_attention_heads": 16, "num_key_value_heads": 16,
    "n_shared_experts": 2, "n_routed_experts": 64, "routed_scaling_factor": 1.0, "kv_lora_rank": 512,
    "q_lora_rank": None, "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128, "topk_method": "greedy",
    "n_group": 1, "topk_group": 1, "num_experts_per_tok": 6, "moe_layer_freq": 1, "first_k_dense_replace": 1,
    "norm_topk_prob": False, "scoring_func": "softmax", "hidden_act": "silu", "max_position_embeddings": 163840,
    "rms_norm_eps": 1e-06, "rope_theta": 10000, "torch_dtype": "bfloat16", "bos_token_id": 100000,
    "eos_token_id": 100001, "tie_word_embeddings": False, "attention_bias": False,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 0.707, "mscale_all_dim": 0.707,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
}
DEEPSEEK_V3 = {
    "model_type": "deepseek_v3", "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432,
    "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_nextn_predict_layers": 1,
    "num_attention_heads": 128, "num_key_value_heads": 128, "n_shared_experts": 1, "n_routed_experts": 256,
    "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64,
    "v_head_dim": 128, "qk_nope_head_dim": 128, "topk_method": "noaux_tc", "n_group": 8, "topk_group": 4,
    "num_experts_per_tok": 8, "moe_layer_freq": 1, "first_k_dense_replace": 3, "norm_topk_prob": True,
    "scoring_func": "sigmoid", "hidden_act": "silu", "max_position_embeddings": 163840, "rms_norm_eps": 1e-06,
    "rope_theta": 10000, "torch_dtype": "bfloat16", "bos_token_id": 0, "eos_token_id": 1,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "weight_block_size": [128, 128]},
}
GPT_OSS_20B = {
    "model_type": "gpt_oss", "attention_bias": True, "eos_token_id": 200002, "experts_per_token": 4,
    "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880, "intermediate_size": 2880,
    "layer_types": ["sliding_attention", "full_attention"] * 12, "max_position_embeddings": 131072,
    "num_attention_heads": 64, "num_experts_per_tok": 4, "num_hidden_layers": 24, "num_key_value_heads": 8,
    "num_local_experts": 32, "pad_token_id": 199999, "rms_norm_eps": 1e-05, "rope_theta": 150000,
    "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "original_max_position_embeddings": 4096,
                     "rope_type": "yarn", "truncate": False},
    "sliding_window": 128, "swiglu_limit": 7.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "vocab_size": 201088,
    "quantization_config": {"modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                       "model.embed_tokens", "lm_head"], "quant_method": "mxfp4"},
}


def test_real_hub_configs():
    v2 = config_from_dict(DEEPSEEK_V2_LITE)
    assert v2.moe_layers == tuple(range(1, 27)) and v2.dense_layers == (0,)  # 27 layers, 26 MoE
    assert (v2.num_experts, v2.num_experts_per_tok, v2.router.topk_method) == (64, 6, "greedy")
    assert v2.attention.head_dim == 192 and v2.attention.mla.q_lora_rank is None
    assert v2.experts.shared_intermediate_size == 2816
    assert v2.rope.type == "yarn" and v2.rope.factor == 40 and v2.rope.dim == 64
    mscale = 0.1 * 0.707 * math.log(40) + 1.0
    v2_scale = rotary.deepseek_softmax_scale(v2.rope, v2.attention.head_dim)
    assert v2_scale == pytest.approx(192**-0.5 * mscale * mscale, rel=1e-12)
    assert rotary.attention_factor(v2.rope) == 1.0  # mscale == mscale_all_dim
    assert v2.metadata()["moe_layers"] == list(range(1, 27)) and v2.metadata()["num_hidden_layers"] == 27

    fp8 = config_from_dict(DEEPSEEK_V3)  # the Hub's block-FP8 checkpoint (dequantised at load)
    assert fp8.quantization.method == "fp8" and fp8.quantization.weight_block_size == (128, 128)
    v3 = config_from_dict({k: v for k, v in DEEPSEEK_V3.items() if k != "quantization_config"})  # a bf16 conversion
    assert v3.quantization.method == "none"
    assert v3.moe_layers == tuple(range(3, 61)) and len(v3.moe_layers) == 58 and v3.routed_experts_dtype == "uint8"
    r = v3.router
    assert (v3.num_experts, r.n_group, r.topk_group, r.routed_scaling_factor) == (256, 8, 4, 2.5)
    assert v3.router.kind == "deepseek_v3" and v3.attention.mla.q_lora_rank == 1536 and v3.rope.style == "interleave"

    go = config_from_dict(GPT_OSS_20B)
    assert go.experts.quant == "mxfp4" and go.moe_layers == tuple(range(24)) and go.num_experts == 32
    assert go.attention.sliding_windows == (128, None) * 12 and go.attention.head_dim == 64
    assert go.attention.num_kv_heads == 8
    assert rotary.attention_factor(go.rope) == pytest.approx(0.1 * math.log(32) + 1.0)


def test_deepseek_and_gpt_oss_errors():
    with pytest.raises(UnsupportedModelError, match="topk_method 'noaux_tc' is not supported"):
        config_from_dict({**DEEPSEEK_V2_LITE, "topk_method": "noaux_tc"})
    with pytest.raises(UnsupportedModelError, match="moe_layer_freq=2"):
        config_from_dict({**DEEPSEEK_V2_LITE, "moe_layer_freq": 2})
    with pytest.raises(UnsupportedModelError, match="multiple of n_group"):
        config_from_dict({**DEEPSEEK_V2_LITE, "topk_method": "group_limited_greedy", "n_group": 5, "topk_group": 2})
    with pytest.raises(UnsupportedModelError, match="rope type 'longrope'"):
        config_from_dict({**DEEPSEEK_V2_LITE, "rope_scaling": {"type": "longrope", "factor": 2.0}})
    with pytest.raises(UnsupportedModelError, match=r"gpt_oss: quantized checkpoints \(bitsandbytes\)"):
        config_from_dict({**GPT_OSS_20B, "quantization_config": {"quant_method": "bitsandbytes"}})
    with pytest.raises(UnsupportedModelError, match="layer_types"):
        config_from_dict({**GPT_OSS_20B, "layer_types": ["chunked_attention"] * 24})


def test_generation_config_eos_merged(tmp_path):
    raw = json.loads(json.dumps(hf_config("mixtral").to_dict()))
    cfg = load_config(write(tmp_path, raw, gen={"eos_token_id": [2, 7]}))
    assert cfg.eos_token_ids == (2, 7)


def test_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="not found"):
        load_config(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_config(tmp_path)
    llama = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2, "vocab_size": 10}
    with pytest.raises(UnsupportedModelError, match=r"'llama' is not a Mixture-of-Experts model; supported MoE architectures: "
                       + ", ".join(SUPPORTED_ARCHITECTURES)):
        load_config(write(tmp_path, llama))
    with pytest.raises(UnsupportedModelError, match=r"model_type 'llama4_text' is not supported; supported MoE architectures: deepseek_v2, "):
        config_from_dict({**llama, "model_type": "llama4_text"})
    base = hf_config("qwen2_moe").to_dict()
    with pytest.raises(UnsupportedModelError, match="no MoE layers"):
        config_from_dict({**base, "num_experts": 0})
    with pytest.raises(UnsupportedModelError, match="rope type 'yarn'"):
        config_from_dict({**base, "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}})
    with pytest.raises(UnsupportedModelError, match="hidden_act 'gelu'"):
        config_from_dict({**base, "hidden_act": "gelu"})
    with pytest.raises(UnsupportedModelError, match=r"quantized checkpoints \(awq\) are not supported; supported: "
                                                    r"quant_method 'fp8'"):
        config_from_dict({**base, "quantization_config": {"quant_method": "awq"}})
    with pytest.raises(UnsupportedModelError, match="no model_type"):
        config_from_dict({})
    for e in [UnsupportedModelError("x")]:
        assert isinstance(e, ValueError)


def test_config_module_does_not_import_torch(tmp_path):
    (tmp_path / "m").mkdir()
    hf_written("olmoe", tmp_path / "m")
    code = (
        "import sys; from moe_engine.config import load_config; "
        f"c = load_config({str(tmp_path / 'm')!r}); print(c.metadata()['num_experts']); "
        "assert 'torch' not in sys.modules"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "64"
