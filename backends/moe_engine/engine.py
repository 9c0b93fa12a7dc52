"""The serving engine: request queue, continuous-batching scheduler, step loop.

Every step runs one forward over the tokens of many sequences: one decode
token for each running sequence, plus prefill chunks of new sequences up to
the step's token budget (long prompts are chunked over several steps). Each
sequence owns a KV-cache slot for its whole life.

Routing capture: the model writes each MoE layer's top-k ids into a step
buffer ``[max_num_batched_tokens, num_hidden_layers, top_k]``; after the
forward the used rows travel to the host in the step's one transfer, with the
sampled tokens, and are sliced per request. With no request wanting routing in
a step, the model gets no buffer and does no capture work.

On CUDA, decode-only steps replay CUDA graphs (cuda_graphs.py), and decode is
overlapped: step i+1 is launched from step i's samples on the device before
step i's results are handed out (``step``), so the host's per-step work runs
while the GPU computes.

Outputs: each request has a callback that receives a ``RequestOutput`` per
step it took part in (new tokens, new routing rows), the last one with
``finished=True`` and a finish reason. Callbacks run on the engine thread and
must not block.
"""
from __future__ import annotations

import collections
import heapq
import itertools
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from .attention import ForwardBatch
from .config import MoEConfig
from .cuda_graphs import DecodeGraphs
from .errors import EngineOverloadedError, EngineStoppedError, InvalidRequestError
from .kv_cache import KVCache, slots_for_budget
from .sampling import SamplingParams, SamplingState, compute_logprobs, make_state, sample

log = logging.getLogger(__name__)


@dataclass
class EngineConfig:
    max_num_seqs: int = 64
    max_model_len: int = 2048
    # Per step: decode tokens + prefill chunk tokens. None: 2048 on CUDA (a step costs about the same host time
    # at any size there, so bigger prefill chunks mean fewer steps), 512 on CPU (a step's time grows with its
    # tokens, and running requests wait for it).
    max_num_batched_tokens: int | None = None
    kv_cache_bytes: int | None = None  # None: room for max_num_seqs full sequences
    max_waiting: int = 1024  # waiting-queue bound; beyond it add_request raises EngineOverloadedError
    enable_routed_experts: bool = True  # server-wide switch; off = never any capture work
    enforce_eager: bool = False  # CUDA: no CUDA graphs for decode steps (debugging, or to save their memory)
    # Launch decode step i+1 before handing out step i's results (None: on CUDA, where the GPU then works while
    # the host does; on CPU the forward runs on the host, so there is nothing to overlap).
    overlap_decode: bool | None = None
    # Fused Triton kernels for norms, rotary, expert bookkeeping and the KV write (kernels.py): same results bit
    # for bit, a third of the kernel launches. None: on CUDA when Triton is installed (CUDA builds of torch).
    # The switch is the model's: engines sharing a model share it.
    fused_kernels: bool | None = None


@dataclass
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    routed_experts: np.ndarray | None  # [rows, num_hidden_layers, top_k] uint16, rows since the last output
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | "error"
    num_prompt_tokens: int
    num_output_tokens: int
    logprobs: list[float] | None = None  # chosen tokens' logprobs, one per new token
    top_logprob_ids: np.ndarray | None = None  # [new tokens, N] int64
    top_logprobs: np.ndarray | None = None  # [new tokens, N] float32
    error: str | None = None


OutputCallback = Callable[[RequestOutput], None]


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    return_routed_experts: bool = True
    routed_experts_prompt_start: int = 0
    on_output: OutputCallback | None = None


@dataclass
class _Sequence:
    req: Request
    sampler: SamplingState
    tokens: list[int]  # prompt + generated
    num_prompt: int
    slot: int = -1
    num_computed: int = 0  # tokens whose KV is in the cache (= rows forwarded)
    num_output: int = 0
    arrival: float = field(default_factory=time.monotonic)

    @property
    def in_prefill(self) -> bool:
        return self.num_computed < self.num_prompt


