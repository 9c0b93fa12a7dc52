"""Whether a GPT-OSS MXFP4 checkpoint keeps its experts packed on the device, and how the loader fills them.

A gpt-oss checkpoint stores its routed experts as MXFP4 (``*_blocks`` uint8 [E, R, C/32, 16] + ``*_scales`` e8m0
uint8 [E, R, C/32]; checkpoint.py). Two ways to serve them:

- packed (``load_model(..., mxfp4=True)``): the bytes and scales stay as stored, on the device (about 4.25 bits a
  weight: GPT-OSS-120B's experts take ~61 GiB instead of ~226 GiB in bf16), and kernels/fused_moe_gpt_oss.py's
  MXFP4 weight load decodes them in registers. Chosen on CUDA with the fused kernels on, one GPU (tensor and expert
  parallelism slice experts along K or across ranks in the model dtype: sharding.py) and no deterministic
  inference (its reference GEMMs take model-dtype weights).
- dequantised at load into the model dtype (checkpoint.py ``dequantize_mxfp4``, as transformers): everywhere else,
  the reference path.

Tests force packing on CPU by passing ``mxfp4=True`` to ``load_model`` (the interpreter then runs the packed kernel).
"""
from __future__ import annotations

import logging

import torch
from torch import nn

from .layers.experts import GptOssExperts

log = logging.getLogger(__name__)


def packing_refusal(cfg, device: torch.device | str, fused_kernels: bool, tensor_parallel: bool = False,
                    deterministic: bool = False) -> str | None:
    """Why an MXFP4 checkpoint's experts are dequantised at load rather than kept packed; None: kept packed.
    (Not an MXFP4 checkpoint: a reason too.)"""
    if cfg.experts.quant != "mxfp4":
        return "not an MXFP4 checkpoint"
    if torch.device(device).type != "cuda":
        return "the packed kernels run on CUDA only"
    if not fused_kernels:
        return "the fused kernels are off"
    if tensor_parallel:
        return "tensor / expert parallelism shards the experts in the model dtype"
    if deterministic:
        return "deterministic inference runs the experts' reference GEMMs"
    if cfg.hidden_size % 32 or cfg.experts.intermediate_size % 32:
        return "hidden and intermediate sizes must be multiples of 32"
    return None


def serve_mxfp4(cfg, ecfg, device: str) -> bool:
    """Whether an engine with settings ``ecfg`` (EngineConfig) on ``device`` keeps ``cfg``'s MXFP4 experts packed;
    logs the choice for an MXFP4 checkpoint."""
    from .engine_config import batch_invariant_env
    from .kernels import support as kernel_support

    if cfg.experts.quant != "mxfp4":
        return False
    dev = torch.device(device)
    fused = ecfg.fused_kernels is not False and dev.type == "cuda" and kernel_support.available(dev)
    reason = packing_refusal(cfg, dev, fused, ecfg.tensor_parallel_size > 1,
                             bool(ecfg.deterministic_inference) or batch_invariant_env())
    if reason is None:
        log.info("MXFP4 checkpoint: experts kept packed on the device (4-bit e2m1 + e8m0 scales, decoded in the "
                 "fused expert GEMMs)")
    else:
        log.info("MXFP4 checkpoint: experts dequantised to the model dtype at load (%s)", reason)
    return reason is None


def prepare(model: nn.Module) -> set[str]:
    """Switch every GPT-OSS experts module of the meta ``model`` to packed MXFP4; returns the names of the packed
    parameters (the checkpoint's ``*_blocks`` / ``*_scales`` keys, read as stored)."""
    names: set[str] = set()
    for name, module in model.named_modules():
        if isinstance(module, GptOssExperts):
            module.keep_mxfp4()
            names.update(f"{name}.{p}" for p in GptOssExperts.MXFP4_PARAMS)
    return names


@torch.no_grad()
def pack_in_memory(model: nn.Module) -> int:
    """Quantise every GPT-OSS experts module's model-dtype weights to MXFP4 on their device (round to nearest,
    checkpoint.py ``quantize_mxfp4``, one expert at a time to keep temporaries small) and serve them packed, freeing
    the model-dtype tensors: the real-shape benchmark's random weights. Returns the packed bytes."""
    from .checkpoint import quantize_mxfp4

    for m in model.modules():
        if not isinstance(m, GptOssExperts) or m.mxfp4:
            continue
        packed = {}
        for name in ("gate_up_proj", "down_proj"):  # [E, K, N] -> the Hub's [E, N, K/32, 16] + [E, N, K/32]
            w = getattr(m, name)
            pairs = [quantize_mxfp4(w[e].t()) for e in range(w.shape[0])]
            packed[f"{name}_blocks"] = torch.stack([b for b, _ in pairs])
            packed[f"{name}_scales"] = torch.stack([s for _, s in pairs])
            del pairs
        m.keep_mxfp4()
        for name, t in packed.items():
            setattr(m, name, nn.Parameter(t, requires_grad=False))
    return packed_bytes(model)


def packed_bytes(model: nn.Module) -> int:
    """Bytes of the model's packed MXFP4 expert weights (bytes and scales)."""
    return sum(getattr(m, p).nbytes for m in model.modules() if isinstance(m, GptOssExperts) and m.mxfp4
               for p in GptOssExperts.MXFP4_PARAMS)
