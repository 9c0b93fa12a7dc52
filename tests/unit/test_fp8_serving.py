"""Serving FP8 weights in FP8 (W8A8 block FP8): an FP8 checkpoint kept as stored (fp8="checkpoint"), or a bf16 /
fp32 checkpoint quantised at load (``--quantization fp8``, fp8="quantize"), against the dequantised reference.

On CPU the FP8 modules run the op-by-op W8A8 reference (fp8.w8a8_linear_reference: activations quantised per token
and 128 channels, dequantised operands, float32 matmul); the Triton kernels equal it (test_fp8_kernels.py). The
activation quantisation changes the forward, so logits and routing are compared with the dequantised model
statistically (what an FP8 deployment changes), while what must be exact is exact: the stored e4m3 bytes and
scales reach the model untouched, and the routed experts returned are those the FP8 forward used (replay forces
them).
"""
from __future__ import annotations

import os

import pytest
import torch

from moe_engine import fp8
from moe_engine.checkpoint import load_model
from moe_engine.fp8_load import fp8_mode
from moe_engine.layers.fp8_linear import Fp8Linear
from moe_engine.models.decoder import reference_forward

from .hf_checkpoints import make_hf_model, save_fp8_checkpoint, save_hf_checkpoint
from .test_fp8_checkpoint import WIDE, random_ids


DEVICE = os.environ.get("MOE_TEST_DEVICE", "cpu")

# Expert widths a multiple of the 128-row block (as Qwen3's 768, DeepSeek-V3's 2048): the per-expert scale grids of
# gate and up stack into the experts' [2I, H] grid, so the experts are served in FP8 too
SERVE = {arch: dict(shape, moe_intermediate_size=256) for arch, shape in WIDE.items()}


