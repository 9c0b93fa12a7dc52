"""FP8 block-scaled checkpoints as DeepSeek-V3, Qwen3-*-FP8 and GLM-*-FP8 publish them (e4m3 ``weight`` +
float32 ``weight_scale_inv`` per 128 x 128 block, ``quantization_config.quant_method: fp8``), loaded dequantised
(the reference path on CPU and GPUs without FP8).

Checkpoints are written by transformers (``save_pretrained`` of a random model), then their tensors quantised into
the published layout (hf_checkpoints.save_fp8_checkpoint). The reference is transformers running the same FP8
weights dequantised block by block by an independent loop (save_dequantized_copy + transformers' own loader):
logits and routed ids must agree as in the bf16 parity tests (float32: logits to 1e-5, id sets 100%).
Shapes are widened past one block (hidden 256, expert width 192: partial last blocks) so that every scale matters.
"""
from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from moe_engine.checkpoint import CheckpointError, load_model
from moe_engine.config import UnsupportedModelError, config_from_dict, load_config
from moe_engine.fp8 import FP8_DTYPE, dequantize_fp8, quantize_activations, quantize_fp8_blocks, w8a8_linear_reference
from moe_engine.models.decoder import reference_forward

from .hf_checkpoints import (
    hf_forward_with_routing,
    load_hf,
    make_hf_model,
    naive_dequantize_fp8,
    save_dequantized_copy,
    save_fp8_checkpoint,
)

# Past one 128-block in every dim that a block covers, with partial last blocks (192 = 128 + 64)
WIDE = {
    "qwen3_moe": dict(hidden_size=256, moe_intermediate_size=192, intermediate_size=320, head_dim=64),
    "deepseek_v3": dict(hidden_size=256, moe_intermediate_size=192, intermediate_size=320, kv_lora_rank=160,
                        q_lora_rank=136),
    "glm4_moe": dict(hidden_size=256, moe_intermediate_size=192, intermediate_size=320, head_dim=64),
}
VOCAB_LO, VOCAB_HI = 3, 256


