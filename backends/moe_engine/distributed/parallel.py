"""Tensor / expert parallel process groups over torch.distributed (NCCL on GPUs, gloo on CPU).

A tensor-parallel group is N ranks, one process each; on CUDA rank r runs on GPU ``first_gpu + r``. Rank 0 is
the serving process (the Triton model instance): it owns the scheduler and the block manager and decides every
step; ranks 1..N-1 (ranks.py) run the same forwards on their shards of the weights (sharding.py).

Two groups over the same ranks:
- the *device* group carries the forward's collectives (an all-reduce after attention and after each MLP / MoE
  block, the embedding's all-reduce, the logits' all-gather) and an overlapped step's fed token ids, which
  never leave rank 0's device: NCCL on CUDA, gloo on CPU;
- the *control* group (gloo, host memory) carries each step's inputs, broadcast from rank 0 (a small header and
  one int64 payload, ranks.py) and the setup's agreements (the KV-cache block count: the smallest over ranks).
  On CPU it is the device group.

Collectives over a rank that died fail at once with gloo (the peer's connection closes); NCCL waits for its
timeout, so rank 0 also watches its child processes (ranks.py) and aborts the group when one dies.

torch.distributed keeps one default group per process, so a process holds one tensor-parallel group at a time
(a Triton model instance is a process of its own; tests build their engines one after the other).

NCCL's NVLink multicast (NVLS) and torch's multicast symmetric memory stay off: ``NCCL_NVLS_ENABLE=0`` and
``TORCH_SYMM_MEM_DISABLE_MULTICAST=1`` are set in every rank's environment unless the user set them.
"""
from __future__ import annotations

import datetime
import logging
import os

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

# Set in every rank's environment unless already set (see the module docstring).
RANK_ENV_DEFAULTS = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
# The forward's collectives on NCCL: past this a rank is declared stuck (gloo needs no timeout to see a death).
DEVICE_TIMEOUT_S = float(os.environ.get("MOE_PARALLEL_TIMEOUT_S", 600))
# The control group waits for the next step however long the engine is idle.
CONTROL_TIMEOUT = datetime.timedelta(days=3650)

_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class ParallelError(RuntimeError):
    """A rank died, a collective failed, or the group could not be formed."""


def apply_rank_env(env: dict | None = None) -> dict:
    """``env`` (default: this process's environment) with NVLink multicast off unless the user set it."""
    env = os.environ if env is None else env
    for key, value in RANK_ENV_DEFAULTS.items():
        env.setdefault(key, value)
    return env


def rank_device(device: str | torch.device, first_gpu: int, rank: int) -> torch.device:
    """The device of ``rank``: GPU ``first_gpu + rank`` on CUDA, the CPU otherwise."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.device("cuda", first_gpu + rank)
    return device


class ParallelGroup:
    """This process's place in a tensor-parallel group and the collectives the model and the runner call."""

    def __init__(self, rank: int, world_size: int, device: torch.device, device_group, control_group):
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self.device_group = device_group
        self.control_group = control_group
        self.destroyed = False

    @classmethod
    def join(cls, store: dist.Store, rank: int, world_size: int, device: torch.device) -> "ParallelGroup":
        """Form the group (every rank calls this with the same store; it returns once all have joined)."""
        apply_rank_env()
        cuda = device.type == "cuda"
        if cuda:
            torch.cuda.set_device(device)
        dist.init_process_group(
            "nccl" if cuda else "gloo", store=store, rank=rank, world_size=world_size,
            timeout=datetime.timedelta(seconds=DEVICE_TIMEOUT_S) if cuda else CONTROL_TIMEOUT,
            **({"device_id": device} if cuda else {}),
        )
        default = dist.group.WORLD
        control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT) if cuda else default
        log.info("rank %d of %d joined its tensor-parallel group (%s, device %s)", rank, world_size,
                 "NCCL + gloo control" if cuda else "gloo", device)
        return cls(rank, world_size, device, default, control)

    # ---------------------------------------------------------------- the forward's collectives (device group)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, in place (every rank gets the same bits); returns ``x``."""
        dist.all_reduce(x, group=self.device_group)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """[n, ...] on each rank -> [world_size * n, ...], rank r's rows at [r * n, (r + 1) * n)."""
        x = x.contiguous()
        out = x.new_empty((self.world_size * x.shape[0], *x.shape[1:]))
        _all_gather_single(out, x, group=self.device_group)
        return out

    def broadcast_device(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's ``x`` into every rank's ``x`` (same shape and dtype everywhere), on the device."""
        dist.broadcast(x, src=0, group=self.device_group)
        return x

    # ---------------------------------------------------------------- control (host memory)

    def broadcast_host(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's CPU tensor ``x`` into every rank's ``x``."""
        dist.broadcast(x, src=0, group=self.control_group)
        return x

    def min_int(self, value: int) -> int:
        """The smallest ``value`` over ranks (every rank calls it)."""
        t = torch.tensor([value], dtype=torch.long)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.control_group)
        return int(t.item())

    # ---------------------------------------------------------------- teardown

    def abort(self) -> None:
        """Make collectives in flight (NCCL waits for a dead peer until its timeout) fail now; best effort."""
        abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
        if abort is not None and not self.destroyed:
            try:
                abort()
            except Exception:  # the group may be broken already; destroying it is what is left to do
                log.debug("aborting the process group failed", exc_info=True)

    def destroy(self) -> None:
        if self.destroyed:
            return
        self.destroyed = True
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:
            log.debug("destroying the process group failed", exc_info=True)