def routed_agreement(a: torch.Tensor, b: torch.Tensor, layers) -> float:
    """Fraction of (token, MoE layer) whose routed expert sets are equal."""
    same = [torch.equal(a[t, i].sort().values, b[t, i].sort().values) for t in range(a.shape[0]) for i in layers]
    return sum(same) / len(same)


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3", "glm4_moe"])
def test_fp8_checkpoint_served_in_fp8(arch, tmp_path):
    path = save_fp8_checkpoint(make_hf_model(arch, seed=0, **SERVE[arch]), tmp_path / "fp8")
    ours = load_model(path, dtype=torch.float32, progress=False, fp8="checkpoint")
    ref = load_model(path, dtype=torch.float32, progress=False)  # dequantised
    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), "pt") as h:
        o = ours.model.layers[0].self_attn.o_proj
        assert isinstance(o, Fp8Linear) and o.weight.dtype == fp8.FP8_DTYPE
        key = "model.layers.0.self_attn.o_proj.weight"
        assert torch.equal(o.weight.view(torch.uint8), h.get_tensor(key).view(torch.uint8))  # the stored bytes
        assert torch.equal(o.weight_scale_inv, h.get_tensor(key + "_scale_inv"))
        moe = ours.config.moe_layers[0]
        experts = ours.model.layers[moe].mlp.experts
        assert experts.fp8_block == (128, 128) and experts.gate_up_proj.dtype == fp8.FP8_DTYPE
        up = h.get_tensor(f"model.layers.{moe}.mlp.experts.3.up_proj.weight")
        assert torch.equal(experts.gate_up_proj[3, up.shape[0]:].view(torch.uint8), up.view(torch.uint8))
        # dequantising what the FP8 model holds gives the reference model's weights
        assert torch.equal(fp8.dequantize_fp8(experts.gate_up_proj, experts.gate_up_proj_scale_inv, (128, 128)),
                           ref.model.layers[moe].mlp.experts.gate_up_proj)
    dense = ours.model.layers[0].mlp  # (deepseek / glm: a dense first layer; qwen3_moe: layer 0 is dense too)
    assert all(isinstance(getattr(dense, n), Fp8Linear) for n in ("gate_proj", "up_proj", "down_proj"))
    if arch != "qwen3_moe":
        shared = ours.model.layers[moe].mlp.shared_experts
        assert isinstance(shared.gate_proj, Fp8Linear) and isinstance(shared.down_proj, Fp8Linear)
    # routers, norms, embeddings and lm_head stay in the model dtype
    assert ours.lm_head.weight.dtype == torch.float32
    assert all(p.dtype == torch.float32 for n, p in ours.named_parameters() if "norm" in n or ".mlp.gate." in n)
    ids = random_ids(48, seed=1)
    logits, routed = reference_forward(ours, ids)
    ref_logits, ref_routed = reference_forward(ref, ids)
    rel = (logits - ref_logits).norm() / ref_logits.norm()
    # random tiny models (hidden 256, 3-4 layers): e4m3 activations (3 mantissa bits) move logits by 5-17%
    assert rel < 0.25, f"W8A8 logits {rel:.3f} away from the dequantised model's"
    agree = routed_agreement(routed, ref_routed, ours.config.moe_layers)
    print(f"{arch}: W8A8 vs dequantised: logits rel. error {rel:.4f}, routed sets equal {agree:.1%}")
    assert agree >= 0.6


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3", "glm4_moe"])
def test_fp8_weights_without_activation_quantization_equal_dequantized(arch, tmp_path, monkeypatch):
    """The wiring, exactly: with activations passed through unquantised (scale 1), every FP8 module computes
    x @ dequantised(W), so the FP8 model equals the dequantised model to float32 rounding, ids included."""
    path = save_fp8_checkpoint(make_hf_model(arch, seed=0, **SERVE[arch]), tmp_path / "fp8")
    ours = load_model(path, dtype=torch.float32, progress=False, fp8="checkpoint")
    ref = load_model(path, dtype=torch.float32, progress=False)
    monkeypatch.setattr(fp8, "quantize_activations",
                        lambda x, group=128: (x.float(), torch.ones(x.shape[0], -(-x.shape[1] // group))))
    ids = random_ids(32, seed=4)
    logits, routed = reference_forward(ours, ids)
    ref_logits, ref_routed = reference_forward(ref, ids)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-5)
    assert torch.equal(routed, ref_routed)


def test_fp8_experts_kept_only_where_blocks_stack(tmp_path):
    """Expert width 192 (not a multiple of 128): gate's last scale block would cover up's first rows once stacked,
    so those experts load dequantised while the dense projections stay FP8."""
    path = save_fp8_checkpoint(make_hf_model("qwen3_moe", seed=0, **WIDE["qwen3_moe"]), tmp_path / "fp8")
    model = load_model(path, dtype=torch.float32, progress=False, fp8="checkpoint")
    assert model.model.layers[1].mlp.experts.fp8_block is None
    assert model.model.layers[1].mlp.experts.gate_up_proj.dtype == torch.float32
    assert isinstance(model.model.layers[1].self_attn.q_proj, Fp8Linear)


def test_online_quantization(tmp_path):
    """--quantization fp8: a float32 checkpoint's projections and experts quantised at load in 128 x 128 blocks."""
    src = make_hf_model("qwen3_moe", seed=0, **SERVE["qwen3_moe"])
    path = save_hf_checkpoint(src, tmp_path / "bf16")
    ours = load_model(path, dtype=torch.float32, progress=False, fp8="quantize")
    ref = load_model(path, dtype=torch.float32, progress=False)
    q = ours.model.layers[0].self_attn.q_proj
    assert isinstance(q, Fp8Linear)
    want_q, want_s = fp8.quantize_fp8_blocks(ref.model.layers[0].self_attn.q_proj.weight)
    assert torch.equal(q.weight.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(q.weight_scale_inv, want_s)
    assert ours.model.layers[1].mlp.experts.fp8_block == (128, 128)
    assert ours.model.layers[1].mlp.gate.weight.dtype == torch.float32  # the router is not quantised
    ids = random_ids(48, seed=2)
    logits, routed = reference_forward(ours, ids)
    ref_logits, ref_routed = reference_forward(ref, ids)
    assert (logits - ref_logits).norm() / ref_logits.norm() < 0.1
    assert routed_agreement(routed, ref_routed, ours.config.moe_layers) >= 0.6


def test_fp8_mode_choices(tmp_path):
    from moe_engine.config import load_config

    fp8_path = save_fp8_checkpoint(make_hf_model("qwen3_moe", seed=0), tmp_path / "fp8")
    plain = save_hf_checkpoint(make_hf_model("qwen3_moe", seed=0), tmp_path / "plain")
    fp8_cfg, plain_cfg = load_config(fp8_path), load_config(plain)
    assert fp8_mode(fp8_cfg, None, "cpu", fused_kernels=False) is None  # CPU: dequantised
    assert fp8_mode(plain_cfg, None, "cpu", fused_kernels=False) is None
    assert fp8_mode(plain_cfg, "fp8", "cpu", fused_kernels=False) == "quantize"
    assert fp8_mode(fp8_cfg, "fp8", "cpu", fused_kernels=False) is None  # already FP8: served as stored
    with pytest.raises(ValueError, match="supported: fp8"):
        fp8_mode(plain_cfg, "awq", "cpu", fused_kernels=False)
    with pytest.raises(ValueError, match="tensor parallelism"):
        fp8_mode(plain_cfg, "fp8", "cpu", fused_kernels=False, tensor_parallel=True)


def test_engine_serves_fp8_routes_and_replays(tmp_path):
    """Through the engine (paged KV cache, prefill then decode steps): the routed experts returned are the FP8
    forward's own (the reference forward of the same FP8 model on prompt + output gives the same ids), replaying
    them changes nothing, a forced routing is used as given, the engine reports serving FP8, and weight updates
    are refused rather than cast into e4m3."""
    import numpy as np

    from moe_engine.engine import Engine, EngineConfig
    from moe_engine.rl.weights import WeightUpdateError

    from .test_replay import replacement, run

    path = save_fp8_checkpoint(make_hf_model("qwen3_moe", seed=0, **SERVE["qwen3_moe"]), tmp_path / "fp8")
    model = load_model(path, dtype=torch.float32, progress=False, fp8="checkpoint")
    cfg = model.config
    engine = Engine(model, cfg, EngineConfig(max_model_len=128, enable_prefix_caching=False))
    ids = random_ids(20, seed=6)
    first = run(engine, ids, max_tokens=6)
    _, routed = reference_forward(model, ids + first.tokens[:-1])
    moe = list(cfg.moe_layers)
    np.testing.assert_array_equal(first.routing[:, moe], routed[:, moe].numpy())
    again = run(engine, ids, replay=first.routing[:20], max_tokens=6)
    assert again.tokens == first.tokens
    np.testing.assert_array_equal(again.routing, first.routing)
    forced = first.routing[:20].astype(np.int64).copy()
    for t in range(5, 10):
        for layer in moe:
            forced[t, layer, 0] = replacement(forced[t, layer], 0, cfg.num_experts, cfg.num_experts)
    res = run(engine, ids, replay=forced, max_tokens=1)
    np.testing.assert_array_equal(res.routing[:20][:, moe], forced[:, moe])  # the FP8 forward used them
    assert engine.lifecycle.get_engine_info().result()["weights_served_as"] == "fp8"
    with pytest.raises(WeightUpdateError, match="FP8 weights"):
        from moe_engine.rl.weights import check_checkpoint

        check_checkpoint(model, str(path))


def test_in_memory_quantization_equals_load_time_quantization(tmp_path):
    """The benchmark's path (a model already in memory: quantise, dequantise the reference in place, install FP8)
    gives the model --quantization fp8 loads, and the reference holds the dequantised weights."""
    from moe_engine.fp8_load import dequantize_in_place, install_fp8, quantize_in_memory, target_names

    path = save_hf_checkpoint(make_hf_model("qwen3_moe", seed=3, **SERVE["qwen3_moe"]), tmp_path / "plain")
    loaded = load_model(path, dtype=torch.float32, progress=False, fp8="quantize")
    model = load_model(path, dtype=torch.float32, progress=False)
    names = target_names(model)
    assert "model.layers.1.mlp.experts.gate_up_proj" in names and "model.layers.0.self_attn.q_proj.weight" in names
    assert not any("mlp.gate.weight" in n or "lm_head" in n for n in names)
    quantized = quantize_in_memory(model, names, to="cpu")
    dequantize_in_place(model, quantized)
    q, s = quantized["model.layers.0.self_attn.o_proj.weight"]
    assert torch.equal(model.model.layers[0].self_attn.o_proj.weight, fp8.dequantize_fp8(q, s, (128, 128)))
    install_fp8(model, quantized)
    ours, want = dict(model.named_parameters()), dict(loaded.named_parameters())
    assert ours.keys() == want.keys()
    for name, p in want.items():
        a, b = ours[name], p
        assert a.dtype == b.dtype, name
        assert torch.equal(a.view(torch.uint8) if a.dtype == fp8.FP8_DTYPE else a,
                           b.view(torch.uint8) if b.dtype == fp8.FP8_DTYPE else b), name


@pytest.mark.skipif(DEVICE != "cuda", reason="the W8A8 Triton kernels inside the engine: GPU (FP8 tensor cores)")
def test_engine_on_gpu_serves_fp8_with_kernels_and_graphs(tmp_path):
    """bf16 on the GPU with the fused kernels and CUDA graphs: the FP8 modules run the Triton W8A8 kernels, the
    routed experts returned replay to the same tokens, and the routing stays close to the dequantised model's."""
    import numpy as np

    from moe_engine.engine import Engine, EngineConfig

    from .test_replay import run

    path = save_fp8_checkpoint(make_hf_model("qwen3_moe", seed=0, **SERVE["qwen3_moe"]), tmp_path / "fp8")
    model = load_model(path, dtype=torch.bfloat16, device="cuda", progress=False, fp8="checkpoint")
    cfg = model.config
    engine = Engine(model, cfg, EngineConfig(max_model_len=128, enable_prefix_caching=False,
                                             kv_cache_memory_bytes=256 << 20))
    assert model.model.layers[0].self_attn.q_proj.fused and model.model.layers[1].mlp.experts.fused
    ids = random_ids(40, seed=8)
    first = run(engine, ids, max_tokens=16)
    again = run(engine, ids, replay=first.routing[:40], max_tokens=16)
    assert again.tokens == first.tokens
    np.testing.assert_array_equal(again.routing, first.routing)
    ref = load_model(path, dtype=torch.bfloat16, device="cuda", progress=False)
    ref_engine = Engine(ref, cfg, EngineConfig(max_model_len=128, enable_prefix_caching=False,
                                               kv_cache_memory_bytes=256 << 20))
    base = run(ref_engine, ids, max_tokens=1)
    moe = list(cfg.moe_layers)
    agree = routed_agreement(torch.from_numpy(first.routing[:39].astype(np.int64)),
                             torch.from_numpy(base.routing[:39].astype(np.int64)), moe)
    print(f"GPU W8A8 vs dequantised bf16: routed sets equal {agree:.1%}")
    assert agree >= 0.6


def test_fp8_qkv_joined_into_one_gemm(tmp_path):
    """fuse_qkv joins FP8 q/k/v weights and their scale rows (views of one tensor each), and the one W8A8 GEMM over
    them gives what the three give (activations are quantised per token, whatever the weight)."""
    from moe_engine.layers.attention import Attention

    path = save_fp8_checkpoint(make_hf_model("qwen3_moe", seed=5, **SERVE["qwen3_moe"]), tmp_path / "fp8")
    model = load_model(path, dtype=torch.float32, progress=False, fp8="checkpoint")
    ids = random_ids(24, seed=9)
    before, routed = reference_forward(model, ids)
    attn = [m for m in model.modules() if isinstance(m, Attention)]
    for m in attn:
        m.fuse_qkv()
        m.within_rounding = True  # (the GPU default: _qkv takes the joined GEMM)
    a = attn[0]
    assert a.k_proj.weight.untyped_storage().data_ptr() == a.q_proj.weight.untyped_storage().data_ptr()
    w, _ = a._qkv_weight()
    s = a._joined("weight_scale_inv")
    assert w.dtype == fp8.FP8_DTYPE and s.shape == (-(-w.shape[0] // 128), 2)
    after, routed_after = reference_forward(model, ids)
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5)
    assert torch.equal(routed_after, routed)


@pytest.mark.skipif(DEVICE != "cpu", reason="the interpreter's run of the fused path (GPUs: the test above)")
@pytest.mark.parametrize("arch, within", [("deepseek_v3", False), ("qwen3_moe", True), ("deepseek_v3", True)])
def test_fused_path_with_fp8_against_op_by_op(arch, within, tmp_path):
    """The fused path serving FP8 weights (Triton's interpreter) against the op-by-op W8A8 path, float32. The
    bit-identical kernel set with the W8A8 expert kernels: the same tokens and routed experts. With the GPU's
    within-rounding fusions too (q/k/v joined into one W8A8 GEMM; MLA's q_a/kv_a and DeepSeek's shared gate/up left
    apart for FP8): the same tokens here, and nearly the same expert sets, no more: a float32 rounding difference
    that moves an activation across an e4m3 rounding boundary moves it by a whole e4m3 step (~6%), and a near-tied
    router then flips (W8A8 amplifies summation-order differences)."""
    import numpy as np

    from moe_engine.engine import Engine, EngineConfig

    from .test_replay import run

    path = save_fp8_checkpoint(make_hf_model(arch, seed=1, **SERVE[arch]), tmp_path / "fp8")
    ids = random_ids(20, seed=10)
    results = []
    for fused in (False, True):
        model = load_model(path, dtype=torch.float32, progress=False, fp8="checkpoint")
        engine = Engine(model, model.config, EngineConfig(max_model_len=64, enable_prefix_caching=False,
                                                          fused_kernels=fused))
        if fused and within:
            model.use_fused_kernels(True, within_rounding=True)
        results.append(run(engine, ids, max_tokens=4))
        assert model.model.layers[1].mlp.experts.fused == fused
    assert results[0].tokens == results[1].tokens
    # sets: DeepSeek's slot order is unsorted (HF's topk(sorted=False)); the fused router writes it descending
    a, b = np.sort(results[0].routing, -1), np.sort(results[1].routing, -1)
    if not within:
        np.testing.assert_array_equal(a, b)
    else:
        assert (a == b).all(-1).mean() >= 0.95