def random_ids(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(VOCAB_LO, VOCAB_HI, (n,), generator=g).tolist()


@pytest.mark.parametrize("fused", [False, True], ids=["per-expert", "fused"])
@pytest.mark.parametrize("arch", sorted(WIDE))
def test_fp8_checkpoint_matches_dequantized_transformers(arch, fused, tmp_path):
    src = make_hf_model(arch, seed=0, **WIDE[arch])
    path = save_fp8_checkpoint(src, tmp_path / "fp8", fused=fused)
    with safe_open(str(path / "model.safetensors"), "pt") as h:
        keys = set(h.keys())
        q_key = "model.layers.0.self_attn.o_proj.weight"
        assert h.get_slice(q_key).get_dtype() == "F8_E4M3"
        assert h.get_slice(q_key + "_scale_inv").get_dtype() == "F32"
        assert h.get_slice("lm_head.weight").get_dtype() == "F32"
    expert_key = ("model.layers.1.mlp.experts.gate_up_proj" if fused
                  else "model.layers.1.mlp.experts.0.gate_proj.weight")
    assert expert_key in keys
    ref_dir = save_dequantized_copy(path, tmp_path / "dequantized")
    hf = load_hf(ref_dir, torch.float32)
    model = load_model(path, dtype=torch.float32, progress=False)
    assert model.config.quantization.method == "fp8" and model.config.quantization.weight_block_size == (128, 128)
    assert model.config.metadata()["quantization"] == "fp8"
    # the dequantised weights are those of the reference (and quantisation changed them: the test is not vacuous)
    ours = model.model.layers[0].self_attn.o_proj.weight
    ref = hf.model.layers[0].self_attn.o_proj.weight
    assert torch.equal(ours, ref)
    assert not torch.equal(ours, src.model.layers[0].self_attn.o_proj.weight)
    moe = next(i for i, layer in enumerate(hf.model.layers) if hasattr(layer.mlp, "experts"))
    assert torch.equal(model.model.layers[moe].mlp.experts.gate_up_proj, hf.model.layers[moe].mlp.experts.gate_up_proj)
    ids = random_ids(48, seed=3)
    hf_logits, hf_routed = hf_forward_with_routing(hf, torch.tensor([ids]))
    logits, routed = reference_forward(model, ids)
    torch.testing.assert_close(logits, hf_logits[0], rtol=1e-5, atol=1e-5)
    assert hf_routed
    for layer, r in hf_routed.items():
        assert torch.equal(routed[:, layer].long().sort(-1).values, r.sort(-1).values), (arch, layer)


def test_fp8_bf16_load_equals_float32_load_cast(tmp_path):
    """In bf16 each weight is the float32 product cast once (transformers' Fp8Dequantize), not two roundings."""
    src = make_hf_model("qwen3_moe", seed=1, **WIDE["qwen3_moe"])
    path = save_fp8_checkpoint(src, tmp_path / "fp8")
    m32 = load_model(path, dtype=torch.float32, progress=False)
    m16 = load_model(path, dtype=torch.bfloat16, progress=False)
    for (n, a), (_, b) in zip(m32.named_parameters(), m16.named_parameters()):
        assert torch.equal(a.to(b.dtype), b), n


def test_dequantize_equals_transformers_fp8_dequantize():
    """fp8.dequantize_fp8 against transformers' own Fp8Dequantize (integrations/finegrained_fp8.py), bit for bit,
    on divisible shapes (transformers derives the block from the grid) and 3-D experts; partial blocks against
    the naive loop."""
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    g = torch.Generator().manual_seed(0)
    op = Fp8Dequantize(None)
    for shape in ((256, 384), (4, 256, 128)):
        q, s = quantize_fp8_blocks(torch.randn(shape, generator=g), (128, 128))
        for dtype in (torch.float32, torch.bfloat16):
            ref = op._dequantize_one(q, s, output_dtype=dtype)
            assert torch.equal(dequantize_fp8(q, s, (128, 128), dtype), ref), (shape, dtype)
    q, s = quantize_fp8_blocks(torch.randn(576, 200, generator=g), (128, 128))  # DeepSeek's 576-row kv_a_proj
    assert s.shape == (5, 2)
    assert torch.equal(dequantize_fp8(q, s, (128, 128)), naive_dequantize_fp8(q, s, (128, 128)))
    # transformers' fused gate_up grid for a projection narrower than a block: one scale row per half
    q = torch.randn(2, 32, 64, generator=g).to(FP8_DTYPE)
    s = torch.rand(2, 2, 1, generator=g)
    assert torch.equal(dequantize_fp8(q, s, (128, 128)), op._dequantize_one(q, s, output_dtype=torch.float32))


def test_quantize_roundtrip_and_activation_scales():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(300, 260, generator=g)
    q, s = quantize_fp8_blocks(w)
    assert q.dtype == FP8_DTYPE and s.shape == (3, 3) and s.dtype == torch.float32
    torch.testing.assert_close(dequantize_fp8(q, s, (128, 128)), w, rtol=0.07, atol=1e-3)  # e4m3: 3 mantissa bits
    x = torch.randn(5, 260, generator=g)  # [T, K]: w is [N=300, K=260]
    x[2] = 0  # an all-zero token
    xq, xs = quantize_activations(x)
    assert xs.shape == (5, 3) and torch.isfinite(xs).all() and (xq[2].float() == 0).all()
    assert (xq.float().abs().amax(-1)[[0, 1, 3, 4]] == 448).all()  # each token's largest group reaches e4m3's max
    out = w8a8_linear_reference(x.bfloat16(), q, s)
    assert out.dtype == torch.bfloat16 and out.shape == (5, 300)


def test_per_tensor_fp8(tmp_path):
    """weight_block_size null: one scale per tensor (FP8 checkpoints quantised per tensor)."""
    src = make_hf_model("qwen3_moe", seed=2)
    path = save_fp8_checkpoint(src, tmp_path / "fp8", block=None)
    assert load_config(path).quantization.weight_block_size is None
    hf = load_hf(save_dequantized_copy(path, tmp_path / "ref"), torch.float32)
    model = load_model(path, dtype=torch.float32, progress=False)
    ids = random_ids(24, seed=5)
    torch.testing.assert_close(reference_forward(model, ids)[0], hf_forward_with_routing(hf, torch.tensor([ids]))[0][0],
                               rtol=1e-5, atol=1e-5)


QWEN = {"model_type": "qwen3_moe", "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
        "num_hidden_layers": 2, "vocab_size": 256, "num_experts": 8, "num_experts_per_tok": 2,
        "moe_intermediate_size": 16, "intermediate_size": 32}


@pytest.mark.parametrize("qc, match", [
    ({"quant_method": "gptq", "bits": 4}, r"quantized checkpoints \(gptq\) are not supported; supported: quant_method 'fp8'"),
    ({"quant_method": "mxfp4"}, r"\(mxfp4\) are not supported; supported: quant_method 'fp8'"),
    ({"quant_method": "fp8", "activation_scheme": "static"}, "activation_scheme 'static'"),
    ({"quant_method": "fp8", "weight_block_size": [128]}, r"weight_block_size \[128\]"),
    ({"quant_method": "fp8", "fmt": "e5m2"}, "fmt 'e5m2'"),
    ({"quant_method": "fp8", "scale_fmt": "ue8m0"}, "scale_fmt 'ue8m0'"),
])
def test_unsupported_quantization_config(qc, match):
    with pytest.raises(UnsupportedModelError, match=match) as e:
        config_from_dict({**QWEN, "quantization_config": qc})
    assert "weight_scale_inv" in str(e.value)  # the error says what is supported


def test_fp8_tensor_without_scales_is_an_error(tmp_path):
    from safetensors.torch import load_file, save_file

    path = save_fp8_checkpoint(make_hf_model("qwen3_moe", seed=0), tmp_path / "fp8")
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.0.self_attn.q_proj.weight_scale_inv"]
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="q_proj.weight' .* has no .*weight_scale_inv"):
        load_model(path, dtype=torch.float32, progress=False)


