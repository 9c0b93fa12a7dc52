"""DeepSeek-V2/V3 and GPT-OSS beyond the shared parity tests (test_hf_parity.py):

- each router against HF's own router module on the same inputs (ids in the same slots, same weights),
  float32 and bfloat16, including DeepSeek-V2 ``greedy``;
- rope tables (default / yarn) and the MLA softmax scale against HF's rotary and attention modules, with
  the rope parameters of the real DeepSeek-V2-Lite, DeepSeek-V3 and gpt-oss checkpoints;
- config variants the main tiny checkpoints do not cover (q_lora_rank with V2, V2 greedy + yarn +
  attention/MLP biases, V3 without rope interleave, topk_group == n_group, GPT-OSS without attention bias
  and other layer_types), float32 parity and greedy generation against HF;
- MXFP4: our dequantisation equals transformers' ``convert_moe_packed_tensors`` bit for bit; a gpt-oss
  checkpoint in the Hub's MXFP4 layout loads to exactly the weights HF dequantises and runs identically;
- loading details: DeepSeek-V3 MTP layers ignored, fp32 router parameters, fused (v5) expert layout.
"""
from __future__ import annotations

import json
import logging

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from moe_engine.checkpoint import dequantize_mxfp4, load_model
from moe_engine.config import config_from_dict
from moe_engine.layers.rotary import RotaryEmbedding, deepseek_softmax_scale
from moe_engine.layers.routing import make_router
from moe_engine.models.decoder import reference_forward

from .hf_checkpoints import (
    hf_config,
    hf_forward_with_routing,
    load_hf,
    load_hf_mxfp4,
    make_hf_model,
    save_gpt_oss_mxfp4,
    save_hf_checkpoint,
)
from .test_config import DEEPSEEK_V2_LITE, DEEPSEEK_V3, GPT_OSS_20B

VOCAB_LO, VOCAB_HI = 3, 256


def random_ids(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(VOCAB_LO, VOCAB_HI, (n,), generator=g).tolist()


def engine_config(hf_cfg):
    return config_from_dict(json.loads(hf_cfg.to_json_string()))


# ----------------------------------------------------------------------------- routers


def _hf_router(arch: str, hf_cfg):
    if arch == "deepseek_v2":
        from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter as R
    elif arch == "deepseek_v3":
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter as R
    else:
        from transformers.models.gpt_oss.modeling_gpt_oss import GptOssTopKRouter as R
    return R(hf_cfg)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "arch,overrides",
    [
        ("deepseek_v2", {}),  # group_limited_greedy, 4 groups, 2 kept
        ("deepseek_v2", {"topk_method": "greedy"}),
        ("deepseek_v3", {}),
        ("deepseek_v3", {"norm_topk_prob": False, "topk_group": 1}),
        ("gpt_oss", {}),
    ],
)
def test_router_matches_hf_router_module(arch, overrides, dtype):
    hf_cfg = hf_config(arch, **overrides)
    hf = _hf_router(arch, hf_cfg)
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for name, p in list(hf.named_parameters()) + list(hf.named_buffers()):
            p.copy_(torch.randn(p.shape, generator=g) * (0.05 if "bias" in name else 0.3))
    hf = hf.to(dtype) if arch == "gpt_oss" else hf  # DeepSeek's gate stays fp32 (HF keeps it fp32)
    cfg = engine_config(hf_cfg)
    ours = make_router(cfg.router, cfg.hidden_size).to(dtype if arch == "gpt_oss" else torch.float32)
    ours.load_state_dict(hf.state_dict())
    x = torch.randn(257, hf_cfg.hidden_size, generator=g).to(dtype)
    with torch.no_grad():
        _, ref_w, ref_ids = hf(x)
        ids, w = ours(x)
    assert torch.equal(ids, ref_ids)  # same ids in the same slots (CPU)
    assert w.dtype == ref_w.dtype and torch.equal(w, ref_w)
    if arch == "deepseek_v3":  # the correction bias really changes the choice on these inputs
        with torch.no_grad():
            ours.e_score_correction_bias.zero_()
            unbiased, _ = ours(x)
        assert not torch.equal(unbiased.sort(-1).values, ids.sort(-1).values)


# ----------------------------------------------------------------------------- rope, softmax scale