@dataclass
class _Transfer:
    """A step's tokens and routing rows on their way to the host (CUDA: a pinned buffer + an event)."""

    n: int  # sampled tokens
    rows: int  # routing rows (0: none fetched)
    host: np.ndarray | None = None  # CUDA: [S + S*L*K] int32 view of the pinned buffer
    event: torch.cuda.Event | None = None
    tokens: list[int] | None = None  # CPU: the results themselves
    routing: np.ndarray | None = None


@dataclass
class _Launched:
    """A step whose forward and sampling are queued; its results are handed out by ``_complete``."""

    plan: list[tuple[_Sequence, int]]
    context: list[int]  # tokens in each sequence's cache before the step
    samplers: list[int]  # plan indices that sample a token this step
    tokens: torch.Tensor | None  # [N] sampled tokens on the device (input of an overlapped next step)
    lp: list | None
    transfer: _Transfer


class Engine:
    def __init__(self, model: torch.nn.Module, cfg: MoEConfig, engine_cfg: EngineConfig | None = None):
        self.model = model
        self.cfg = cfg
        self.ecfg = ec = engine_cfg or EngineConfig()
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        if ec.max_model_len > cfg.max_position_embeddings:
            log.warning(
                "max_model_len %d exceeds the model's max_position_embeddings %d",
                ec.max_model_len,
                cfg.max_position_embeddings,
            )
        specs = model.kv_layout()
        num_slots = slots_for_budget(specs, ec.max_model_len, self.dtype, ec.max_num_seqs, ec.kv_cache_bytes)
        self.fused = model.use_fused_kernels(self.device.type == "cuda" if ec.fused_kernels is None else ec.fused_kernels)
        graphs_off = self._graphs_off_reason(model)
        # CUDA graphs pad a decode step to a bucket size; padding rows write into one spare slot.
        self.kv = KVCache(specs, num_slots + (graphs_off is None), ec.max_model_len, self.dtype, self.device)
        self.max_running = num_slots
        step_budget = ec.max_num_batched_tokens or (2048 if self.device.type == "cuda" else 512)
        self.step_tokens = max(step_budget, num_slots)  # every running seq can decode
        self.eos_ids = frozenset(cfg.eos_token_ids)
        L, K = self.routing_shape = cfg.num_hidden_layers, cfg.num_experts_per_tok
        # The step's outputs in one int32 buffer: [step_tokens] sampled tokens, then the capture buffer
        # [step_tokens, L, K] that each MoE layer writes. Preallocated (a decode step allocates nothing; graphs
        # capture its address). Dense layers' columns are never written and stay 0; metadata says which layers
        # are MoE. On CUDA a step's tokens and first T routing rows are one contiguous prefix, fetched with a
        # single copy into pinned memory: capture adds bytes to the step's one transfer, not a transfer.
        S = self.step_tokens
        capture_numel = S * L * K if ec.enable_routed_experts else 0
        self.step_out = torch.zeros(S + capture_numel, dtype=torch.int32, device=self.device)
        self.capture_buf = self.step_out[S:].view(S, L, K) if ec.enable_routed_experts else None
        cuda = self.device.type == "cuda"
        # Two pinned host copies (an overlapped step's transfer lands while the previous one is read), with
        # numpy views (slicing numpy costs a fraction of slicing torch) and an event each.
        self.step_out_host = (
            [torch.empty(S + capture_numel, dtype=torch.int32, pin_memory=True) for _ in range(2)] if cuda else None
        )
        self._host_np = [h.numpy() for h in self.step_out_host] if cuda else None
        self._events = [torch.cuda.Event() for _ in range(2)] if cuda else None
        self._parity = 0
        self.overlap = cuda if ec.overlap_decode is None else ec.overlap_decode
        self._inflight: _Launched | None = None  # a decode step launched, results not yet handed out
        self.graphs = (
            DecodeGraphs(model, self.kv, pad_slot=num_slots, max_batch=num_slots, max_model_len=ec.max_model_len,
                         capture_buf=self.capture_buf)
            if graphs_off is None
            else None
        )
        log.info(
            "engine: %d slots x %d tokens, KV cache %.1f MiB, %d tokens/step, routed experts %s, device %s, %s, "
            "CUDA graphs %s, fused kernels %s",
            num_slots,
            ec.max_model_len,
            self.kv.nbytes / 2**20,
            self.step_tokens,
            "on" if ec.enable_routed_experts else "off",
            self.device,
            self.dtype,
            f"off ({graphs_off})" if graphs_off else f"for decode batches up to {num_slots}",
            "on" if self.fused else "off",
        )
        self._free_slots = list(range(num_slots))  # min-heap: the lowest free slot first (contiguous cache views)
        self._waiting: collections.deque[_Sequence] = collections.deque()
        self._running: dict[str, _Sequence] = {}  # insertion order = admission order
        self._inbox: collections.deque = collections.deque()  # ("add", seq) | ("abort", id), from any thread
        self._known_ids: set[str] = set()
        self._cv = threading.Condition()
        self._stop = False
        self._thread: threading.Thread | None = None
        self._ids = itertools.count()
        self.dead: BaseException | None = None
        self.num_steps = 0

    def _graphs_off_reason(self, model: torch.nn.Module) -> str | None:
        """Why decode steps run eagerly, or None when they replay CUDA graphs."""
        if self.device.type != "cuda":
            return "not on CUDA"
        if self.ecfg.enforce_eager:
            return "enforce_eager"
        return model.graph_unsafe_reason()

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

    def new_request_id(self) -> str:
        return f"req-{next(self._ids)}"

    def validate(self, req: Request) -> None:
        """Raise InvalidRequestError naming the problem; cheap, runs in the caller's thread."""
        n = len(req.prompt_token_ids)
        if n == 0:
            raise InvalidRequestError("input_ids: the prompt is empty", param="input_ids")
        V = self.cfg.vocab_size
        bad = [t for t in req.prompt_token_ids if not 0 <= t < V]
        if bad:
            raise InvalidRequestError(
                f"input_ids: token id {bad[0]} is outside the vocabulary [0, {V})", param="input_ids"
            )
        req.sampling.validate(V)
        limit = self.ecfg.max_model_len
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

    def add_request(self, req: Request) -> None:
        self.validate(req)
        with self._cv:
            if self.dead is not None or self._stop:
                raise EngineStoppedError("the engine is not running")
            if req.request_id in self._known_ids:
                raise InvalidRequestError(f"request id {req.request_id!r} is already in use", param="request_id")
            if len(self._waiting) + len(self._inbox) >= self.ecfg.max_waiting:
                raise EngineOverloadedError(
                    f"the engine's waiting queue is full ({self.ecfg.max_waiting} requests); retry later"
                )
            self._known_ids.add(req.request_id)
            seq = _Sequence(
                req=req,
                sampler=make_state(req.sampling, self.device),
                tokens=list(req.prompt_token_ids),
                num_prompt=len(req.prompt_token_ids),
            )
            self._inbox.append(("add", seq))
            self._cv.notify_all()

    def abort(self, request_id: str) -> None:
        """Abort a request; its slot and cache are freed at the next step and it ends with "abort"."""
        with self._cv:
            self._inbox.append(("abort", request_id))
            self._cv.notify_all()

    @property
    def num_unfinished(self) -> int:
        with self._cv:
            return len(self._known_ids)

    def stats(self) -> dict:
        with self._cv:
            return {
                "running": len(self._running),
                "waiting": len(self._waiting) + len(self._inbox),
                "free_slots": len(self._free_slots),
                "steps": self.num_steps,
            }

    # ---------------------------------------------------------------- engine thread

    def _loop(self) -> None:
        try:
            while True:
                with self._cv:
                    while (
                        not self._stop and not self._inbox and not self._waiting and not self._running
                        and self._inflight is None
                    ):
                        self._cv.wait()
                    if self._stop:
                        break
                self.step()
        except BaseException as exc:  # the loop must never die silently
            log.exception("engine loop died")
            self.dead = exc
            self._fail_all(f"engine failure: {exc!r}")
        finally:
            self._fail_all("the engine shut down")

    def _fail_all(self, message: str) -> None:
        with self._cv:
            seqs = list(self._running.values()) + list(self._waiting)
            seqs += [item for kind, item in self._inbox if kind == "add"]
            self._running.clear()
            self._waiting.clear()
            self._inbox.clear()
            self._inflight = None
        for seq in seqs:
            self._finish(seq, "error", error=message)

    def step(self) -> bool:
        """Run one scheduler step; returns False when there was nothing to do.

        Overlapped decode (CUDA by default): a decode step is left in flight, and the next call launches the
        following decode step from its sampled tokens on the device *before* reading its results, so the
        GPU runs the next forward while the host hands out this one's tokens and routing rows."""
        self._drain_inbox()
        self._admit()
        prev, self._inflight = self._inflight, None
        if prev is not None:
            following = self._launch_next_decode(prev)
            self._complete(prev)
            if following is not None:
                self._keep_or_complete(following)
                return True
        plan = self._schedule()
        if not plan:
            return prev is not None
        self._keep_or_complete(self._launch(plan, [s.num_computed for s, _ in plan]))
        return True

    def _keep_or_complete(self, launched: _Launched) -> None:
        """Leave a launched step in flight when the next one can follow it on the device, else finish it now."""
        self.num_steps += 1
        if self._can_overlap(launched):
            self._inflight = launched
        else:
            self._complete(launched)

    def _drain_inbox(self) -> None:
        with self._cv:
            items = list(self._inbox)
            self._inbox.clear()
        for kind, item in items:
            if kind == "add":
                self._waiting.append(item)
                continue
            seq = self._running.get(item) or next((s for s in self._waiting if s.req.request_id == item), None)
            if seq is not None:
                if seq in self._waiting:
                    self._waiting.remove(seq)
                self._finish(seq, "abort")

    def _admit(self) -> None:
        while self._waiting and self._free_slots:
            seq = self._waiting.popleft()
            seq.slot = heapq.heappop(self._free_slots)
            self._running[seq.req.request_id] = seq

    def _schedule(self) -> list[tuple[_Sequence, int]]:
        """(sequence, tokens this step): all decodes first, then prefill chunks within the budget."""
        budget = self.step_tokens
        plan = []
        for seq in self._running.values():
            if not seq.in_prefill:
                plan.append((seq, 1))
                budget -= 1
        # Ascending slots within decodes and within prefills: contiguous slots read the cache as a view.
        plan.sort(key=lambda p: p[0].slot)
        pre = []
        for seq in self._running.values():
            if seq.in_prefill and budget > 0:
                n = min(seq.num_prompt - seq.num_computed, budget)
                pre.append((seq, n))
                budget -= n
        pre.sort(key=lambda p: p[0].slot)
        return plan + pre

    @torch.inference_mode()
    def _launch(
        self, plan: list[tuple[_Sequence, int]], context: list[int], input_ids: torch.Tensor | None = None
    ) -> _Launched:
        """Queue a step's forward, sampling and device->host transfer; returns before the GPU finishes.

        ``context``: tokens already in each sequence's cache (where its step starts). ``input_ids``: the step's
        token ids on the device (an overlapped decode step, whose inputs the previous step sampled), else the
        ids are read from the sequences."""
        T = sum(n for _, n in plan)
        if input_ids is None:
            ids: list[int] = []
            for (seq, n), c in zip(plan, context):
                ids.extend(seq.tokens[c : c + n])
        want_routing = self.capture_buf is not None and any(s.req.return_routed_experts for s, _ in plan)
        slots = [s.slot for s, _ in plan]
        graph_logits = None  # [T, V]: a one-token-per-sequence step replayed from a CUDA graph
        if self.graphs is not None and T == len(plan) and self.graphs.supports(T, max(context) + 1):
            graph_logits = self.graphs.run(ids if input_ids is None else input_ids, context, slots, want_routing)
        else:
            batch = ForwardBatch.build(slots, context, [n for _, n in plan], self.device)
            if input_ids is None:
                input_ids = torch.tensor(ids, dtype=torch.long, device=self.device)
            capture = self.capture_buf[:T] if want_routing else None
            hidden = self.model(input_ids, batch, self.kv, capture)  # [T, H]

        # Sequences that produce a token this step: decoding, or finishing their prompt now.
        samplers = [i for i, ((s, n), c) in enumerate(zip(plan, context)) if c + n >= s.num_prompt]
        tokens = None
        lp = None
        if samplers:
            if graph_logits is not None:
                logits = graph_logits if len(samplers) == T else graph_logits[samplers]
            else:
                logits = self.model.compute_logits(hidden[batch.last_token_index[samplers]])  # [N, V] float32
            states = [plan[i][0].sampler for i in samplers]
            tokens = sample(logits, states)  # [N] long, on the device
            top_n = max((st.params.logprobs for st in states if st.params.logprobs is not None), default=-1)
            if top_n >= 0:
                lp = [t.cpu() if t is not None else None for t in compute_logprobs(logits, tokens, top_n)]
        return _Launched(plan, context, samplers, tokens, lp, self._transfer(tokens, T if want_routing else 0))

    def _transfer(self, tokens: torch.Tensor | None, rows: int) -> _Transfer:
        """Queue the step's device->host transfer: sampled tokens [N] and the first ``rows`` routing rows
        [rows, L, K], one copy into one of two pinned buffers (one step may be in flight while the previous
        one's results are read)."""
        n = 0 if tokens is None else tokens.shape[0]
        S, (L, K) = self.step_tokens, self.routing_shape
        routing_end = S + rows * L * K  # the first `rows` rows of the capture buffer
        if self.step_out_host is None:  # CPU: done already; copy out before the next step reuses the buffer
            routing = self.step_out[S:routing_end].numpy().reshape(rows, L, K).astype(np.uint16) if rows else None
            return _Transfer(n, rows, tokens=tokens.tolist() if n else [], routing=routing)
        self._parity ^= 1
        host, event = self.step_out_host[self._parity], self._events[self._parity]
        if n:
            self.step_out[:n].copy_(tokens)
        end = routing_end if rows else n
        if end:
            host[:end].copy_(self.step_out[:end], non_blocking=True)
        event.record()
        return _Transfer(n, rows, host=self._host_np[self._parity], event=event)

    def _results(self, tr: _Transfer) -> tuple[list[int], np.ndarray | None]:
        """Wait for a step's transfer: (tokens, routing rows [rows, L, K] uint16 or None)."""
        if tr.host is None:
            return tr.tokens, tr.routing
        tr.event.synchronize()
        S, (L, K) = self.step_tokens, self.routing_shape
        # One conversion for the step, into a fresh array: requests get views of it (no per-request copy).
        routing = tr.host[S : S + tr.rows * L * K].reshape(tr.rows, L, K).astype(np.uint16) if tr.rows else None
        return tr.host[: tr.n].tolist(), routing

    def _complete(self, step: _Launched) -> None:
        """Hand a launched step's results to its sequences: tokens, routing rows, stops, outputs."""
        plan, context = step.plan, step.context
        new_tokens, routing = self._results(step.transfer)
        lp = step.lp
        # A step of one token per sequence (decode) hands out one row each: views made in one C-level pass.
        row_views = list(routing[:, None]) if routing is not None and len(routing) == len(plan) else None
        sampled = dict(zip(step.samplers, range(len(step.samplers))))
        offset = 0
        for i, (seq, n) in enumerate(plan):
            c = context[i]
            offset += n
            if seq.slot < 0 or seq.num_computed != c:
                continue  # finished (or aborted) while this overlapped step was in flight: its row is dropped
            rows_np = None
            if routing is not None and seq.req.return_routed_experts:
                first = max(c, seq.req.routed_experts_prompt_start)
                last = c + n
                if row_views is not None:
                    rows_np = row_views[i]
                else:
                    rows_np = routing[offset - n + first - c : offset]
                if first >= last:
                    rows_np = rows_np[:0]
            seq.num_computed += n
            tok: list[int] = []
            out = RequestOutput(
                request_id=seq.req.request_id,
                new_token_ids=tok,
                routed_experts=rows_np,
                finished=False,
                finish_reason=None,
                num_prompt_tokens=seq.num_prompt,
                num_output_tokens=seq.num_output,
            )
            if i in sampled:
                j = sampled[i]
                t = new_tokens[j]
                tok.append(t)
                seq.tokens.append(t)
                seq.num_output += 1
                out.num_output_tokens = seq.num_output
                n_lp = seq.sampler.params.logprobs
                if lp is not None and n_lp is not None:
                    out.logprobs = [float(lp[0][j])]
                    if n_lp > 0:
                        out.top_logprob_ids = lp[1][j : j + 1, :n_lp].numpy()
                        out.top_logprobs = lp[2][j : j + 1, :n_lp].numpy()
                reason = self._stop_reason(seq, t)
                if reason is not None:
                    self._finish(seq, reason, last=out)
                    continue
            self._emit(seq, out)

    # ---------------------------------------------------------------- overlapped decode

    def _can_overlap(self, step: _Launched) -> bool:
        """Whether the next step may be launched from this one's sampled tokens before its results are read:
        a decode step (every sequence samples one token, no logprobs) in which no sequence can reach a length
        limit, so every one of them would decode again unless it stops on a token."""
        if not self.overlap or step.lp is not None or len(step.samplers) != len(step.plan):
            return False
        limit = self.ecfg.max_model_len
        for (seq, n), c in zip(step.plan, step.context):
            if n != 1 or seq.num_output + 1 >= seq.sampler.params.max_tokens or c + 2 >= limit:
                return False
        return True

    def _launch_next_decode(self, prev: _Launched) -> _Launched | None:
        """Launch the decode step that follows ``prev`` (not yet completed), fed by its sampled tokens on the
        device, if the running batch is still exactly prev's sequences (no arrival, no abort). A sequence that
        stops on prev's token has computed one wasted row in it, dropped when the step completes; its KV
        write lands in its own slot, past its end."""
        if len(self._running) != len(prev.plan) or any(seq.slot < 0 for seq, _ in prev.plan):
            return None
        return self._launch(prev.plan, [c + 1 for c in prev.context], input_ids=prev.tokens)

    def _stop_reason(self, seq: _Sequence, token: int) -> str | None:
        p = seq.sampler.params
        if seq.num_output >= p.min_tokens:
            if token in p.stop_token_ids:
                return "stop"
            if not p.ignore_eos and token in self.eos_ids:
                return "stop"
        if seq.num_output >= p.max_tokens or len(seq.tokens) >= self.ecfg.max_model_len:
            return "length"
        return None

    def _emit(self, seq: _Sequence, out: RequestOutput) -> None:
        cb = seq.req.on_output
        if cb is None:
            return
        try:
            cb(out)
        except Exception:
            log.exception("output callback of %s failed; aborting it", seq.req.request_id)
            if not out.finished:
                self.abort(seq.req.request_id)

    def _finish(self, seq: _Sequence, reason: str, last: RequestOutput | None = None, error: str | None = None):
        rid = seq.req.request_id
        if self._running.pop(rid, None) is not None:
            heapq.heappush(self._free_slots, seq.slot)
        seq.slot = -1
        with self._cv:
            self._known_ids.discard(rid)
        out = last or RequestOutput(
            request_id=rid,
            new_token_ids=[],
            routed_experts=None,
            finished=True,
            finish_reason=reason,
            num_prompt_tokens=seq.num_prompt,
            num_output_tokens=seq.num_output,
        )
        out.finished, out.finish_reason, out.error = True, reason, error
        self._emit(seq, out)
