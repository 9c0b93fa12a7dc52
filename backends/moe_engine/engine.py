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
``engine.lifecycle``'s (lifecycle.py), the weight loading weights.py's.
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

from . import kernels
from .block_manager import BlockManager
from .config import MoEConfig
from .engine_config import EngineConfig
from .errors import EngineOverloadedError, EngineStoppedError, InvalidRequestError
from .kv_cache import blocks_for_budget
from .paged_attention import available as paged_attention_available
from .paged_attention import default_block_size
from .runner import LaunchedStep, ModelRunner, kv_cache_budget, log_late_compiles, starting_up
from .sampling import SamplingParams, make_state
from .scheduler import Scheduler
from .sequence import Request, RequestOutput, Sequence
from . import weights as W
from .lifecycle import Control, RolloutLifecycle

log = logging.getLogger(__name__)

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
        self.model = model
        self.cfg = cfg
        self.ecfg = ec = engine_cfg or EngineConfig()
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        cuda = self.device.type == "cuda"
        self.max_model_len = ec.max_model_len or cfg.max_position_embeddings
        if self.max_model_len > cfg.max_position_embeddings:
            log.warning("max_model_len %d exceeds the model's max_position_embeddings %d", self.max_model_len,
                        cfg.max_position_embeddings)
        self.max_num_seqs = ec.max_num_seqs or (256 if cuda else 64)
        step_budget = ec.max_num_batched_tokens or (8192 if cuda else 512)
        self.step_tokens = max(step_budget, self.max_num_seqs)  # every running sequence can decode
        self.fused = model.use_fused_kernels(cuda if ec.fused_kernels is None else ec.fused_kernels,
                                             within_rounding=False if ec.exact_kernels else None)
        graphs_off = self._graphs_off_reason(model)
        graph_tokens = (max(2048, self.max_num_seqs) if ec.max_cudagraph_capture_size is None
                        else ec.max_cudagraph_capture_size)
        if graph_tokens < 0:
            raise ValueError(f"max_cudagraph_capture_size must be >= 0, got {graph_tokens}")

        specs = model.kv_layout()
        overlap = cuda if ec.overlap_decode is None else ec.overlap_decode
        use_kernels = (self.fused and cuda and model.config.attention.mla is None
                       and paged_attention_available(self.device))
        bs = ec.block_size or default_block_size(use_kernels, self.device, self.dtype,
                                                 {d for spec in specs for d in (spec.k_dim, spec.v_dim)})
        if parallel is not None:  # the other ranks build the same runner (ranks.build_runner) from these
            parallel.send_setup(dict(
                fused=self.fused, exact_kernels=ec.exact_kernels, block_size=bs, step_tokens=self.step_tokens,
                max_num_seqs=self.max_num_seqs,
                max_model_len=self.max_model_len, gpu_memory_utilization=ec.gpu_memory_utilization,
                kv_cache_memory_bytes=ec.kv_cache_memory_bytes, graphs_off=graphs_off, overlap=overlap,
                use_attention_kernels=use_kernels, max_cudagraph_capture_size=graph_tokens,
            ), (cfg.num_hidden_layers, cfg.num_experts_per_tok))
        budget = kv_cache_budget(model, specs, bs, self.step_tokens, self.max_num_seqs, self.max_model_len,
                                 ec.gpu_memory_utilization, ec.kv_cache_memory_bytes)
        num_blocks = blocks_for_budget(specs, bs, self.dtype, budget)
        if parallel is not None:  # the same block ids on every rank
            num_blocks = parallel.group.min_int(num_blocks)
        if (num_blocks - 1) * bs < self.max_model_len:
            raise ValueError(
                f"the KV cache ({budget / 2**30:.2f} GiB, {num_blocks - 1} blocks of {bs} tokens) cannot hold one "
                f"sequence of max_model_len={self.max_model_len}; raise the KV budget or lower max_model_len"
            )
        # Routing rows are kept with cached prefix blocks, so with the prefix cache on every step captures.
        keep_rows = ec.enable_prefix_caching and ec.enable_routed_experts
        L, K = cfg.num_hidden_layers, cfg.num_experts_per_tok
        self.blocks = BlockManager(num_blocks - 1, bs, ec.enable_prefix_caching,
                                   routing_shape=(L, K) if keep_rows else None,
                                   routing_dtype=np.uint8 if cfg.num_experts <= 256 else np.uint16)
        self.runner = ModelRunner(
            model, num_blocks, bs, self.step_tokens, self.max_num_seqs, self.max_model_len,
            capture_routing=ec.enable_routed_experts, graphs_off=graphs_off, overlap=overlap,
            use_attention_kernels=use_kernels, max_cudagraph_capture_size=graph_tokens,
        )
        self.scheduler = Scheduler(self.blocks, self.max_num_seqs, self.step_tokens, self.max_model_len,
                                   frozenset(cfg.eos_token_ids), keep_rows)
        self.keep_rows = keep_rows
        log.info(
            "engine: KV cache %.2f GiB = %d blocks x %d tokens (%d tokens), %d seqs, %d tokens/step, max_model_len "
            "%d, prefix caching %s, routed experts %s, device %s, %s, CUDA graphs %s, fused kernels %s, attention %s",
            self.runner.kv.nbytes / 2**30, num_blocks - 1, bs, (num_blocks - 1) * bs, self.max_num_seqs,
            self.step_tokens, self.max_model_len,
            f"on (routing rows of cached blocks: {self.blocks.rows.nbytes / 2**20:.0f} MiB of host memory)"
            if keep_rows else "on" if ec.enable_prefix_caching else "off",
            "on" if ec.enable_routed_experts else "off", self.device, self.dtype,
            self._graphs_description(graphs_off),
            (("on, bit-exact ones only" if ec.exact_kernels else "on")
             + (", programmatic dependent launch" if kernels.pdl(self.device) else "")) if self.fused else "off",
            "paged kernels" if self.runner.use_kernels else "reference (gather + SDPA)",
        )
        self._inbox: collections.deque = collections.deque()  # ("add", seq) | ("abort", id) | ("control", c)
        self._controls: collections.deque[Control] = collections.deque()  # taken from the inbox, not yet run
        self._held: collections.deque[Sequence] = collections.deque()  # submitted after a pending control
        self.paused = False  # pause_generation: no steps until continue_generation
        self.released: set[str] = set()  # release_memory_occupation tags in effect (no steps while any is)
        self.weight_version = ""  # set by the caller (the checkpoint's folder name), then by weight updates
        self.lifecycle = RolloutLifecycle(self)  # the control operations (weight updates, pause, release, ...)
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
        if parallel is not None:
            parallel.attach(self.runner, on_death=self.fail)
        else:
            # Kernels compile now rather than inside the first requests of each step shape or batch size; any
            # compiled later is logged. Tensor-parallel ranks run in lockstep, collectives inside: lazily, when
            # steps reach them all.
            triton_kernels = cuda and self.fused
            with starting_up():
                if triton_kernels:
                    self.runner.warm_prefill(self.max_num_seqs)
                if self.runner.graphs is not None:
                    # Routing on and the prefix cache off: a step in which no request asks for routing replays
                    # graphs without the capture, whose kernels are other variants (the router's and route's
                    # CAPTURE=False): captured now too, or the first such step would compile them (about a second
                    # at real shapes).
                    routing = self.runner.capture_buf is not None
                    for capture in (True, False) if routing and not keep_rows else (routing,):
                        self.runner.graphs.capture_all(capture=capture)
                        if self.runner.prefill_graphs is not None:
                            self.runner.prefill_graphs.capture_all(capture=capture)
            if triton_kernels:
                log_late_compiles()

    def _graphs_description(self, graphs_off: str | None) -> str:
        r = self.runner
        if graphs_off or not r.graphs_on:
            return f"off ({graphs_off or 'max_cudagraph_capture_size=0'})"
        return f"for decode batches up to {r.graph_max_batch}" + (
            f" and prefill steps up to {r.max_prefill_graph_tokens} tokens" if r.prefill_graphs is not None else "")

    def _graphs_off_reason(self, model: torch.nn.Module) -> str | None:
        """Why decode steps run eagerly, or None when they replay CUDA graphs."""
        if self.device.type != "cuda":
            return "not on CUDA"
        if self.ecfg.enforce_eager:
            return "enforce_eager"
        return model.graph_unsafe_reason()

    @property
    def capture_buf(self) -> torch.Tensor | None:
        return self.runner.capture_buf

    @property
    def graphs(self):
        return self.runner.graphs

    @property
    def overlap(self) -> bool:
        return self.runner.overlap

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
        limit = self.max_model_len
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
            if len(self.scheduler.waiting) + len(self._held) + len(self._inbox) + len(reqs) > self.ecfg.max_waiting:
                raise EngineOverloadedError(
                    f"the engine's waiting queue is full ({self.ecfg.max_waiting} requests); retry later"
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
                "waiting": len(self.scheduler.waiting) + len(self._held) + len(self._inbox),
                "num_blocks": b.num_blocks,
                "block_size": b.block_size,  # tokens per block (the prefix cache reuses whole blocks)
                "free_blocks": b.num_free,
                "cached_blocks": b.num_cached,
                "kv_cache_usage": b.usage(),
                "num_preemptions": self.scheduler.num_preemptions,
                "prefix_cache_queries": b.query_tokens,
                "prefix_cache_hits": b.hit_tokens,
                "steps": self.num_steps,
                "overlapped_steps": self.num_followed,
            }

    # ---------------------------------------------------------------- engine thread

    def _loop(self) -> None:
        try:
            while True:
                with self._cv:
                    while not (self._stop or self._inbox or self._controls or self._inflight or
                               self._failure is not None or (self.can_run and self.scheduler.has_work())):
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
            seqs = list(self.scheduler.running) + list(self.scheduler.waiting) + list(self._held)
            seqs += [item for kind, item in self._inbox if kind == "add"]
            controls = list(self._controls) + [item for kind, item in self._inbox if kind == "control"]
            self._inbox.clear()
            self._controls.clear()
            self._held.clear()
            self._inflight = None
        for seq in seqs:
            self.scheduler.finish(seq, "error", self._emit, error=message)
        for c in controls:
            if c.future.set_running_or_notify_cancel():
                c.future.set_exception(EngineStoppedError(message))

    def step(self) -> bool:
        """Run one step; returns False when there was nothing to do."""
        self._drain_inbox()
        if self._controls:
            self._run_controls()
        if not self.can_run:
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
        return self.keep_rows or any(s.req.return_routed_experts or s.req.return_routed_weights
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
                self._controls.append(item)
            elif kind == "add":
                (self._held.append if self._controls else self.scheduler.add)(item)
            else:
                seq = self.scheduler.find(item) or next((s for s in self._held if s.request_id == item), None)
                if seq in self._held:
                    self._held.remove(seq)
                if seq is not None:
                    self.scheduler.finish(seq, "abort", self._emit)

    def _emit(self, seq: Sequence, out: RequestOutput) -> None:
        out.weight_version = self.weight_version  # the weights that produced this output
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

    # ---------------------------------------------------------------- control operations (RL rollout lifecycle)

    @property
    def can_run(self) -> bool:
        """Whether steps may run: not paused, and no memory released."""
        return not self.paused and not self.released

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

    def _run_controls(self) -> None:
        """Run the pending controls in order; a draining one waits (steps go on) while requests submitted
        before it are unfinished and steps can run. Then the requests held behind them join the queue."""
        if self._inflight is not None:  # nothing changes under a step in flight
            self._complete(self._inflight)
            self._inflight = None
        while self._controls:
            c = self._controls[0]
            if c.abort:
                for seq in list(self.scheduler.running) + list(self.scheduler.waiting):
                    self.scheduler.finish(seq, "abort", self._emit)
                c.abort = False
            if c.drain and self.can_run and self.scheduler.has_work():
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
            self.scheduler.add(self._held.popleft())