ROPE_CASES = {  # name -> (arch, config.json dict): rope parameters of real checkpoints on tiny shapes
    "deepseek_v2_lite_yarn": ("deepseek_v2", DEEPSEEK_V2_LITE),
    "deepseek_v3_yarn": ("deepseek_v3", {k: v for k, v in DEEPSEEK_V3.items() if k != "quantization_config"}),
    "deepseek_v3_default": ("deepseek_v3", {**DEEPSEEK_V3, "rope_scaling": None, "quantization_config": None}),
    "gpt_oss_20b_yarn": ("gpt_oss", {k: v for k, v in GPT_OSS_20B.items() if k != "quantization_config"}),
}


@pytest.mark.parametrize("case", sorted(ROPE_CASES))
def test_rope_and_softmax_scale_match_hf(case):
    import transformers

    arch, raw = ROPE_CASES[case]
    small = {"hidden_size": 64, "num_attention_heads": 2, "num_key_value_heads": 2, "kv_lora_rank": 16,
             "q_lora_rank": None, "intermediate_size": 32, "moe_intermediate_size": 16, "num_hidden_layers": 1,
             "first_k_dense_replace": 0, "layer_types": None}
    raw = {k: v for k, v in {**raw, **small}.items() if v is not None}
    cls = {"deepseek_v2": "DeepseekV2", "deepseek_v3": "DeepseekV3", "gpt_oss": "GptOss"}[arch]
    hf_cfg = getattr(transformers, f"{cls}Config")(**raw)
    modeling = getattr(transformers.models, arch)
    hf_rope = getattr(modeling, f"modeling_{arch}").__dict__[f"{cls}RotaryEmbedding"](hf_cfg)
    cfg = config_from_dict(raw)
    ours = RotaryEmbedding(cfg.rope)
    assert torch.equal(ours.inv_freq, hf_rope.inv_freq)
    assert ours.attention_factor == hf_rope.attention_scaling
    positions = torch.tensor([0, 1, 7, 4095, 4096, 100000])
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.zeros(1, len(positions), 8, dtype=dtype)
        ref = hf_rope(x, positions[None])
        cos, sin = ours(positions, dtype)
        if cfg.rope.style == "complex":  # DeepSeek-V2: freqs_cis [1, T, R/2] complex64
            assert sin is None and torch.equal(cos, ref[0])
        else:  # (cos, sin) [1, T, R] (DeepSeek-V3) or [1, T, R/2] (GPT-OSS, both halves equal in ours)
            width = ref[0].shape[-1]
            assert torch.equal(cos[:, :width], ref[0][0]) and torch.equal(sin[:, :width], ref[1][0])
    attn = getattr(modeling, f"modeling_{arch}").__dict__[f"{cls}Attention"](hf_cfg, 0)
    D = cfg.attention.head_dim
    assert (deepseek_softmax_scale(cfg.rope, D) if cfg.attention.mla else D**-0.5) == attn.scaling


# ----------------------------------------------------------------------------- config variants, float32 parity

