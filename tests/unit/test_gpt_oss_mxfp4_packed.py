"""GPT-OSS MXFP4 experts kept packed on the device (moe_engine/mxfp4_load.py, GptOssExperts.keep_mxfp4,
kernels/fused_moe_gpt_oss.py's MXFP4 weight load), on a checkpoint transformers wrote with the experts rewritten as
the Hub stores gpt-oss (``*_blocks`` / ``*_scales``): the bytes served are the checkpoint's, at about a quarter of the
bf16 bytes; logits, routed ids and greedy tokens are those of the engine that dequantises at load; /v1/models says
mxfp4; weight updates land in the packed storage (MXFP4 by name) or are refused (float experts), naming the fix.

Packing is chosen on CUDA with the fused kernels; here ``load_model(..., mxfp4=True)`` forces it, and on CPU the
packed kernel runs under Triton's interpreter. ``MOE_TEST_DEVICE=cuda`` runs the compiled kernels.
"""
from __future__ import annotations

import logging
import os
import sys

import numpy as np
import pytest
import torch
from safetensors import safe_open

from moe_engine.checkpoint import load_model
from moe_engine.config import load_config
from moe_engine.core.memory_plan import quantized_weight_bytes, weight_bytes
from moe_engine.core.sequence import Request, SamplingParams
from moe_engine.engine import Engine, EngineConfig
from moe_engine.kernels import support as kernel_support
from moe_engine.layers.experts import GptOssExperts
from moe_engine.models.decoder import reference_forward
from moe_engine.mxfp4_load import packed_bytes, packing_refusal, serve_mxfp4
from moe_engine.rl.weights import WeightUpdateError, check_tensors

from ..rl_trainer import announce, checkpoint_tensors
from .hf_checkpoints import make_hf_model, save_gpt_oss_mxfp4, save_hf_checkpoint
from .test_engine import Collector, run_all

DEVICE = os.environ.get("MOE_TEST_DEVICE", "cpu")
EXPERTS = "model.layers.0.mlp.experts"

pytestmark = pytest.mark.skipif(not kernel_support.available(DEVICE), reason="Triton not available for this device")


def prompt_of(n: int, seed: int) -> list[int]:
    return torch.randint(3, 250, (n,), generator=torch.Generator().manual_seed(seed)).tolist()  # vocab 256


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """Two MXFP4 gpt-oss checkpoints of one model (seeds 0 and 1; swiglu_limit 3 so the clamp is not the whole
    story) and the bf16 checkpoint of the second, all written by transformers' save_pretrained."""
    root = tmp_path_factory.mktemp("gpt_oss_mxfp4")
    a, b = (make_hf_model("gpt_oss", seed=s, dtype=torch.float32, swiglu_limit=3.0) for s in (0, 1))
    return {"A": save_gpt_oss_mxfp4(a, root / "A"), "B": save_gpt_oss_mxfp4(b, root / "B"),
            "B_bf16": save_hf_checkpoint(b.to(torch.bfloat16), root / "B_bf16")}


def packed(path, dtype="auto"):
    model = load_model(path, dtype=dtype, device=DEVICE, progress=False, mxfp4=True)
    assert model.use_fused_kernels(True)  # the packed experts' fused path (on CPU: the interpreter)
    return model


def experts_of(model) -> list[GptOssExperts]:
    return [m for m in model.modules() if isinstance(m, GptOssExperts)]


def expert_weight_bytes(model) -> int:
    return sum(p.nbytes for m in experts_of(model) for n, p in m.named_parameters() if not n.endswith("_bias"))


