"""``--kv-cache-dtype fp8`` end to end: what a user checks on the tiny checkpoint, and on a tiny DeepSeek-V3 (MLA:
its latent and rope key cached in FP8) that transformers wrote.

- the engine's greedy tokens and routed experts mostly agree with the same engine on a model-dtype cache (random tiny
  weights have near-ties that the quantised keys and values can flip, so agreement is measured, not assumed exact);
- the same KV memory holds twice the tokens of a bf16 cache (one byte per value), and the start-up log says so;
- MLA on the kernel path (absorbed decode, expanded prefill over cached latents, a prefix-cache hit) gives the
  op-by-op engine's tokens and routes over the same FP8 cache;
- /v1/models' quantization.kv_cache says fp8_e4m3 (the engine reports it; the card shows what the engine says);
- the checkpoint's per-layer k_scale / v_scale / kv_scale are used, else 1.0 with a log line;
- unsupported values and combinations are refused by name.
"""
from __future__ import annotations

import logging
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from moe_engine.checkpoint import load_model
from moe_engine.config import load_config
from moe_engine.engine import Engine, EngineConfig

from .test_engine import DEVICE, make_engine, prompt_of, run_all, submit, tiny  # noqa: F401 (fixture)

FP8 = torch.float8_e4m3fn
# The tiny random model is very sensitive to its keys and values: 2% random noise on them moves its logits by ~2
# (std 4), and e4m3 rounds each value by up to 6% (3 mantissa bits). Measured on the CPU (float32 model, reference
# attention): 41% of 96 next tokens and 87% of 1,252 prompt routing rows (token, MoE layer) agree with the float32
# cache; for scale, bf16 weights against float32 ones agree on 78% / 94% at full context. A broken cache (a scale
# ignored, wrong slots) agrees on ~0% of tokens (512-token vocabulary). Thresholds leave room for GPU rounding.
MIN_TOKEN_AGREEMENT = 0.3
MIN_ROUTING_AGREEMENT = 0.75


def generate(engine, prompts, max_tokens=16):
    runs = [submit(engine, p, max_tokens=max_tokens, ignore_eos=True) for p in prompts]
    run_all(engine, runs)
    return [(c.tokens, c.routing) for c in runs]


def agreement(base_engine, fp8_engine, prompts, steps, moe_layers) -> tuple[float, float]:
    """(next-token, prompt-routing-row) agreement of ``fp8_engine`` with ``base_engine``. Each greedy step compared
    from the same context: the model-dtype engine's continuation, cut after every step, is a prompt for the FP8
    engine, whose next token should be the one the model-dtype engine chose (without the cut, one flipped near-tie
    would make every later token differ); its prompt routing rows (MoE layers) compare row for row."""
    base = generate(base_engine, prompts, max_tokens=steps)
    contexts = [(p + tokens[:i], tokens[i]) for p, (tokens, _) in zip(prompts, base) for i in range(steps)]
    fp8 = generate(fp8_engine, [c for c, _ in contexts], max_tokens=1)
    token_agreement = np.mean([tokens[0] == want for (tokens, _), (_, want) in zip(fp8, contexts)])
    moe = list(moe_layers)
    same_rows = total_rows = 0
    for (_, r_base), (_, r_fp8), p in zip(base, fp8[::steps], prompts):  # the uncut prompts' rows
        a, b = np.sort(r_base[: len(p) - 1][:, moe], -1), np.sort(r_fp8[: len(p) - 1][:, moe], -1)
        same_rows += int((a == b).all(-1).sum())
        total_rows += a.shape[0] * a.shape[1]
    routing_agreement = same_rows / total_rows
    print(f"fp8 KV vs model-dtype KV: next tokens {token_agreement:.3f} of {len(contexts)}, prompt routing rows "
          f"{routing_agreement:.4f} of {total_rows}")
    return token_agreement, routing_agreement


def test_fp8_kv_engine_agrees_with_the_model_dtype_cache_on_most_tokens_and_routes(tiny):
    cfg, _ = tiny
    prompts = [prompt_of(n, 40 + n) for n in (12, 33, 57, 80, 21, 64, 45, 9)]
    engine = make_engine(tiny, kv_cache_dtype="fp8")
    assert engine.runner.kv[0].k.dtype == FP8 and engine.runner.kv[0].k_scale.item() == 1.0
    token_agreement, routing_agreement = agreement(make_engine(tiny), engine, prompts, 12, cfg.moe_layers)
    assert token_agreement >= MIN_TOKEN_AGREEMENT
    assert routing_agreement >= MIN_ROUTING_AGREEMENT
    assert engine.lifecycle.get_engine_info().result()["kv_cache_dtype"] == "fp8_e4m3"
    assert make_engine(tiny).lifecycle.get_engine_info().result()["kv_cache_dtype"] == "auto"


