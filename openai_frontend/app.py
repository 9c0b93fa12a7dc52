"""FastAPI app: thin routes over :mod:`.serving`.

``create_app(cfg)`` is what ``moe-serve`` runs under uvicorn.  The Triton
connection is opened in the lifespan; the model metadata (``moe_metadata``)
is fetched from the model config then and, if Triton is not ready yet,
retried in the background (``/health`` says 503 until it is loaded).

Middleware, outermost first: ``_FrontMiddleware`` (API key, request
metrics), :class:`~.lifecycle.RequestGuard` (body limit, availability gate,
deadlines, aborts).  ``app.state.server_state`` is the
:class:`~.lifecycle.ServerState` that moe-serve's watchdog and signal
handlers drive.  With a key set, everything but ``/health`` and ``/metrics``
needs it: ``/health`` is for load balancers and container health checks,
``/metrics`` for Prometheus scrapers, as in vLLM (both show only aggregate
numbers, never request content).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from collections.abc import Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from .config import FrontendConfig
from .errors import (
    BadRequestError,
    ClientDisconnected,
    OpenAIError,
    ServiceUnavailableError,
    backend_unavailable,
    install_error_handlers,
    model_not_found,
    shutting_down,
)
from .http_utils import check_api_key
from .lifecycle import RequestGuard, ServerState
from .metrics import CONTENT_TYPE, Metrics
from .openapi_doc import documented_openapi
from .protocol import ChatCompletionRequest, CompletionRequest, GenerateRequest
from .responses import disconnected_response
from .serving import ServingContext
from .serving_chat import create_chat_completion
from .serving_completions import create_completion
from .serving_expert_load import PROTECTED_PATHS as EXPERT_LOAD_PATHS
from .serving_expert_load import expert_load_router
from .serving_generate import create_generate
from .serving_weights import RL_PATHS, engine_state, refresh_weights_state, rl_router
from .tokenizer import Tokenizer
from .triton_client import ModelInfo, TritonClient

logger = logging.getLogger(__name__)

_GENERATION_ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/inference/v1/generate")
_KNOWN_ENDPOINTS = frozenset(_GENERATION_ENDPOINTS + ("/v1/models", "/health", "/metrics"))
_PROTECTED_PREFIXES = ("/v1/", "/inference/")
_PROTECTED_PATHS = frozenset({"/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json"})


class _FrontMiddleware:
    """Pure ASGI (keeps disconnect detection working): API-key check and request metrics."""

    def __init__(self, app: ASGIApp, cfg: FrontendConfig, metrics: Metrics) -> None:
        self.app = app
        self.api_key = cfg.api_key
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path: str = scope.get("path", "")
        endpoint = path if path in _KNOWN_ENDPOINTS else ("/v1/models/{id}" if path.startswith("/v1/models/")
                                                          else "other")
        status = 500
        t0 = time.monotonic()

        async def send_wrapper(message: dict[str, Any]) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            # The key is checked before anything reads the body (the RL endpoints included: no key, no parsing).
            if self.api_key is not None and (path.startswith(_PROTECTED_PREFIXES) or path in _PROTECTED_PATHS
                                             or path in RL_PATHS or path in EXPERT_LOAD_PATHS):
                headers = dict(scope.get("headers") or [])
                auth = headers.get(b"authorization")
                try:
                    check_api_key(self.api_key, auth.decode("latin-1") if auth else None)
                except OpenAIError as e:
                    await e.to_response()(scope, receive, send_wrapper)
                    return
            await self.app(scope, receive, send_wrapper)
        finally:
            self.metrics.requests.labels(endpoint, str(status)).inc()
            if endpoint in _GENERATION_ENDPOINTS and status == 200:
                self.metrics.e2e.labels(endpoint).observe(time.monotonic() - t0)


def model_card(cfg: FrontendConfig, model: ModelInfo, created: int,
               engine: dict[str, Any] | None = None) -> dict[str, Any]:
    """The /v1/models entry: the model's metadata and ``engine`` (``engine_state``: weight version, KV block size,
    deterministic inference; None where the backend cannot tell)."""
    engine = engine or {}
    return {
        "id": cfg.served_model_name,
        "object": "model",
        "created": created,
        "owned_by": "moe-serve",
        "root": cfg.checkpoint_dir,
        "parent": None,
        "max_model_len": model.max_model_len,
        "architecture": model.architecture,
        "vocab_size": model.vocab_size,
        "num_hidden_layers": model.num_hidden_layers,
        "moe_layers": list(model.moe_layers),
        "num_experts": model.num_experts,
        "num_experts_per_tok": model.num_experts_per_tok,
        "top_k": model.num_experts_per_tok,
        "routed_experts_dtype": model.routed_experts_dtype,
        # weights: the checkpoint's format ("none", "fp8", "mxfp4"); served_as: what the engine computes with, "fp8"
        # (W8A8 block FP8: an FP8 checkpoint on a GPU with FP8 tensor cores, or --quantization fp8), "mxfp4"
        # (GPT-OSS experts kept packed on the GPU) or the model dtype (dequantised at load; null when the engine
        # cannot tell); kv_cache: the KV blocks' dtype ("auto": the model dtype, as vLLM's --kv-cache-dtype auto;
        # "fp8_e4m3" with --kv-cache-dtype fp8; null when the engine cannot tell)
        "quantization": {"weights": model.quantization, "served_as": engine.get("weights_served_as"),
                         "kv_cache": engine.get("kv_cache_dtype")},
        "routed_experts_enabled": cfg.enable_routed_experts,
        # Cached prompt tokens still get their exact routed-experts rows (stored with the KV blocks).
        "prefix_caching_enabled": model.enable_prefix_caching,
        **({"prefix_caching_disabled_reason": model.prefix_caching_disabled_reason}
           if model.prefix_caching_disabled_reason else {}),
        # hybrid models: each layer's token mixer ("attention", "linear_attention", "mamba", "none"); the layer axis
        # of routed_experts counts every layer, rows of 0 where a layer does not route (moe_layers lists those that do)
        **({"layer_types": list(model.layer_types)} if model.layer_types else {}),
        # tokens per KV block, the prefix cache's granularity (the engine chooses it: 64 on Hopper, 16 elsewhere)
        "kv_block_size": engine.get("kv_block_size"),
        "weight_version": engine.get("weight_version"),  # the engine's current weights (serving_weights.py)
        # --enable-deterministic-inference (or VLLM_BATCH_INVARIANT=1): a request's tokens, logprobs and routed
        # experts do not depend on what shares its steps (docs/design/determinism.md)
        "deterministic_inference": engine.get("deterministic_inference"),
    }


async def _load_model_info(ctx: ServingContext, timeout_s: float) -> None:
    """Fetch moe_metadata; retry quickly up to timeout_s, then every 5 s."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            info = await ctx.client.model_info()
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - Triton may not be up yet
            delay = 0.5 if time.monotonic() < deadline else 5.0
            logger.info("model metadata not available yet (%s); retrying in %.1fs", e, delay)
            await asyncio.sleep(delay)
            continue
        if ctx.tokenizer.vocab_size > info.vocab_size:
            logger.warning("tokenizer has %d tokens but the model only %d", ctx.tokenizer.vocab_size, info.vocab_size)
        ctx.metrics.configure(info)
        ctx.tokenizer.set_max_model_len(info.max_model_len)  # text longer than any prompt that fits: 400 early
        ctx.model = info
        logger.info("serving %s: %s", ctx.cfg.served_model_name, info)
        # Start-up objects (tokenizer, modules) out of the collector's way: a full collection then only walks what
        # requests made, and pauses the event loop for less.
        gc.freeze()
        return


