"""The RL rollout lifecycle over HTTP, with SGLang's endpoint names and bodies (so that slime, verl and other
trainers written for SGLang drive this server unchanged):

    POST /update_weights_from_disk          {model_path, weight_version?, flush_cache?, abort_all_requests?}
    POST /init_weights_update_group         {master_address, master_port, rank_offset, world_size, group_name?,
                                             backend?}
    POST /update_weights_from_distributed   {names, dtypes, shapes, group_name?, weight_version?, flush_cache?, ...}
    GET|POST /flush_cache
    POST /pause_generation                  {mode?: "abort" | "retract" | "in_place"}
    POST /continue_generation
    GET|POST /release_memory_occupation     {tags?: ["weights", "kv_cache", "cuda_graph"]}
    GET|POST /resume_memory_occupation      {tags?}
    GET /get_weight_version (and /weight_version)   -> {"weight_version": str}

and vLLM's names for the same operations (its development endpoints), for trainers written against vLLM:

    POST /reset_prefix_cache                = flush_cache
    POST /sleep?level=1|2                   = release_memory_occupation (all memory; level 2 keeps the weights in
                                              host memory like level 1, so a wake-up without a reload still serves)
    POST /wake_up[?tags=weights&tags=kv_cache]   = resume_memory_occupation
    GET /is_sleeping                        -> {"is_sleeping": bool}

Each one is a control request to the Triton model (never a side channel: backends/moe/control_ops.py runs it through
the engine's control channel, between steps) and answers ``{"success", "message", "weight_version"}``; a refused
operation (a checkpoint of another shape, an unknown tensor name: nothing changed) is a 400 whose body carries
both that shape and the OpenAI ``error`` object; the engine not running is a 503. The API key applies as on /v1.
Repeating a call is harmless (each is idempotent). Bodies: :mod:`.protocol_rl`.
"""

from __future__ import annotations

import logging
from typing import Any, Literal

from fastapi import APIRouter, Body, Depends, Query, Request
from fastapi.responses import JSONResponse

from .errors import BadRequestError, InternalServerError, NotFoundError, OpenAIError
from .http_utils import check_api_key
from .protocol_rl import (
    ContinueGenerationRequest,
    FlushCacheRequest,
    InitWeightsUpdateGroupRequest,
    MemoryOccupationRequest,
    PauseGenerationRequest,
    UpdateWeightsFromDiskRequest,
    UpdateWeightsFromDistributedRequest,
)
from .serving import ServingContext, backend_error_to_openai
from .triton_client import BackendError

logger = logging.getLogger(__name__)

# Every path rl_router serves: the API middleware checks the key on them before the body is read (app.py).
RL_PATHS = frozenset({
    "/update_weights_from_disk", "/init_weights_update_group", "/update_weights_from_distributed", "/flush_cache",
    "/pause_generation", "/continue_generation", "/release_memory_occupation", "/resume_memory_occupation",
    "/get_weight_version", "/weight_version", "/reset_prefix_cache", "/sleep", "/wake_up", "/is_sleeping",
})


async def _control(ctx: ServingContext, op: str, args: dict[str, Any]) -> dict[str, Any]:
    """The backend's control_result for ``op``; Triton / engine errors become OpenAI errors (503, 500)."""
    control = getattr(ctx.client, "control", None)
    if control is None:
        raise InternalServerError("this backend client has no control requests")
    try:
        result = await control(op, args)
    except BackendError as e:
        raise backend_error_to_openai(e, ctx.cfg.retry_after_s) from e
    # Every answer says whether a restart lost the served weights (backends/moe/weights_state.py); /health reads it.
    ctx.weights_lost = result.get("weights_lost")
    return result


async def refresh_weights_state(ctx: ServingContext) -> None:
    """Ask the backend whether it serves the weights it should (after a restart; while /health says it does not)."""
    if getattr(ctx.client, "control", None) is None:
        return
    try:
        await _control(ctx, "get_weight_version", {})
    except Exception as e:  # noqa: BLE001 - the backend is down: /health says so already
        logger.warning("weight state unavailable: %s", e)


async def engine_state(ctx: ServingContext) -> dict[str, Any]:
    """For /v1/models: the engine's weight version, its KV block size and whether deterministic inference is on
    (``get_engine_info``; every control result carries the weight version); {} when the backend cannot tell."""
    if getattr(ctx.client, "control", None) is None:  # a backend client without control requests (tests' fakes)
        return {}
    try:
        info = await _control(ctx, "get_engine_info", {})
    except Exception as e:  # noqa: BLE001 - the model card must not fail on it
        logger.warning("engine state unavailable: %s", e)
        return {}
    return {"weight_version": info.get("weight_version"), "kv_block_size": info.get("kv_block_size"),
            "deterministic_inference": info.get("deterministic_inference"),
            "weights_served_as": info.get("weights_served_as"), "kv_cache_dtype": info.get("kv_cache_dtype")}


