"""Request bodies of the RL rollout-lifecycle endpoints, with SGLang's names and defaults (its ``io_struct.py``), so
that trainers written for SGLang (slime, verl) post them unchanged.

As in :mod:`.protocol`: unknown fields are ignored; known SGLang fields this server does not implement are accepted
at their neutral value only (else a 400 naming the field). Fields accepted whatever their value, because here they
change nothing: ``torch_empty_cache`` (freed GPU memory is always handed back), ``recapture_cuda_graph`` (in-place
updates keep every address, so the graphs stay valid), ``token_step`` (bookkeeping of the trainer).

Every endpoint answers ``{"success": bool, "message": str, "weight_version": str}`` (SGLang's shape, plus the
version); a refusal is a 400 whose body also carries the OpenAI ``error`` object.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from .protocol import _unsupported
from .protocol import _ValidUnicode as _Base  # strict types, valid Unicode


class UpdateWeightsFromDiskRequest(_Base):
    # a checkpoint directory of the same model, readable by the server (at most PATH_MAX, 4096 bytes, on Linux)
    model_path: str = Field(min_length=1, max_length=4096)
    weight_version: str | None = None  # default: the checkpoint's folder name
    flush_cache: bool = True
    abort_all_requests: bool = False  # False: requests submitted before finish first, later ones wait
    load_format: str | None = None
    is_async: bool = False
    keep_pause: bool = False
    manifest: dict[str, Any] | None = None
    torch_empty_cache: bool = False
    recapture_cuda_graph: bool = False
    token_step: int = 0

    _load_format = _unsupported("load_format", "auto")
    _is_async = _unsupported("is_async", False)
    _keep_pause = _unsupported("keep_pause", False)
    _manifest = _unsupported("manifest", None)

    def control_args(self) -> dict[str, Any]:
        return self.model_dump(include={"model_path", "weight_version", "flush_cache", "abort_all_requests"})


class InitWeightsUpdateGroupRequest(_Base):
    master_address: str = Field(min_length=1)
    master_port: int = Field(ge=1, le=65535)
    rank_offset: int = Field(ge=1)  # the engine's rank (the trainer is rank 0)
    world_size: int = Field(ge=2)
    group_name: str = "weight_update_group"
    backend: Literal["nccl", "gloo"] = "nccl"

    def control_args(self) -> dict[str, Any]:
        return self.model_dump()


class UpdateWeightsFromDistributedRequest(_Base):
    names: list[str]  # checkpoint (Hugging Face) tensor names, in the order the trainer broadcasts them
    dtypes: list[str]  # "bfloat16", "float32", "float16" (a "torch." prefix is accepted)
    shapes: list[list[int]]
    group_name: str = "weight_update_group"
    weight_version: str | None = None  # default: unchanged (a trainer sending buckets names the last one)
    flush_cache: bool = True
    abort_all_requests: bool = False
    load_format: str | None = None
    torch_empty_cache: bool = False

    _load_format = _unsupported("load_format", "auto")

    def control_args(self) -> dict[str, Any]:
        return self.model_dump(include={"names", "dtypes", "shapes", "group_name", "weight_version", "flush_cache",
                                        "abort_all_requests"})


class PauseGenerationRequest(_Base):
    # abort: requests submitted before end with finish_reason "abort"; retract: running requests give back their
    # KV cache and are recomputed after continue; in_place: everything stays as it is.
    mode: Literal["abort", "retract", "in_place"] = "abort"

    def control_args(self) -> dict[str, Any]:
        return {"mode": self.mode}


class ContinueGenerationRequest(_Base):
    torch_empty_cache: bool = True

    def control_args(self) -> dict[str, Any]:
        return {}


class MemoryOccupationRequest(_Base):
    """release_memory_occupation / resume_memory_occupation: which memory (None: all of it)."""

    tags: list[Literal["weights", "kv_cache", "cuda_graph"]] | None = None

    def control_args(self) -> dict[str, Any]:
        return {"tags": self.tags}


class FlushCacheRequest(_Base):
    def control_args(self) -> dict[str, Any]:
        return {}
