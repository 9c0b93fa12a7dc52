"""The ranks of a tensor-parallel engine: rank 0 starts, drives, watches and stops ranks 1..N-1.

Process model (torch.distributed.run style): the serving process (the Triton model instance) is rank 0. It
starts one process per other rank (``python -m moe_engine.distributed.ranks``; on CUDA rank r uses GPU
first_gpu + r), and every rank loads only its shard of the checkpoint (sharding.py, read through the memory map). Rank 0 alone runs
the scheduler and the block manager; each step it broadcasts the step's inputs (``StepInputs``: a header and one
int64 payload on the control group, plus the token ids on the device group when an overlapped step's ids
never left rank 0's GPU), and every rank runs the same forward (``ModelRunner.forward``, CUDA-graph replays
included: every rank captures the same graphs at the same steps); rank 0 samples and captures routed experts.

Setup: rank 0's engine sends its settings (``ResolvedConfig``); every rank builds its runner from them
(``build_runner``) and sizes its KV cache the same way (on CUDA by profiling the same step, collectives included);
the smallest block count over ranks wins, so every rank holds the same block ids.

Failures: a watchdog thread waits on the child processes. When one exits unasked, the engine is failed
(``Engine.fail``: every in-flight request ends with an error, ``engine.dead`` is set, the backend's
``moe_engine_alive`` gauge turns 0) and the other ranks are stopped; with NCCL the group is aborted so that a
collective waiting for the dead rank returns. A rank whose parent (rank 0) disappears exits by itself. Stopping
sends a stop message when the engine thread is done, then SIGTERM, then SIGKILL: no process is left behind.
"""
from __future__ import annotations

import argparse
import datetime
import itertools
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Callable, TypeVar

import numpy as np
import torch
import torch.distributed as dist

from ..core.runner import ModelRunner, StepInputs, build_runner
from ..core.warmup import freeze_start_up_objects
from ..engine_config import ResolvedConfig
from .parallel import ParallelError, ParallelGroup, apply_rank_env, rank_device

T = TypeVar("T")

log = logging.getLogger(__name__)

JOIN_TIMEOUT_S = float(os.environ.get("MOE_PARALLEL_JOIN_TIMEOUT_S", 300))  # ranks starting (imports, not loads)
STOP_WAIT_S = 10.0  # a rank's time to exit after the stop message (then SIGTERM, 5 s, SIGKILL)
TERM_WAIT_S = 5.0

# A message: one broadcast of _FIRST int64 (a header of _HEADER: kind, payload size, the step's sizes and flags;
# then the payload's start), and a second one for the rest of a payload that does not fit (a decode step of up
# to ~30 sequences with 64-block tables fits in one).
_HEADER = 12
_FIRST = 2048
_STEP, _SETUP, _STOP, _CONTROL = 1, 2, 3, 4
_F_DEVICE_IDS, _F_ROUTING, _F_WEIGHTS, _F_FORCED, _F_GRAPH = 1, 2, 4, 8, 16


# ----------------------------------------------------------------------------- the step channel


