"""A stand-in for the engine, for benchmarks and tests of the serving path alone (never used by default).

``StandInEngine`` has the public API of :class:`moe_engine.engine.Engine` that the Triton backend uses (``start``,
``add_request(s)``, ``abort``, ``stats``, ``lifecycle``, ``dead``, ...) and runs a real engine thread with a real
step loop: it admits requests up to ``max_num_seqs``, and each step hands every running request a
:class:`RequestOutput` through its callback, exactly as the engine does (a prompt's first step: one token and the
routing rows of the prompt from ``routed_experts_prompt_start``; each later step: one token and one row). What it
does not do is compute: tokens and expert ids are a cheap function of the request's seed and the position, so a
client can check every token and every row it receives (:func:`standin_tokens`, :func:`standin_rows`), and a step
takes no time unless ``step_interval_s`` asks for it (the pace of a GPU: 17 ms a step is the Qwen3-30B-A3B shape's
decode of 64 sequences on an H200). It is selected by the backend's ``standin_engine`` parameter (``moe-serve
--standin-engine JSON``, a hidden flag) and loads no weights: the checkpoint directory gives only the config (the
routing shape: layers, experts, top-k) and the tokenizer.

Measures the path around the engine at GPU rates on a machine without a GPU:
``loadtest/bench/bench_serving_path.py``.
"""
from __future__ import annotations

import collections
import itertools
import logging
import threading
import time
from concurrent.futures import Future

import numpy as np

from .config import MoEConfig
from .core.sequence import Request, RequestOutput
from .engine_config import EngineConfig
from .errors import EngineOverloadedError, EngineStoppedError, InvalidRequestError

log = logging.getLogger(__name__)

ROW_PERIOD = 4096  # rows repeat with the position modulo this (a table of that many rows, built once)
FIRST_TOKEN = 3  # tokens are drawn from [FIRST_TOKEN, vocab): clear of the usual special ids 0-2


def standin_tokens(seed: int | None, start: int, count: int, vocab_size: int) -> list[int]:
    """The tokens at positions ``start .. start + count - 1`` of a request with ``seed`` (None counts as 0)."""
    s = (seed or 0) % 1_000_003
    span = vocab_size - FIRST_TOKEN
    return [FIRST_TOKEN + (s * 7919 + p * 104_729) % span for p in range(start, start + count)]


