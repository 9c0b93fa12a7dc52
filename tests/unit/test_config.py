"""config.json -> MoEConfig: per-architecture keys, MoE-layer selection, metadata, clear errors, no torch."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from moe_engine.config import SUPPORTED_ARCHITECTURES, MoEConfig, UnsupportedModelError, config_from_dict, load_config

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
    assert SUPPORTED_ARCHITECTURES == ("mixtral", "olmoe", "qwen2_moe", "qwen3_moe")
    assert set(ARCHS) == set(SUPPORTED_ARCHITECTURES)


def test_metadata_and_moe_layers_from_transformers_configs(tmp_path):
    expect = {  # arch -> (moe_layers, E, K, head_dim)
        "mixtral": ((0, 1, 2), 8, 2, 16),
        "qwen2_moe": ((0, 2), 60, 4, 16),  # mlp_only_layers=[1]
        "qwen3_moe": ((1, 3), 16, 4, 32),  # decoder_sparse_step=2; explicit head_dim
        "olmoe": ((0, 1), 64, 8, 16),
    }
    for arch, (moe_layers, E, K, D) in expect.items():
        d = tmp_path / arch
        d.mkdir()
        hf_written(arch, d)
        cfg = load_config(d)
        assert isinstance(cfg, MoEConfig)
        assert (cfg.moe_layers, cfg.num_experts, cfg.num_experts_per_tok, cfg.head_dim) == (moe_layers, E, K, D), arch
        meta = cfg.metadata()
        assert meta == {
            "architecture": arch,
            "num_hidden_layers": cfg.num_hidden_layers,
            "moe_layers": list(moe_layers),
            "num_experts": E,
            "num_experts_per_tok": K,
            "routed_experts_dtype": "uint8",
        }
        json.dumps(meta)
        assert cfg.torch_dtype == "float32" and cfg.eos_token_ids == (2,) and cfg.bos_token_id == 1


def test_arch_specific_fields(tmp_path):
    cfgs = {}
    for arch in ARCHS:
        (tmp_path / arch).mkdir()
        cfgs[arch] = config_from_dict(hf_written(arch, tmp_path / arch))
    mx, q2, q3, ol = cfgs["mixtral"], cfgs["qwen2_moe"], cfgs["qwen3_moe"], cfgs["olmoe"]
    assert mx.rope_theta == 1e6 and mx.sliding_windows == (16, 16, 16) and mx.router_weights_fp32 and mx.norm_topk_prob
    assert q2.shared_expert_intermediate_size == 32 and q2.shared_expert_gate and q2.qkv_bias and not q2.o_bias
    assert q2.intermediate_size == 48 and q2.moe_intermediate_size == 16 and not q2.norm_topk_prob
    assert q2.sliding_windows == (None, None, None)  # use_sliding_window=False
    assert q3.qk_norm == "head" and q3.norm_topk_prob and not q3.router_weights_fp32
    assert ol.qk_norm == "full" and ol.clip_qkv == 0.3 and ol.tie_word_embeddings


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
    assert cfg.torch_dtype == "bfloat16" and cfg.rope_theta == 1e6 and cfg.eos_token_ids == (5, 6)
    assert cfg.head_dim == 128 and cfg.moe_layers == (0, 1)
    linear = config_from_dict({**raw, "rope_scaling": {"type": "linear", "factor": 4.0}})
    assert (linear.rope_type, linear.rope_factor) == ("linear", 4.0)
    qwen2 = config_from_dict({**raw, "model_type": "qwen2_moe", "num_experts": 300, "decoder_sparse_step": 2,
                              "shared_expert_intermediate_size": 0, "use_sliding_window": True, "sliding_window": 8,
                              "max_window_layers": 1})
    assert qwen2.routed_experts_dtype == "uint16" and qwen2.moe_layers == (1,) and not qwen2.shared_expert_gate
    assert qwen2.sliding_windows == (8, None)


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
    with pytest.raises(UnsupportedModelError, match=r"'llama' is not a Mixture-of-Experts model; supported MoE architectures: mixtral, olmoe, qwen2_moe, qwen3_moe"):
        load_config(write(tmp_path, llama))
    with pytest.raises(UnsupportedModelError, match=r"model_type 'deepseek_v3' is not supported; supported MoE architectures: mixtral, olmoe, qwen2_moe, qwen3_moe"):
        config_from_dict({**llama, "model_type": "deepseek_v3"})
    base = hf_config("qwen2_moe").to_dict()
    with pytest.raises(UnsupportedModelError, match="no MoE layers"):
        config_from_dict({**base, "num_experts": 0})
    with pytest.raises(UnsupportedModelError, match="rope type 'yarn'"):
        config_from_dict({**base, "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}})
    with pytest.raises(UnsupportedModelError, match="hidden_act 'gelu'"):
        config_from_dict({**base, "hidden_act": "gelu"})
    with pytest.raises(UnsupportedModelError, match="quantized"):
        config_from_dict({**base, "quantization_config": {"quant_method": "fp8"}})
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
