"""The serving engine: public API, engine thread, and ``step()``.

The parts (nano-vllm's shape): ``scheduler.py`` decides what each step runs (waiting/running queues, admission by
free KV blocks, preemption) and turns a step's results into per-request outputs; ``block_manager.py`` hands out KV
blocks and keeps the prefix cache with its routing rows; ``runner.py`` does the device side (inputs, CUDA graphs,
forward, sampling, one transfer to the host). This module owns the thread, the request inbox and ``step``.

Outputs: each request has a callback that receives a ``RequestOutput`` per step it took part in (new tokens, new
routing rows), the last one with ``finished=True`` and a finish reason. Callbacks run on the engine thread and must
not block.

Overlapped steps (CUDA by default): a step is left in flight, and the next ``step`` plans and launches the
following one *before* reading its results (``Scheduler.follow``): rows that decode a token the step in flight
samples take it on the device, prompt chunks and new admissions go on as planned, so the GPU runs the next forward
while the host hands out this one's tokens and routing rows (and a prefill step's successor is queued before the
GPU gets to it).

Control operations (RL rollout lifecycle: weight updates, cache flush, pause / continue, release / resume of GPU
memory) go through the same inbox as requests (``call``) and run on the engine thread *between* steps, after the
step in flight (an overlapped step included) has been completed: no weight or cache changes under a
running forward. Each returns a ``concurrent.futures.Future``. A weight update either lets the requests submitted
before it finish first (requests submitted after it wait until it is done) or aborts them
(``abort_all_requests``); while generation is paused it runs at once (requests kept in place continue on the new
weights after ``continue_generation``, as SGLang's in_place pause). Every weight change bumps the weights epoch,
which the scheduler puts in the prefix-cache key of every sequence it admits: blocks (and routing rows) computed
under other weights never match a later request, whether or not the cache is flushed. The operations are
``engine.lifecycle``'s (rl/lifecycle.py), the weight loading rl/weights.py's.

Expert load (core/expert_load.py): tokens per (MoE layer, expert), counted on the device in every step;
``expert_load_summary`` and ``expert_load_gauges`` read it from any thread, and SGLang's recorder operations
(``start_expert_distribution_record`` / ``stop_...`` / ``dump_...``) run between steps like the control operations.
When the engine runs out of work it brings the device's counts to the host (the device is idle then).
"""
from __future__ import annotations

import array
import collections
import hashlib
import itertools
import logging
import threading
from concurrent.futures import Future
from typing import Callable

import numpy as np
import torch

from .config import MoEConfig
from .core.block_manager import BlockManager
from .core.runner import LaunchedStep, build_runner
from .core.warmup import warm_up
from .core.sampling import SamplingParams, make_state
from .core.scheduler import Scheduler
from .core.sequence import Request, RequestOutput, Sequence
from .engine_config import EngineConfig
from .errors import EngineOverloadedError, EngineStoppedError, InvalidRequestError
from .kernels import support as kernel_support
from .rl.lifecycle import Control, RolloutLifecycle

log = logging.getLogger(__name__)


def _failed(exc: Exception) -> Future:
    future: Future = Future()
    future.set_exception(exc)
    return future


__all__ = ["Engine", "EngineConfig", "Request", "RequestOutput"]


def validate_replay(replay: np.ndarray, num_prompt: int, cfg: MoEConfig) -> None:
    """A routing replay must be [R, num_hidden_layers, top_k] integer ids, R <= the prompt, each MoE layer's row
    naming top_k distinct experts (rows of dense layers are ignored)."""
    L, K, E = cfg.num_hidden_layers, cfg.num_experts_per_tok, cfg.num_experts

    def bad(msg: str):
        raise InvalidRequestError(f"replay_routed_experts: {msg}", param="replay_routed_experts")

    if not isinstance(replay, np.ndarray) or replay.dtype.kind not in "iu":
        bad("must be an integer array")
    if replay.ndim != 3 or replay.shape[1:] != (L, K) or replay.shape[0] == 0:
        bad(f"expected shape [R, {L}, {K}] with 1 <= R <= {num_prompt} (prompt tokens), got {list(replay.shape)}")
    if replay.shape[0] > num_prompt:
        bad(f"{replay.shape[0]} rows but the prompt has only {num_prompt} tokens (rows force prompt tokens)")
    moe = replay[:, list(cfg.moe_layers)].astype(np.int64)  # [R, moe layers, K]
    if moe.size and (moe.min() < 0 or moe.max() >= E):
        where = np.argwhere((moe < 0) | (moe >= E))[0]
        bad(f"expert id {int(moe[tuple(where)])} at row {where[0]}, layer {cfg.moe_layers[where[1]]} is outside "
            f"[0, {E})")
    if K > 1 and moe.size:
        srt = np.sort(moe, axis=-1)
        dup = np.argwhere((srt[..., 1:] == srt[..., :-1]).any(-1))
        if len(dup):
            r, layer = dup[0]
            bad(f"row {r}, layer {cfg.moe_layers[layer]} repeats an expert id ({moe[r, layer].tolist()}): a token's "
                f"{K} experts must be distinct")


