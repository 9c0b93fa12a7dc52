"""RL rollout lifecycle operations of the engine (SGLang's names): weight updates, cache flush, pause / continue,
release / resume of GPU memory, for a trainer that generates, trains, pushes new weights and generates again.

``engine.lifecycle`` (a ``RolloutLifecycle``): each operation checks its arguments in the caller's thread, then hands
the engine a function to run between steps (``Engine.call``, which says when) and returns a
``concurrent.futures.Future`` of a result dict with a ``message``. Failures are exceptions on the future
(``WeightUpdateError`` / ``InvalidRequestError``: refused, nothing changed). The work itself is weights.py's (loading,
broadcasts, moving weights), the runner's (KV cache, CUDA graphs), the block manager's (prefix cache) and the
scheduler's (retracting sequences, the weights epoch in prefix-cache keys).

Memory release: ``kv_cache`` frees the KV cache (running requests are retracted and recomputed after resume);
``weights`` moves the parameters to host memory (CUDA; on CPU nothing is freed, but the engine still waits for the
resume); ``cuda_graph`` is accepted (SGLang's tag): the CUDA graphs are always dropped with either, and captured
again lazily after resume. In-place weight updates keep every address, so graphs captured before stay valid.
Idempotent: releasing what is released, resuming what is not, pausing a paused engine are no-ops that succeed.
"""
from __future__ import annotations

import collections
import logging
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable

import torch

from ..errors import EngineStoppedError, InvalidRequestError
from . import weights as W

log = logging.getLogger(__name__)

PAUSE_MODES = ("abort", "retract", "in_place")  # SGLang's pause_generation modes
MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")  # SGLang's release/resume_memory_occupation tags
_PAUSED = {"abort": "aborted", "retract": "retracted", "in_place": "kept in place"}


def _failed(exc: Exception) -> Future:
    future: Future = Future()
    future.set_exception(exc)
    return future


def release_rank_memory(runner, op: dict) -> list[str]:
    """One rank's part of release_memory_occupation (``op``: which of kv_cache / weights): the KV cache, and the
    weights to host memory (CUDA only; on CPU there is nothing to free). What was freed, for the answer."""
    done = []
    if op["kv_cache"]:
        done.append(f"KV cache ({runner.release_kv() / 2**30:.2f} GiB)")
    if op["weights"] and runner.device.type == "cuda":
        runner.drop_graphs()  # they read the weights at their current addresses
        done.append(f"weights ({W.move_weights(runner.model, torch.device('cpu')) / 2**30:.2f} GiB)")
    if runner.device.type == "cuda":
        torch.cuda.empty_cache()  # hand the freed memory back to the driver (the trainer's process)
    return done


def resume_rank_memory(runner, op: dict) -> list[str]:
    """One rank's part of resume_memory_occupation: what release_rank_memory freed, back on the device."""
    done = []
    if op["weights"]:
        W.move_weights(runner.model, runner.device)
        done.append("weights")
    if op["kv_cache"]:
        runner.allocate_kv()
        done.append("KV cache")
    if done:
        runner.reset_graphs()  # weights or KV at new addresses: graphs are captured again lazily
    return done


@dataclass
class Control:
    """A control operation in the engine's inbox: ``fn`` runs on the engine thread between steps."""

    fn: Callable[[], dict]
    future: Future
    drain: bool = False  # first let the requests submitted before it finish (later ones wait)
    abort: bool = False  # first abort the requests submitted before it


