"""A running engine's weights: update them in place (from disk, from a torch.distributed broadcast) and move them off
the GPU and back (RL: the trainer borrows the GPU between rollouts).

Contracts:
- An update writes into the *existing* parameter tensors (``copy_``, or a broadcast received straight into them).
  No parameter moves, so the CUDA graphs captured before stay valid, and the device never holds a second copy of
  the model: from disk, one parameter at a time is staged in host memory (read through the memory map).
- Everything is checked before anything is written: every tensor's name, shape and dtype against the live model.
  The first mismatch raises ``WeightUpdateError`` naming the tensor, and the old weights stay in use.
- From disk, tensors are found exactly as at start-up (checkpoint.py's mapping, reused: per-expert and fused expert
  layouts, the Hub's Mixtral names, MXFP4, tied embeddings, float dtypes converted), so an engine updated to
  checkpoint B computes what an engine started on B computes. B's config.json, when present, must describe the
  same model (its dtype aside). GPT-OSS experts kept packed in MXFP4 take MXFP4 bytes and scales only (by name,
  uint8): a float update of them is refused, naming the fix (no re-quantisation here).
- From a broadcast, the trainer names tensors as a checkpoint does; ``checkpoint_targets`` maps every such name to
  the parameter, or the rows of a fused expert parameter, it fills. A trainer may send the model in buckets (one
  call each). Names of tensors the model does not use (a tied ``lm_head.weight``, DeepSeek-V3's multi-token
  prediction layers) are received and dropped, as at start-up.
- The caller (engine.py) runs an update between steps, on the engine thread, and then makes the prefix cache
  forget what the old weights computed.

Process groups for broadcasts (``init_update_process_group``): the trainer is rank 0 and the engine rank
``rank_offset``, joined through a TCP store at ``tcp://master_address:master_port`` with the store keys prefixed by
the group name, as SGLang's ``init_custom_process_group`` does; the engine's process needs no default group. A
trainer calls the same function with rank 0 (NCCL between GPUs, gloo on CPU), then ``dist.broadcast(t, src=0,
group=group)`` for each tensor, in the order of the names it posts.
"""
from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
import time
from contextlib import ExitStack
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch

from ..checkpoint import (
    _DEFAULT_PER_EXPERT_NAMES,
    _PER_EXPERT_NAMES,
    CheckpointError,
    _fmt,
    _ignored_key,
    _load_direct,
    _load_experts,
    _Tensors,
    is_experts_param,
)
from ..config import MoEConfig, QuantSpec, load_config
from ..errors import InvalidRequestError

log = logging.getLogger(__name__)

# safetensors dtypes a float parameter may be read from (converted as at start-up); MXFP4 blocks / scales are U8.
_FLOAT_FILE_DTYPES = frozenset({"F64", "F32", "F16", "BF16"})
_FLOAT_DTYPES = {"float32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16,
                 "float16": torch.float16, "half": torch.float16, "float64": torch.float64}
_META = torch.device("meta")


class WeightUpdateError(InvalidRequestError):
    """A weight update was refused (nothing was written): the message names the first mismatching tensor."""

    code: str | None = None  # checkpoint_not_found, weight_update_group_not_found: the API answers 404


_PACKED_SUFFIXES = ("_blocks", "_scales")  # GPT-OSS experts kept as MXFP4 (layers/experts.py GptOssExperts.mxfp4)


def _packed_param(model: torch.nn.Module, name: str) -> bool:
    """Whether parameter ``name`` holds packed MXFP4 bytes or scales (uint8, written as the checkpoint stores them)."""
    return name.endswith(_PACKED_SUFFIXES) and is_experts_param(name) and model.get_parameter(name).dtype == torch.uint8


def _refuse_dense_into_packed(name: str, dtype) -> WeightUpdateError:
    """A model-dtype expert tensor for experts served packed: refused (no re-quantisation here), naming the fixes."""
    return WeightUpdateError(
        f"tensor {name!r} ({dtype}): this engine serves the GPT-OSS experts packed as MXFP4 and does not re-quantize "
        f"{dtype} weights into them; send the experts as MXFP4 ({name}_blocks uint8 + {name}_scales uint8, as "
        "gpt-oss checkpoints store them), or start the engine with --disable-fused-kernels to serve them "
        "dequantized (then any float dtype is accepted)", param="names")


