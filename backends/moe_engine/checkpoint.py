"""Load a Hugging Face MoE checkpoint (safetensors) into ``MoEForCausalLM``.

- single ``model.safetensors``, sharded (``model.safetensors.index.json``) or any ``*.safetensors`` set;
- experts stored per expert, as on the Hub (Mixtral ``block_sparse_moe.experts.{e}.w1/w3/w2``,
  Qwen/OLMoE ``mlp.experts.{e}.{gate,up,down}_proj``), or fused 3-D as transformers v5 writes with
  ``save_pretrained(save_original_format=False)`` (``mlp.experts.gate_up_proj`` [E, 2I, H],
  ``mlp.experts.down_proj`` [E, H, I]; Mixtral's ``block_sparse_moe`` renamed ``mlp``);
- GPT-OSS experts as transformers writes them ([E, H, 2I] / [E, I, H] plus biases) or MXFP4 as on the Hub
  (``*_blocks`` uint8 [E, R, C/32, 16] + ``*_scales`` uint8 [E, R, C/32]), dequantised at load exactly as
  transformers' ``integrations/mxfp4.py`` does (LUT, ldexp, transpose);
- FP8 block-scaled as DeepSeek-V3 / Qwen3-FP8 / GLM-FP8 publish (e4m3 ``weight`` + float32 ``weight_scale_inv``
  per ``weight_block_size`` block, per expert or fused; fp8.py), dequantised at load: float32 product, one cast
  to the model dtype, as transformers' ``Fp8Dequantize``;
- bf16 / fp16 / fp32 on disk, converted tensor by tensor to the requested dtype, except where HF keeps float32
  (DeepSeek's router weight and e_score_correction_bias; ``MoEForCausalLM.param_dtype``);
- tied embeddings (``lm_head`` shares ``embed_tokens``; a stored ``lm_head.weight`` is ignored, as HF);
- DeepSeek-V3 multi-token-prediction layers (``model.layers.{num_hidden_layers}.*``) are ignored, as HF;
- FP8 KV-cache scales as vLLM reads them (``...self_attn[.k_proj].k_scale``, ``[.v_proj].v_scale``, or one
  ``kv_scale`` for both; ``read_kv_scales``) go to ``model.kv_scales`` for ``--kv-cache-dtype fp8``.

The model is built on the ``meta`` device and each parameter is read from the memory-mapped
file (``safe_open``) and assigned, so there is never a second full copy of the weights in RAM.
Tensor / expert parallelism: ``shard`` (sharding.py) shrinks the meta model to one rank's part and says where
each part lies in the checkpoint's tensors (``Selection``); only those slices are read from the memory map
(per-expert layouts: only this rank's experts, and of each only its rows or columns).
A missing or mis-shaped tensor raises ``CheckpointError`` naming the key and the expected shape.
"""
from __future__ import annotations

import itertools
import json
import logging
import os
import re
import sys
import time
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from .config import DTYPE_ALIASES, MoEConfig, load_config
from . import fp8_load, mxfp4_load
from .fp8 import FP8_DTYPE as fp8_dtype
from .fp8 import dequantize_fp8
from .distributed.sharding import Selection
from .models.decoder import MoEForCausalLM

log = logging.getLogger(__name__)

_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# Per-expert (Hub) layout: MoE block module names (first = the Hub name) and the gate / up / down names.
_PER_EXPERT_NAMES = {
    "mixtral": (("block_sparse_moe", "mlp"), "w1", "w3", "w2"),
}
_DEFAULT_PER_EXPERT_NAMES = (("mlp",), "gate_proj", "up_proj", "down_proj")


class CheckpointError(RuntimeError):
    """The checkpoint's tensors do not match what the config describes."""


