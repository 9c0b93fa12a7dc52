"""Triton Python-based backend "moe": a thin adapter between Triton and moe_engine.

- ``execute`` only parses each request, hands it to the engine and returns.
- The engine thread calls back with per-step outputs; they go on a queue that a
  separate response thread drains, so the engine never waits on Triton IPC.
- Streaming requests get one response per step; non-streaming requests get one
  response with everything (routed experts and weights concatenated; prompt
  logprobs, which the engine sends once, on the response that carries them).
  Every request ends with exactly one response that carries
  ``TRITONSERVER_RESPONSE_COMPLETE_FINAL`` (an error response included).
- A request Triton marks cancelled is aborted in the engine and ended with a
  CANCELLED error.
- Every response carries ``weight_version``: the weights that produced its tokens.

Control requests (RL rollout lifecycle: weight updates, pause, release) are control_ops.py's; the engine's gauges on
Triton's /metrics are engine_metrics.py's; where the served weights came from (for a restart) weights_state.py's.
"""
from __future__ import annotations

import faulthandler
import json
import logging
import os
import queue
import sys
import threading
import time
from dataclasses import dataclass, field

import numpy as np
import triton_python_backend_utils as pb_utils

from moe_engine.core.warmup import freeze_start_up_objects
from moe_engine.core.sampling import SamplingParams
from moe_engine.engine import Engine, EngineConfig, Request, RequestOutput
from moe_engine.errors import EngineError, EngineOverloadedError, EngineStoppedError, InvalidRequestError

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # modules beside this file (Triton loads it by path)
from control_ops import ControlOps, ControlReply  # noqa: E402
from engine_metrics import EngineMetrics  # noqa: E402
from weights_state import WeightsState, lost_message  # noqa: E402

log = logging.getLogger("moe_backend")

# How often the response thread asks Triton about cancellations (one IPC call per open request, so not
# too often: under load they compete with the engine thread for the stub's GIL) and refreshes the gauges.
CANCEL_POLL_S = 0.2
# Requests asked per poll at most, round robin: with 256 streams open, 1,280 IPC calls a second would cost the stub
# and tritonserver a tenth of a core; each request is still asked at least every 0.4 s.
CANCEL_POLL_MAX = 128
QUEUE_WAIT_S = 0.05  # longest wait for engine outputs before checking the poll timer
# Engine outputs the response thread takes from its queue at once: everything queued (the bound only keeps a round
# finite). A streaming request's outputs that queued up while the last round was sent go out as one response, so the
# slower Triton's IPC is against the engine, the fewer and larger the responses.
MAX_OUTPUTS_PER_ROUND = 1 << 16
SEND_DUTY = 0.25  # the share of its time the response thread may spend sending (see _response_loop)
PACE_MAX_S = 0.1  # the longest pause between two rounds


@dataclass
class _Pending:
    """Response-side state of one Triton request."""

    sender: object  # pb_utils.InferenceResponseSender
    engine_id: str
    stream: bool
    routing: bool
    weights: bool  # return_routed_weights
    L: int
    K: int
    # Non-streaming requests accumulate here until the final output.
    tokens: list = field(default_factory=list)
    rows: list = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    top_ids: list = field(default_factory=list)
    top_vals: list = field(default_factory=list)
    weight_rows: list = field(default_factory=list)
    prompt_lp: RequestOutput | None = None  # the output that carried the prompt logprobs
    cancelled: bool = False
    first_sent: bool = False  # streaming: whether a response went out already
    held: list = field(default_factory=list)  # streaming: outputs held back until --stream-interval tokens
    held_tokens: int = 0
    outputs: frozenset = frozenset()  # the output names the request asked for (see _requested)


def _param(params: dict, key: str, default: str = "") -> str:
    value = params.get(key, {}).get("string_value", default)
    return value if value != "" else default


def _text(value) -> str:
    """A BYTES input's element as text."""
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def _inputs(request) -> dict:
    """A request's input tensors by name, read once: ``pb_utils.get_input_tensor_by_name`` lists them all again at
    every call, and its 18 lookups were a third of ``execute``'s time (~0.1 ms of ~0.3), which Triton spends one
    request at a time while a batch of new requests waits."""
    return {t.name(): t for t in request.inputs()}


def _optional_scalar(inputs: dict, name, cast):
    t = inputs.get(name)
    if t is None:
        return None
    arr = t.as_numpy().reshape(-1)
    if arr.size != 1:
        raise InvalidRequestError(f"{name}: expected one value, got {arr.size}", param=name)
    return cast(arr[0])