def refuse_fp8(model: torch.nn.Module) -> None:
    """Weights served in FP8 (e4m3 + block scales) are not updated in place: a bf16 tensor written into them would
    be cast without its scales. Refused, naming the way out."""
    if any(p.dtype == torch.float8_e4m3fn for p in model.parameters()):
        raise WeightUpdateError("weight updates are not supported while the engine serves FP8 weights (an FP8 "
                                "checkpoint on an FP8 GPU, or --quantization fp8); serve the bf16 checkpoint")


# --------------------------------------------------------------------------------------------- from disk


class _Headers(_Tensors):
    """A checkpoint's index and tensor headers, nothing more: ``get`` / ``get_row`` check a tensor's shape and dtype
    and return an empty meta tensor, so checkpoint.py's loaders run over a whole checkpoint without reading it."""

    def _check(self, key: str, shape, dtypes: frozenset[str]) -> None:
        key = self._real(key)
        found = self.shape(key)
        if list(found) != list(shape):
            raise CheckpointError(
                f"tensor {key!r} in {self.key_file[key]} has shape {_fmt(found)}, the model's is {_fmt(shape)}"
            )
        dtype = self._open(self.key_file[key]).get_slice(key).get_dtype()
        if dtype not in dtypes:
            raise CheckpointError(
                f"tensor {key!r} in {self.key_file[key]} has dtype {dtype}, expected one of {', '.join(sorted(dtypes))}"
            )
        self.used.add(key)

    def get(self, key: str, shape) -> torch.Tensor:
        if key.endswith(_PACKED_SUFFIXES):  # MXFP4 blocks / scales read whole into packed experts
            self._check(key, shape, frozenset({"U8"}))
            return torch.empty(shape, dtype=torch.uint8, device=_META)
        self._check(key, shape, _FLOAT_FILE_DTYPES)
        return torch.empty(shape, device=_META)

    def get_row(self, key: str, shape, i: int) -> torch.Tensor:  # MXFP4 blocks / scales only
        self._check(key, shape, frozenset({"U8"}))
        return torch.empty([1, *shape[1:]], dtype=torch.uint8, device=_META)

    def read_selected(self, key: str, sel, out: torch.Tensor) -> None:  # a tensor-parallel rank's part
        self._check(key, sel.full_shape, _FLOAT_FILE_DTYPES)