def test_packed_experts_hold_the_checkpoint_bytes_in_a_quarter_of_the_bf16_memory(ckpts):
    model = packed(ckpts["A"], "bfloat16")
    dense = load_model(ckpts["A"], dtype="bfloat16", device=DEVICE, progress=False)
    with safe_open(str(ckpts["A"] / "model.safetensors"), "pt") as f:
        for name in GptOssExperts.MXFP4_PARAMS:
            p = model.get_parameter(f"{EXPERTS}.{name}")
            assert p.dtype == torch.uint8 and torch.equal(p.cpu(), f.get_tensor(f"{EXPERTS}.{name}"))
    assert all(m.mxfp4 and not hasattr(m, "gate_up_proj") for m in experts_of(model))
    ratio = expert_weight_bytes(model) / expert_weight_bytes(dense)
    assert 0.25 < ratio <= 0.266  # 4 bits + one 8-bit scale per 32 weights, against 16 bits
    # the memory plan counts what the device holds: the packed bytes
    assert weight_bytes(dense) - weight_bytes(model) == expert_weight_bytes(dense) - expert_weight_bytes(model)
    assert packed_bytes(model) == quantized_weight_bytes(model) == expert_weight_bytes(model)  # the start-up log's
    assert quantized_weight_bytes(dense) == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logits_and_routed_ids_equal_the_dequantised_model(ckpts, dtype):
    """Against the model dequantised at load: on its fused path (the bf16 GEMMs on the same weights and tiles) the
    same bits; against its op-by-op path the same routed ids, logits within float32 rounding (float32 only: in
    bf16 the op-by-op path rounds differently, tests/unit/test_fused_moe_gpt_oss.py bounds that)."""
    model = packed(ckpts["A"], dtype)
    dense = load_model(ckpts["A"], dtype=dtype, device=DEVICE, progress=False)
    dense.use_fused_kernels(True)
    for m in experts_of(dense):
        m.triton_gemm_max_pairs = sys.maxsize  # the bf16 expert GEMMs for every step size, as packed experts run
    for n, seed in ((1, 1), (23, 2), (40, 3)):
        ids = prompt_of(n, seed)
        logits, routed = reference_forward(model, ids)
        dense_logits, dense_routed = reference_forward(dense, ids)
        assert torch.equal(routed, dense_routed) and torch.equal(logits, dense_logits), (dtype, n)
    if dtype != torch.float32:
        return
    dense.use_fused_kernels(False)
    model_off = load_model(ckpts["A"], dtype=dtype, device=DEVICE, progress=False, mxfp4=True)  # fused kernels off
    for n, seed in ((1, 1), (23, 2)):
        ids = prompt_of(n, seed)
        dense_logits, dense_routed = reference_forward(dense, ids)
        for m in (model, model_off):  # the packed kernel, and packed experts dequantised one at a time by torch
            logits, routed = reference_forward(m, ids)
            assert torch.equal(routed, dense_routed)
            torch.testing.assert_close(logits, dense_logits, atol=1e-4, rtol=1e-4)


def engine_on(model, path, fused: bool) -> Engine:
    gpu = {} if DEVICE == "cpu" else {"kv_cache_memory_bytes": 256 << 20, "max_num_seqs": 8}
    engine = Engine(model, load_config(path), EngineConfig(max_model_len=64, max_num_batched_tokens=16,
                                                           fused_kernels=fused, **gpu))
    model.use_fused_kernels(fused)
    return engine


def greedy(engine, prompts=((11, 30), (6, 31), (20, 32))):
    """Greedy tokens and routed-expert rows of a few prompts (prefill chunks beside decode steps)."""
    outs = []
    for n, seed in prompts:
        c = Collector()
        engine.add_request(Request(
            request_id=engine.new_request_id(), prompt_token_ids=prompt_of(n, seed),
            sampling=SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True), return_routed_experts=True,
            on_output=c))
        outs.append(c)
        engine.step()
    run_all(engine, outs)
    return [(c.tokens, c.routing) for c in outs]


def assert_same_generation(a, b):
    for (ta, ra), (tb, rb) in zip(a, b, strict=True):
        assert ta == tb
        np.testing.assert_array_equal(ra, rb)


def test_engine_with_packed_experts_generates_what_the_dequantised_engine_does(ckpts):
    """Float32 (the checkpoint's dtype): the same greedy tokens and routed ids as the op-by-op engine that
    dequantised at load; /v1/models' quantization says the experts are served as mxfp4."""
    path = ckpts["A"]
    reference = greedy(engine_on(load_model(path, dtype="auto", device=DEVICE, progress=False), path, False))
    engine = engine_on(packed(path), path, True)
    assert_same_generation(greedy(engine), reference)
    assert engine.lifecycle.get_engine_info().result()["weights_served_as"] == "mxfp4"
    dense = engine_on(load_model(path, dtype="auto", device=DEVICE, progress=False), path, True)
    assert dense.lifecycle.get_engine_info().result()["weights_served_as"] == "float32"