def resolve_dtype(dtype: str | torch.dtype | None, cfg: MoEConfig) -> torch.dtype:
    """"auto" (or None) = the checkpoint's dtype from config.json, as vLLM."""
    if isinstance(dtype, torch.dtype):
        if dtype not in _TORCH_DTYPES.values():
            raise ValueError(f"unsupported dtype {dtype}; supported: float32, bfloat16, float16")
        return dtype
    name = cfg.torch_dtype if dtype in (None, "auto") else DTYPE_ALIASES.get(str(dtype).removeprefix("torch."))
    if name is None:
        raise ValueError(f"unsupported dtype {dtype!r}; supported: auto, float32, bfloat16, float16")
    return _TORCH_DTYPES[name]


def _fmt(shape) -> str:
    return "[" + ", ".join(str(int(s)) for s in shape) + "]"


class _Tensors:
    """key -> file index over a checkpoint directory, with lazily opened memory-mapped handles. ``prefixes``: (our
    prefix, the checkpoint's) pairs (``MoEConfig.key_prefixes``): a key stored under the checkpoint's prefix is also
    found under ours (Nemotron-H's ``backbone.``, a Qwen3.5 checkpoint's ``model.language_model.``)."""

    def __init__(self, root: Path, stack: ExitStack, prefixes: tuple[tuple[str, str], ...] = (),
                 fp8_block: tuple[int, int] | None = None):
        self.root, self._stack, self._handles = root, stack, {}
        self.fp8_block = fp8_block  # weight_block_size of an FP8 checkpoint (None: per-tensor scales)
        index = root / "model.safetensors.index.json"
        if index.is_file():
            self.key_file = dict(json.loads(index.read_text())["weight_map"])
        else:
            files = [root / "model.safetensors"] if (root / "model.safetensors").is_file() else sorted(root.glob("*.safetensors"))
            if not files:
                other = [p.name for p in root.glob("*.bin")] + [p.name for p in root.glob("*.pt")]
                hint = f" (found {', '.join(other)}: only safetensors is supported)" if other else ""
                raise FileNotFoundError(f"no *.safetensors weights in {root}{hint}")
            self.key_file = {}
            for f in files:
                for key in self._open(f.name).keys():
                    self.key_file[key] = f.name
        self.used: set[str] = set()
        self.alias: dict[str, str] = {}  # our name -> the key stored under the checkpoint's prefix
        for ours, theirs in prefixes:
            for key in self.key_file:
                if key.startswith(theirs):
                    self.alias.setdefault(ours + key[len(theirs):], key)

    def _real(self, key: str) -> str:
        return key if key in self.key_file else self.alias.get(key, key)

    def _open(self, fname: str):
        if fname not in self._handles:
            path = self.root / fname
            if not path.is_file():
                raise FileNotFoundError(f"checkpoint shard {path} (listed in the index) is missing")
            self._handles[fname] = self._stack.enter_context(safe_open(str(path), framework="pt", device="cpu"))
        return self._handles[fname]

    def __contains__(self, key: str) -> bool:
        return key in self.key_file or key in self.alias

    def shape(self, key: str) -> list[int]:
        key = self._real(key)
        return list(self._open(self.key_file[key]).get_slice(key).get_shape())

    def fp8_scale_key(self, key: str) -> str | None:
        """The ``weight_scale_inv`` of an FP8 tensor (``X.weight`` -> ``X.weight_scale_inv``, fused experts'
        ``...gate_up_proj`` -> ``...gate_up_proj_scale_inv``); None for a tensor stored unquantized. An e4m3
        tensor without its scales is an error, not silently read as values."""
        key = self._real(key)
        if not self._open(self.key_file[key]).get_slice(key).get_dtype().startswith("F8"):
            return None
        scale = key[: -len("weight")] + "weight_scale_inv" if key.endswith("weight") else key + "_scale_inv"
        if scale not in self.key_file:
            raise CheckpointError(f"FP8 tensor {key!r} in {self.key_file[key]} has no {scale!r}: only block- or "
                                  "tensor-scaled FP8 (quantization_config quant_method 'fp8') is supported")
        return scale

    def get_fp8(self, key: str, shape, scale_shape, device) -> tuple[torch.Tensor, torch.Tensor]:
        """An FP8 tensor as stored (e4m3) and its float32 scales, on ``device``, after checking both shapes."""
        key = self._real(key)
        scale_key = self.fp8_scale_key(key)
        for k, want in ((key, shape), (scale_key, scale_shape)):
            if list(self.shape(k)) != list(want):
                raise CheckpointError(f"tensor {k!r} in {self.key_file[k]} has shape {_fmt(self.shape(k))}, "
                                      f"expected {_fmt(want)}")
            self.used.add(k)
        read = lambda k, dtype: _place(self._open(self.key_file[k]).get_tensor(k), dtype, device)  # noqa: E731
        return read(key, fp8_dtype), read(scale_key, torch.float32)

    def _read(self, key: str, rows: slice | None = None) -> torch.Tensor:
        """A stored tensor (``rows`` of its first dim), FP8 dequantised to float32 with its scales."""
        handle = self._open(self.key_file[key])
        value = handle.get_slice(key)[rows] if rows is not None else handle.get_tensor(key)
        scale_key = self.fp8_scale_key(key)
        if scale_key is None:
            return value
        self.used.add(scale_key)
        scale_handle = self._open(self.key_file[scale_key])
        if rows is not None and len(scale_handle.get_slice(scale_key).get_shape()) == value.dim():
            scales = scale_handle.get_slice(scale_key)[rows]  # one expert's grid
        else:
            scales = scale_handle.get_tensor(scale_key)
        try:
            return dequantize_fp8(value, scales, self.fp8_block)
        except ValueError as e:
            raise CheckpointError(f"{key!r} in {self.key_file[key]}: {e}") from None

    def get(self, key: str, shape: list[int] | tuple[int, ...]) -> torch.Tensor:
        """Read one tensor (from the memory map) after checking its shape (FP8: dequantised to float32)."""
        key = self._real(key)
        found = self.shape(key)
        if list(found) != list(shape):
            raise CheckpointError(
                f"tensor {key!r} in {self.key_file[key]} has shape {_fmt(found)}, expected {_fmt(shape)}"
            )
        self.used.add(key)
        return self._read(key)

    def get_row(self, key: str, shape: list[int] | tuple[int, ...], i: int) -> torch.Tensor:
        """Rows [i : i + 1] of one tensor (read through the memory map) after checking the whole shape."""
        key = self._real(key)
        found = self.shape(key)
        if list(found) != list(shape):
            raise CheckpointError(
                f"tensor {key!r} in {self.key_file[key]} has shape {_fmt(found)}, expected {_fmt(shape)}"
            )
        self.used.add(key)
        return self._read(key, slice(i, i + 1))

    def read_selected(self, key: str, sel: Selection, out: torch.Tensor) -> None:
        """This rank's part of one tensor (``sel``) into ``out`` (zeros where nothing is read), slice by slice
        from the memory map, after checking the whole tensor's shape."""
        key = self._real(key)
        found = self.shape(key)
        if list(found) != list(sel.full_shape):
            raise CheckpointError(
                f"tensor {key!r} in {self.key_file[key]} has shape {_fmt(found)}, expected {_fmt(sel.full_shape)}"
            )
        self.used.add(key)
        if sel.zeros:
            return
        part = self._open(self.key_file[key]).get_slice(key)
        if self.fp8_scale_key(key) is not None and len(found) == 3:
            # fused FP8 experts: scales cover blocks, not slices; dequantised one expert at a time (a whole layer in
            # float32 would be tens of GB at DeepSeek-V3's shape), then sliced
            for src, dst in _pieces(sel):
                for j, e in enumerate(range(src[0].start, src[0].stop)):
                    out[dst[0].start + j][dst[1:]].copy_(self._read(key, slice(e, e + 1))[0][src[1:]])
            return
        if self.fp8_scale_key(key) is not None:  # scales cover blocks, not slices: dequantise, then slice
            part = self._read(key)
        for src, dst in _pieces(sel):
            out[dst].copy_(part[src])