@pytest.fixture(scope="module")
def deepseek_v3_checkpoint(tmp_path_factory):
    """A tiny DeepSeek-V3 (MLA: latent 32 + rope key 8 values per token and layer) that transformers wrote."""
    from .hf_checkpoints import make_hf_model, save_hf_checkpoint

    return save_hf_checkpoint(make_hf_model("deepseek_v3", seed=3), tmp_path_factory.mktemp("v3"))


@pytest.mark.parametrize("checkpoint", ["tiny_checkpoint", "deepseek_v3_checkpoint"], ids=["tiny", "deepseek_v3"])
def test_the_same_kv_memory_holds_twice_the_tokens_of_a_bf16_cache(checkpoint, request, caplog):
    """MLA: its 576 (here 40) latent + rope-key values per token and layer take one byte each."""
    path = request.getfixturevalue(checkpoint)
    cfg = load_config(path)
    model = load_model(path, dtype="bfloat16", device=DEVICE, progress=False)
    mla = cfg.attention.mla
    budget = 64 << 20
    engines = {}
    for kv in ("auto", "fp8"):
        with caplog.at_level(logging.INFO):
            caplog.clear()
            engines[kv] = Engine(model, cfg, EngineConfig(kv_cache_dtype=kv, kv_cache_memory_bytes=budget,
                                                          max_model_len=256, enforce_eager=True))
            log = caplog.text
        per_token = engines[kv].runner.kv.bytes_per_token
        assert f"{per_token} bytes per token in {'bfloat16' if kv == 'auto' else 'float8_e4m3fn'}" in log
        if mla is not None:
            values = mla.kv_lora_rank + mla.qk_rope_head_dim
            assert per_token == cfg.num_hidden_layers * values * (2 if kv == "auto" else 1)
            assert f"{values} values per layer: MLA latent {mla.kv_lora_rank}" in log
        if kv == "fp8":
            assert "uncalibrated scales of 1.0" in log  # the tiny checkpoints have no k_scale / v_scale
    auto, fp8 = engines["auto"], engines["fp8"]
    assert fp8.runner.kv.bytes_per_token * 2 == auto.runner.kv.bytes_per_token
    tokens = {kv: e.blocks.num_blocks * e.settings.block_size for kv, e in engines.items()}
    assert 1.99 <= tokens["fp8"] / tokens["auto"] <= 2.01, tokens
    assert fp8.runner.kv.nbytes <= budget and fp8.runner.kv.nbytes > 0.99 * auto.runner.kv.nbytes


def test_checkpoint_kv_scales_are_read_under_vllms_names(tiny_checkpoint, tmp_path, caplog):
    """``model.layers.0.self_attn.k_proj.k_scale`` / ``v_proj.v_scale`` and layer 1's single ``kv_scale`` become those
    layers' scales (the rest 1.0), are not reported as unused tensors, and the FP8 cache stores x / scale."""
    path = tmp_path / "scaled"
    shutil.copytree(tiny_checkpoint, path)
    tensors = load_file(path / "model.safetensors")
    tensors["model.layers.0.self_attn.k_proj.k_scale"] = torch.tensor(0.5)
    tensors["model.layers.0.self_attn.v_proj.v_scale"] = torch.tensor([0.25])
    tensors["model.layers.1.self_attn.kv_scale"] = torch.tensor(2.0)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    cfg = load_config(path)
    with caplog.at_level(logging.INFO):
        model = load_model(path, dtype="float32", device=DEVICE, progress=False)
        engine = Engine(model, cfg, EngineConfig(kv_cache_dtype="fp8", max_model_len=256,
                                                 kv_cache_memory_bytes=16 << 20))
    assert "not used" not in caplog.text
    assert f"scales from the checkpoint for 2 of {cfg.num_hidden_layers} attention layers" in caplog.text
    assert model.kv_scales[:2] == [(0.5, 0.25), (2.0, 2.0)] and set(model.kv_scales[2:]) == {None}
    kv = engine.runner.kv
    assert [(kv[i].k_scale.item(), kv[i].v_scale.item()) for i in range(3)] == [(0.5, 0.25), (2.0, 2.0), (1.0, 1.0)]
    # layer 0's keys (computed before any cache read) stored with k_scale 0.5 are twice those stored with 1.0: the
    # same e4m3 rounding one binade up (away from saturation and subnormals)
    plain = Engine(load_model(tiny_checkpoint, dtype="float32", device=DEVICE, progress=False), cfg,
                   EngineConfig(kv_cache_dtype="fp8", max_model_len=256, kv_cache_memory_bytes=16 << 20))
    for e in (engine, plain):
        run_all(e, [submit(e, prompt_of(20, 1), max_tokens=2)])
    scaled, unscaled = kv[0].k.float(), plain.runner.kv[0].k.float()
    normal = (unscaled.abs() >= 2**-5) & (unscaled.abs() <= 200)
    assert normal.sum() > 100
    assert torch.equal(scaled[normal], 2 * unscaled[normal])