class RolloutLifecycle:
    """``engine.lifecycle``: the control operations of one engine, the queue they wait in, the requests held behind
    them, and the state they set (paused, released memory, the weight version). The engine thread calls ``take``,
    ``hold`` and ``run_pending``; the operations use the engine's named methods (``call``, ``abort_all``,
    ``retract_all``, ``weights_changed``, ``release_kv_cache``) and its model and runner."""

    def __init__(self, engine):
        self.engine = engine
        self.update_groups = W.UpdateGroups(engine.device)
        self.paused = False  # pause_generation: no steps until continue_generation
        self.released: set[str] = set()  # release_memory_occupation tags in effect (no steps while any is)
        self.weight_version = ""  # set by the caller (the checkpoint's folder name), then by weight updates
        self._controls: collections.deque[Control] = collections.deque()  # taken from the inbox, not yet run
        self._held: collections.deque = collections.deque()  # sequences submitted after a pending control

    # ---------------------------------------------------------------- the engine thread's side

    @property
    def can_run(self) -> bool:
        """Whether steps may run: not paused, and no memory released."""
        return not self.paused and not self.released

    @property
    def pending(self) -> bool:
        return bool(self._controls)

    @property
    def num_held(self) -> int:
        return len(self._held)

    def take(self, control: Control) -> None:
        self._controls.append(control)

    def hold(self, seq) -> bool:
        """Hold a new request while a control operation is pending (it joins the queue after them); whether held."""
        if self._controls:
            self._held.append(seq)
        return bool(self._controls)

    def unhold(self, request_id: str):
        """The held sequence of that request, taken out (to be aborted), or None."""
        seq = next((s for s in self._held if s.request_id == request_id), None)
        if seq is not None:
            self._held.remove(seq)
        return seq

    def drop_pending(self) -> tuple[list, list[Control]]:
        """(held sequences, pending controls), all taken out (the engine is stopping)."""
        held, controls = list(self._held), list(self._controls)
        self._held.clear()
        self._controls.clear()
        return held, controls

    def run_pending(self) -> None:
        """Run the pending controls in order; a draining one waits (steps go on) while requests submitted before it
        are unfinished and steps can run. Then the requests held behind them join the queue."""
        while self._controls:
            c = self._controls[0]
            if c.abort:
                self.engine.abort_all()
                c.abort = False
            if c.drain and self.can_run and self.engine.has_work():
                return
            self._controls.popleft()
            if not c.future.set_running_or_notify_cancel():
                continue
            try:
                c.future.set_result(c.fn())
            except Exception as exc:  # reported to the caller; the engine goes on
                if not isinstance(exc, W.WeightUpdateError):
                    log.exception("control operation failed")
                c.future.set_exception(exc)
        while self._held:
            self.engine.admit(self._held.popleft())

    # ---------------------------------------------------------------- the operations (any thread)

    def get_weight_version(self) -> Future:
        future: Future = Future()
        future.set_result({"message": f"weight version {self.weight_version!r}"})
        return future

    def get_engine_info(self) -> Future:
        """What a client cannot see in the model's metadata because the engine decides it when it starts: the KV
        cache's block size (the prefix cache's granularity; device-dependent by default) and block count, and
        whether deterministic inference is on (--enable-deterministic-inference or VLLM_BATCH_INVARIANT=1), what the
        weights are served as and what the KV blocks hold (--kv-cache-dtype: "auto" or "fp8_e4m3")."""
        future: Future = Future()
        blocks = self.engine.blocks
        deterministic = bool(self.engine.settings.deterministic_inference)
        # what the weights are served as: "fp8" (W8A8 block FP8), "mxfp4" (GPT-OSS experts kept packed, the rest in
        # the model dtype) or the model dtype (a quantized checkpoint dequantised)
        fp8_served = any(p.dtype == torch.float8_e4m3fn for p in self.engine.model.parameters())
        mxfp4_served = any(getattr(m, "mxfp4", False) for m in self.engine.model.modules())
        weights = ("fp8" if fp8_served else "mxfp4" if mxfp4_served
                   else str(self.engine.model.dtype).removeprefix("torch."))
        kv_dtype = self.engine.settings.kv_cache_dtype  # "auto" (the model dtype) or "fp8_e4m3"
        future.set_result({"message": f"KV cache: {blocks.num_blocks} blocks x {blocks.block_size} tokens"
                                      + (f" ({kv_dtype})" if kv_dtype != "auto" else "")
                                      + ("; deterministic inference" if deterministic else ""),
                           "kv_block_size": blocks.block_size, "num_kv_blocks": blocks.num_blocks,
                           "deterministic_inference": deterministic, "weights_served_as": weights,
                           "kv_cache_dtype": kv_dtype})
        return future

    def is_sleeping(self) -> Future:
        """Whether any memory is released (vLLM's /is_sleeping): no steps run until it is resumed."""
        future: Future = Future()
        released = sorted(self.released)
        future.set_result({"message": f"released: {', '.join(released) or 'nothing'}", "is_sleeping": bool(released)})
        return future

    def _weights_changed(self, version: str | None, flush_cache: bool) -> None:
        self.engine.weights_changed(flush_cache)
        if version is not None:
            self.weight_version = version

    def update_weights_from_disk(self, model_path: str, weight_version: str | None = None, flush_cache: bool = True,
                                 abort_all_requests: bool = False) -> Future:
        """Load checkpoint ``model_path`` (same model) into the live parameters; weight_version defaults to its
        folder name. Checked at once, in the caller's thread (a refused checkpoint waits for nothing)."""
        try:  # under tensor parallelism: rank 0's slices, against the checkpoint's whole tensors
            root = W.check_checkpoint(self.engine.model, model_path)
        except W.WeightUpdateError as exc:
            return _failed(exc)

        def run() -> dict:
            t0 = time.monotonic()
            nbytes = self._load_everywhere(root)
            self._weights_changed(weight_version or root.name, flush_cache)
            seconds = time.monotonic() - t0
            log.info("weights updated from %s in %.2f s (%.2f GB); version %s", root, seconds, nbytes / 1e9,
                     self.weight_version)
            return {"message": f"loaded {root} ({nbytes / 1e9:.3f} GB in {seconds:.2f} s)", "num_bytes": nbytes}

        return self.engine.call(run, drain=not abort_all_requests, abort=abort_all_requests)

    def _load_everywhere(self, root) -> int:
        """Load checkpoint ``root`` into this engine's model and, under tensor parallelism, into every rank's
        (each reads only its slices)."""
        return self._on_every_rank({"op": "update_weights_from_disk", "model_path": str(root)},
                                   lambda: W.load_checkpoint(self.engine.model, root))

    def _on_every_rank(self, op: dict, local: Callable[[], object]):
        """``local()`` here and, under tensor parallelism, ``op`` on every other rank (ranks.apply_control). A rank
        that fails leaves the ranks with different weights or memory: the engine is failed (the watchdog restarts
        the backend) and the caller gets a 503."""
        parallel = self.engine.parallel
        if parallel is None:
            return local()
        try:
            return parallel.run_on_every_rank(op, local)
        except Exception as exc:
            log.error("%s failed under tensor parallelism: %s", op["op"], exc)
            self.engine.fail(exc)
            raise EngineStoppedError(f"{op['op']} failed on a tensor-parallel rank ({exc}); the engine stopped "
                                     f"and the backend restarts") from exc

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                  group_name: str = "weight_update_group", backend: str = "nccl") -> Future:
        """Join the trainer's process group (blocks until the trainer joins: runs on its own thread, not the
        engine's)."""
        future: Future = Future()

        def run() -> None:
            try:
                future.set_result(self.update_groups.init(master_address, master_port, rank_offset, world_size,
                                                          group_name, backend))
            except Exception as exc:
                future.set_exception(exc)

        threading.Thread(target=run, name="moe-update-group", daemon=True).start()
        return future

    def update_weights_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                        group_name: str = "weight_update_group", weight_version: str | None = None,
                                        flush_cache: bool = True, abort_all_requests: bool = False) -> Future:
        """Receive the announced tensors from the trainer's broadcast into the live parameters. A refused
        announcement is still received (and dropped) so that the trainer's broadcasts complete."""
        try:
            group, device = self.update_groups.get(group_name)
        except W.WeightUpdateError as exc:
            return _failed(exc)
        try:
            plan = W.check_tensors(self.engine.model, names, dtypes, shapes)
        except W.WeightUpdateError as exc:
            dropped = W.dropped_plan(names, dtypes, shapes)
            if dropped is None:  # not even sizes to receive: the trainer's announcement itself is malformed
                return _failed(exc)
            refusal = exc
            return self.engine.call(lambda: self._refuse_broadcast(group, device, dropped, refusal))

        def run() -> dict:
            t0 = time.monotonic()
            # under tensor parallelism rank 0 forwards each whole tensor to the other ranks, which keep their part
            op = {"op": "update_weights_from_distributed", "names": names, "dtypes": dtypes, "shapes": shapes}
            tp = self.engine.parallel.group if self.engine.parallel is not None else None
            nbytes = self._on_every_rank(op, lambda: W.receive_broadcast(self.engine.model, group, device, plan, tp))
            self._weights_changed(weight_version, flush_cache)
            return {"message": f"received {len(plan)} tensors ({nbytes / 1e9:.3f} GB in "
                               f"{time.monotonic() - t0:.2f} s)", "num_bytes": nbytes}

        return self.engine.call(run, drain=not abort_all_requests, abort=abort_all_requests)

    def _refuse_broadcast(self, group, device, plan: list, exc: Exception) -> dict:
        W.receive_broadcast(self.engine.model, group, device, plan)
        raise exc

    def flush_cache(self) -> Future:
        return self.engine.call(lambda: {"message": f"flushed {self.engine.blocks.flush()} cached prefix blocks"})

    def pause_generation(self, mode: str = "abort") -> Future:
        """Stop running steps. ``abort``: requests submitted before end with "abort"; ``retract``: running ones
        give their KV blocks back and are recomputed after continue; ``in_place``: everything stays as is."""
        if mode not in PAUSE_MODES:
            return _failed(InvalidRequestError(f"mode must be one of {', '.join(PAUSE_MODES)}", param="mode"))

        def run() -> dict:
            stats = self.engine.stats()
            n = stats["running"] + stats["waiting"]
            if mode == "abort":
                n = self.engine.abort_all()
            elif mode == "retract":
                n = self.engine.retract_all()
            self.paused = True
            return {"message": f"generation paused ({mode}: {n} requests {_PAUSED[mode]})"}

        return self.engine.call(run)

    def continue_generation(self) -> Future:
        def run() -> dict:
            was, self.paused = self.paused, False
            return {"message": "generation continued" if was else "generation was not paused"}

        return self.engine.call(run)

    def release_memory_occupation(self, tags: list[str] | None = None) -> Future:
        """Free the KV cache (running requests are retracted, recomputed after resume) and/or the weights' GPU
        memory (kept in host memory; on CPU there is nothing to free). No steps run until every tag is resumed."""
        tags = self._memory_tags(tags)
        if isinstance(tags, Exception):
            return _failed(tags)

        def run() -> dict:
            kv = "kv_cache" in tags and "kv_cache" not in self.released
            weights = "weights" in tags and "weights" not in self.released
            if kv:
                self.engine.release_kv_cache()
            op = {"op": "release_memory_occupation", "kv_cache": kv, "weights": weights}
            done = self._on_every_rank(op, lambda: release_rank_memory(self.engine.runner, op))
            self.released |= tags - {"cuda_graph"}
            return {"message": f"released {', '.join(done) or 'nothing (already released, or on CPU)'}"}

        return self.engine.call(run)

    def resume_memory_occupation(self, tags: list[str] | None = None) -> Future:
        tags = self._memory_tags(tags)
        if isinstance(tags, Exception):
            return _failed(tags)

        def run() -> dict:
            op = {"op": "resume_memory_occupation",
                  "kv_cache": "kv_cache" in tags and "kv_cache" in self.released,
                  "weights": "weights" in tags and "weights" in self.released}
            done = self._on_every_rank(op, lambda: resume_rank_memory(self.engine.runner, op))
            self.released -= {t for t in ("kv_cache", "weights") if op[t]}
            return {"message": f"resumed {', '.join(done) or 'nothing (not released)'}"}

        return self.engine.call(run)

    @staticmethod
    def _memory_tags(tags: list[str] | None) -> set[str] | Exception:
        chosen = set(MEMORY_TAGS if tags is None else tags)
        unknown = sorted(chosen - set(MEMORY_TAGS))
        if unknown:
            return InvalidRequestError(f"unknown memory tags {unknown}; known: {', '.join(MEMORY_TAGS)}",
                                       param="tags")
        return chosen