def _rows(chunks: list, p: _Pending, dtype) -> np.ndarray:
    """Per-step row chunks ([rows, L, K] each, or None) -> one contiguous array of ``dtype``."""
    chunks = [c for c in chunks if c is not None and len(c)]
    arr = np.concatenate(chunks) if len(chunks) > 1 else chunks[0] if chunks else np.empty((0, p.L, p.K))
    return np.ascontiguousarray(arr, dtype=dtype)


def _requested(request) -> frozenset:
    """The output names a request asked for. A response must carry only these: the python backend stub (Triton
    2.51) drops the others in ``InferenceResponseSender.send`` after releasing the GIL, so the numpy array behind a
    dropped tensor is freed without the GIL, which corrupts Python's allocator (the stub later dies with SIGSEGV
    in pymalloc, no traceback; fixed upstream in python_backend PR #390). Dropping them here, in Python, is safe."""
    return frozenset(request.requested_output_names())


def _only(tensors: list, wanted: frozenset) -> list:
    return [t for t in tensors if t.name() in wanted]


def _prompt_lp(outs: list[RequestOutput]) -> RequestOutput | None:
    """The output among ``outs`` that carries the prompt logprobs (the engine sets them once)."""
    return next((o for o in outs if o.prompt_logprobs is not None), None)