def create_app(cfg: FrontendConfig, *, engine: Any = None) -> FastAPI:
    """The API app.  ``engine`` replaces the Triton client (tests only)."""
    tokenizer = Tokenizer.from_dir(cfg.checkpoint_dir)
    metrics = Metrics(cfg.triton_metrics_url)
    ctx = ServingContext(cfg, engine, tokenizer, metrics)
    state = ServerState(cfg.retry_after_s)
    own_engine = engine is None
    state.on_backend_up = _reconnector(ctx, own_engine)

    app = FastAPI(title="moe-serve", version="0.1.0", lifespan=_lifespan(ctx, state, own_engine),
                  strict_content_type=False)
    app.state.ctx = ctx
    app.state.server_state = state
    install_error_handlers(app)
    app.add_middleware(RequestGuard, state=state, metrics=metrics, max_request_bytes=cfg.max_request_bytes,
                       request_timeout_s=cfg.request_timeout_s)
    app.add_middleware(_FrontMiddleware, cfg=cfg, metrics=metrics)  # added last: outermost
    app.openapi = lambda: documented_openapi(app)
    # Generation first: a request is matched against the routes in order, and the ~30 status, RL and expert-load
    # routes ahead of these took ~0.1 ms of the event loop per generation request (no other route has their paths).
    _add_generation_routes(app, ctx)
    _add_status_routes(app, ctx, state)
    app.include_router(rl_router(ctx))  # RL rollout lifecycle (SGLang's endpoints), behind the API key
    app.include_router(expert_load_router(ctx))  # SGLang's expert-distribution recorder, /dashboard
    return app