def _answer(result: dict[str, Any], **extra: Any) -> JSONResponse:
    body = {"success": bool(result.get("success")), "message": str(result.get("message", "")),
            "weight_version": result.get("weight_version"), **extra}
    if body["success"]:
        return JSONResponse(body)
    if result.get("code") in ("checkpoint_not_found", "weight_update_group_not_found"):  # nothing there by that name
        err: OpenAIError = NotFoundError(body["message"], param=result.get("param"), code=result["code"])
    else:
        cls = InternalServerError if result.get("internal") else BadRequestError
        err = cls(body["message"], param=result.get("param"))
    return JSONResponse({**body, **err.to_dict()}, status_code=err.status_code)


def rl_router(ctx: ServingContext) -> APIRouter:
    """The lifecycle endpoints, behind the API key (same check as /v1)."""

    async def api_key(request: Request) -> None:
        check_api_key(ctx.cfg.api_key, request.headers.get("authorization"))

    router = APIRouter(dependencies=[Depends(api_key)])

    async def run(op: str, req: Any, **extra: Any) -> JSONResponse:
        return _answer(await _control(ctx, op, req.control_args()), **extra)

    @router.post("/update_weights_from_disk")
    async def update_weights_from_disk(req: UpdateWeightsFromDiskRequest) -> JSONResponse:
        # num_paused_requests: SGLang's field; requests here are finished first or aborted, never paused.
        return await run("update_weights_from_disk", req, num_paused_requests=0)

    @router.post("/init_weights_update_group")
    async def init_weights_update_group(req: InitWeightsUpdateGroupRequest) -> JSONResponse:
        return await run("init_weights_update_group", req)

    @router.post("/update_weights_from_distributed")
    async def update_weights_from_distributed(req: UpdateWeightsFromDistributedRequest) -> JSONResponse:
        return await run("update_weights_from_distributed", req)

    @router.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache(req: FlushCacheRequest | None = Body(None)) -> JSONResponse:
        return await run("flush_cache", req or FlushCacheRequest())

    @router.post("/pause_generation")
    async def pause_generation(req: PauseGenerationRequest | None = Body(None)) -> JSONResponse:
        return await run("pause_generation", req or PauseGenerationRequest())

    @router.post("/continue_generation")
    async def continue_generation(req: ContinueGenerationRequest | None = Body(None)) -> JSONResponse:
        return await run("continue_generation", req or ContinueGenerationRequest())

    @router.api_route("/release_memory_occupation", methods=["GET", "POST"])
    async def release_memory_occupation(req: MemoryOccupationRequest | None = Body(None)) -> JSONResponse:
        return await run("release_memory_occupation", req or MemoryOccupationRequest())

    @router.api_route("/resume_memory_occupation", methods=["GET", "POST"])
    async def resume_memory_occupation(req: MemoryOccupationRequest | None = Body(None)) -> JSONResponse:
        return await run("resume_memory_occupation", req or MemoryOccupationRequest())

    @router.get("/get_weight_version")
    @router.get("/weight_version")
    async def get_weight_version() -> JSONResponse:
        result = await _control(ctx, "get_weight_version", {})
        if result.get("weights_lost"):  # null: no weights to serve until they are pushed again
            return JSONResponse({"weight_version": None, "weights_lost": True,
                                 "lost_weight_version": result.get("lost_weight_version"),
                                 "message": result["weights_lost"]})
        return JSONResponse({"weight_version": result.get("weight_version")})

    # vLLM's names (module docstring)
    @router.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> JSONResponse:
        return await run("flush_cache", FlushCacheRequest())

    @router.post("/sleep")
    async def sleep(level: int = Query(1, ge=1, le=2)) -> JSONResponse:
        if level not in (1, 2):
            raise BadRequestError(f"level must be 1 or 2, got {level}", param="level")
        return await run("release_memory_occupation", MemoryOccupationRequest())

    @router.post("/wake_up")
    async def wake_up(tags: list[Literal["weights", "kv_cache"]] | None = Query(None)) -> JSONResponse:
        return await run("resume_memory_occupation", MemoryOccupationRequest(tags=tags))

    @router.get("/is_sleeping")
    async def is_sleeping() -> JSONResponse:
        return JSONResponse({"is_sleeping": bool((await _control(ctx, "is_sleeping", {})).get("is_sleeping"))})

    return router