def _id_array(prompt) -> np.ndarray | None:
    """A prompt's token ids as int64 [n] in one C-level pass (a list's ints through ``array``, which refuses
    floats and ids beyond int64), or None when they are not all integers."""
    if isinstance(prompt, np.ndarray):
        if prompt.ndim != 1:
            return None
        if prompt.dtype.kind in "iu":
            return prompt.astype(np.int64)
        prompt = prompt.tolist()
    try:
        return np.frombuffer(array.array("q", prompt), np.int64)
    except (TypeError, OverflowError):
        return None


class Engine:
    def __init__(self, model: torch.nn.Module, cfg: MoEConfig, engine_cfg: EngineConfig | None = None,
                 parallel=None):
        """``parallel``: with tensor parallelism, the RankPool (ranks.py) of the other ranks; ``model`` is then
        rank 0's shard."""
        self.model, self.cfg, self.engine_config = model, cfg, engine_cfg or EngineConfig()
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.settings = s = self.engine_config.resolve(cfg, self.device, self.dtype)
        if s.max_model_len > cfg.max_position_embeddings:
            log.warning("max_model_len %d exceeds the model's max_position_embeddings %d", s.max_model_len,
                        cfg.max_position_embeddings)
        if parallel is not None:  # the other ranks build the same runner from these settings
            parallel.send_setup(s, (cfg.num_hidden_layers, cfg.num_experts_per_tok))
        self.runner = build_runner(model, s, parallel.group if parallel is not None else None)
        self.blocks = BlockManager.for_engine(self.runner.kv.num_blocks - 1, s, cfg)
        self.kv_bytes_per_token = self.runner.kv.bytes_per_token  # (kept while the cache is released)
        self.scheduler = Scheduler(self.blocks, s, frozenset(cfg.eos_token_ids))
        self.expert_load = self.runner.expert_load  # None when off (or routed experts off)
        if self.expert_load is not None:
            self.expert_load.probe = self._load_probe
        log.info("engine: %s", self._describe())
        self.lifecycle = RolloutLifecycle(self)  # control operations, pause / release state, weight version
        self._inbox: collections.deque = collections.deque()  # ("add", seq) | ("abort", id) | ("control", c)
        self._known_ids: set[str] = set()
        self._cv = threading.Condition()
        self._stop = False
        self._thread: threading.Thread | None = None
        self._ids = itertools.count()
        self._inflight: LaunchedStep | None = None  # a step launched, results not yet handed out
        self.dead: BaseException | None = None
        self._failure: BaseException | None = None  # set by ``fail`` from another thread
        self.num_steps = 0
        self.num_followed = 0  # steps launched before the previous step's results were read
        self.parallel = parallel
        if parallel is not None:  # tensor-parallel ranks run in lockstep, collectives inside: compiled lazily
            parallel.attach(self.runner, on_death=self.fail)
        else:
            warm_up(self.runner, s)

    def _describe(self) -> str:
        """The start-up log line: how memory, steps and kernels were set up."""
        s, r, b = self.settings, self.runner, self.blocks
        prefix = "off"
        if s.keep_routing_rows:
            prefix = f"on (routing rows of cached blocks: {b.rows.nbytes / 2**20:.0f} MiB of host memory)"
        elif s.enable_prefix_caching:
            prefix = "on"
        kernels = "off"
        if s.fused_kernels:
            kernels = ("on, bit-exact ones only" if s.exact_kernels else "on") + (
                ", programmatic dependent launch" if kernel_support.pdl(self.device) else "")
        mla = self.model.config.attention.mla
        per_layer = "/".join(map(str, r.kv.values_per_token_layer)) + " values per layer" + (
            f": MLA latent {mla.kv_lora_rank} + rope key {mla.qk_rope_head_dim}" if mla is not None else "")
        return (f"KV cache {r.kv.nbytes / 2**30:.2f} GiB = {b.num_blocks} blocks x {s.block_size} tokens "
                f"({b.num_blocks * s.block_size} tokens; {r.kv.bytes_per_token} bytes per token in "
                f"{str(r.kv.kv_dtype).removeprefix('torch.')}, {per_layer}), "
                f"{s.max_num_seqs} seqs, {s.step_tokens} tokens/step, "
                f"max_model_len {s.max_model_len}, prefix caching {prefix}, routed experts "
                f"{'on' if s.enable_routed_experts else 'off'}, expert load "
                f"{f'on ({s.expert_load_window:g} s window)' if self.runner.expert_load is not None else 'off'}, "
                f"device {self.device}, {self.dtype}, CUDA graphs "
                f"{r.describe_graphs()}, fused kernels {kernels}, attention "
                f"{'paged kernels' if r.use_kernels else 'reference (gather + SDPA)'}"
                + (", deterministic inference (batch-invariant forward)" if s.deterministic_inference else ""))

    # ---------------------------------------------------------------- public API (any thread)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="moe-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
        self.lifecycle.update_groups.close()
        # the other ranks of a tensor-parallel group; told to stop only when no step can be in flight
        self.runner.close(graceful=self._thread is None or not self._thread.is_alive())

    def fail(self, exc: BaseException) -> None:
        """From another thread (a tensor-parallel rank died): the engine is dead at once (no new requests);
        the engine thread ends every request with an error and stops."""
        with self._cv:
            self.dead = self.dead or exc
            self._failure = exc
            self._cv.notify_all()

    def new_request_id(self) -> str:
        return f"req-{next(self._ids)}"

    def validate(self, req: Request) -> np.ndarray:
        """Raise InvalidRequestError naming the problem; cheap, runs in the caller's thread. Returns the prompt's
        ids as an int64 array (what the prefix cache hashes: one conversion for both)."""
        n = len(req.prompt_token_ids)
        if n == 0:
            raise InvalidRequestError("input_ids: the prompt is empty", param="input_ids")
        V = self.cfg.vocab_size
        ids = _id_array(req.prompt_token_ids)
        if ids is None or ids.min() < 0 or ids.max() >= V:
            bad = next(t for t in req.prompt_token_ids if not (isinstance(t, (int, np.integer)) and 0 <= t < V))
            bad = bad.item() if isinstance(bad, np.generic) else bad  # 1.0, not np.float64(1.0)
            shown = f"{int(bad)} is outside" if isinstance(bad, (int, np.integer)) else f"{bad!r} is not an integer of"
            raise InvalidRequestError(f"input_ids: token id {shown} the vocabulary [0, {V})", param="input_ids")
        req.sampling.validate(V)
        limit = self.settings.max_model_len
        if n + req.sampling.max_tokens > limit:
            raise InvalidRequestError(
                f"this model's maximum context length is {limit} tokens; the request asks for "
                f"{n + req.sampling.max_tokens} ({n} in the prompt + {req.sampling.max_tokens} max_tokens)",
                param="max_tokens" if n < limit else "input_ids",
            )
        ps = req.routed_experts_prompt_start
        if not 0 <= ps < n:
            raise InvalidRequestError(
                f"routed_experts_prompt_start: must be in [0, {n}) for a {n}-token prompt, got {ps}",
                param="routed_experts_prompt_start",
            )
        if req.replay_routed_experts is not None:
            validate_replay(req.replay_routed_experts, n, self.cfg)
        lp = req.prompt_logprobs
        if lp is not None and not 0 <= lp <= SamplingParams.MAX_LOGPROBS:
            raise InvalidRequestError(
                f"prompt_logprobs: must be in [0, {SamplingParams.MAX_LOGPROBS}], got {lp}", param="prompt_logprobs"
            )
        return ids

    def add_request(self, req: Request) -> None:
        self.add_requests([req])

    def add_requests(self, reqs: list[Request]) -> None:
        """Submit requests together (a rollout batch, a multi-turn agent's turn): the engine's next step sees all of
        them, where one ``add_request`` after another lets the loop start a step with the first few (and the rest
        wait for it). All or none: any invalid request, a duplicate id or a full queue raises and submits none;
        the message names the request's index when there are several."""
        ids = []
        for i, req in enumerate(reqs):
            try:
                ids.append(self.validate(req))
            except InvalidRequestError as exc:
                if len(reqs) == 1:
                    raise
                raise InvalidRequestError(f"requests[{i}]: {exc}", param=exc.param) from exc
        with self._cv:
            if self.dead is not None or self._stop:
                raise EngineStoppedError("the engine is not running")
            seen: set[str] = set()
            for i, req in enumerate(reqs):
                if req.request_id in self._known_ids or req.request_id in seen:
                    where = f"requests[{i}]: " if len(reqs) > 1 else ""
                    raise InvalidRequestError(f"{where}request id {req.request_id!r} is already in use",
                                              param="request_id")
                seen.add(req.request_id)
            bound = self.settings.max_waiting
            if len(self.scheduler.waiting) + self.lifecycle.num_held + len(self._inbox) + len(reqs) > bound:
                raise EngineOverloadedError(
                    f"the engine's waiting queue is full ({bound} requests); retry later"
                )
            for req, prompt_ids in zip(reqs, ids):
                self._enqueue(req, prompt_ids)
            self._cv.notify_all()

    def _enqueue(self, req: Request, prompt_ids: np.ndarray) -> None:
        """A validated request into the inbox (the caller holds the lock and notifies)."""
        self._known_ids.add(req.request_id)
        p = req.prompt_token_ids
        seq = Sequence(
            req=req,
            sampler=make_state(req.sampling, self.device),
            tokens=p.tolist() if isinstance(p, np.ndarray) else list(p),
            num_prompt=len(p),
            prompt_ids=prompt_ids,
        )
        key = []
        if req.cache_salt:  # only requests of the same salt share cached blocks
            key.append(("salt", req.cache_salt))
        if req.replay_routed_experts is not None:
            # Blocks computed under forced routing are shared only with the same replay, never with requests
            # routed by the router's own choice (and never the other way round).
            req.replay_routed_experts = np.ascontiguousarray(req.replay_routed_experts, dtype=np.int64)
            key.append(("replay", hashlib.sha1(req.replay_routed_experts.tobytes()).hexdigest()))
        seq.table.cache_key = tuple(key) or None
        self._inbox.append(("add", seq))

    def abort(self, request_id: str) -> None:
        """Abort a request; its blocks are freed at the next step and it ends with "abort"."""
        with self._cv:
            self._inbox.append(("abort", request_id))
            self._cv.notify_all()

    @property
    def num_unfinished(self) -> int:
        with self._cv:
            return len(self._known_ids)

    def stats(self) -> dict:
        b = self.blocks
        with self._cv:
            return {
                "running": len(self.scheduler.running),
                "waiting": len(self.scheduler.waiting) + self.lifecycle.num_held + len(self._inbox),
                "num_blocks": b.num_blocks,
                "block_size": b.block_size,  # tokens per block (the prefix cache reuses whole blocks)
                "kv_bytes_per_token": self.kv_bytes_per_token,  # all layers; MLA: latent + rope key
                "free_blocks": b.num_free,
                "cached_blocks": b.num_cached,
                "kv_cache_usage": b.usage(),
                "num_preemptions": self.scheduler.num_preemptions,
                "prefix_cache_queries": b.query_tokens,
                "prefix_cache_hits": b.hit_tokens,
                "steps": self.num_steps,
                "overlapped_steps": self.num_followed,
            }

    # ---------------------------------------------------------------- expert load (any thread)

    def _expert_load_or_refuse(self):
        if self.expert_load is None:
            why = ("routed experts are off (--disable-routed-experts)" if not self.settings.enable_routed_experts
                   else "the server runs with --disable-expert-load")
            raise InvalidRequestError(f"expert load counting is off: {why}", param="expert_load")
        return self.expert_load

    def expert_load_gauges(self) -> dict:
        """Totals and per-layer balance over the window for /metrics ({} when the expert load is off)."""
        return self.expert_load.gauges() if self.expert_load is not None else {}

    def expert_load_summary(self) -> dict:
        """The dashboard's data (core/expert_load.py ``summary``) with the engine's current gauges."""
        if self.expert_load is None:
            return {"enabled": False, "message": self._expert_load_message(), "stats": self.stats()}
        return {**self.expert_load.summary(), "stats": self.stats()}

    def _expert_load_message(self) -> str:
        try:
            self._expert_load_or_refuse()
        except InvalidRequestError as exc:
            return str(exc)
        return ""

    def start_expert_distribution_record(self) -> Future:
        """SGLang's recorder: clear the record and record every step from now on (between steps)."""
        try:
            load = self._expert_load_or_refuse()
        except InvalidRequestError as exc:
            return _failed(exc)
        return self.call(lambda: {"message": load.start_record()})

    def stop_expert_distribution_record(self) -> Future:
        try:
            load = self._expert_load_or_refuse()
        except InvalidRequestError as exc:
            return _failed(exc)
        return self.call(lambda: {"message": load.stop_record()})

    def dump_expert_distribution_record(self) -> Future:
        """The record (``logical_count`` as a numpy array, its axes in ``dims``, the MoE layers in ``layers``),
        cleared after the dump."""
        try:
            load = self._expert_load_or_refuse()
        except InvalidRequestError as exc:
            return _failed(exc)
        return self.call(lambda: {"message": "Dump expert distribution record.", **load.dump_record()})

    def _load_probe(self) -> dict:
        """The engine's gauges at an expert-load tick (engine thread): KV use, prefix-cache counters, requests."""
        b = self.blocks
        return {"kv_cache_usage": round(b.usage(), 4), "prefix_cache_hits": b.hit_tokens,
                "prefix_cache_queries": b.query_tokens, "running": len(self.scheduler.running),
                "waiting": len(self.scheduler.waiting)}

    # ---------------------------------------------------------------- engine thread

    def _loop(self) -> None:
        try:
            while True:
                with self._cv:
                    while not (self._stop or self._inbox or self.lifecycle.pending or self._inflight or
                               self._failure is not None or (self.lifecycle.can_run and self.scheduler.has_work())):
                        if self.expert_load is not None and self.expert_load.stale:
                            self.expert_load.flush()  # nothing in flight: the last steps' counts to the host
                        self._cv.wait()
                    if self._failure is not None:
                        raise self._failure
                    if self._stop:
                        break
                self.step()
        except BaseException as exc:  # the loop must never die silently
            log.exception("engine loop died")
            exc = self._failure or exc  # a dead rank breaks the collectives too: name the cause
            self.dead = exc
            self._fail_all(f"engine failure: {exc!r}")
        finally:
            self._fail_all("the engine shut down")
            self.runner.close()  # stops the other ranks of a tensor-parallel group

    def _fail_all(self, message: str) -> None:
        with self._cv:
            held, controls = self.lifecycle.drop_pending()
            seqs = list(self.scheduler.running) + list(self.scheduler.waiting) + held
            seqs += [item for kind, item in self._inbox if kind == "add"]
            controls += [item for kind, item in self._inbox if kind == "control"]
            self._inbox.clear()
            self._inflight = None
        for seq in seqs:
            self.scheduler.finish(seq, "error", self._emit, error=message)
        for c in controls:
            if c.future.set_running_or_notify_cancel():
                c.future.set_exception(EngineStoppedError(message))

    def step(self) -> bool:
        """Run one step; returns False when there was nothing to do."""
        self._drain_inbox()
        if self.lifecycle.pending:
            self.complete_inflight()  # nothing changes under a step in flight
            self.lifecycle.run_pending()
        if not self.lifecycle.can_run:
            return False
        prev, self._inflight = self._inflight, None
        if prev is not None:
            following = self._launch_following(prev)
            self._complete(prev)
            if following is not None:
                self._keep_or_complete(following)
                return True
        plan = self.scheduler.schedule()
        if plan is None:
            return prev is not None
        launched = self.runner.launch(plan, self._wants_routing(plan))
        self.scheduler.prepare_outputs(plan)  # while the device computes the step
        self._keep_or_complete(launched)
        return True

    def _wants_routing(self, plan) -> bool:
        return self.settings.keep_routing_rows or any(s.req.return_routed_experts or s.req.return_routed_weights
                                     for s, _ in plan.items)

    def _launch_following(self, prev: LaunchedStep) -> LaunchedStep | None:
        """The step after ``prev``, launched before prev's results are read (its rows that decode prev's samples
        take them on the device), or None."""
        nxt = self.scheduler.follow(prev.plan)
        if nxt is None:
            return None
        launched = self.runner.launch(nxt, self._wants_routing(nxt), fed_from=prev.tokens)
        self.scheduler.prepare_outputs(nxt)  # cached rows of the sequences it admits (the others': with prev's)
        self.num_followed += 1
        return launched

    def _keep_or_complete(self, launched: LaunchedStep) -> None:
        """Leave a launched step in flight for the next one to follow on the device, else finish it now."""
        self.num_steps += 1
        if self.runner.overlap:
            self._inflight = launched
        else:
            self._complete(launched)

    def _complete(self, step: LaunchedStep) -> None:
        self.scheduler.process(self.runner.results(step), self._emit)

    def _drain_inbox(self) -> None:
        with self._cv:
            items = list(self._inbox)
            self._inbox.clear()
        for kind, item in items:
            if kind == "control":
                self.lifecycle.take(item)
            elif kind == "add":
                if not self.lifecycle.hold(item):
                    self.scheduler.add(item)
            else:
                seq = self.scheduler.find(item) or self.lifecycle.unhold(item)
                if seq is not None:
                    self.scheduler.finish(seq, "abort", self._emit)

    def _emit(self, seq: Sequence, out: RequestOutput) -> None:
        out.weight_version = self.lifecycle.weight_version  # the weights that produced this output
        if out.finished:
            with self._cv:
                self._known_ids.discard(seq.request_id)
        cb = seq.req.on_output
        if cb is None:
            return
        try:
            cb(out)
        except Exception:
            log.exception("output callback of %s failed; aborting it", seq.request_id)
            if not out.finished:
                self.abort(seq.request_id)

    # ---------------------------------------------------------------- what the RL lifecycle uses (engine thread)

    def call(self, fn: Callable[[], dict], *, drain: bool = False, abort: bool = False) -> Future:
        """Run ``fn`` on the engine thread between steps (see the module docstring); its dict is the result."""
        future: Future = Future()
        with self._cv:
            if self.dead is not None or self._stop:
                future.set_exception(EngineStoppedError("the engine is not running"))
                return future
            self._inbox.append(("control", Control(fn, future, drain, abort)))
            self._cv.notify_all()
        return future

    def complete_inflight(self) -> None:
        """Hand out the results of the step in flight, if any (before anything changes the model or the cache)."""
        if self._inflight is not None:
            self._complete(self._inflight)
            self._inflight = None

    def abort_all(self) -> int:
        """End every running and waiting request with "abort"; how many."""
        seqs = list(self.scheduler.running) + list(self.scheduler.waiting)
        for seq in seqs:
            self.scheduler.finish(seq, "abort", self._emit)
        return len(seqs)

    def retract_all(self) -> int:
        """Running requests give their KV blocks back and wait, to be recomputed; how many requests wait now."""
        return self.scheduler.retract_all()

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def admit(self, seq: Sequence) -> None:
        """A request held behind a control operation joins the waiting queue."""
        self.scheduler.add(seq)

    def weights_changed(self, flush_cache: bool) -> None:
        """After a weight update: a new weights epoch in every later prefix-cache key (cached blocks computed
        under the old weights never match), the old entries optionally dropped."""
        self.scheduler.bump_cache_epoch()
        if flush_cache:
            self.blocks.flush()

    def release_kv_cache(self) -> None:
        """Before the KV cache is freed: every running request retracted, the prefix cache emptied."""
        self.scheduler.retract_all()
        self.blocks.flush()