def test_bad_values_and_combinations_are_refused_by_name(tiny_checkpoint):
    cfg = load_config(tiny_checkpoint)
    for value, extra in (("fp8_e5m2", "fp8_e5m2 is not implemented"), ("int8", "supported: auto, fp8, fp8_e4m3")):
        with pytest.raises(ValueError, match=extra):
            EngineConfig(kv_cache_dtype=value).resolve(cfg, "cpu", torch.float32)
    for value in ("fp8", "fp8_e4m3", "FP8"):
        assert EngineConfig(kv_cache_dtype=value).resolve(cfg, "cpu", torch.float32).kv_cache_dtype == "fp8_e4m3"
    assert EngineConfig().resolve(cfg, "cpu", torch.float32).kv_cache_dtype == "auto"
    with pytest.raises(ValueError, match="tensor parallelism"):
        EngineConfig(kv_cache_dtype="fp8", tensor_parallel_size=2).resolve(cfg, "cpu", torch.float32)
    with pytest.raises(ValueError, match="deterministic"):
        EngineConfig(kv_cache_dtype="fp8", deterministic_inference=True).resolve(cfg, "cpu", torch.float32)


def test_the_cli_takes_vllms_values_and_refuses_others():
    from openai_frontend.cli import build_parser

    parser = build_parser()
    for value in ("auto", "fp8", "fp8_e4m3"):
        args = parser.parse_args(["--kv-cache-dtype", value])
        assert EngineConfig.from_cli_args(args).kv_cache_dtype == value
    with pytest.raises(SystemExit):
        parser.parse_args(["--kv-cache-dtype", "fp8_e5m2"])


def test_hybrid_models_keep_fp8_kv_only_for_their_attention_layers(tmp_path):
    """Qwen3.5: the attention layers' blocks are FP8, the Gated DeltaNet states stay in the model dtype, and the
    engine generates."""
    from moe_engine.layers.attend import LayerKV
    from moe_engine.layers.recurrent import LayerState

    from .hf_checkpoints import make_hf_model, save_hf_checkpoint

    path = save_hf_checkpoint(make_hf_model("qwen3_5_moe", seed=0), tmp_path / "q35")
    cfg = load_config(path)
    engine = Engine(load_model(path, dtype="float32", device=DEVICE, progress=False), cfg,
                    EngineConfig(kv_cache_dtype="fp8", max_model_len=128, kv_cache_memory_bytes=16 << 20))
    layers = engine.runner.kv.layers
    kv = [layer for layer in layers if isinstance(layer, LayerKV)]
    states = [layer for layer in layers if isinstance(layer, LayerState)]
    assert len(kv) == len(cfg.attention_layers) and states
    assert all(layer.k.dtype == FP8 and layer.v.dtype == FP8 for layer in kv)
    assert all(t.dtype == torch.float32 for layer in states for t in vars(layer).values() if isinstance(t, torch.Tensor))
    c = submit(engine, [t % cfg.vocab_size for t in prompt_of(30, 2)], max_tokens=4, ignore_eos=True)
    run_all(engine, [c])
    assert len(c.tokens) == 4


# ---------------------------------------------------------------------------------------- MLA (DeepSeek-V3)