def standin_row_table(num_layers: int, top_k: int, num_experts: int) -> np.ndarray:
    """uint16 [ROW_PERIOD, num_layers, top_k]: the routing of a token at position p is row p % ROW_PERIOD; a row's
    k ids are distinct (spread over the experts as a balanced router spreads them)."""
    p = np.arange(ROW_PERIOD, dtype=np.int64)[:, None, None]
    layer = np.arange(num_layers, dtype=np.int64)[None, :, None]
    k = np.arange(top_k, dtype=np.int64)[None, None, :]
    stride = max(1, num_experts // top_k)
    ids = ((p * 13 + layer * 7) % num_experts + k * stride) % num_experts
    return ids.astype(np.uint16)


def standin_rows(table: np.ndarray, start: int, stop: int) -> np.ndarray:
    """Rows of positions ``start .. stop - 1`` (a copy)."""
    return table[np.arange(start, stop) % ROW_PERIOD]


class _Lifecycle:
    """What the backend reads of the engine's RL lifecycle; control operations other than the reads are refused."""

    def __init__(self) -> None:
        self.weight_version = "standin"
        self.paused = False
        self.released: set = set()
        self.num_held = 0

    @staticmethod
    def _done(result: dict) -> Future:
        f: Future = Future()
        f.set_result(result)
        return f

    def get_weight_version(self) -> Future:
        return self._done({"message": f"weight version {self.weight_version!r}"})

    def get_engine_info(self) -> Future:
        return self._done({"message": "stand-in engine (no KV cache)", "kv_block_size": None, "num_kv_blocks": 0,
                           "deterministic_inference": False})

    def is_sleeping(self) -> Future:
        return self._done({"message": "released: nothing", "is_sleeping": False})

    def __getattr__(self, op: str):
        def refuse(**_: object) -> Future:
            raise InvalidRequestError(f"control {op}: not supported by the stand-in engine", param="op")

        return refuse


class _Seq:
    __slots__ = ("req", "n_prompt", "pos", "emitted", "first")

    def __init__(self, req: Request) -> None:
        self.req = req
        self.n_prompt = len(req.prompt_token_ids)
        self.pos = self.n_prompt  # position of the next token to sample
        self.emitted = 0
        self.first = True


class StandInEngine:
    """Engine-shaped, computes nothing (module docstring). ``step_interval_s``: the least time between two steps'
    starts (0: as fast as the loop goes)."""

    def __init__(self, cfg: MoEConfig, engine_cfg: EngineConfig | None = None, step_interval_s: float = 0.0):
        self.cfg = cfg
        self.engine_config = engine_cfg or EngineConfig()
        self.max_num_seqs = self.engine_config.max_num_seqs or 256
        self.max_model_len = self.engine_config.model_len(cfg)
        self.max_waiting = self.engine_config.max_waiting
        self.step_interval_s = float(step_interval_s)
        self.table = standin_row_table(cfg.num_hidden_layers, cfg.num_experts_per_tok, cfg.num_experts)
        self.lifecycle = _Lifecycle()
        self.dead: BaseException | None = None
        self.num_steps = 0
        self._cv = threading.Condition()
        self._inbox: collections.deque = collections.deque()
        self._waiting: collections.deque = collections.deque()
        self._running: dict[str, _Seq] = {}
        self._known: set[str] = set()
        self._stop = False
        self._thread: threading.Thread | None = None
        self._ids = itertools.count()
        self._eos = frozenset(cfg.eos_token_ids)
        log.warning("STAND-IN ENGINE: no model runs; tokens and routed experts are synthetic (%d layers x top-%d of "
                    "%d experts), a step every %.1f ms at most", cfg.num_hidden_layers, cfg.num_experts_per_tok,
                    cfg.num_experts, 1000 * self.step_interval_s)

    # ------------------------------------------------------------ public API (any thread)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="moe-standin-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)

    def new_request_id(self) -> str:
        return f"req-{next(self._ids)}"

    def add_request(self, req: Request) -> None:
        self.add_requests([req])

    def add_requests(self, reqs: list[Request]) -> None:
        for req in reqs:
            n = len(req.prompt_token_ids)
            if n == 0:
                raise InvalidRequestError("input_ids: the prompt is empty", param="input_ids")
            req.sampling.validate(self.cfg.vocab_size)
            if n + req.sampling.max_tokens > self.max_model_len:
                raise InvalidRequestError(f"this model's maximum context length is {self.max_model_len} tokens",
                                          param="max_tokens")
            if not 0 <= req.routed_experts_prompt_start < n:
                raise InvalidRequestError("routed_experts_prompt_start: out of range",
                                          param="routed_experts_prompt_start")
        with self._cv:
            if self._stop or self.dead is not None:
                raise EngineStoppedError("the engine is not running")
            if len(self._waiting) + len(self._inbox) + len(reqs) > self.max_waiting:
                raise EngineOverloadedError(f"the engine's waiting queue is full ({self.max_waiting} requests)")
            for req in reqs:
                if req.request_id in self._known:
                    raise InvalidRequestError(f"request id {req.request_id!r} is already in use", param="request_id")
                self._known.add(req.request_id)
                self._inbox.append(("add", req))
            self._cv.notify_all()

    def abort(self, request_id: str) -> None:
        with self._cv:
            self._inbox.append(("abort", request_id))
            self._cv.notify_all()

    def stats(self) -> dict:
        with self._cv:
            return {"running": len(self._running), "waiting": len(self._waiting) + len(self._inbox),
                    "num_blocks": 0, "block_size": 0, "free_blocks": 0, "cached_blocks": 0, "kv_cache_usage": 0.0,
                    "num_preemptions": 0, "prefix_cache_queries": 0, "prefix_cache_hits": 0,
                    "steps": self.num_steps, "overlapped_steps": 0}

    # The expert load (core/expert_load.py) is off: the stand-in captures nothing.
    def expert_load_gauges(self) -> dict:
        return {}

    def expert_load_summary(self) -> dict:
        return {"enabled": False, "message": "stand-in engine: no expert load", "stats": self.stats()}

    def __getattr__(self, op: str):
        if op.endswith("_expert_distribution_record"):  # SGLang's recorder calls: refused, as with the load off
            def refuse(**_: object) -> Future:
                raise InvalidRequestError(f"{op}: the stand-in engine records no expert load", param="op")

            return refuse
        raise AttributeError(op)

    # ------------------------------------------------------------ engine thread

    def _loop(self) -> None:
        next_start = time.monotonic()
        while True:
            with self._cv:
                while not (self._stop or self._inbox or self._running or self._waiting):
                    self._cv.wait()
                    next_start = time.monotonic()
                if self._stop:
                    break
                items = list(self._inbox)
                self._inbox.clear()
            for kind, item in items:
                if kind == "add":
                    self._waiting.append(_Seq(item))
                else:
                    self._abort(item)
            while self._waiting and len(self._running) < self.max_num_seqs:
                seq = self._waiting.popleft()
                self._running[seq.req.request_id] = seq
            if self._running:
                self._step()
            if self.step_interval_s:
                next_start += self.step_interval_s
                delay = next_start - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
                else:
                    next_start = time.monotonic()  # behind: the pace starts again from now
        for seq in list(self._running.values()) + list(self._waiting):
            self._finish(seq, "error", [], None, error="the engine shut down")

    def _abort(self, request_id: str) -> None:
        seq = self._running.pop(request_id, None)
        if seq is None:
            seq = next((s for s in self._waiting if s.req.request_id == request_id), None)
            if seq is None:
                return
            self._waiting.remove(seq)
        self._finish(seq, "abort", [], None)

    def _step(self) -> None:
        self.num_steps += 1
        V, table = self.cfg.vocab_size, self.table
        done = []
        for seq in self._running.values():
            req = seq.req
            sp = req.sampling
            tok = standin_tokens(sp.seed, seq.pos, 1, V)
            rows = None
            if req.return_routed_experts:
                if seq.first:  # the prompt's rows (from prompt_start), as the prefill step hands them out
                    rows = standin_rows(table, req.routed_experts_prompt_start, seq.n_prompt)
                else:  # the row of the token this step forwarded (the one sampled before)
                    p = (seq.pos - 1) % ROW_PERIOD
                    rows = table[p : p + 1]
            seq.first = False
            seq.pos += 1
            seq.emitted += 1
            reason = None
            if seq.emitted >= sp.max_tokens:
                reason = "length"
            elif seq.emitted >= sp.min_tokens and ((tok[0] in self._eos and not sp.ignore_eos)
                                                    or tok[0] in sp.stop_token_ids):
                reason = "stop"
            if reason is not None:
                done.append((seq, tok, rows, reason))
                continue
            self._emit(req, RequestOutput(req.request_id, tok, rows, False, None, seq.n_prompt, seq.emitted))
        for seq, tok, rows, reason in done:
            del self._running[seq.req.request_id]
            self._finish(seq, reason, tok, rows)

    def _finish(self, seq: _Seq, reason: str, tok: list[int], rows, error: str | None = None) -> None:
        with self._cv:
            self._known.discard(seq.req.request_id)
        self._emit(seq.req, RequestOutput(seq.req.request_id, tok, rows, True, reason, seq.n_prompt, seq.emitted,
                                          error=error))

    def _emit(self, req: Request, out: RequestOutput) -> None:
        out.weight_version = self.lifecycle.weight_version
        if req.on_output is not None:
            try:
                req.on_output(out)
            except Exception:
                log.exception("output callback of %s failed", req.request_id)