class StepChannel:
    """Rank 0 -> every rank: each step's ``StepInputs`` (two host broadcasts: header, payload), the setup, stop."""

    def __init__(self, group: ParallelGroup, routing_shape: tuple[int, int]):
        self.group = group
        self.L, self.K = routing_shape
        self.lock = threading.Lock()  # one sender at a time (the engine thread; the pool's stop)

    def _send(self, kind: int, fields: list[int], payload: np.ndarray) -> None:
        first = np.zeros(_FIRST, dtype=np.int64)
        first[0], first[1] = kind, payload.size
        first[2 : 2 + len(fields)] = fields
        n = min(payload.size, _FIRST - _HEADER)
        first[_HEADER : _HEADER + n] = payload[:n]
        self.group.broadcast_host(torch.from_numpy(first))
        if payload.size > n:
            self.group.broadcast_host(torch.from_numpy(np.ascontiguousarray(payload[n:], dtype=np.int64)))

    def _recv(self) -> tuple[int, list[int], np.ndarray]:
        first = self.group.broadcast_host(torch.zeros(_FIRST, dtype=torch.long)).numpy()
        size = int(first[1])
        payload = first[_HEADER : _HEADER + min(size, _FIRST - _HEADER)]
        if size > payload.size:
            rest = self.group.broadcast_host(torch.zeros(size - payload.size, dtype=torch.long)).numpy()
            payload = np.concatenate([payload, rest])
        return int(first[0]), first[2:_HEADER].tolist(), payload

    # -- rank 0

    def publish(self, step: StepInputs, input_ids: torch.Tensor | None) -> None:
        B, T = len(step.context), sum(step.query_lens)
        flags = ((_F_DEVICE_IDS if step.ids is None else 0) | (_F_ROUTING if step.want_routing else 0)
                 | (_F_WEIGHTS if step.want_weights else 0) | (_F_FORCED if step.forced is not None else 0)
                 | (_F_GRAPH if step.graph else 0))
        lens = [len(t) for t in step.tables]
        parts = [
            np.array(step.ids or [], dtype=np.int64), np.array(step.context, dtype=np.int64),
            np.array(step.query_lens, dtype=np.int64), np.array(lens, dtype=np.int64),
            np.fromiter(itertools.chain.from_iterable(step.tables), dtype=np.int64, count=sum(lens)),
            np.array(step.samplers, dtype=np.int64), np.array(step.score_rows, dtype=np.int64),
        ]
        if step.forced is not None:
            parts += [step.forced[0].astype(np.int64), step.forced[1].reshape(-1).astype(np.int64)]
        payload = np.concatenate(parts)
        with self.lock:
            self._send(_STEP, [flags, B, T, len(step.samplers), len(step.score_rows)], payload)
            if step.ids is None:
                self.group.broadcast_device(input_ids)

    def send_setup(self, setup: dict) -> None:
        data = np.frombuffer(json.dumps(setup).encode(), dtype=np.uint8).astype(np.int64)
        with self.lock:
            self._send(_SETUP, [], data)

    def send_stop(self) -> None:
        with self.lock:
            self._send(_STOP, [], np.zeros(0, dtype=np.int64))

    def send_control(self, op: dict) -> None:
        data = np.frombuffer(json.dumps(op).encode(), dtype=np.uint8).astype(np.int64)
        with self.lock:
            self._send(_CONTROL, [], data)

    # -- ranks 1..N-1

    def receive(self, device: torch.device):
        """The next message: ("step", StepInputs, ids on the device or None) | ("setup", dict) | ("control", dict)
        | ("stop",)."""
        kind, f, p = self._recv()
        if kind == _STOP:
            return ("stop",)
        if kind in (_SETUP, _CONTROL):
            return ("setup" if kind == _SETUP else "control", json.loads(p.astype(np.uint8).tobytes()))
        flags, B, T, n_samplers, n_score = f[:5]
        on_device = bool(flags & _F_DEVICE_IDS)
        pos = 0

        def take(n: int) -> np.ndarray:
            nonlocal pos
            pos += n
            return p[pos - n : pos]

        ids = None if on_device else take(T).tolist()
        context, query_lens, lens = take(B).tolist(), take(B).tolist(), take(B).tolist()
        flat = take(sum(lens)).tolist()
        tables, at = [], 0
        for n in lens:
            tables.append(flat[at : at + n])
            at += n
        step = StepInputs(ids=ids, context=context, query_lens=query_lens, tables=tables,
                          want_routing=bool(flags & _F_ROUTING), want_weights=bool(flags & _F_WEIGHTS),
                          samplers=take(n_samplers).tolist(), score_rows=take(n_score).tolist(),
                          graph=bool(flags & _F_GRAPH))
        if flags & _F_FORCED:
            step.forced = (take(T).astype(bool), take(T * self.L * self.K).reshape(T, self.L, self.K).copy())
        input_ids = None
        if on_device:
            input_ids = self.group.broadcast_device(torch.empty(T, dtype=torch.long, device=device))
        return ("step", step, input_ids)


# ----------------------------------------------------------------------------- every rank: the runner


