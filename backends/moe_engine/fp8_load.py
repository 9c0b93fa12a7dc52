"""Which weights a model serves in W8A8 block FP8, and how the loader fills them.

Two ways in (``load_model(..., fp8=...)``):

- "checkpoint": an FP8 checkpoint (quantization_config quant_method fp8 with a weight_block_size) keeps its e4m3
  weights and ``weight_scale_inv`` as stored: nothing is dequantised or re-quantised (re-quantising a dequantised
  weight would not give back the same blocks). The engine chooses it on GPUs with FP8 tensor cores (compute
  capability 8.9+) when the fused kernels run (``fp8_mode``); elsewhere the checkpoint loads dequantised.
- "quantize" (``--quantization fp8``, vLLM's flag): a bf16 / fp16 / fp32 checkpoint's targets are read in the model
  dtype and quantised at load, tensor by tensor on the device, in 128 x 128 blocks (``fp8.quantize_fp8_blocks``).

Targets, as the published FP8 checkpoints choose them: the dense projections of attention (q/k/v/o; MLA's q_a/q_b/
kv_a, not kv_b_proj, which MLA uses as a matrix on the cached latents, as vLLM dequantises it) and of dense MLPs and
shared experts, and the routed SwiGLU experts. Not: embeddings, lm_head, norms, routers (``mlp.gate``), the shared
expert gate, linear-attention / Mamba layers, GPT-OSS and Nemotron-H experts. In "checkpoint" mode only those the
checkpoint stores in FP8 (a projection kept in bf16 stays bf16), and routed experts only where each expert's gate
and up projections have whole row blocks (I a multiple of the block rows: their scale grids then stack into the
[2I, H] grid); others load dequantised.
"""
from __future__ import annotations

import logging

import torch
from torch import nn

from . import fp8
from .layers.experts import Experts
from .layers.fp8_linear import Fp8Linear

log = logging.getLogger(__name__)

ONLINE_BLOCK = (128, 128)
_KEEP_DENSE = (".mlp.gate", ".mixer.gate", ".shared_expert_gate", ".kv_b_proj", ".router")  # module names ending so


def fp8_mode(cfg, quantization: str | None, device: torch.device | str, fused_kernels: bool,
             tensor_parallel: bool = False, deterministic: bool = False) -> str | None:
    """"quantize" (``--quantization fp8``), "checkpoint" (an FP8 checkpoint served in FP8) or None (dequantised or
    unquantized weights). Raises ValueError for a ``quantization`` this engine does not know or cannot combine.
    The W8A8 GEMMs pick tiles by step size, so deterministic inference serves an FP8 checkpoint dequantised."""
    if quantization not in (None, "", "none", "fp8"):
        raise ValueError(f"--quantization {quantization!r} is not supported (supported: fp8)")
    if quantization == "fp8":
        if cfg.quantization.method != "none":
            log.info("--quantization fp8: the checkpoint is already quantized (%s); serving it as stored",
                     cfg.quantization.method)
        elif tensor_parallel or deterministic:
            raise ValueError("--quantization fp8 is not supported with tensor parallelism or deterministic inference")
        else:
            return "quantize"
    q = cfg.quantization
    if q.method != "fp8" or q.weight_block_size is None or tensor_parallel or deterministic or not fused_kernels:
        return None
    device = torch.device(device)
    if device.type != "cuda" or torch.cuda.get_device_capability(device) < (8, 9):
        return None  # no FP8 tensor cores: the dequantised reference path
    return "checkpoint"


def serve_fp8(cfg, ecfg, device: str) -> str | None:
    """``fp8_mode`` for an engine's settings (EngineConfig) on ``device``: fused kernels unless disabled, where
    Triton runs."""
    from .engine_config import batch_invariant_env
    from .kernels import support as kernel_support

    dev = torch.device(device)
    fused = ecfg.fused_kernels is not False and dev.type == "cuda" and kernel_support.available(dev)
    mode = fp8_mode(cfg, ecfg.quantization, dev, fused, ecfg.tensor_parallel_size > 1,
                    bool(ecfg.deterministic_inference) or batch_invariant_env())
    if cfg.quantization.method == "fp8" and mode is None:
        log.info("FP8 checkpoint: dequantised at load (W8A8 needs a GPU with FP8 tensor cores, the fused kernels, "
                 "one GPU and no deterministic inference)")
    return mode


def _dense_targets(model: nn.Module):
    """(name, parent module, attribute, Linear) of every dense projection that may be served in FP8."""
    for name, module in model.named_modules():
        if type(module) is not nn.Linear or not name.startswith("model.layers."):
            continue
        if (".self_attn." not in name and ".mlp." not in name) or name.endswith(_KEEP_DENSE):
            continue
        parent, _, attr = name.rpartition(".")
        yield name, model.get_submodule(parent), attr, module


def _stored_fp8(tensors, key: str) -> bool:
    return key in tensors and tensors.fp8_scale_key(key) is not None


def _experts_stored_fp8(tensors, cfg, name: str) -> bool:
    """Whether the routed experts of module ``name`` are stored in FP8 with scale grids that stack (see above)."""
    fused = f"{name}.gate_up_proj"
    if fused in tensors:
        return _stored_fp8(tensors, fused)
    block = cfg.quantization.weight_block_size
    return (_stored_fp8(tensors, f"{name}.0.gate_proj.weight") and block is not None
            and cfg.experts.intermediate_size % block[0] == 0)