def _place(src: torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Copy a tensor read from the file into a fresh torch allocation of the target dtype/device.

    safetensors hands back buffers that are not 64-byte aligned, and CPU GEMM kernels round differently
    on differently aligned operands, so without this the same weights could give different bits
    depending on the checkpoint layout. The temporary ``src`` is freed right after."""
    out = torch.empty(src.shape, dtype=dtype, device=device)
    return out.copy_(src)


def _pieces(sel: Selection):
    """(source slices, destination slices) of every block a selection reads (one per combination of ranges)."""
    per_dim = []
    for ranges in sel.ranges:
        dst, opts = 0, []
        for a, b in ranges:
            opts.append((slice(a, b), slice(dst, dst + b - a)))
            dst += b - a
        per_dim.append(opts)
    for combo in itertools.product(*per_dim):
        yield tuple(c[0] for c in combo), tuple(c[1] for c in combo)


def _zeros(shape, dtype, device) -> torch.Tensor:
    return torch.zeros(shape, dtype=dtype, device=device)


def _missing(root: Path, key: str, shape, alternative: str = "") -> CheckpointError:
    return CheckpointError(f"checkpoint {root} is missing tensor {key!r} (expected shape {_fmt(shape)}){alternative}")


def _load_direct(
    t: _Tensors, cfg: MoEConfig, name: str, shape, dtype, device, sel: Selection | None = None
) -> torch.Tensor:
    candidates = [name]
    blocks = _PER_EXPERT_NAMES.get(cfg.architecture, _DEFAULT_PER_EXPERT_NAMES)[0]
    if ".mlp." in name:  # e.g. Mixtral's router: block_sparse_moe.gate (Hub) or mlp.gate (v5)
        candidates += [name.replace(".mlp.", f".{b}.") for b in blocks if b != "mlp"]
    for key in candidates:
        if key in t:
            if sel is None:
                return _place(t.get(key, shape), dtype, device)
            out = _zeros(shape, dtype, device)
            t.read_selected(key, sel, out)
            return out
    raise _missing(t.root, name, sel.full_shape if sel is not None else shape)


def _load_experts(
    t: _Tensors, cfg: MoEConfig, name: str, shape, dtype, device, sel: Selection | None = None
) -> torch.Tensor:
    """``model.layers.{i}.mlp.experts.gate_up_proj`` [E, 2I, H] or ``...down_proj`` [E, H, I], from the fused
    tensor or assembled expert by expert (gate rows then up rows) into one preallocated buffer; GPT-OSS
    experts fused (as transformers writes them) or MXFP4. With ``sel``, only this rank's part."""
    if sel is not None:
        return _load_experts_part(t, cfg, name, shape, dtype, device, sel)
    if name in t:
        return _place(t.get(name, shape), dtype, device)
    if ".mixer.experts." in name:  # Nemotron-H: ungated up_proj [E, I, H] / down_proj [E, H, I], per expert
        prefix, _, leaf = name.partition(".mixer.experts.")
        out = torch.empty(shape, dtype=dtype, device=device)
        for e in range(shape[0]):
            key = f"{prefix}.mixer.experts.{e}.{leaf}.weight"
            if key not in t:
                raise _missing(t.root, name, shape, f" or its per-expert form {key!r} (expected shape "
                                                    f"{_fmt(shape[1:])})")
            out[e].copy_(t.get(key, list(shape[1:])))
        return out
    if cfg.experts.block == "gpt_oss":
        if f"{name}_blocks" in t:
            return _load_mxfp4(t, name, shape, dtype, device)
        alt = f" or its MXFP4 form {name + '_blocks'!r} + {name + '_scales'!r}" if not name.endswith("_bias") else ""
        raise _missing(t.root, name, shape, alt)
    layer_prefix = name.split(".mlp.experts.")[0]  # model.layers.{i}
    blocks, gate_n, up_n, down_n = _PER_EXPERT_NAMES.get(cfg.architecture, _DEFAULT_PER_EXPERT_NAMES)
    E, I = cfg.experts.num_experts, cfg.experts.intermediate_size
    is_gate_up = name.endswith("gate_up_proj")
    parts = [(gate_n, 0), (up_n, I)] if is_gate_up else [(down_n, None)]
    part_shape = [I, cfg.hidden_size] if is_gate_up else [cfg.hidden_size, I]
    block = next((b for b in blocks if f"{layer_prefix}.{b}.experts.0.{parts[0][0]}.weight" in t), blocks[0])
    out = torch.empty(shape, dtype=dtype, device=device)
    for e in range(E):
        for part, row in parts:
            key = f"{layer_prefix}.{block}.experts.{e}.{part}.weight"
            if key not in t:
                raise _missing(t.root, name, shape, f" or its per-expert form {key!r} (expected shape {_fmt(part_shape)})")
            src = t.get(key, part_shape)
            (out[e] if row is None else out[e, row : row + I]).copy_(src)
    return out


def _load_experts_part(t: _Tensors, cfg: MoEConfig, name: str, shape, dtype, device, sel: Selection) -> torch.Tensor:
    """This rank's part of an experts tensor: a slice of the fused tensor, or this rank's experts read one at a
    time (per-expert keys: only the rows / columns of the selection; MXFP4: dequantised, then sliced)."""
    out = _zeros(shape, dtype, device)
    if name in t:
        t.read_selected(name, sel, out)
        return out
    full = sel.full_shape
    if cfg.experts.block == "gpt_oss":
        if f"{name}_blocks" not in t:
            raise _missing(t.root, name, full)
        E, C, R = full
        for src, dst in _pieces(sel):
            for j, e in enumerate(range(src[0].start, src[0].stop)):
                blocks = t.get_row(f"{name}_blocks", [E, R, C // 32, 16], e).to(device)
                scales = t.get_row(f"{name}_scales", [E, R, C // 32], e).to(device)
                out[dst[0].start + j][dst[1:]].copy_(dequantize_mxfp4(blocks, scales, dtype)[0][src[1:]])
        return out
    layer_prefix = name.split(".mlp.experts.")[0]
    blocks, gate_n, up_n, down_n = _PER_EXPERT_NAMES.get(cfg.architecture, _DEFAULT_PER_EXPERT_NAMES)
    I, H = cfg.experts.intermediate_size, cfg.hidden_size
    is_gate_up = name.endswith("gate_up_proj")
    parts = [(gate_n, 0), (up_n, I)] if is_gate_up else [(down_n, 0)]
    part_shape = [I, H] if is_gate_up else [H, I]
    block = next((b for b in blocks if f"{layer_prefix}.{b}.experts.0.{parts[0][0]}.weight" in t), blocks[0])
    for src, dst in _pieces(sel):
        rows, cols = src[1], src[2]
        for j, e in enumerate(range(src[0].start, src[0].stop)):
            for part, lo in parts:  # gate_up: the gate rows [0, I), then the up rows [I, 2I)
                hi = lo + part_shape[0]
                a, b = max(rows.start, lo), min(rows.stop, hi)
                if a >= b:
                    continue
                key = f"{layer_prefix}.{block}.experts.{e}.{part}.weight"
                if key not in t:
                    raise _missing(t.root, name, full,
                                   f" or its per-expert form {key!r} (expected shape {_fmt(part_shape)})")
                piece = Selection(tuple(part_shape), (((a - lo, b - lo),), ((cols.start, cols.stop),)))
                d = dst[1].start + a - rows.start
                t.read_selected(key, piece, out[dst[0].start + j, d : d + b - a, dst[2]])
    return out


def is_experts_param(name: str) -> bool:
    """A routed experts' 3-D parameter (stored fused or per expert): ``mlp.experts.*``, Nemotron-H's
    ``mixer.experts.*``."""
    return ".mlp.experts." in name or ".mixer.experts." in name


# MXFP4 (OCP microscaling FP4, e2m1): nibble -> value; the low nibble is the even column (integrations/mxfp4.py)
FP4_VALUES = [+0.0, +0.5, +1.0, +1.5, +2.0, +3.0, +4.0, +6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """blocks uint8 [E, R, G, 16], scales uint8 [E, R, G] -> [E, G*32, R] in ``dtype``, as transformers'
    ``convert_moe_packed_tensors`` (LUT in the target dtype, ``ldexp`` by scale - 127, then transpose(1, 2))."""
    if blocks.shape[:-1] != scales.shape:
        raise CheckpointError(f"MXFP4 blocks {_fmt(blocks.shape)} do not match scales {_fmt(scales.shape)}")
    *prefix, G, B = blocks.shape
    lut = torch.tensor(FP4_VALUES, dtype=dtype, device=blocks.device)
    blocks = blocks.to(torch.uint8).reshape(-1, B)
    exp = (scales.to(torch.int32) - 127).reshape(-1, 1)
    out = torch.empty(blocks.shape[0], B * 2, dtype=dtype, device=blocks.device)
    out[:, 0::2] = lut[(blocks & 0x0F).to(torch.int)]
    out[:, 1::2] = lut[(blocks >> 4).to(torch.int)]
    torch.ldexp(out, exp, out=out)
    return out.reshape(*prefix, G * B * 2).transpose(1, 2).contiguous()


_FP4_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)  # between the magnitudes FP4_VALUES[0:8]


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., R, C] (C, the reduction dim, a multiple of 32) -> (blocks uint8 [..., R, C/32, 16], scales uint8
    [..., R, C/32]) that ``dequantize_mxfp4`` reads: per group of 32, the power-of-two scale that fits max |w| into
    6, each value rounded to the nearest e2m1 magnitude (a tie to the smaller), its sign kept. For random weights
    (the real-shape benchmark) and test checkpoints; not a calibrated quantiser."""
    groups = w.float().contiguous().unflatten(-1, (-1, 32))  # [..., R, C/32, 32]
    amax = groups.abs().amax(-1)
    exp = torch.ceil(torch.log2(torch.clamp(amax, min=2.0**-126) / 6.0)).clamp(-127, 127)
    scaled = groups / torch.exp2(exp)[..., None]
    mids = torch.tensor(_FP4_MIDPOINTS, device=w.device)
    code = torch.bucketize(scaled.abs(), mids).to(torch.uint8) | ((scaled < 0).to(torch.uint8) << 3)
    blocks = code[..., 0::2] | (code[..., 1::2] << 4)  # low nibble: the even column
    return blocks, (exp + 127).to(torch.uint8)


def _load_mxfp4(t: _Tensors, name: str, shape, dtype, device) -> torch.Tensor:
    """GPT-OSS ``{name}_blocks`` / ``{name}_scales`` -> dequantised [E, C, R] (``shape``)."""
    E, C, R = shape
    if C % 32:
        raise CheckpointError(f"{name}: MXFP4 needs the reduction dim ({C}) to be a multiple of 32")
    out = torch.empty(shape, dtype=dtype, device=device)
    for e in range(E):  # one expert at a time keeps the temporaries small
        blocks = t.get_row(f"{name}_blocks", [E, R, C // 32, 16], e).to(device)
        scales = t.get_row(f"{name}_scales", [E, R, C // 32], e).to(device)
        out[e].copy_(dequantize_mxfp4(blocks, scales, dtype)[0])
    return out


_MTP_ARCHITECTURES = ("deepseek_v3", "glm4_moe", "glm4_moe_lite")

# A layer's KV-cache scales, under the names vLLM's loaders accept (ModelOpt / compressed-tensors / Quark: on the
# attention module or its k_proj / v_proj; AutoFP8's older ``kv_scale``: one scale for keys and values).
_KV_SCALE_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|attn|mixer)\.(?:(?:[kv]_proj|qkv_proj|attn)\.)?"
                           r"(k_scale|v_scale|kv_scale)$")


def read_kv_scales(tensors: _Tensors, num_layers: int, mla: bool = False) -> list[tuple[float, float] | None]:
    """Per layer (k_scale, v_scale) from the checkpoint, None where it has none (a missing half: 1.0). The scales
    dequantise: the FP8 cache stores x / scale (kernels/kv_fp8.py), as vLLM. Marks the keys used. ``mla``: the
    cache's "k" is the latent and its "v" the rope key; both take k_scale, as vLLM quantises the whole 576-value
    latent + rope row with it (a v_scale is read and unused there)."""
    found: dict[int, dict[str, float]] = {}
    for key in tensors.key_file:
        m = _KV_SCALE_KEY.search(key)
        if m is None or int(m.group(1)) >= num_layers:
            continue
        value = tensors._open(tensors.key_file[key]).get_tensor(key).float()
        if value.numel() != 1:
            raise CheckpointError(f"KV-cache scale {key!r} has {value.numel()} elements; only per-tensor scales "
                                  "are supported")
        found.setdefault(int(m.group(1)), {})[m.group(2)] = float(value.reshape(()))
        tensors.used.add(key)
    scales: list[tuple[float, float] | None] = [None] * num_layers
    for layer, names in found.items():
        both = names.get("kv_scale", 1.0)
        k_scale = names.get("k_scale", both)
        scales[layer] = (k_scale, k_scale if mla else names.get("v_scale", both))
    return scales


def _ignored_key(key: str, cfg: MoEConfig) -> bool:
    """Tensors HF does not load either: the multi-token-prediction layers after the last layer (DeepSeek-V3,
    GLM-4.5 / 4.7), and the config's ``ignored_keys`` (Qwen3-Next's ``mtp.*``, a Qwen3.5 checkpoint's vision tower)."""
    if any(re.search(pattern, key) for pattern in cfg.ignored_keys):
        return True
    if cfg.architecture not in _MTP_ARCHITECTURES:
        return False
    m = re.match(r"model\.layers\.(\d+)\.", key)
    return m is not None and int(m.group(1)) >= cfg.num_hidden_layers


def load_model(
    path: str | os.PathLike,
    dtype: str | torch.dtype = "auto",
    device: str | torch.device = "cpu",
    progress: bool = True,
    shard=None,
    fp8: str | None = None,
    mxfp4: bool = False,
) -> MoEForCausalLM:
    """Build ``MoEForCausalLM`` from a HF checkpoint directory (config.json + safetensors). ``shard``: a callable
    that shards the meta model for one rank and returns its selections (sharding.shard_model); then only this
    rank's parts are read. ``fp8``: serve the dense projections and experts in W8A8 block FP8 (fp8_load.py):
    "checkpoint" keeps an FP8 checkpoint's weights as stored, "quantize" quantises them at load; None: FP8 weights
    are dequantised into ``dtype``. ``mxfp4``: keep an MXFP4 checkpoint's GPT-OSS experts packed as stored
    (mxfp4_load.py); False: dequantise them into ``dtype``."""
    root = Path(path)
    cfg = load_config(root)
    tdtype = resolve_dtype(dtype, cfg)
    device = torch.device(device)
    start = time.monotonic()
    if fp8 is not None and shard is not None:
        raise ValueError("FP8 weights are not supported with tensor parallelism")
    if mxfp4 and (shard is not None or cfg.experts.quant != "mxfp4"):
        raise ValueError("packed MXFP4 experts need an MXFP4 checkpoint and one GPU (no tensor parallelism)")
    with torch.device("meta"):
        model = MoEForCausalLM(cfg)
    selections = shard(model) if shard is not None else {}

    with ExitStack() as stack:
        tensors = _Tensors(root, stack, cfg.key_prefixes, cfg.quantization.weight_block_size)
        fp8_names = fp8_load.prepare(model, cfg, tensors, fp8) if fp8 is not None else set()
        mxfp4_names = mxfp4_load.prepare(model) if mxfp4 else set()
        params = list(model.named_parameters())  # tied lm_head.weight appears once, as embed_tokens.weight
        stored = fp8_names | mxfp4_names  # read in the checkpoint's dtype
        total = sum(p.numel() * (p.element_size() if n in stored or n.endswith("_scale_inv") else torch.empty(
            (), dtype=model.param_dtype(n, tdtype)).element_size()) for n, p in params)
        bar = None
        if progress:
            try:
                from tqdm import tqdm

                bar = tqdm(total=total, desc=f"Loading {root.name}", unit="B", unit_scale=True, delay=2.0,
                           file=sys.stderr, leave=False)
            except ImportError:  # pragma: no cover - tqdm is a pinned dependency
                bar = None
        for name, meta in params:
            shape = tuple(meta.shape)
            pdtype = model.param_dtype(name, tdtype)
            sel = selections.get(name)
            if name.endswith("_scale_inv"):
                continue  # read with its FP8 weight
            if name in fp8_names:
                module_name, _, attr = name.rpartition(".")
                module = model.get_submodule(module_name)
                scale_attr = "weight_scale_inv" if attr == "weight" else f"{attr}_scale_inv"
                if fp8 == "checkpoint":
                    q, s = fp8_load.read_checkpoint_fp8(tensors, cfg, name, meta, getattr(module, scale_attr), device)
                else:
                    load = _load_experts if is_experts_param(name) else _load_direct
                    q, s = fp8_load.quantize_loaded(load(tensors, cfg, name, shape, pdtype, device))
                setattr(module, attr, nn.Parameter(q, requires_grad=False))
                setattr(module, scale_attr, nn.Parameter(s, requires_grad=False))
                if bar is not None:
                    bar.update(q.nbytes + s.nbytes)
                continue
            if name in mxfp4_names:  # bytes / scales as stored
                value = _place(tensors.get(name, shape), torch.uint8, device)
            elif is_experts_param(name):
                value = _load_experts(tensors, cfg, name, shape, pdtype, device, sel)
            else:
                value = _load_direct(tensors, cfg, name, shape, pdtype, device, sel)
            module_name, _, attr = name.rpartition(".")
            setattr(model.get_submodule(module_name), attr, nn.Parameter(value, requires_grad=False))
            if bar is not None:
                bar.update(value.nbytes)
        kv_scales = read_kv_scales(tensors, cfg.num_hidden_layers, mla=cfg.attention.mla is not None)
        unused = sorted(set(tensors.key_file) - tensors.used - ({"lm_head.weight"} if cfg.tie_word_embeddings else set()))
        ignored = [k for k in unused if _ignored_key(k, cfg)]
        unused = [k for k in unused if not _ignored_key(k, cfg)]
        if shard is not None:  # expert parallelism: the other ranks' experts are theirs to read
            unused = [k for k in unused if not re.search(r"\.experts\.\d+\.", k)]
        if ignored:
            log.info("ignored %d tensors of layers >= num_hidden_layers (multi-token prediction), as HF", len(ignored))
    if bar is not None:
        bar.close()

    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embedding().weight
    model.init_buffers(device)
    leftover = [n for n, p in list(model.named_parameters()) + list(model.named_buffers()) if p.is_meta]
    if leftover:  # a bug in the key mapping, not in the checkpoint
        raise CheckpointError(f"parameters left unloaded: {', '.join(leftover[:5])}")
    if unused:
        log.warning("%d checkpoint tensors not used by %s (e.g. %s)", len(unused), cfg.architecture, ", ".join(unused[:3]))
    packed = f"; experts MXFP4 packed: {mxfp4_load.packed_bytes(model) / 1e9:.2f} GB" if mxfp4 else ""
    log.info("loaded %s (%s, %.2f GB%s) in %.1f s", root, tdtype, total / 1e9, packed, time.monotonic() - start)
    model.shard_selections = selections  # this rank's slices of each sharded tensor: weight updates read the same
    model.kv_scales = kv_scales  # per layer (k_scale, v_scale) or None: an FP8 KV cache's (core/kv_cache.py)
    return model.eval()