def test_mxfp4_update_lands_in_the_packed_experts_and_a_float_one_is_refused(ckpts):
    """From disk: B's MXFP4 experts are copied into the packed storage (the engine then generates what an engine
    started on B generates); B in bf16 is refused naming MXFP4 and --disable-fused-kernels, nothing written.
    Broadcast: MXFP4 bytes and scales are accepted by name as uint8; float experts are refused."""
    engine = engine_on(packed(ckpts["A"]), ckpts["A"], True)
    on_b = greedy(engine_on(packed(ckpts["B"]), ckpts["B"], True))
    before = {n: p.clone() for n, p in engine.model.named_parameters()}
    future = engine.lifecycle.update_weights_from_disk(str(ckpts["B_bf16"]))
    while not future.done():
        engine.step()
    with pytest.raises(WeightUpdateError, match=r"packed as MXFP4.*_blocks.*--disable-fused-kernels"):
        future.result()
    assert all(torch.equal(p, before[n]) for n, p in engine.model.named_parameters())

    future = engine.lifecycle.update_weights_from_disk(str(ckpts["B"]))
    while not future.done():
        engine.step()
    future.result()
    with safe_open(str(ckpts["B"] / "model.safetensors"), "pt") as f:
        assert torch.equal(engine.model.get_parameter(f"{EXPERTS}.down_proj_blocks").cpu(),
                           f.get_tensor(f"{EXPERTS}.down_proj_blocks"))
    assert_same_generation(greedy(engine), on_b)

    plan = check_tensors(engine.model, **announce(checkpoint_tensors(ckpts["B"])))
    blocks = next(inc for inc in plan if inc.name == f"{EXPERTS}.gate_up_proj_blocks")
    assert blocks.dtype == torch.uint8 and blocks.target.param == blocks.name
    with pytest.raises(WeightUpdateError, match=r"experts\.(gate_up|down)_proj' \(bfloat16\).*packed as MXFP4"):
        check_tensors(engine.model, **announce(checkpoint_tensors(ckpts["B_bf16"])))


def test_packing_is_chosen_on_cuda_with_the_fused_kernels_and_logged(ckpts, caplog):
    cfg = load_config(ckpts["A"])
    assert packing_refusal(cfg, "cuda", fused_kernels=True) is None
    assert "CUDA" in packing_refusal(cfg, "cpu", fused_kernels=True)
    assert "fused kernels are off" in packing_refusal(cfg, "cuda", fused_kernels=False)
    assert "parallelism" in packing_refusal(cfg, "cuda", True, tensor_parallel=True)
    assert "deterministic" in packing_refusal(cfg, "cuda", True, deterministic=True)
    assert packing_refusal(load_config(ckpts["B_bf16"]), "cuda", True) == "not an MXFP4 checkpoint"
    with caplog.at_level(logging.INFO, logger="moe_engine.mxfp4_load"):
        assert serve_mxfp4(cfg, EngineConfig(), "cpu") is False
    assert "experts dequantised to the model dtype at load (the packed kernels run on CUDA only)" in caplog.text


def test_quantizer_rounds_every_weight_to_its_nearest_mxfp4_value():
    """checkpoint.quantize_mxfp4 (the benchmark's and the test checkpoints' quantiser): each weight becomes the
    nearest of its group's 16 representable values (scale * FP4_VALUES), the scale the power of two that fits the
    group's max |w| into 6."""
    from moe_engine.checkpoint import FP4_VALUES, dequantize_mxfp4, quantize_mxfp4

    w = torch.randn(3, 8, 96, generator=torch.Generator().manual_seed(0)) * torch.logspace(-4, 1, 8)[:, None]
    blocks, scales = quantize_mxfp4(w)
    assert blocks.shape == (3, 8, 3, 16) and scales.shape == (3, 8, 3) and blocks.dtype == scales.dtype == torch.uint8
    deq = dequantize_mxfp4(blocks, scales, torch.float32).transpose(1, 2)  # [3, 8, 96], as w
    grid = torch.exp2(scales.float() - 127).repeat_interleave(32, -1)[..., None] * torch.tensor(FP4_VALUES)
    nearest = (grid - w[..., None]).abs().min(-1).values
    assert torch.equal((deq - w).abs(), nearest)
    assert (w.abs().unflatten(-1, (3, 32)).amax(-1) <= 6 * torch.exp2(scales.float() - 127)).all()


def test_packing_a_loaded_model_in_memory_keeps_its_weights(ckpts):
    """mxfp4_load.pack_in_memory (the real-shape benchmark's --quantization mxfp4): a model dequantised from an
    MXFP4 checkpoint, packed again, holds exactly the same weight values (scales chosen by each group's max)."""
    from moe_engine.checkpoint import dequantize_mxfp4
    from moe_engine.mxfp4_load import pack_in_memory

    model = load_model(ckpts["A"], dtype="float32", device=DEVICE, progress=False)
    dense = {n: p.clone() for n, p in model.named_parameters() if ".experts." in n}
    assert pack_in_memory(model) == expert_weight_bytes(model) > 0
    for m_name, m in model.named_modules():
        if isinstance(m, GptOssExperts):
            for name in ("gate_up_proj", "down_proj"):
                got = dequantize_mxfp4(getattr(m, f"{name}_blocks"), getattr(m, f"{name}_scales"), torch.float32)
                assert torch.equal(got, dense[f"{m_name}.{name}"]), (m_name, name)