VARIANTS = {
    "v2_greedy_qlora_yarn_biases": ("deepseek_v2", dict(
        topk_method="greedy", n_group=None, topk_group=None, q_lora_rank=16, attention_bias=True, mlp_bias=True,
        first_k_dense_replace=2, num_hidden_layers=3, routed_scaling_factor=1.0,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                         "mscale": 0.707, "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1,
                         "rope_theta": 10000.0},
    )),
    "v3_no_interleave_all_groups": ("deepseek_v3", dict(
        rope_interleave=False, rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, topk_group=4,
        norm_topk_prob=False, n_shared_experts=2, q_lora_rank=None,
    )),
    "gpt_oss_no_attn_bias_layer_types": ("gpt_oss", dict(
        attention_bias=False, num_experts_per_tok=4, swiglu_limit=7.0,
        layer_types=["full_attention", "sliding_attention", "sliding_attention"],
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_config_variants_match_hf(variant, tmp_path):
    arch, overrides = VARIANTS[variant]
    path = save_hf_checkpoint(make_hf_model(arch, seed=3, **overrides), tmp_path / variant)
    hf = load_hf(path)
    model = load_model(path, progress=False)
    cfg = model.config
    ids = random_ids(33, seed=7)
    hf_logits, hf_routed = hf_forward_with_routing(hf, torch.tensor([ids]))
    logits, routed = reference_forward(model, ids)
    torch.testing.assert_close(logits, hf_logits[0], atol=1e-5, rtol=1e-5)
    assert set(hf_routed) == set(cfg.moe_layers)
    for layer in range(cfg.num_hidden_layers):
        if layer in hf_routed:
            assert torch.equal(routed[:, layer].long().sort(-1).values, hf_routed[layer].sort(-1).values), layer
        else:
            assert not routed[:, layer].any()
    # greedy decoding over the KV cache (prefill + 1-token steps) equals HF generate
    prompt = ids[:6]
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False, eos_token_id=None,
                          pad_token_id=0)[0, len(prompt):].tolist()
    from moe_engine.core.kv_cache import KVCache
    from moe_engine.layers.attend import ForwardBatch

    cache = KVCache.for_sequences(model.kv_layout(), 1, len(prompt) + 10, model.dtype, "cpu", block_size=4)
    tokens, context, step = [], 0, prompt
    with torch.inference_mode():
        while len(tokens) < 10:
            batch = ForwardBatch.build([cache.sequence_blocks(0)], [context], [len(step)], "cpu", 4)
            hidden = model(torch.tensor(step), batch, cache)
            context += len(step)
            tokens.append(int(model.compute_logits(hidden[batch.last_token_index]).argmax(-1)))
            step = tokens[-1:]
    assert tokens == ref


# ----------------------------------------------------------------------------- MXFP4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_mxfp4_dequant_equals_transformers(dtype):
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = torch.Generator().manual_seed(5)
    blocks = torch.randint(0, 256, (3, 40, 4, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(100, 150, (3, 40, 4), generator=g, dtype=torch.uint8)
    scales[0, 0, :] = torch.tensor([0, 1, 127, 254], dtype=torch.uint8)  # extreme exponents
    ours = dequantize_mxfp4(blocks, scales, dtype)
    ref = convert_moe_packed_tensors(blocks.clone(), scales.clone(), dtype=dtype)
    assert ours.shape == (3, 128, 40) and ours.dtype == dtype
    torch.testing.assert_close(ours, ref, rtol=0, atol=0, equal_nan=True)


def test_mxfp4_checkpoint_matches_hf(tmp_path):
    """gpt-oss experts stored as on the Hub (MXFP4 blocks/scales + mxfp4 quantization_config): the engine's
    dequantised weights are exactly the ones HF's own MXFP4 loader produces, and so are logits and routing."""
    src = make_hf_model("gpt_oss", seed=0)
    path = save_gpt_oss_mxfp4(src, tmp_path / "mxfp4")
    with safe_open(str(path / "model.safetensors"), "pt") as h:
        keys = set(h.keys())
        assert h.get_slice("model.layers.0.mlp.experts.gate_up_proj_blocks").get_dtype() == "U8"
    assert "model.layers.0.mlp.experts.gate_up_proj_blocks" in keys and "model.layers.0.mlp.experts.down_proj_scales" in keys
    assert not any(k.endswith(("experts.gate_up_proj", "experts.down_proj")) for k in keys)
    ids = random_ids(40, seed=8)
    for dtype in (torch.float32, torch.bfloat16):
        hf = load_hf_mxfp4(path, dtype)
        model = load_model(path, dtype=dtype, progress=False)
        assert model.config.experts.quant == "mxfp4"
        for layer in range(3):
            ours, ref = model.model.layers[layer].mlp.experts, hf.model.layers[layer].mlp.experts
            for name in ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias"):
                assert torch.equal(getattr(ours, name), getattr(ref, name)), (dtype, layer, name)
        # quantisation did change the weights (the test is not vacuous)
        assert not torch.equal(model.model.layers[0].mlp.experts.gate_up_proj.float(), src.model.layers[0].mlp.experts.gate_up_proj)
        hf_logits, hf_routed = hf_forward_with_routing(hf, torch.tensor([ids]))
        logits, routed = reference_forward(model, ids)
        assert torch.equal(logits, hf_logits[0]), dtype
        for layer, ref in hf_routed.items():
            assert torch.equal(routed[:, layer].long(), ref), (dtype, layer)


# ----------------------------------------------------------------------------- loading details


def test_deepseek_v3_mtp_layers_ignored_and_fp32_router(tmp_path, caplog):
    hf = make_hf_model("deepseek_v3", seed=4, dtype=torch.bfloat16)
    path = save_hf_checkpoint(hf, tmp_path / "v3")
    with safe_open(str(path / "model.safetensors"), "pt") as h:
        tensors = {k: h.get_tensor(k) for k in h.keys()}
    # An MTP module as DeepSeek-V3 ships it: a full decoder layer at index num_hidden_layers plus its extras.
    for k in [k for k in tensors if k.startswith("model.layers.2.")]:
        tensors[k.replace("model.layers.2.", "model.layers.3.")] = tensors[k].clone()
    tensors["model.layers.3.eh_proj.weight"] = torch.zeros(64, 128, dtype=torch.bfloat16)
    tensors["model.layers.3.enorm.weight"] = torch.ones(64, dtype=torch.bfloat16)
    tensors["model.layers.3.hnorm.weight"] = torch.ones(64, dtype=torch.bfloat16)
    tensors["model.layers.3.shared_head.head.weight"] = torch.zeros(256, 64, dtype=torch.bfloat16)
    mtp = tmp_path / "v3_mtp"
    mtp.mkdir()
    for f in ("config.json", "generation_config.json"):
        if (path / f).is_file():
            (mtp / f).write_text((path / f).read_text())
    cfg = json.loads((mtp / "config.json").read_text())
    assert cfg["num_nextn_predict_layers"] == 1
    save_file(tensors, str(mtp / "model.safetensors"), metadata={"format": "pt"})
    with caplog.at_level(logging.WARNING, logger="moe_engine.checkpoint"):
        model = load_model(mtp, progress=False)
    assert "not used" not in caplog.text
    plain = load_model(path, progress=False)
    ids = random_ids(20, seed=9)
    la, ra = reference_forward(model, ids)
    lb, rb = reference_forward(plain, ids)
    assert torch.equal(la, lb) and torch.equal(ra, rb)
    # HF keeps the DeepSeek gate weight and e_score_correction_bias in float32 (_keep_in_fp32_modules_strict)
    gate = model.model.layers[1].mlp.gate
    assert model.dtype == torch.bfloat16 and gate.weight.dtype == torch.float32
    assert gate.e_score_correction_bias.dtype == torch.float32 and gate.e_score_correction_bias.abs().sum() > 0
    assert model.model.layers[1].mlp.experts.gate_up_proj.dtype == torch.bfloat16
    hf_loaded = load_hf(path, torch.bfloat16, attn_implementation="sdpa")
    assert hf_loaded.model.layers[1].mlp.gate.weight.dtype == torch.float32
    assert torch.equal(gate.e_score_correction_bias, hf_loaded.model.layers[1].mlp.gate.e_score_correction_bias)


def test_deepseek_fused_layout_and_gpt_oss_fp16_norms(tmp_path):
    hf = make_hf_model("deepseek_v2", seed=6)
    a = load_model(save_hf_checkpoint(hf, tmp_path / "per_expert"), progress=False)
    b = load_model(save_hf_checkpoint(hf, tmp_path / "fused", fused=True), progress=False)
    for (na, pa), (nb, pb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert na == nb and torch.equal(pa, pb), na
    # GPT-OSS in float16: HF keeps the norms in float32 (_keep_in_fp32_modules), so does the engine
    path = save_hf_checkpoint(make_hf_model("gpt_oss", seed=6), tmp_path / "gpt_oss")
    m16 = load_model(path, dtype="float16", progress=False)
    hf16 = load_hf(path, torch.float16)
    assert m16.model.norm.weight.dtype == torch.float32 == hf16.model.norm.weight.dtype
    assert m16.model.layers[0].input_layernorm.weight.dtype == torch.float32
    assert m16.model.layers[0].mlp.experts.down_proj.dtype == torch.float16
    ids = random_ids(24, seed=10)
    hf_logits, hf_routed = hf_forward_with_routing(hf16, torch.tensor([ids]))
    logits, routed = reference_forward(m16, ids)
    assert torch.equal(logits, hf_logits[0])
    for layer, ref in hf_routed.items():
        assert torch.equal(routed[:, layer].long(), ref), layer