def test_mla_fp8_kv_engine_agrees_with_the_model_dtype_cache_on_most_tokens_and_routes(deepseek_v3_checkpoint):
    """The latent and rope key in e4m3 (scales 1.0): measured as for the tiny model (``agreement``), the same
    thresholds. On CPU both engines take the op-by-op path (the FP8 one reads the dequantised cache); on CUDA the
    kernel path with decode and prefill graphs."""
    from .test_deepseek_fast_path import prompt_of as ds_prompt

    cfg = load_config(deepseek_v3_checkpoint)
    model = load_model(deepseek_v3_checkpoint, dtype="float32", device=DEVICE, progress=False)
    tiny_v3 = (cfg, model)
    engine = make_engine(tiny_v3, kv_cache_dtype="fp8")
    layer = engine.runner.kv[0]
    assert layer.k.dtype == FP8 and layer.v.dtype == FP8 and layer.k.shape[-1] == cfg.attention.mla.kv_lora_rank
    prompts = [ds_prompt(n, 40 + n) for n in (12, 33, 57, 80, 21, 64, 45, 9)]
    token_agreement, routing_agreement = agreement(make_engine(tiny_v3), engine, prompts, 12, cfg.moe_layers)
    assert token_agreement >= MIN_TOKEN_AGREEMENT
    assert routing_agreement >= MIN_ROUTING_AGREEMENT
    assert engine.lifecycle.get_engine_info().result()["kv_cache_dtype"] == "fp8_e4m3"


def test_mla_fp8_kv_kernel_path_equals_the_op_by_op_engine_with_a_prefix_cache_hit(deepseek_v3_checkpoint):
    """Over the same FP8 cache the kernel path (absorbed decode, prompt chunks expanded from cached latents, under
    the interpreter on CPU) gives the op-by-op engine's greedy tokens and routing rows, float32, for a prompt and a
    second one that reuses its first 16 tokens' latent blocks (prefix caching unchanged by the FP8 blocks)."""
    from .test_deepseek_fast_path import fast_engine
    from .test_deepseek_fast_path import prompt_of as ds_prompt
    from .test_replay import run

    cfg = load_config(deepseek_v3_checkpoint)
    model = load_model(deepseek_v3_checkpoint, dtype="float32", device=DEVICE, progress=False)
    first = ds_prompt(20, seed=7)
    second = first[:16] + ds_prompt(6, seed=8)
    engine = fast_engine(model, cfg, enable_prefix_caching=True, block_size=4, kv_cache_dtype="fp8")
    assert engine.runner.kv[0].k.dtype == FP8
    got = [run(engine, p, max_tokens=4, return_routed_experts=True) for p in (first, second)]
    assert engine.stats()["prefix_cache_hits"] >= 16
    model.use_fused_kernels(False)
    gpu = {"kv_cache_memory_bytes": 256 << 20, "max_num_seqs": 4} if DEVICE == "cuda" else {}
    ref = Engine(model, cfg, EngineConfig(max_model_len=64, enable_prefix_caching=False, fused_kernels=False,
                                          block_size=4, kv_cache_dtype="fp8", **gpu))
    assert not ref.runner.use_kernels and ref.runner.kv[0].k.dtype == FP8
    for prompt, g in zip((first, second), got):
        want = run(ref, prompt, max_tokens=4, return_routed_experts=True)
        assert g.tokens == want.tokens
        np.testing.assert_array_equal(np.sort(g.routing, -1), np.sort(want.routing, -1))


def test_mla_checkpoint_kv_scales_quantise_latent_and_rope_key_with_k_scale(deepseek_v3_checkpoint, tmp_path):
    """vLLM quantises an MLA layer's whole latent + rope-key row with its k_scale: layer 0's k_scale 0.5 becomes
    both of its cache scales (its v_scale is read, not reported unused, and not used)."""
    path = tmp_path / "scaled"
    shutil.copytree(deepseek_v3_checkpoint, path)
    tensors = load_file(path / "model.safetensors")
    tensors["model.layers.0.self_attn.k_scale"] = torch.tensor(0.5)
    tensors["model.layers.0.self_attn.v_scale"] = torch.tensor(0.25)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    model = load_model(path, dtype="float32", device=DEVICE, progress=False)
    engine = Engine(model, load_config(path), EngineConfig(kv_cache_dtype="fp8", max_model_len=64,
                                                           kv_cache_memory_bytes=16 << 20))
    kv = engine.runner.kv
    assert model.kv_scales[0] == (0.5, 0.5) and set(model.kv_scales[1:]) == {None}
    assert (kv[0].k_scale.item(), kv[0].v_scale.item(), kv[1].k_scale.item()) == (0.5, 0.5, 1.0)
