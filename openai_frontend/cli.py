"""`moe-serve`: start tritonserver with the moe model, then serve the OpenAI API.

Flags follow vLLM's names; each also reads an environment variable
(MOE_SERVE_<FLAG>, e.g. MOE_SERVE_PORT=9000) for containers. SIGINT/SIGTERM
stop the API and tritonserver (and its python stubs); if tritonserver dies,
moe-serve says so and exits non-zero.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
from pathlib import Path

from moe_engine.config import UnsupportedModelError, load_config
from moe_engine.engine_config import EngineConfig

from .triton_server import (
    DEFAULT_MODEL_REPOSITORY,
    DEFAULT_MOE_BACKEND,
    TritonError,
    TritonPorts,
    TritonServer,
    model_config_with_parameters,
)

log = logging.getLogger("moe_serve")

TRITON_MODEL = "moe"


def _env(flag: str) -> str:
    return "MOE_SERVE_" + flag.lstrip("-").replace("-", "_").upper()


def _bool(value: str) -> bool:
    return str(value).lower() in ("1", "true", "yes", "on")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="moe-serve",
        description="Serve a MoE model on NVIDIA Triton with routed experts through an OpenAI-compatible API.",
        epilog="Every flag can also be set with an environment variable MOE_SERVE_<FLAG> (e.g. MOE_SERVE_PORT).",
    )

    def add(flag, **kw):
        env = _env(flag)
        if env in os.environ:
            kw["default"] = kw.get("type", str)(os.environ[env]) if kw.get("action") is None else _bool(
                os.environ[env]
            )
        kw["help"] = kw.get("help", "") + f" [env {env}]"
        p.add_argument(flag, **kw)

    add("--model", default=None, help="Hugging Face checkpoint directory (default: the embedded tiny MoE model)")
    add("--served-model-name", default=None, help="model name in the API (default: the checkpoint's folder name)")
    add("--host", default="127.0.0.1", help="API bind address")
    add("--port", type=int, default=9000, help="API port")
    add("--api-key", default=None, help="require 'Authorization: Bearer <key>' on every request")
    add("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"], help="weights dtype")
    add("--device", default="auto", choices=["auto", "cpu", "cuda"], help="engine device")
    add("--max-num-seqs", type=int, default=None, help="sequences running at once (default: 256 on CUDA, 64 on CPU)")
    add(
        "--max-model-len",
        type=int,
        default=None,
        help="prompt + output tokens of one sequence (default: the model's max_position_embeddings)",
    )
    add(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="tokens per engine step (prefill chunk size); default 2048 on CUDA, 512 on CPU",
    )
    add("--block-size", type=int, default=16, choices=[8, 16, 32, 64, 128], help="tokens per KV-cache block")
    add(
        "--gpu-memory-utilization",
        type=float,
        default=0.9,
        help="CUDA: share of GPU memory for weights, activations and the KV cache (the KV cache gets the rest)",
    )
    add(
        "--kv-cache-memory",
        type=float,
        default=None,
        help="KV cache size in GiB (overrides --gpu-memory-utilization; CPU default 2 GiB)",
    )
    add(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="reuse the KV blocks and routed experts of shared prompt prefixes (--no-enable-prefix-caching: off)",
    )
    add("--max-waiting", type=int, default=1024, help="engine queue bound; beyond it requests get 503")
    add(
        "--max-pending-requests",
        type=int,
        default=256,
        help="in-flight choices the API accepts; beyond it requests get 503 with Retry-After",
    )
    add(
        "--disable-routed-experts",
        action="store_true",
        default=False,
        help="turn routed experts off server-wide (no capture work at all)",
    )
    add(
        "--enforce-eager",
        action="store_true",
        default=False,
        help="CUDA: run decode steps eagerly instead of replaying CUDA graphs (debugging; saves the graphs' memory)",
    )
    add(
        "--disable-fused-kernels",
        action="store_true",
        default=False,
        help="CUDA: op-by-op forward instead of the fused Triton kernels (same results; debugging)",
    )
    add("--triton-http-port", type=int, default=8000, help="tritonserver HTTP port")
    add("--triton-grpc-port", type=int, default=8001, help="tritonserver gRPC port")
    add("--triton-metrics-port", type=int, default=8002, help="tritonserver metrics port")
    add("--triton-host", default="127.0.0.1", help="tritonserver bind address (0.0.0.0 to expose it)")
    add("--tritonserver", default=None, help="tritonserver binary (default: PATH, else the pytriton wheel's)")
    add("--model-repository", default=str(DEFAULT_MODEL_REPOSITORY), help="Triton model repository")
    add("--moe-backend", default=str(DEFAULT_MOE_BACKEND), help="directory of the moe backend's model.py")
    add("--run-dir", default=None, help="where the Triton backend directory is assembled (must allow exec)")
    add("--triton-shm-mb", type=int, default=64, help="python backend shared memory per model (MiB)")
    add("--num-threads", type=int, default=None, help="torch CPU threads in the engine (default: cores - 1)")
    add("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return p


def resolve_checkpoint(model: str | None) -> Path:
    if model is None:
        from moe_engine.tiny import ensure_tiny_checkpoint

        return ensure_tiny_checkpoint()
    path = Path(model).expanduser()
    if not path.is_dir():
        raise SystemExit(f"moe-serve: error: --model {model}: no such directory")
    return path.resolve()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    checkpoint = resolve_checkpoint(args.model)
    try:
        cfg = load_config(checkpoint)
    except (UnsupportedModelError, FileNotFoundError, ValueError) as exc:
        print(f"moe-serve: error: --model {checkpoint}: {exc}", file=sys.stderr)
        return 2
    served_name = args.served_model_name or (checkpoint.name if args.model else "tiny-mixtral")
    if args.max_model_len is None:
        args.max_model_len = cfg.max_position_embeddings
    if args.max_model_len > cfg.max_position_embeddings:
        print(
            f"moe-serve: error: --max-model-len {args.max_model_len} exceeds the model's "
            f"max_position_embeddings ({cfg.max_position_embeddings})",
            file=sys.stderr,
        )
        return 2
    if not 0 < args.gpu_memory_utilization <= 1:
        print("moe-serve: error: --gpu-memory-utilization must be in (0, 1]", file=sys.stderr)
        return 2

    metadata = dict(
        cfg.metadata(),
        max_model_len=args.max_model_len,
        eos_token_ids=list(cfg.eos_token_ids),
        vocab_size=cfg.vocab_size,
        served_model_name=served_name,
        enable_prefix_caching=args.enable_prefix_caching,
    )
    engine_config = EngineConfig(
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        max_num_batched_tokens=args.max_num_batched_tokens,
        block_size=args.block_size,
        gpu_memory_utilization=args.gpu_memory_utilization,
        kv_cache_memory_bytes=int(args.kv_cache_memory * 2**30) if args.kv_cache_memory else None,
        enable_prefix_caching=args.enable_prefix_caching,
        max_waiting=args.max_waiting,
        enable_routed_experts=not args.disable_routed_experts,
        enforce_eager=args.enforce_eager,
        fused_kernels=False if args.disable_fused_kernels else None,
    )
    parameters = {
        "checkpoint": str(checkpoint),
        "dtype": args.dtype,
        "device": args.device,
        "engine_config": engine_config.to_json(),
        "num_threads": args.num_threads or "",
        "moe_metadata": json.dumps(metadata),
    }
    repo = Path(args.model_repository)
    try:
        triton = TritonServer(
            model_repository=repo,
            ports=TritonPorts(args.triton_http_port, args.triton_grpc_port, args.triton_metrics_port),
            binary=args.tritonserver,
            shm_bytes=args.triton_shm_mb * 2**20,
            host=args.triton_host,
            moe_backend=Path(args.moe_backend),
            run_dir=args.run_dir,
        )
    except TritonError as exc:
        print(f"moe-serve: error: {exc}", file=sys.stderr)
        return 2

    stopping = threading.Event()
    uvicorn_server = None

    def on_signal(signum, frame):
        stopping.set()
        if uvicorn_server is not None:
            uvicorn_server.should_exit = True
        else:
            raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    exit_code = 0
    try:
        triton.start()
        triton.wait_live()
        log.info("loading %s from %s", cfg.architecture, checkpoint)
        triton.load_model(TRITON_MODEL, model_config_with_parameters(repo / TRITON_MODEL / "config.pbtxt", parameters))
        log.info("model %r is READY on tritonserver (gRPC %s, HTTP %s)", TRITON_MODEL, triton.grpc_url, triton.http_url)

        import uvicorn

        from .app import create_app
        from .config import FrontendConfig

        app = create_app(
            FrontendConfig(
                triton_grpc_url=triton.grpc_url,
                served_model_name=served_name,
                checkpoint_dir=str(checkpoint),
                triton_model_name=TRITON_MODEL,
                api_key=args.api_key,
                enable_routed_experts=not args.disable_routed_experts,
                max_pending_requests=args.max_pending_requests,
            )
        )
        uvicorn_server = uvicorn.Server(
            uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=5)
        )
        uvicorn_server.install_signal_handlers = lambda: None  # ours (above) stay in charge

        def watch_triton():
            nonlocal exit_code
            while not stopping.wait(0.5):
                if not triton.alive():
                    log.error("tritonserver died (exit code %s); shutting down", triton.proc.returncode)
                    exit_code = 1
                    uvicorn_server.should_exit = True
                    return

        threading.Thread(target=watch_triton, name="triton-watchdog", daemon=True).start()
        log.info("OpenAI API on http://%s:%d/v1 (model %r)", args.host, args.port, served_name)
        uvicorn_server.run()
        if not stopping.is_set() and exit_code == 0 and not uvicorn_server.started:
            exit_code = 1  # e.g. the API port was taken
    except TritonError as exc:
        log.error("%s", exc)
        exit_code = 1
    except KeyboardInterrupt:
        log.info("interrupted")
    finally:
        stopping.set()
        triton.stop()
    log.info("stopped")
    return exit_code


if __name__ == "__main__":
    sys.exit(main())