def prepare(model: nn.Module, cfg, tensors, mode: str) -> set[str]:
    """Swap the targets of the meta ``model`` for their FP8 forms; returns the names of the FP8 weights (their
    ``*_scale_inv`` are read with them)."""
    block = ONLINE_BLOCK if mode == "quantize" else tuple(cfg.quantization.weight_block_size)
    names: set[str] = set()
    for name, parent, attr, lin in list(_dense_targets(model)):
        if mode == "checkpoint" and not _stored_fp8(tensors, f"{name}.weight"):
            continue
        setattr(parent, attr, Fp8Linear(lin.in_features, lin.out_features, lin.bias is not None, block,
                                         dtype=lin.weight.dtype, device="meta"))
        names.add(f"{name}.weight")
    for name, module in model.named_modules():
        if type(module) is Experts and not (mode == "checkpoint" and not _experts_stored_fp8(tensors, cfg, name)):
            module.keep_fp8(block)
            names.update({f"{name}.gate_up_proj", f"{name}.down_proj"})
    if not names:
        log.warning("FP8: no projection of %s can be served in FP8; serving it in the model dtype", cfg.architecture)
    return names


def read_checkpoint_fp8(tensors, cfg, name: str, weight: nn.Parameter, scale: nn.Parameter, device) -> tuple:
    """(e4m3 weight, float32 scales) of FP8 target ``name`` as stored: a dense ``X.weight``, fused experts, or the
    per-expert Hub layout stacked (gate rows then up rows, their scale rows likewise)."""
    if name in tensors:
        return tensors.get_fp8(name, weight.shape, scale.shape, device)
    prefix, _, leaf = name.rpartition(".")  # model.layers.{i}.mlp.experts, gate_up_proj | down_proj
    E, R, _ = weight.shape
    q = torch.empty(weight.shape, dtype=fp8.FP8_DTYPE, device=device)
    s = torch.empty(scale.shape, dtype=torch.float32, device=device)
    parts = ("gate_proj", "up_proj") if leaf == "gate_up_proj" else ("down_proj",)
    rows, srows = R // len(parts), scale.shape[1] // len(parts)
    for e in range(E):
        for j, part in enumerate(parts):
            key = f"{prefix}.{e}.{part}.weight"
            pq, ps = tensors.get_fp8(key, (rows, weight.shape[2]), (srows, scale.shape[2]), device)
            q[e, j * rows : (j + 1) * rows].copy_(pq)
            s[e, j * srows : (j + 1) * srows].copy_(ps)
    return q, s


def quantize_loaded(value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``--quantization fp8``: one weight (or [E, R, C] experts, one expert at a time to keep temporaries small)."""
    if value.dim() == 2:
        return fp8.quantize_fp8_blocks(value, ONLINE_BLOCK)
    pairs = [fp8.quantize_fp8_blocks(value[e], ONLINE_BLOCK) for e in range(value.shape[0])]
    return torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])


# ----------------------------------------------------------------------------- a model already in memory
# (the real-shape benchmark: random bf16 weights built on the GPU, quantised there)


def target_names(model: nn.Module) -> list[str]:
    """The weights ``--quantization fp8`` would quantise in this model: dense "X.weight", experts "X.gate_up_proj"
    and "X.down_proj"."""
    names = [f"{name}.weight" for name, *_ in _dense_targets(model)]
    for name, module in model.named_modules():
        if type(module) is Experts and module.fp8_block is None:
            names += [f"{name}.gate_up_proj", f"{name}.down_proj"]
    return names


@torch.no_grad()
def quantize_in_memory(model: nn.Module, names: list[str], to: torch.device | str | None = None) -> dict:
    """name -> (e4m3 weight, float32 scales) of each named weight, quantised on its device in 128 x 128 blocks
    (experts one at a time) and moved to ``to`` (e.g. the host, while the model keeps its bf16 weights)."""
    out = {}
    for name in names:
        q, s = quantize_loaded(model.get_parameter(name))
        out[name] = (q.to(to), s.to(to)) if to is not None else (q, s)
    return out


@torch.no_grad()
def dequantize_in_place(model: nn.Module, quantized: dict) -> None:
    """Each named weight := its dequantised FP8 value in the model dtype: the reference an FP8 forward is compared
    with (the same weights, unquantised activations)."""
    for name, (q, s) in quantized.items():
        p = model.get_parameter(name)
        for e in range(p.shape[0]) if p.dim() == 3 else [None]:  # experts one at a time: small temporaries
            dst, qq, ss = (p, q, s) if e is None else (p[e], q[e], s[e])
            dst.copy_(fp8.dequantize_fp8(qq.to(p.device), ss.to(p.device), ONLINE_BLOCK, p.dtype))


@torch.no_grad()
def install_fp8(model: nn.Module, quantized: dict) -> None:
    """Serve the named weights in FP8 from ``quantized`` (moved to the model's device), freeing their bf16 tensors:
    dense projections become Fp8Linear (bias kept), experts take their e4m3 weights and scales."""
    for name, (q, s) in quantized.items():
        module_name, _, attr = name.rpartition(".")
        module = model.get_submodule(module_name)
        device = getattr(module, attr).device
        if isinstance(module, nn.Linear):
            parent_name, _, child = module_name.rpartition(".")
            lin = Fp8Linear(module.in_features, module.out_features, module.bias is not None, ONLINE_BLOCK,
                            dtype=module.weight.dtype, device="meta")
            lin.weight = nn.Parameter(q.to(device), requires_grad=False)
            lin.weight_scale_inv = nn.Parameter(s.to(device), requires_grad=False)
            lin.bias = module.bias
            lin.fused = getattr(module, "fused", False)
            setattr(model.get_submodule(parent_name), child, lin)
        else:
            if module.fp8_block is None:
                module.fp8_block = ONLINE_BLOCK
            setattr(module, attr, nn.Parameter(q.to(device), requires_grad=False))
            setattr(module, f"{attr}_scale_inv", nn.Parameter(s.to(device), requires_grad=False))