def _read(t: _Tensors, model: torch.nn.Module, name: str, like: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Parameter ``name`` (shaped and typed like ``like``) read from the checkpoint as load_model reads it: under
    tensor parallelism only this rank's slices (the checkpoint's whole tensors are what the shapes are checked
    against)."""
    load = _load_experts if is_experts_param(name) else _load_direct
    if _packed_param(model, name) and name not in t:
        dense = name.rsplit("_", 1)[0]  # ...experts.gate_up_proj(_blocks)
        if dense in t:
            raise _refuse_dense_into_packed(dense, "a float tensor")
    sel = getattr(model, "shard_selections", {}).get(name)
    return load(t, model.config, name, tuple(like.shape), like.dtype, device, sel)


def _same_model_fields(cfg: MoEConfig) -> dict:
    """The config as a flat dict, minus what may differ between checkpoints of one model: the dtype, and MXFP4
    experts (read dequantised in place). FP8 storage stays in: the in-place readers take float tensors only."""
    quantization = QuantSpec() if cfg.quantization.method == "mxfp4" else cfg.quantization
    cfg = dataclasses.replace(cfg, torch_dtype="", experts=dataclasses.replace(cfg.experts, quant="none"),
                              quantization=quantization)
    flat: dict = {}

    def walk(prefix: str, value) -> None:
        if dataclasses.is_dataclass(value):
            for f in dataclasses.fields(value):
                walk(f"{prefix}{f.name}.", getattr(value, f.name))
        else:
            flat[prefix.rstrip(".")] = value

    walk("", cfg)
    return flat


def check_checkpoint(model: torch.nn.Module, path: str) -> Path:
    """Check that checkpoint ``path`` holds every parameter of the live model, with its shape and a float dtype, and
    finite values (``check_finite`` reads each tensor once). Returns the checkpoint directory; raises
    WeightUpdateError."""
    refuse_fp8(model)
    root = Path(path)
    try:
        is_dir, why = root.is_dir(), "is not a directory"
    except OSError as exc:  # a name too long for the file system, ...
        is_dir, why = False, f"is not a usable path ({exc.strerror})"
    if not is_dir:
        err = WeightUpdateError(f"model_path {path[:200]!r}{'...' if len(path) > 200 else ''} {why}",
                                param="model_path")
        err.code = "checkpoint_not_found"
        raise err
    cfg: MoEConfig = model.config
    try:
        if (root / "config.json").is_file():
            new_cfg = load_config(root)
            if new_cfg.quantization.method == "fp8":
                raise WeightUpdateError(f"{root}: updates from FP8 checkpoints are not supported (the served weights "
                                        "are replaced in place from float tensors); publish the update in bf16",
                                        param="model_path")
            live, new = _same_model_fields(cfg), _same_model_fields(new_cfg)
            diff = next((k for k in live if live[k] != new.get(k)), None)
            if diff is not None:
                raise CheckpointError(
                    f"{root / 'config.json'} describes another model: {diff} = {new.get(diff)!r}, the served "
                    f"model's is {live[diff]!r}"
                )
        with ExitStack() as stack:
            headers = _Headers(root, stack, cfg.key_prefixes)
            for name, p in model.named_parameters():
                _read(headers, model, name, p, _META)
            _check_finite(headers, root)  # a NaN / Inf tensor: refused before anything is written
    except WeightUpdateError:
        raise
    except Exception as exc:  # CheckpointError, a missing shard, an unreadable header, an unsupported config
        raise WeightUpdateError(f"checkpoint {root} cannot replace the served weights: {exc}",
                                param="model_path") from exc
    return root


_SCAN_ELEMENTS = 1 << 26  # elements read at once by the finiteness check (256 MB of float32)


@torch.no_grad()
def _check_finite(headers: _Headers, root: Path) -> None:
    """Raise WeightUpdateError naming the first tensor the model reads from checkpoint ``root`` (``headers.used``,
    after a headers pass) that holds a NaN or an infinity: nothing is written, the old weights stay. Reads through
    the memory map in slices of the leading dimension."""
    for key in sorted(headers.used):
        sl = headers._open(headers.key_file[key]).get_slice(key)
        if sl.get_dtype() not in _FLOAT_FILE_DTYPES:
            continue  # MXFP4 blocks / scales
        shape = sl.get_shape()
        rows = shape[0] if shape else 1
        per_row = max(1, int(torch.Size(shape[1:]).numel())) if shape else 1
        step = max(1, _SCAN_ELEMENTS // per_row)
        for lo in range(0, rows, step):
            part = sl[lo:lo + step] if shape else sl[:]
            if not torch.isfinite(part).all():
                raise WeightUpdateError(f"checkpoint {root} cannot replace the served weights: tensor {key!r} holds "
                                        f"NaN or infinite values", param="model_path")


@torch.no_grad()
def load_checkpoint(model: torch.nn.Module, root: Path) -> int:
    """Copy every parameter of checkpoint ``root`` (checked by ``check_checkpoint``) into the live parameters, one
    at a time through host memory. Returns the bytes written."""
    written = 0
    with ExitStack() as stack:
        tensors = _Tensors(root, stack, model.config.key_prefixes)
        for name, p in model.named_parameters():
            value = _read(tensors, model, name, p, torch.device("cpu"))
            p.copy_(value)
            written += p.nbytes
    return written


# --------------------------------------------------------------------------------------------- from a broadcast


@dataclass(frozen=True)
class Target:
    """Where a checkpoint tensor goes: a whole parameter, or the rows [lo, hi) of expert e of a fused one."""

    param: str
    shape: tuple[int, ...]  # the checkpoint tensor's shape
    rows: tuple[int, int, int] | None = None  # (e, lo, hi)

    def view(self, params: dict[str, torch.Tensor]) -> torch.Tensor:
        p = params[self.param]
        if self.rows is None:
            return p
        e, lo, hi = self.rows
        return p[e, lo:hi]  # leading-dimension slices of a contiguous parameter: contiguous


def checkpoint_targets(model: torch.nn.Module) -> dict[str, Target]:
    """Checkpoint tensor name -> Target, for every name load_model accepts: in-memory (HF v5) names, the Hub's
    per-expert names (``...experts.{e}.{gate,up,down}_proj.weight``, Mixtral's ``block_sparse_moe...w1/w3/w2``)."""
    cfg: MoEConfig = model.config
    blocks, gate_n, up_n, down_n = _PER_EXPERT_NAMES.get(cfg.architecture, _DEFAULT_PER_EXPERT_NAMES)
    I = cfg.experts.intermediate_size
    out: dict[str, Target] = {}
    selections = getattr(model, "shard_selections", {})
    for name, p in model.named_parameters():
        # the whole tensor's shape: under tensor parallelism a trainer still sends whole tensors
        shape = tuple(selections[name].full_shape) if name in selections else tuple(p.shape)
        out[name] = Target(name, shape)
        if ".mixer.experts." in name:  # Nemotron-H: ungated, one tensor per expert on the Hub
            prefix, _, leaf = name.partition(".mixer.experts.")
            for e in range(shape[0]):
                out[f"{prefix}.mixer.experts.{e}.{leaf}.weight"] = Target(name, shape[1:], (e, 0, shape[1]))
        elif ".mlp.experts." in name:
            if cfg.experts.block == "gpt_oss":
                continue  # GPT-OSS experts are stored fused (MXFP4 only on disk)
            prefix, _, leaf = name.partition(".mlp.experts.")
            parts = [(gate_n, 0, I), (up_n, I, 2 * I)] if leaf == "gate_up_proj" else [(down_n, 0, shape[1])]
            for block in blocks:
                for e in range(shape[0]):
                    for part, lo, hi in parts:
                        key = f"{prefix}.{block}.experts.{e}.{part}.weight"
                        out[key] = Target(name, (hi - lo, shape[2]), (e, lo, hi))
        elif ".mlp." in name:
            for block in blocks:
                if block != "mlp":
                    out[name.replace(".mlp.", f".{block}.")] = out[name]
    for ours, theirs in cfg.key_prefixes:  # the checkpoint's names of the same tensors (e.g. Nemotron-H's backbone.)
        for name in [n for n in out if n.startswith(ours)]:
            out.setdefault(theirs + name[len(ours):], out[name])
    return out


def _unused_name(cfg: MoEConfig, name: str) -> bool:
    """Tensors a checkpoint may hold that the model does not use (dropped at start-up too)."""
    return (cfg.tie_word_embeddings and name == "lm_head.weight") or _ignored_key(name, cfg)


def parse_dtype(name: str, dtype: str, packed: bool = False) -> torch.dtype:
    """The torch dtype of an announced tensor: a float dtype, or uint8 where ``packed`` (MXFP4 bytes / scales)."""
    key = str(dtype).removeprefix("torch.")
    if packed and key == "uint8":
        return torch.uint8
    if key not in _FLOAT_DTYPES:
        raise WeightUpdateError(f"tensor {name!r}: dtype {dtype!r} is not a float dtype "
                                f"({', '.join(sorted(_FLOAT_DTYPES))})", param="dtypes")
    return _FLOAT_DTYPES[key]


@dataclass(frozen=True)
class Incoming:
    """One tensor of a broadcast, in the trainer's order: where it goes (None: received and dropped)."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    target: Target | None


def check_tensors(model: torch.nn.Module, names: list[str], dtypes: list[str],
                  shapes: list[list[int]]) -> list[Incoming]:
    """Check a trainer's announced tensors against the live model; raises WeightUpdateError at the first mismatch."""
    refuse_fp8(model)
    if not (len(names) == len(dtypes) == len(shapes)):
        raise WeightUpdateError(f"names, dtypes and shapes differ in length ({len(names)}, {len(dtypes)}, "
                                f"{len(shapes)})", param="names")
    cfg: MoEConfig = model.config
    targets = checkpoint_targets(model)
    plan = []
    packed = {n for n in targets if _packed_param(model, targets[n].param)}
    for name, dtype, shape in zip(names, dtypes, shapes):
        tdtype, shape = parse_dtype(name, dtype, packed=name in packed), tuple(int(s) for s in shape)
        target = targets.get(name)
        if name in packed and tdtype != torch.uint8:
            raise WeightUpdateError(f"tensor {name!r} holds MXFP4 {name.rsplit('_', 1)[1]}: its dtype must be "
                                    f"uint8, not {dtype!r}", param="dtypes")
        if target is None and f"{name}_blocks" in packed:
            raise _refuse_dense_into_packed(name, dtype)
        if target is None and not _unused_name(cfg, name):
            raise WeightUpdateError(
                f"tensor {name!r} is not a parameter of the served {cfg.architecture} model (names are checkpoint "
                f"names, e.g. {next(iter(targets))!r})", param="names"
            )
        if target is not None and shape != target.shape:
            raise WeightUpdateError(f"tensor {name!r} has shape {_fmt(shape)}, the model's is {_fmt(target.shape)}",
                                    param="shapes")
        plan.append(Incoming(name, tdtype, shape, target))
    return plan


def dropped_plan(names: list[str], dtypes: list[str], shapes: list[list[int]]) -> list[Incoming] | None:
    """The announced tensors, each to be received and dropped (a refused update); None if not even their dtypes
    and shapes can be read."""
    try:
        return [Incoming(n, parse_dtype(n, d, packed=n.endswith(_PACKED_SUFFIXES)), tuple(int(x) for x in s), None)
                for n, d, s in
                zip(names, dtypes, shapes, strict=True)]
    except (WeightUpdateError, TypeError, ValueError):
        return None


def write_part(p: torch.Tensor, sel, target: Target, value: torch.Tensor) -> None:
    """Copy checkpoint tensor ``value`` (``target``: the whole parameter, or rows [lo, hi) of expert e, in the
    whole tensor's coordinates) into ``p``, this rank's part of the parameter (``sel``: the ranges of the whole
    tensor it holds, per dimension, concatenated; sharding.Selection). Nothing when the rank holds none of it."""
    if sel.zeros:
        return
    full = tuple(sel.full_shape)
    if target.rows is None:
        region = [(0, n) for n in full]
    else:
        e, lo, hi = target.rows
        region, value = [(e, e + 1), (lo, hi), *[(0, n) for n in full[2:]]], value.unsqueeze(0)
    per_dim = []
    for (a, b), ranges in zip(region, sel.ranges):
        opts, at = [], 0  # (source slice in value, destination slice in p)
        for s0, s1 in ranges:
            x0, x1 = max(a, s0), min(b, s1)
            if x0 < x1:
                opts.append((slice(x0 - a, x1 - a), slice(at + x0 - s0, at + x1 - s0)))
            at += s1 - s0
        if not opts:
            return
        per_dim.append(opts)
    for combo in itertools.product(*per_dim):
        p[tuple(c[1] for c in combo)].copy_(value[tuple(c[0] for c in combo)])


@torch.no_grad()
def receive_broadcast(model: torch.nn.Module, group, device: torch.device, plan: list[Incoming], tp=None) -> int:
    """Receive each tensor of ``plan`` from rank 0 of ``group`` (in order) into its target: straight into the
    parameter when dtype and device match, else through one tensor-sized buffer. Targets None are dropped (also
    how a refused update still lets the trainer's broadcasts complete). Returns the bytes received.

    Tensor parallelism (``tp``, the ParallelGroup): rank 0 receives each whole tensor from the trainer (``group``;
    None on the other ranks) and broadcasts it over ``tp``; every rank keeps its own part (``write_part``)."""
    import torch.distributed as dist

    params = dict(model.named_parameters())
    received = 0
    if tp is not None:
        selections = getattr(model, "shard_selections", {})
        for inc in plan:
            buf = torch.empty(inc.shape, dtype=inc.dtype, device=device)
            if group is not None:
                dist.broadcast(buf, src=0, group=group)
            if buf.device != tp.device:  # a gloo trainer group on a GPU engine: the ranks' group is NCCL
                buf = buf.to(tp.device)
            tp.broadcast_device(buf)
            if inc.target is not None:
                name = inc.target.param
                if name in selections:
                    write_part(params[name], selections[name], inc.target, buf)
                else:
                    inc.target.view(params).copy_(buf)
            received += buf.nbytes
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()
        return received
    for inc in plan:
        dst = inc.target.view(params) if inc.target is not None else None
        direct = dst is not None and dst.dtype == inc.dtype and dst.device == device and dst.is_contiguous()
        buf = dst if direct else torch.empty(inc.shape, dtype=inc.dtype, device=device)
        dist.broadcast(buf, src=0, group=group)
        if dst is not None and not direct:
            dst.copy_(buf)
        received += buf.nbytes
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()  # done means received (and the timing says so)
    return received


def init_update_process_group(backend: str, master_address: str, master_port: int, rank: int, world_size: int,
                              group_name: str, timeout_s: float = 600.0):
    """A process group of ``world_size`` ranks (trainer = rank 0) outside any default group: TCP store rendezvous
    at master_address:master_port, keys prefixed by ``group_name``. Blocks until every rank joined (gloo) or
    the store is reached (NCCL connects at the first broadcast). Used by both sides."""
    import inspect

    from torch.distributed import distributed_c10d as c10d

    timeout = timedelta(seconds=timeout_s)
    url = f"tcp://{master_address}:{int(master_port)}"
    store, rank, world_size = next(c10d.rendezvous(url, rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    store = c10d.PrefixStore(group_name, store)
    # The options argument was renamed pg_options -> backend_options in torch 2.6.
    params = inspect.signature(c10d._new_process_group_helper).parameters
    options = {"backend_options" if "backend_options" in params else "pg_options": None}
    pg, _ = c10d._new_process_group_helper(world_size, rank, [], c10d.Backend(backend), store,
                                           group_name=group_name, timeout=timeout, **options)
    c10d._world.pg_group_ranks[pg] = {i: i for i in range(world_size)}  # group rank = global rank
    return pg


class UpdateGroups:
    """The engine's weight-update process groups by name (a name given again replaces its group)."""

    def __init__(self, device: torch.device):
        self.device = device
        self._groups: dict[str, tuple[object, str]] = {}
        self._lock = threading.Lock()

    def init(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
             group_name: str = "weight_update_group", backend: str = "nccl") -> dict:
        if backend not in ("nccl", "gloo"):
            raise WeightUpdateError(f"backend {backend!r}: use nccl (GPU) or gloo (CPU)", param="backend")
        if backend == "nccl" and self.device.type != "cuda":
            raise WeightUpdateError("backend 'nccl' needs the engine on a GPU; this engine runs on "
                                    f"{self.device.type}: use 'gloo'", param="backend")
        if not 0 < rank_offset < world_size:
            raise WeightUpdateError(f"rank_offset {rank_offset} must be in [1, world_size={world_size}) (the "
                                    "trainer is rank 0)", param="rank_offset")
        self.destroy(group_name)
        t0 = time.monotonic()
        try:
            pg = init_update_process_group(backend, master_address, master_port, rank_offset, world_size, group_name)
        except Exception as exc:  # rendezvous timeout, refused connection, ...
            raise WeightUpdateError(f"joining weight update group {group_name!r} at {master_address}:{master_port} "
                                    f"failed: {exc}") from exc
        with self._lock:
            self._groups[group_name] = (pg, backend)
        log.info("joined weight update group %r (%s, rank %d of %d) in %.1f s", group_name, backend, rank_offset,
                 world_size, time.monotonic() - t0)
        return {"message": f"joined weight update group {group_name!r} as rank {rank_offset} of {world_size}"}

    def get(self, group_name: str) -> tuple[object, torch.device]:
        """(group, device its tensors live on)."""
        with self._lock:
            entry = self._groups.get(group_name)
        if entry is None:
            err = WeightUpdateError(f"no weight update group {group_name!r}: call init_weights_update_group first",
                                    param="group_name")
            err.code = "weight_update_group_not_found"
            raise err
        pg, backend = entry
        return pg, (self.device if backend == "nccl" else torch.device("cpu"))

    def close(self) -> None:
        for name in list(self._groups):
            self.destroy(name)

    def destroy(self, group_name: str) -> bool:
        with self._lock:
            entry = self._groups.pop(group_name, None)
        if entry is None:
            return False
        try:
            import torch.distributed as dist

            dist.destroy_process_group(entry[0])
        except Exception:  # the trainer may be gone already; the group is dropped either way
            log.warning("destroying weight update group %r failed", group_name, exc_info=True)
        return True


# --------------------------------------------------------------------------------------------- release / resume


def move_weights(model: torch.nn.Module, device: torch.device) -> int:
    """Move every parameter's storage to ``device``; returns the bytes moved. Storage by storage, so parameters
    that are views of one tensor stay views of one tensor (tied weights; the q/k/v projections that
    ``Attention.fuse_qkv`` lays out back to back). Parameters get new addresses: CUDA graphs captured before are
    invalid afterwards."""
    moved = 0
    storages: dict[int, torch.UntypedStorage] = {}  # old storage address -> its copy on ``device``
    with torch.no_grad():
        for p in model.parameters():
            if p.device == device:
                continue
            old = p.untyped_storage()
            if old.data_ptr() not in storages:
                storages[old.data_ptr()] = old.to(device=device)
                moved += old.nbytes()
            p.data = torch.empty(0, dtype=p.dtype, device=device).set_(
                storages[old.data_ptr()], p.storage_offset(), p.shape, p.stride())
    return moved
