"""Expert load over HTTP: SGLang's expert-distribution recorder and the live dashboard.

SGLang's endpoints, names and semantics (``GET`` or ``POST``; 200 with SGLang's text for start and stop):

    /start_expert_distribution_record   clear the record, record every step from now on
    /stop_expert_distribution_record    stop recording (the record is kept until dumped)
    /dump_expert_distribution_record    the record, then cleared: JSON (default) or ``?format=npy``

The dump carries ``logical_count`` with its axes named: ``dims`` (``["layer", "expert"]`` in ``stat`` mode, the counts
summed over the recorded steps; ``["step", "layer", "expert"]`` in ``per_pass`` mode), ``layers`` (the global index of
each MoE layer on the layer axis: dense layers are absent) and ``experts``. With ``--expert-distribution-recorder-dir``
each dump is also written there as ``expert_distribution_recorder_<time>.npy`` and ``.json`` (SGLang writes a ``.pt``
to ``SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR``). Behind the API key like the RL endpoints (serving_weights.py).

The dashboard: ``GET /dashboard`` is a page shipped in this package (``static/``: HTML, CSS and JavaScript, nothing
loaded from elsewhere) that polls ``GET /dashboard/data`` (behind the API key; the page asks for the key when the
server has one). Each is a control request to the Triton model; the engine answers the data from host-side copies of
its device counters (moe_engine/core/expert_load.py), without waiting for a step.
"""

from __future__ import annotations

import base64
import io
import json
import logging
import time
from pathlib import Path
from typing import Any, Literal

import numpy as np
from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse, PlainTextResponse, Response

from .errors import BadRequestError, InternalServerError, NotFoundError
from .http_utils import check_api_key
from .serving import ServingContext
from .serving_weights import _control

logger = logging.getLogger(__name__)

RECORDER_PATHS = frozenset({"/start_expert_distribution_record", "/stop_expert_distribution_record",
                            "/dump_expert_distribution_record"})
DATA_PATH = "/dashboard/data"
# The API middleware checks the key on these before anything runs (app.py); the page and its assets need none.
PROTECTED_PATHS = RECORDER_PATHS | {DATA_PATH}
STATIC = Path(__file__).parent / "static"
ASSETS = {"dashboard.js": "text/javascript", "dashboard.css": "text/css"}


def _refused(result: dict[str, Any]) -> None:
    if not result.get("success"):
        cls = InternalServerError if result.get("internal") else BadRequestError
        raise cls(str(result.get("message", "refused")), param=result.get("param"))


def _decode(result: dict[str, Any]) -> np.ndarray:
    return np.load(io.BytesIO(base64.b64decode(result["logical_count_npy"])), allow_pickle=False)


def dump_body(result: dict[str, Any], counts: np.ndarray) -> dict[str, Any]:
    """The dump as JSON: the counts with their axes named."""
    body = {k: v for k, v in result.items() if k not in ("success", "logical_count_npy", "weight_version")}
    body["experts"] = list(range(int(result["num_experts"])))
    body["logical_count"] = counts.tolist()
    return body


def write_dump(directory: str, body: dict[str, Any], counts: np.ndarray) -> str:
    """``expert_distribution_recorder_<time>.npy`` (the counts) and ``.json`` (everything, axes named) in
    ``directory``; returns the .npy path."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"expert_distribution_recorder_{time.time():.6f}"
    np.save(stem.with_suffix(".npy"), counts, allow_pickle=False)
    stem.with_suffix(".json").write_text(json.dumps(body))
    logger.info("expert distribution written to %s.npy / .json", stem)
    return str(stem.with_suffix(".npy"))


def expert_load_router(ctx: ServingContext) -> APIRouter:
    """The recorder endpoints and /dashboard/data behind the API key; the dashboard page and its assets open."""

    async def api_key(request: Request) -> None:
        check_api_key(ctx.cfg.api_key, request.headers.get("authorization"))

    router = APIRouter()
    protected = APIRouter(dependencies=[Depends(api_key)])

    @protected.get("/start_expert_distribution_record", include_in_schema=False)  # SGLang answers GET too (one documented method)
    @protected.post("/start_expert_distribution_record", response_class=PlainTextResponse)
    async def start_expert_distribution_record() -> Response:
        result = await _control(ctx, "start_expert_distribution_record", {})
        _refused(result)
        return PlainTextResponse(str(result.get("message")) + "\n")

    @protected.get("/stop_expert_distribution_record", include_in_schema=False)  # SGLang answers GET too (one documented method)
    @protected.post("/stop_expert_distribution_record", response_class=PlainTextResponse)
    async def stop_expert_distribution_record() -> Response:
        result = await _control(ctx, "stop_expert_distribution_record", {})
        _refused(result)
        return PlainTextResponse(str(result.get("message")) + "\n")

    @protected.get("/dump_expert_distribution_record", include_in_schema=False)  # SGLang answers GET too (one documented method)
    @protected.post("/dump_expert_distribution_record")
    async def dump_expert_distribution_record(format: Literal["json", "npy"] = Query("json")) -> Response:  # noqa: A002
        result = await _control(ctx, "dump_expert_distribution_record", {})
        _refused(result)
        counts = _decode(result)
        body = dump_body(result, counts)
        if ctx.cfg.expert_distribution_recorder_dir:
            body["path"] = write_dump(ctx.cfg.expert_distribution_recorder_dir, body, counts)
        if format == "npy":
            buf = io.BytesIO()
            np.save(buf, counts, allow_pickle=False)
            return Response(buf.getvalue(), media_type="application/octet-stream", headers={
                "X-Expert-Distribution-Dims": ",".join(body["dims"]),
                "X-Expert-Distribution-Layers": ",".join(map(str, body["layers"])),
                "X-Expert-Distribution-Mode": str(body.get("mode"))})
        return JSONResponse(body)

    @protected.get(DATA_PATH)
    async def dashboard_data() -> JSONResponse:
        model = ctx.model_info()
        result = await _control(ctx, "get_expert_load", {})
        _refused(result)
        result.pop("success", None)
        result["model"] = {"name": ctx.cfg.served_model_name, "architecture": model.architecture,
                           "num_hidden_layers": model.num_hidden_layers, "moe_layers": list(model.moe_layers),
                           "num_experts": model.num_experts, "top_k": model.num_experts_per_tok}
        return JSONResponse(result)

    page = (STATIC / "dashboard.html").read_text().replace("__KEY_REQUIRED__", "1" if ctx.cfg.api_key else "0")

    @router.get("/dashboard", include_in_schema=False)
    async def dashboard() -> HTMLResponse:
        return HTMLResponse(page, headers={"Cache-Control": "no-cache"})

    @router.get("/dashboard/static/{name}", include_in_schema=False)
    async def dashboard_asset(name: str) -> FileResponse:
        if name not in ASSETS:  # only the files shipped for the page
            raise NotFoundError(f"no dashboard asset {name!r}")
        return FileResponse(STATIC / name, media_type=ASSETS[name], headers={"Cache-Control": "no-cache"})

    router.include_router(protected)
    return router