class TritonPythonModel:
    def initialize(self, args):
        logging.basicConfig(
            level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
        )
        # A crash of this stub (a signal, not an exception) would otherwise leave no trace in Triton's log; the
        # watchdog only sees the process gone. With this, every thread's Python stack goes to stderr first.
        faulthandler.enable(file=sys.stderr, all_threads=True)
        import torch

        from moe_engine.tiny import ensure_tiny_checkpoint

        model_config = json.loads(args["model_config"])
        params = model_config.get("parameters", {})
        checkpoint = _param(params, "checkpoint") or str(ensure_tiny_checkpoint())
        # After a restart: the weights served before it (weights_state.py), not the start-up checkpoint.
        state_file = _param(params, "weights_state_file")
        if state_file and not os.path.isabs(state_file):
            state_file = os.path.join(args["model_repository"], state_file)
        self._weights_state = WeightsState(state_file or None)
        restored = self._weights_state.restored(checkpoint)
        device = _param(params, "device", "auto")
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        dtype = _param(params, "dtype", "auto")
        # Every engine setting arrives as one JSON object (as Triton's vllm_backend takes its engine args);
        # EngineConfig holds the defaults.
        ecfg = EngineConfig.from_json(_param(params, "engine_config", "{}"))
        num_threads = _param(params, "num_threads")
        if num_threads:
            torch.set_num_threads(int(num_threads))
        elif device == "cpu":
            # Leave a core to tritonserver, the API and the response thread: on a 2-core host one engine
            # thread gave 1.5x the throughput of torch's default two (loadtest/reports/loadtest.md)
            torch.set_num_threads(max(1, (os.cpu_count() or 2) - 1))
        log.info("loading %s (dtype=%s, device=%s)", restored.checkpoint, dtype, device)
        t0 = time.monotonic()
        try:
            self._load(restored.checkpoint, dtype, device, ecfg, args, _param(params, "standin_engine"))
        except Exception as exc:
            if restored.checkpoint == checkpoint:
                raise
            # The last checkpoint loaded from disk is gone (a trainer cleaned it up) or broken: the start-up one,
            # refusing generation until weights are pushed again.
            restored.lost = lost_message(restored.weight_version, f"were loaded from {restored.checkpoint}, "
                                                                  f"which cannot be loaded again ({exc})")
            restored.lost_version = restored.weight_version
            log.error("restart: %s", restored.lost)
            restored.weight_version = os.path.basename(os.path.normpath(checkpoint))
            self._load(checkpoint, dtype, device, ecfg, args)
        log.info("loaded %s in %.1f s", self.cfg.architecture, time.monotonic() - t0)
        self.engine.lifecycle.weight_version = restored.weight_version
        self.routing_enabled = ecfg.enable_routed_experts
        # Streaming: a response once this many new tokens are held (the first token and the last response at once),
        # as vLLM's and SGLang's --stream-interval; 1: a response per engine step (steps that queued up while a
        # response was being sent still go out together).
        self.stream_interval = max(1, int(_param(params, "stream_interval", "1")))
        self.send_duty = SEND_DUTY

        self._outputs: queue.SimpleQueue = queue.SimpleQueue()
        self._pending: dict[str, _Pending] = {}
        self._poll_from = 0  # where the next cancellation poll starts (round robin past CANCEL_POLL_MAX)
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._metrics = EngineMetrics(args)
        groups = json.loads(args["model_config"]).get("instance_group", [])
        num_instances = sum(int(g.get("count", 1)) for g in groups) or 1  # > 1: data parallelism
        self._control = ControlOps(self.engine, self._weights_state, num_instances, self._outputs, restored.lost,
                                   restored.lost_version)
        self.engine.start()
        self._responder = threading.Thread(target=self._response_loop, name="moe-responses", daemon=True)
        self._responder.start()
        log.info("garbage collector: %d objects alive after start-up frozen (full collections skip them)",
                 freeze_start_up_objects())

    def _load(self, checkpoint: str, dtype: str, device: str, ecfg: EngineConfig, args: dict,
              standin: str = "") -> None:
        """Build the engine on ``checkpoint`` (refused if a weight is NaN or infinite). ``standin``: benchmarks and
        tests of the serving path only (moe-serve's hidden --standin-engine): the JSON arguments of a
        moe_engine.standin.StandInEngine, which computes nothing and loads no weights."""
        from moe_engine.checkpoint import load_model
        from moe_engine.config import load_config
        from moe_engine.fp8 import all_finite
        from moe_engine.fp8_load import serve_fp8
        from moe_engine.mxfp4_load import serve_mxfp4

        self.cfg = load_config(checkpoint)
        fp8 = serve_fp8(self.cfg, ecfg, device)  # (refuses --quantization fp8 with tensor parallelism)
        if standin:
            from moe_engine.standin import StandInEngine

            self.engine = StandInEngine(self.cfg, ecfg, **json.loads(standin))
        elif ecfg.tensor_parallel_size > 1:  # this instance is rank 0; it starts the other ranks (ranks.py)
            from moe_engine.distributed.ranks import build_parallel_engine

            # KIND_GPU instances (data parallelism) get their first GPU from Triton; rank r uses first + r
            gpu_instance = args.get("model_instance_kind") == "GPU"
            first_gpu = int(args.get("model_instance_device_id") or 0) if gpu_instance else 0
            self.engine = build_parallel_engine(checkpoint, dtype, device, self.cfg, ecfg, first_gpu=first_gpu)
        else:
            if device == "cuda" and args.get("model_instance_kind") == "GPU":
                device = f"cuda:{args.get('model_instance_device_id') or 0}"
            mxfp4 = serve_mxfp4(self.cfg, ecfg, device)  # GPT-OSS MXFP4 experts packed (CUDA, fused kernels)
            model = load_model(checkpoint, dtype=dtype, device=device, fp8=fp8, mxfp4=mxfp4)
            bad = next((n for n, p in model.named_parameters() if p.is_floating_point() and not all_finite(p)), None)
            if bad is not None:
                raise ValueError(f"checkpoint {checkpoint}: tensor {bad!r} holds NaN or infinite values")
            self.engine = Engine(model, self.cfg, ecfg)

    # ------------------------------------------------------------------ request path

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            try:
                inputs = _inputs(request)
                control = inputs.get("control")
                if control is not None:
                    self._control.start(request, control, sender, _requested(request))
                    continue
                self._submit(request, inputs, sender)
            except EngineError as exc:
                # The message starts with its kind, because Triton's stream responses carry only the text:
                # clients (our frontend included) can classify it without guessing from the wording.
                code, kind = pb_utils.TritonError.INVALID_ARG, "invalid request"
                if isinstance(exc, (EngineOverloadedError, EngineStoppedError)):
                    code, kind = pb_utils.TritonError.UNAVAILABLE, "unavailable"
                sender.send(
                    pb_utils.InferenceResponse(error=pb_utils.TritonError(f"{kind}: {exc}", code)),
                    flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL,
                )
            except Exception as exc:  # never let one request take the model down
                log.exception("rejecting a request")
                sender.send(
                    pb_utils.InferenceResponse(error=pb_utils.TritonError(f"internal error: {exc!r}")),
                    flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL,
                )
        return None

    def _submit(self, request, inputs: dict, sender) -> None:
        if self._control.lost is not None:  # after a restart that could not bring the served weights back
            raise EngineStoppedError(f"weights_lost: {self._control.lost}")
        ids_t = inputs.get("input_ids")
        if ids_t is None:
            raise InvalidRequestError("input_ids: missing", param="input_ids")
        prompt = ids_t.as_numpy().reshape(-1).astype(np.int64)  # the engine validates and hashes the array as is
        d = SamplingParams()
        stop_t = inputs.get("stop_token_ids")

        def opt(name, cast, default):
            v = _optional_scalar(inputs, name, cast)
            return default if v is None else v

        top_k = opt("top_k", int, 0)
        logprobs = _optional_scalar(inputs, "logprobs", int)
        sampling = SamplingParams(
            max_tokens=opt("max_tokens", int, d.max_tokens),
            min_tokens=opt("min_tokens", int, 0),
            temperature=opt("temperature", float, d.temperature),
            top_p=opt("top_p", float, d.top_p),
            top_k=0 if top_k == -1 else top_k,
            seed=_optional_scalar(inputs, "seed", int),
            stop_token_ids=tuple(stop_t.as_numpy().reshape(-1).tolist()) if stop_t is not None else (),
            ignore_eos=opt("ignore_eos", bool, False),
            logprobs=None if logprobs is None or logprobs < 0 else logprobs,
        )
        want_routing = opt("return_routed_experts", bool, True) and self.routing_enabled
        want_weights = opt("return_routed_weights", bool, False) and self.routing_enabled
        replay_t = inputs.get("replay_routed_experts")
        engine_id = f"{self.engine.new_request_id()}:{request.request_id()}"
        pending = _Pending(
            sender=sender,
            engine_id=engine_id,
            stream=opt("stream", bool, False),
            routing=want_routing,
            weights=want_weights,
            L=self.cfg.num_hidden_layers,
            K=self.cfg.num_experts_per_tok,
            outputs=_requested(request),
        )
        req = Request(
            request_id=engine_id,
            prompt_token_ids=prompt,
            sampling=sampling,
            # The engine hands out weights with the ids: it captures both when either is asked for.
            return_routed_experts=want_routing or want_weights,
            routed_experts_prompt_start=opt("routed_experts_prompt_start", int, 0),
            replay_routed_experts=replay_t.as_numpy() if replay_t is not None else None,  # the engine checks it
            return_routed_weights=want_weights,
            prompt_logprobs=_optional_scalar(inputs, "prompt_logprobs", int),
            cache_salt=_optional_scalar(inputs, "cache_salt", _text),
            on_output=self._outputs.put,
        )
        with self._lock:
            self._pending[engine_id] = pending
        try:
            self.engine.add_request(req)
        except Exception:
            with self._lock:
                self._pending.pop(engine_id, None)
            raise

    # ------------------------------------------------------------------ response path

    def _response_loop(self) -> None:
        last_poll = time.monotonic()
        carry: list = []  # what a pacing pause took from the queue: the start of the next round
        while not self._stopping.is_set() or self._pending or carry:
            if carry:
                batch, carry = carry, []
            else:
                try:
                    batch = [self._outputs.get(timeout=QUEUE_WAIT_S)]
                except queue.Empty:
                    batch = []
            # Take whatever else is queued: when the engine runs ahead of Triton's IPC, a streaming
            # request's queued steps go out as one response (fewer, larger messages under load).
            while batch and len(batch) < MAX_OUTPUTS_PER_ROUND:
                try:
                    batch.append(self._outputs.get_nowait())
                except queue.Empty:
                    break
            t_round = time.monotonic()
            by_request: dict[str, list[RequestOutput]] = {}
            for out in batch:
                if isinstance(out, ControlReply):
                    try:
                        self._control.send_reply(out)
                    except Exception:
                        log.exception("sending a control reply failed")
                    continue
                by_request.setdefault(out.request_id, []).append(out)
            # finished requests first: their client (an RL rollout's closed loop) waits for nothing else
            for outs in sorted(by_request.values(), key=lambda outs: not outs[-1].finished):
                self._send_outputs(outs)
            if by_request and self.send_duty < 1:
                # Pace the rounds: sending may take at most send_duty of the thread's time. What the engine hands out
                # meanwhile goes out with the next round, several steps per response: when responses cost more (many
                # streams, a busy host, slow readers behind Triton) they get fewer and larger, and the time they
                # take from the engine and the API stays bounded. Under light load a round is short and so is the
                # pause.
                busy = time.monotonic() - t_round
                pause = min(PACE_MAX_S, busy * (1 / self.send_duty - 1))
                if pause > 1e-4:
                    carry = self._pause(pause)
            if time.monotonic() - last_poll >= CANCEL_POLL_S:
                try:
                    self._poll_cancellations()
                    self._metrics.update(self._gauges())
                except Exception:  # the response thread must survive anything
                    log.exception("cancellation/metrics poll failed")
                last_poll = time.monotonic()

    def _send_outputs(self, outs: list[RequestOutput]) -> None:
        try:
            self._on_outputs(outs)
        except Exception:
            log.exception("sending a response failed")

    def _pause(self, seconds: float) -> list:
        """The pacing pause: ``seconds``, cut short by a request's first output (time to first token is not paced)
        or a control reply. What arrives meanwhile is taken from the queue a step's burst at a time and returned, in
        order, for the next round, but for finished requests: each goes out at once, with what the pause held of
        it (a final response would otherwise wait out the pause, and a closed-loop client's next request with it;
        it is one response either way)."""
        taken: list = []
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            new = len(taken)
            try:
                taken.append(self._outputs.get(timeout=left))
            except queue.Empty:
                break
            while len(taken) < MAX_OUTPUTS_PER_ROUND:
                try:
                    taken.append(self._outputs.get_nowait())
                except queue.Empty:
                    break
            fresh = taken[new:]
            done = {out.request_id for out in fresh if isinstance(out, RequestOutput) and out.finished}
            if done:
                for rid in done:
                    self._send_outputs([o for o in taken if isinstance(o, RequestOutput) and o.request_id == rid])
                taken = [o for o in taken if not isinstance(o, RequestOutput) or o.request_id not in done]
                fresh = [o for o in fresh if not isinstance(o, RequestOutput) or o.request_id not in done]
            if len(taken) >= MAX_OUTPUTS_PER_ROUND or any(self._urgent(out) for out in fresh):
                break
        return taken

    def _urgent(self, out) -> bool:  # noqa: ANN001 - a RequestOutput or a ControlReply
        if isinstance(out, ControlReply):
            return True
        p = self._pending.get(out.request_id)
        return p is not None and p.stream and not p.first_sent

    def _gauges(self) -> dict:
        lifecycle = self.engine.lifecycle
        return dict(self.engine.stats(), alive=0 if self.engine.dead is not None else 1,
                    paused=int(lifecycle.paused), sleeping=int(bool(lifecycle.released)),
                    control_ops=self._control.running(), weights_lost=int(self._control.lost is not None),
                    **self.engine.expert_load_gauges())  # routed tokens, per-layer balance (engine_metrics.py)

    def _poll_cancellations(self) -> None:
        with self._lock:
            items = [p for p in self._pending.values() if not p.cancelled]
        if len(items) > CANCEL_POLL_MAX:  # round robin over the open requests, CANCEL_POLL_MAX of them per poll
            start = self._poll_from % len(items)
            items = (items[start:] + items[:start])[:CANCEL_POLL_MAX]
            self._poll_from = start + CANCEL_POLL_MAX
        for p in items:
            try:
                if p.sender.is_cancelled():
                    p.cancelled = True
                    log.info("request %s cancelled by the client; aborting", p.engine_id)
                    self.engine.abort(p.engine_id)
            except Exception:
                log.exception("cancellation check failed")

    def _on_outputs(self, outs: list[RequestOutput]) -> None:
        """One request's outputs, in engine order; only the last can be finished."""
        out = outs[-1]
        with self._lock:
            p = self._pending.get(out.request_id)
            if p is not None and out.finished:
                del self._pending[out.request_id]
        if p is None:
            return
        flags = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL if out.finished else 0
        if out.finished and (p.cancelled or out.finish_reason == "error"):
            if p.cancelled:
                err = pb_utils.TritonError("request cancelled", pb_utils.TritonError.CANCELLED)
            else:  # the engine stopped under it (died, e.g. a tensor-parallel rank exited; or shuts down): a 503
                err = pb_utils.TritonError(f"unavailable: the engine is not running ({out.error or 'engine error'})",
                                           pb_utils.TritonError.UNAVAILABLE)
            p.sender.send(pb_utils.InferenceResponse(error=err), flags=flags)
            return
        if p.stream:
            if not p.first_sent:  # the first step always goes out alone, at once (time to first token)
                p.first_sent = True
                if len(outs) > 1 or not out.finished:
                    first = outs.pop(0)
                    p.sender.send(self._response(p, first, first.new_token_ids, [first.routed_experts], [first],
                                                 [first.routed_weights], _prompt_lp([first])))
                    if not outs:
                        return
            if p.held:
                outs = p.held + outs
            if not out.finished and self.stream_interval > 1:
                p.held_tokens += sum(len(o.new_token_ids) for o in outs[len(p.held):])
                if p.held_tokens < self.stream_interval:
                    p.held = outs
                    return
            p.held, p.held_tokens = [], 0
            tokens = [t for o in outs for t in o.new_token_ids]
            rows = [o.routed_experts for o in outs]
            weight_rows = [o.routed_weights for o in outs]
            p.sender.send(self._response(p, out, tokens, rows, outs, weight_rows, _prompt_lp(outs)), flags=flags)
            return
        for o in outs:
            p.tokens.extend(o.new_token_ids)
            if o.routed_experts is not None:
                p.rows.append(o.routed_experts)
            if o.routed_weights is not None:
                p.weight_rows.append(o.routed_weights)
            if o.logprobs is not None:
                p.logprobs.append(o)
            if o.prompt_logprobs is not None:
                p.prompt_lp = o
        if out.finished:
            p.sender.send(self._response(p, out, p.tokens, p.rows, p.logprobs, p.weight_rows, p.prompt_lp),
                          flags=flags)

    def _response(self, p: _Pending, out: RequestOutput, tokens, rows, lp_outputs, weight_rows, prompt_lp):
        T = pb_utils.Tensor
        tensors = [
            T("output_ids", np.asarray(tokens, dtype=np.int64)),
            T("finish_reason", np.array([(out.finish_reason or "").encode()], dtype=np.object_)),
            T("num_prompt_tokens", np.array([out.num_prompt_tokens], dtype=np.int32)),
            T("num_output_tokens", np.array([out.num_output_tokens], dtype=np.int32)),
            T("num_cached_tokens", np.array([out.num_cached_tokens], dtype=np.int32)),
            T("weight_version", np.array([(out.weight_version or "").encode()], dtype=np.object_)),
        ]
        if p.routing:
            tensors.append(T("routed_experts", _rows(rows, p, np.uint16)))
        if p.weights:  # the same rows as routed_experts
            tensors.append(T("routed_weights", _rows(weight_rows, p, np.float32)))
        if prompt_lp is not None:
            tensors.append(T("prompt_logprobs", np.asarray(prompt_lp.prompt_logprobs, dtype=np.float32).reshape(-1)))
            if prompt_lp.prompt_logprob_ranks is not None:
                tensors.append(T("prompt_logprob_ranks", np.asarray(prompt_lp.prompt_logprob_ranks, np.int64)))
            if prompt_lp.prompt_top_logprob_ids is not None:
                tensors.append(T("prompt_top_logprob_ids", np.asarray(prompt_lp.prompt_top_logprob_ids, np.int64)))
                tensors.append(T("prompt_top_logprobs", np.asarray(prompt_lp.prompt_top_logprobs, np.float32)))
        lp_outputs = [o for o in lp_outputs if o.logprobs is not None]
        if lp_outputs:
            tensors.append(
                T("logprobs", np.asarray([v for o in lp_outputs for v in o.logprobs], dtype=np.float32))
            )
            if lp_outputs[0].top_logprob_ids is not None:
                tensors.append(T("top_logprob_ids", np.concatenate([o.top_logprob_ids for o in lp_outputs])))
                tensors.append(
                    T("top_logprobs", np.concatenate([o.top_logprobs for o in lp_outputs]).astype(np.float32))
                )
        return pb_utils.InferenceResponse(output_tensors=_only(tensors, p.outputs))

    def finalize(self):
        log.info("finalizing: stopping the engine")
        self.engine.shutdown()  # ends every open request with an error response
        self._stopping.set()
        self._responder.join(timeout=10)
        # Triton 2.51's stub itself segfaults in its C++ teardown after this, with no Python frame (every normal stop,
        # before faulthandler too: the kernel log's "segfault at 60 ... in triton_python_backend_stub"). Nothing of
        # ours runs then; a fatal-error report at every stop would only hide the crashes that matter.
        faulthandler.disable()