def apply_control(runner: ModelRunner, group: ParallelGroup, op: dict) -> bool:
    """Rank 1..N-1's part of a weight or memory operation (``RankPool.run_on_every_rank``); whether it succeeded
    here."""
    from ..rl import lifecycle, weights

    try:
        if op["op"] == "update_weights_from_disk":  # this rank's slices, into the live parameters
            weights.load_checkpoint(runner.model, Path(op["model_path"]))
        elif op["op"] == "update_weights_from_distributed":  # whole tensors from rank 0; this rank keeps its part
            try:
                plan = weights.check_tensors(runner.model, op["names"], op["dtypes"], op["shapes"])
            except weights.WeightUpdateError:  # still take part in every broadcast, then report the failure
                weights.receive_broadcast(runner.model, None, runner.device,
                                          weights.dropped_plan(op["names"], op["dtypes"], op["shapes"]), tp=group)
                raise
            weights.receive_broadcast(runner.model, None, runner.device, plan, tp=group)
        elif op["op"] == "release_memory_occupation":
            lifecycle.release_rank_memory(runner, op)
        elif op["op"] == "resume_memory_occupation":
            lifecycle.resume_rank_memory(runner, op)
        else:
            raise ParallelError(f"unknown control operation {op['op']!r}")
        return True
    except Exception:
        log.exception("%s failed on this rank", op.get("op"))
        return False


# ----------------------------------------------------------------------------- rank 0: the pool


def _python() -> str:
    """A Python interpreter for the ranks (inside Triton's stub ``sys.executable`` is the stub)."""
    exe = sys.executable
    if exe and Path(exe).name.startswith("python"):
        return exe
    for candidate in (Path(sys.exec_prefix) / "bin" / "python3", Path(sys.prefix) / "bin" / "python3"):
        if candidate.exists():
            return str(candidate)
    raise ParallelError(f"no Python interpreter to start the other ranks with (sys.executable is {exe!r})")


