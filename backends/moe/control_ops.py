"""Control requests of the moe backend: the RL rollout lifecycle (weight updates, pause, release, cache flush), and
the expert load (SGLang's expert-distribution recorder, the dashboard's data).

A request with the optional BYTES input ``control`` = one JSON object ``{"op": <name>, ...arguments}`` (``input_ids``
is required by the model config: send an empty INT64 [0]) is one of these. It gets exactly one response, whose
BYTES output ``control_result`` is the JSON ``{"success": bool, "message": str, "weight_version": str, ...}``; a
refused operation (bad arguments, a checkpoint of another shape: nothing changed) is ``success: false``, an engine
that is not running an "unavailable: ..." Triton error, and a reply that cannot be built an "internal error: ..."
one: an accepted control request always ends. ``start`` never waits for the operation: the engine runs it between
steps (moe_engine/rl/lifecycle.py) and the response thread sends the answer (``send_reply``).
"""
from __future__ import annotations

import base64
import io
import json
import logging
import threading
from concurrent.futures import Future
from dataclasses import dataclass

import numpy as np
import triton_python_backend_utils as pb_utils

from moe_engine.errors import EngineError, EngineOverloadedError, EngineStoppedError, InvalidRequestError

log = logging.getLogger("moe_backend")

# op -> the arguments it takes (beyond them, a control request is refused); each is a method of engine.lifecycle.
CONTROL_OPS = {
    "update_weights_from_disk": ("model_path", "weight_version", "flush_cache", "abort_all_requests"),
    "init_weights_update_group": ("master_address", "master_port", "rank_offset", "world_size", "group_name",
                                  "backend"),
    "update_weights_from_distributed": ("names", "dtypes", "shapes", "group_name", "weight_version", "flush_cache",
                                        "abort_all_requests"),
    "flush_cache": (),
    "pause_generation": ("mode",),
    "continue_generation": (),
    "release_memory_occupation": ("tags",),
    "resume_memory_occupation": ("tags",),
    "get_weight_version": (),
    "get_engine_info": (),
    "is_sleeping": (),
    # expert load (moe_engine/core/expert_load.py): methods of the engine itself
    "start_expert_distribution_record": (),
    "stop_expert_distribution_record": (),
    "dump_expert_distribution_record": (),
    "get_expert_load": (),
}
ENGINE_OPS = frozenset({"start_expert_distribution_record", "stop_expert_distribution_record",
                        "dump_expert_distribution_record", "get_expert_load"})
# Ops that only read this instance's state; the others change it, and a request reaches one Triton instance.
READ_ONLY_OPS = frozenset({"get_weight_version", "get_engine_info", "is_sleeping", "get_expert_load"})
# Ops that run on the engine thread between steps (a long one holds steps back: not a stall, see ``running``).
ENGINE_THREAD_OPS = frozenset(CONTROL_OPS) - READ_ONLY_OPS - {"init_weights_update_group"}
FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


def _jsonable(result: dict) -> dict:
    """numpy arrays of a result (the recorder's ``logical_count``) as base64 ``.npy`` under ``<key>_npy``."""
    out = {}
    for key, value in result.items():
        if isinstance(value, np.ndarray):
            buf = io.BytesIO()
            np.save(buf, value, allow_pickle=False)
            out[f"{key}_npy"] = base64.b64encode(buf.getvalue()).decode("ascii")
        else:
            out[key] = value
    return out


@dataclass
class ControlReply:
    """A control operation's outcome, on its way to the response thread."""

    sender: object
    op: str
    future: object  # concurrent.futures.Future of the op's result dict
    outputs: frozenset = frozenset()  # the output names the request asked for


def parse_control(tensor) -> tuple[str, dict]:
    """The ``control`` input -> (op, arguments); InvalidRequestError naming what is wrong."""
    values = tensor.as_numpy().reshape(-1)
    if values.size != 1:
        raise InvalidRequestError(f"control: expected one JSON object, got {values.size} values", param="control")
    raw = values[0]
    try:
        body = json.loads(raw.decode("utf-8") if isinstance(raw, bytes) else str(raw))
    except ValueError as exc:
        raise InvalidRequestError(f"control: not JSON ({exc})", param="control") from exc
    if not isinstance(body, dict):
        raise InvalidRequestError("control: expected a JSON object", param="control")
    op = body.pop("op", None)
    if op not in CONTROL_OPS:
        raise InvalidRequestError(f"control: unknown op {op!r}; known: {', '.join(CONTROL_OPS)}", param="op")
    unknown = sorted(set(body) - set(CONTROL_OPS[op]))
    if unknown:
        raise InvalidRequestError(f"control {op}: unknown arguments {unknown}; it takes {list(CONTROL_OPS[op])}",
                                  param=unknown[0])
    return op, body