def test_real_fp8_configs_parse(tmp_path):
    """Config keys as the Hub's FP8 checkpoints have them (DeepSeek-V3 style; Qwen3-FP8 with modules_to_not_convert)."""
    cfg = config_from_dict({**QWEN, "quantization_config": {
        "activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128],
        "modules_to_not_convert": ["lm_head", "model.layers.0.mlp.gate"]}})
    assert cfg.quantization.method == "fp8" and cfg.quantization.weight_block_size == (128, 128)
    assert config_from_dict(QWEN).metadata()["quantization"] == "none"
    (tmp_path / "config.json").write_text(json.dumps({**QWEN, "quantization_config": {"quant_method": "fp8"}}))
    # no weight_block_size: None, as vLLM's Fp8Config reads it; the scale grid's shape then gives the block
    assert load_config(tmp_path).quantization.weight_block_size is None


@pytest.mark.parametrize("fused", [False, True], ids=["per-expert", "fused"])
@pytest.mark.parametrize("expert_parallel", [False, True], ids=["tp", "ep"])
@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])
def test_fp8_sharded_load_equals_plain_sharded_load(arch, expert_parallel, fused, tmp_path):
    """A tensor-parallel rank reads its slices of FP8 tensors (dequantised whole, then sliced: scales cover blocks,
    not slices): each rank's parameters equal those it reads from the dequantised plain checkpoint."""
    from types import SimpleNamespace

    from moe_engine.distributed.sharding import shard_model

    path = save_fp8_checkpoint(make_hf_model(arch, seed=4, **WIDE[arch]), tmp_path / "fp8", fused=fused)
    ref_dir = save_dequantized_copy(path, tmp_path / "plain")
    for rank in range(2):
        group = SimpleNamespace(rank=rank, world_size=2)
        ours = load_model(path, dtype=torch.float32, progress=False,
                          shard=lambda m: shard_model(m, group, expert_parallel))
        ref = load_model(ref_dir, dtype=torch.float32, progress=False,
                         shard=lambda m: shard_model(m, group, expert_parallel))
        ref_params = dict(ref.named_parameters())
        for name, p in ours.named_parameters():
            assert torch.equal(p, ref_params[name]), (rank, name)