class RankPool:
    """Rank 0's side of a tensor-parallel group: ranks 1..N-1 as child processes, the group, the step channel."""

    def __init__(self, world_size: int, checkpoint: str, dtype: str, device: str, first_gpu: int = 0,
                 expert_parallel: bool = False, num_threads: int | None = None):
        self.world_size = world_size
        self.args = dict(checkpoint=str(checkpoint), dtype=str(dtype), device=str(device), first_gpu=first_gpu,
                         expert_parallel=expert_parallel)
        self.device = rank_device(device, first_gpu, 0)
        self.num_threads = num_threads or torch.get_num_threads()
        self.procs: list[subprocess.Popen] = []
        self.group: ParallelGroup | None = None
        self.channel: StepChannel | None = None
        self._stopping = threading.Event()
        self._watch: threading.Thread | None = None
        self.failure: ParallelError | None = None

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def start(self) -> ParallelGroup:
        """Start ranks 1..N-1 and form the group with them (they load their shards after joining)."""
        store = dist.TCPStore("127.0.0.1", 0, self.world_size, is_master=True, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=JOIN_TIMEOUT_S))
        env = apply_rank_env(dict(os.environ))
        backends_dir = str(Path(__file__).resolve().parent.parent)  # so that ``moe_engine`` imports
        env["PYTHONPATH"] = os.pathsep.join(p for p in (backends_dir, env.get("PYTHONPATH", "")) if p)
        for rank in range(1, self.world_size):
            cmd = [_python(), "-m", "moe_engine.distributed.ranks", "--rank", str(rank), "--world-size", str(self.world_size),
                   "--store-port", str(store.port), "--parent", str(os.getpid()),
                   "--num-threads", str(self.num_threads), "--args", json.dumps(self.args)]
            # A session of their own: signals to rank 0's process group (Ctrl-C, Triton stopping) reach rank 0,
            # which stops them in order; they also exit when rank 0 disappears (``_exit_with_parent``).
            self.procs.append(subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, start_new_session=True))
        log.info("started ranks 1..%d (pids %s)", self.world_size - 1, self.pids)
        try:
            self._wait_joined(store)
            self.group = ParallelGroup.join(store, 0, self.world_size, self.device)
        except BaseException:
            self.stop(graceful=False)
            raise
        self._store = store  # the ranks' rendezvous; kept for the group's lifetime
        return self.group

    def _wait_joined(self, store) -> None:
        """Until every rank has connected (a rank that exits first is reported with its exit code)."""
        deadline = time.monotonic() + JOIN_TIMEOUT_S
        while store.add("joined", 0) < self.world_size - 1:
            for rank, p in enumerate(self.procs, start=1):
                if p.poll() is not None:
                    raise ParallelError(f"rank {rank} (pid {p.pid}) exited with code {p.returncode} before joining")
            if time.monotonic() > deadline:
                raise ParallelError(f"the other ranks did not join within {JOIN_TIMEOUT_S:.0f} s")
            time.sleep(0.05)

    def send_setup(self, settings: ResolvedConfig, routing_shape: tuple[int, int]) -> None:
        """The engine's settings, which every rank builds its runner from (before rank 0 sizes its own KV cache)."""
        self.channel = StepChannel(self.group, routing_shape)
        self.channel.send_setup({"settings": asdict(settings), "num_threads": self.num_threads})

    def run_on_every_rank(self, op: dict, local: Callable[[], T]) -> T:
        """A weight operation on every rank, between steps (rank 0's engine thread calls this): ``op`` goes to
        ranks 1..N-1 (``apply_control``), ``local`` runs here, and every rank says whether it succeeded. Raises
        ParallelError when any rank failed: the ranks' weights may differ now, so the caller fails the engine."""
        self.channel.send_control(op)
        error: BaseException | None = None
        try:
            result = local()
        except Exception as exc:
            result, error = None, exc
        if self.group.min_int(0 if error else 1) == 0:
            where = f"rank 0: {error}" if error else "another rank (its log says why)"
            raise ParallelError(f"{op['op']} failed on {where}; the ranks' weights may differ") from error
        return result

    def attach(self, runner: ModelRunner, on_death) -> None:
        """Rank 0's runner publishes every step to the other ranks and stops them when it closes; the watchdog
        calls ``on_death(error)`` when a rank exits unasked."""
        runner.publish = self.channel.publish
        runner.on_close = self.stop
        self._watch = threading.Thread(target=self._watchdog, args=(on_death,), name="moe-ranks-watchdog",
                                       daemon=True)
        self._watch.start()

    def _watchdog(self, on_death) -> None:
        while not self._stopping.is_set():
            for rank, p in enumerate(self.procs, start=1):
                if p.poll() is not None and not self._stopping.is_set():
                    self.failure = ParallelError(f"tensor-parallel rank {rank} (pid {p.pid}) exited with code "
                                                 f"{p.returncode}")
                    log.error("%s; failing the engine and stopping the other ranks", self.failure)
                    on_death(self.failure)
                    if self.device.type == "cuda" and self.group is not None:
                        self.group.abort()  # NCCL waits for the dead rank until its timeout otherwise
                    self._terminate()
                    return
            self._stopping.wait(0.2)

    def _terminate(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + TERM_WAIT_S
        for p in self.procs:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def stop(self, graceful: bool = True) -> None:
        """Stop every other rank (a stop message when the group is healthy and idle, then SIGTERM, SIGKILL) and
        leave the group; idempotent."""
        if self._stopping.is_set():
            return
        self._stopping.set()
        if graceful and self.failure is None and self.channel is not None:
            try:
                self.channel.send_stop()
                deadline = time.monotonic() + STOP_WAIT_S
                for p in self.procs:
                    p.wait(max(0.0, deadline - time.monotonic()))
            except Exception:  # a broken group or a rank that did not exit: SIGTERM below
                log.debug("graceful stop of the other ranks failed", exc_info=True)
        self._terminate()
        if self.group is not None:
            if self.failure is not None and self.device.type == "cuda":
                self.group.abort()
            self.group.destroy()
        log.info("tensor-parallel ranks stopped")


# ----------------------------------------------------------------------------- loading a parallel engine


def load_rank_model(checkpoint: str, dtype: str, device: torch.device, group: ParallelGroup, expert_parallel: bool,
                    progress: bool = True):
    from ..checkpoint import load_model
    from .sharding import shard_model

    return load_model(checkpoint, dtype=dtype, device=device, progress=progress,
                      shard=lambda m: shard_model(m, group, expert_parallel))


def build_parallel_engine(checkpoint, dtype: str, device: str, cfg, ecfg, first_gpu: int = 0):
    """An Engine whose model is split over ``ecfg.tensor_parallel_size`` ranks (this process is rank 0). The
    other ranks are stopped if anything fails on the way."""
    from ..engine import Engine

    pool = RankPool(ecfg.tensor_parallel_size, checkpoint, dtype, device, first_gpu, ecfg.enable_expert_parallel)
    group = pool.start()
    try:
        model = load_rank_model(checkpoint, dtype, pool.device, group, ecfg.enable_expert_parallel)
        return Engine(model, cfg, ecfg, parallel=pool)
    except BaseException:
        pool.stop(graceful=False)
        raise


# ----------------------------------------------------------------------------- ranks 1..N-1: the process


def _exit_with_parent(parent: int) -> None:
    """Rank 0 gone (killed, crashed): this rank has nothing left to do."""
    while True:
        if os.getppid() != parent:
            os._exit(1)
        time.sleep(1.0)


@torch.inference_mode()
def serve_rank(rank: int, world_size: int, store_port: int, args: dict, num_threads: int) -> None:
    apply_rank_env()
    torch.set_num_threads(num_threads)
    device = rank_device(args["device"], args["first_gpu"], rank)
    store = dist.TCPStore("127.0.0.1", store_port, world_size, is_master=False,
                          timeout=datetime.timedelta(seconds=JOIN_TIMEOUT_S))
    store.add("joined", 1)
    group = ParallelGroup.join(store, rank, world_size, device)
    try:
        model = load_rank_model(args["checkpoint"], args["dtype"], device, group, args["expert_parallel"],
                                progress=False)
        cfg = model.config
        channel = StepChannel(group, (cfg.num_hidden_layers, cfg.num_experts_per_tok))
        msg = channel.receive(device)
        if msg[0] != "setup":
            return
        setup = msg[1]
        torch.set_num_threads(setup.get("num_threads", num_threads))
        # only rank 0 captures routing
        settings = replace(ResolvedConfig(**setup["settings"]), enable_routed_experts=False)
        runner = build_runner(model, settings, group)
        log.info("rank %d ready: KV cache %d blocks; garbage collector: %d start-up objects frozen", rank,
                 runner.kv.num_blocks - 1, freeze_start_up_objects())
        while True:
            msg = channel.receive(device)
            if msg[0] == "control":
                group.min_int(1 if apply_control(runner, group, msg[1]) else 0)
                continue
            if msg[0] != "step":
                break
            _, step, input_ids = msg
            _, hidden = runner.forward(step, input_ids)
            if step.score_rows:
                for _ in runner.score_logits(hidden, step.score_rows):
                    pass
    finally:
        group.destroy()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="A tensor-parallel rank > 0 of a moe-serve engine (started by rank 0).")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--store-port", type=int, required=True)
    p.add_argument("--parent", type=int, required=True)
    p.add_argument("--num-threads", type=int, default=1)
    p.add_argument("--args", required=True, help="JSON: checkpoint, dtype, device, first_gpu, expert_parallel")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"%(asctime)s %(levelname)s rank{a.rank} %(name)s: %(message)s")
    threading.Thread(target=_exit_with_parent, args=(a.parent,), daemon=True).start()
    try:
        serve_rank(a.rank, a.world_size, a.store_port, json.loads(a.args), a.num_threads)
    except Exception as exc:  # rank 0 sees the broken group; this says why
        log.error("rank %d stops: %r", a.rank, exc)
        return 1
    logging.shutdown()
    os._exit(0)  # told to stop, group left: nothing to flush, and torch's interpreter teardown can take seconds


if __name__ == "__main__":
    sys.exit(main())