class ControlOps:
    """The control requests of one model instance: started on the engine's lifecycle, the ones the engine thread
    runs tracked (the stall gauge), every successful weight update recorded in ``weights_state`` (a restart comes
    back on those weights), and whether generation is refused because a restart could not bring them back."""

    def __init__(self, engine, weights_state, num_instances: int, replies, lost: str | None,
                 lost_version: str | None):
        self.engine = engine
        self.weights_state = weights_state
        self.num_instances = num_instances
        self.replies = replies  # the response thread's queue (ControlReply items)
        self.lost, self.lost_version = lost, lost_version  # weights_lost: generation refused until weights come
        self._futures: set = set()  # engine-thread ops not answered yet
        self._lock = threading.Lock()

    def start(self, request, tensor, sender, outputs: frozenset) -> None:
        """Start a control operation; its one response goes out from the response thread when it is done."""
        op, body = parse_control(tensor)
        if self.num_instances > 1 and op not in READ_ONLY_OPS:
            # Triton hands a request to one instance: the other replicas would keep their weights / caches / memory.
            raise InvalidRequestError(
                f"control {op}: not supported with --data-parallel-size > 1 yet (Triton hands a request to one of "
                f"the {self.num_instances} replicas; the others would keep their state); run one server per replica "
                f"and send the operation to each", param="op")
        try:
            future = self._call(op, body)
        except TypeError as exc:  # a required argument missing
            raise InvalidRequestError(f"control {op}: {exc}", param="control") from exc
        if op != "get_expert_load":  # the dashboard polls it
            log.info("control %s %s", op, {k: v for k, v in body.items() if k not in ("names", "dtypes", "shapes")})
        if op in ENGINE_THREAD_OPS:
            with self._lock:
                self._futures.add(future)

        def done(f) -> None:
            with self._lock:
                self._futures.discard(f)
            if not f.cancelled() and f.exception() is None:
                self.weights_changed(op, body)
            self.replies.put(ControlReply(sender, op, f, outputs))

        future.add_done_callback(done)

    def _call(self, op: str, body: dict):
        """Start ``op``: a Future of its result dict."""
        if op == "get_expert_load":  # read from this thread (host-side copies), no step waits for it
            future = Future()
            try:
                future.set_result(self.engine.expert_load_summary())
            except Exception as exc:  # answered as a failed op
                future.set_exception(exc)
            return future
        owner = self.engine if op in ENGINE_OPS else self.engine.lifecycle
        return getattr(owner, op)(**body)

    def weights_changed(self, op: str, body: dict) -> None:
        version = self.engine.lifecycle.weight_version
        self.weights_state.record(op, body, version)
        if op in ("update_weights_from_disk", "update_weights_from_distributed") and self.lost:
            log.info("weights pushed again (%s, version %r): generation is served again", op, version)
            self.lost = self.lost_version = None

    def running(self) -> int:
        """Control ops the engine thread is running now (a Future is running() from when the engine takes it up
        until its result): while one runs, no step runs, on purpose. One still waiting (a weight update letting the
        requests before it finish) does not count: steps go on meanwhile, and a stall then is a stall."""
        with self._lock:
            futures = list(self._futures)
        return sum(1 for f in futures if f.running())

    def send_reply(self, reply: ControlReply) -> None:
        """The one response of a control request; an error response if the answer cannot be built."""
        try:
            response = self._response(reply)
        except Exception as exc:
            log.exception("building the reply of control %s failed", reply.op)
            response = pb_utils.InferenceResponse(error=pb_utils.TritonError(f"internal error: {reply.op}: {exc!r}"))
        reply.sender.send(response, flags=FINAL)

    def _response(self, reply: ControlReply):
        exc = reply.future.exception()
        if isinstance(exc, (EngineOverloadedError, EngineStoppedError)):
            return pb_utils.InferenceResponse(error=pb_utils.TritonError(
                f"unavailable: {exc}", pb_utils.TritonError.UNAVAILABLE))
        if exc is None:
            result = {"success": True, **_jsonable(reply.future.result())}
        elif isinstance(exc, EngineError):  # refused: nothing changed
            result = {"success": False, "message": str(exc), "param": getattr(exc, "param", None)}
            if getattr(exc, "code", None):  # e.g. checkpoint_not_found
                result["code"] = exc.code
        else:
            result = {"success": False, "message": f"{reply.op} failed: {exc!r}", "internal": True}
        result["weight_version"] = self.engine.lifecycle.weight_version
        if self.lost is not None:  # the engine holds the start-up weights, which are not to be served
            result.update(weight_version=None, weights_lost=self.lost, lost_weight_version=self.lost_version)
        out = pb_utils.Tensor("control_result", np.array([json.dumps(result).encode()], dtype=np.object_))
        return pb_utils.InferenceResponse(output_tensors=[t for t in [out] if t.name() in reply.outputs])