def _triton_client(cfg: FrontendConfig) -> TritonClient:
    return TritonClient(cfg.triton_grpc_url, cfg.triton_model_name, cfg.triton_headers)


def _reconnector(ctx: ServingContext, own_engine: bool) -> Callable[[], Awaitable[None]]:
    """What the server state runs once the backend is up again (``ServerState.on_backend_up``)."""

    async def reconnect() -> None:
        """After a backend restart: a fresh channel (the old one may sit in its reconnect backoff)."""
        if own_engine:
            old, ctx.client = ctx.client, _triton_client(ctx.cfg)
            await old.close()
            await refresh_weights_state(ctx)  # did the restart bring the served weights back?

    return reconnect


def _lifespan(ctx: ServingContext, state: ServerState, own_engine: bool):  # noqa: ANN202 - FastAPI's lifespan
    """Open the Triton connection and load the model metadata: for up to 5 s before serving, then in the
    background (``/health`` says 503 until it is loaded); close both at shutdown."""
    cfg = ctx.cfg

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        state.loop = asyncio.get_running_loop()
        if own_engine:
            ctx.client = _triton_client(cfg)
        loader = asyncio.create_task(_load_model_info(ctx, cfg.startup_timeout_s))
        try:
            await asyncio.wait_for(asyncio.shield(loader), timeout=min(5.0, cfg.startup_timeout_s))
        except asyncio.TimeoutError:
            logger.warning("Triton model %r not ready yet; /health stays 503 until it is", cfg.triton_model_name)
        try:
            yield
        finally:
            loader.cancel()
            await asyncio.gather(loader, return_exceptions=True)
            if own_engine:
                await ctx.client.close()

    return lifespan


def _add_status_routes(app: FastAPI, ctx: ServingContext, state: ServerState) -> None:
    """``/health``, ``/metrics`` and ``/v1/models``: what load balancers, scrapers and clients ask first."""
    cfg, metrics = ctx.cfg, ctx.metrics

    @app.get("/health")
    async def health() -> Response:
        if state.draining:
            return shutting_down(cfg.retry_after_s).to_response()
        if state.backend_error is not None:
            return backend_unavailable(cfg.retry_after_s).to_response()
        if ctx.weights_lost is not None:
            await refresh_weights_state(ctx)  # pushed again, maybe straight through Triton
            if ctx.weights_lost is not None:
                return ServiceUnavailableError(ctx.weights_lost, retry_after_s=cfg.retry_after_s,
                                               code="weights_lost").to_response()
        if ctx.model is not None and await ctx.client.is_ready():
            return Response(status_code=200)
        return ServiceUnavailableError("Triton or the model is not ready.", code="not_ready").to_response()

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        # In a thread: the engine gauges are fetched from Triton's metrics port.
        return Response(await asyncio.to_thread(metrics.render), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def list_models() -> JSONResponse:
        card = model_card(cfg, ctx.model_info(), ctx.created, await engine_state(ctx))
        return JSONResponse({"object": "list", "data": [card]})

    @app.get("/v1/models/{model_id:path}")
    async def retrieve_model(model_id: str) -> JSONResponse:
        if model_id != cfg.served_model_name:
            raise model_not_found(model_id)
        return JSONResponse(model_card(cfg, ctx.model_info(), ctx.created, await engine_state(ctx)))


def _add_generation_routes(app: FastAPI, ctx: ServingContext) -> None:
    """The three generation endpoints; a client gone before its handler answered counts as a disconnect."""
    cfg = ctx.cfg

    async def guarded(handler: Callable[..., Awaitable[Response]], req: Any, raw: Request) -> Response:
        try:
            return await handler(ctx, req, raw)
        except ClientDisconnected:
            ctx.metrics.disconnects.inc()
            return disconnected_response()

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, raw: Request) -> Response:
        return await guarded(create_completion, req, raw)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, raw: Request) -> Response:
        if req.chat_template is not None and not cfg.trust_request_chat_template:
            # A template is code: rendering one from a client is opt-in (vLLM's --trust-request-chat-template).
            raise BadRequestError("`chat_template` in requests is disabled on this server (the operator can "
                                  "enable it with --trust-request-chat-template).", param="chat_template")
        return await guarded(create_chat_completion, req, raw)

    @app.post("/inference/v1/generate")
    async def generate(req: GenerateRequest, raw: Request) -> Response:
        return await guarded(create_generate, req, raw)
