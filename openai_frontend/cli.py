"""`moe-serve`: start a locked-down tritonserver with the moe model, then serve the OpenAI API.

Flags follow vLLM's names; each also reads an environment variable
(MOE_SERVE_<FLAG>, e.g. MOE_SERVE_PORT=9000) for containers. Keys are best
passed through the environment or a file (a command line is visible in `ps`).

Lifecycle (README "Health, failures and shutdown"):
- the watchdog (watchdog.py) watches tritonserver, its python stub and the
  engine; on a failure every in-flight request ends with a 503 at once,
  /health turns 503, and tritonserver is restarted (at most
  --max-backend-restarts times in ten minutes); past that moe-serve exits 1;
- SIGTERM/SIGINT: stop accepting, let in-flight requests finish for
  --shutdown-timeout seconds, end the rest with a 503 (an SSE error event and
  [DONE] for streams), stop tritonserver, exit 0. A second signal ends the
  in-flight requests at once.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import sys
from pathlib import Path

from moe_engine.config import UnsupportedModelError, load_config
from moe_engine.engine_config import EngineConfig, batch_invariant_env, check_parallel, resolve_kv_cache_dtype

from .triton_server import (
    DEFAULT_MODEL_REPOSITORY,
    DEFAULT_MOE_BACKEND,
    KEY_NAME,
    TritonAccess,
    TritonError,
    TritonPorts,
    TritonServer,
    is_loopback,
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
        if kw.get("help") is not argparse.SUPPRESS:
            kw["help"] = kw.get("help", "") + f" [env {env}]"
        p.add_argument(flag, **kw)

    _add_model_and_api_flags(add)
    EngineConfig.add_cli_args(add)  # one flag per engine setting, with the help written beside the field
    _add_serving_flags(add)
    _add_triton_flags(add)
    return p


def _add_model_and_api_flags(add) -> None:
    add("--model", default=None, help="Hugging Face checkpoint directory (default: the embedded tiny MoE model)")
    add("--served-model-name", default=None, help="model name in the API (default: the checkpoint's folder name)")
    add("--host", default="127.0.0.1", help="API bind address")
    add("--port", type=int, default=9000, help="API port")
    add("--api-key", default=None,
        help="require 'Authorization: Bearer <key>' (all but /health and /metrics); on the command line it is "
             "visible in `ps`: prefer the environment variable or --api-key-file")
    add("--api-key-file", default=None, help="file whose first line is the API key")
    add("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"], help="weights dtype")
    add("--device", default="auto", choices=["auto", "cpu", "cuda"], help="engine device")


def _add_serving_flags(add) -> None:
    add("--max-pending-requests", type=int, default=256,
        help="in-flight choices the API accepts; beyond it requests get 503 with Retry-After")
    add("--data-parallel-size", type=int, default=1,
        help="independent engine replicas (Triton model instances, each with its own tensor-parallel group and "
             "GPUs); Triton spreads requests over them")
    add("--request-timeout", type=float, default=3600.0,
        help="seconds a generation request may run; past it the request is cancelled and answered 504 (0: none)")
    add("--max-request-bytes", type=int, default=16 * 2**20, help="largest request body; larger ones get 413 (0: none)")
    add("--max-response-logprobs", type=int, default=1 << 20,
        help="logprob entries one response may carry (each token's logprob and its top alternatives, over every "
             "choice and its max_tokens, prompt logprobs as often as the response repeats them); a request that "
             "could return more gets 400 before any work (0: no limit)")
    add("--shutdown-timeout", type=float, default=30.0,
        help="on SIGTERM, seconds in-flight requests get to finish before they are ended with a 503")
    add("--max-backend-restarts", type=int, default=3,
        help="restarts of a failed tritonserver within ten minutes before moe-serve exits 1 (0: exit at once)")
    add("--engine-stall-timeout", type=float, default=10.0,
        help="seconds without an engine step while it holds requests before the backend counts as stuck")
    add("--stream-interval", type=int, default=1,
        help="streaming: send a response once this many new tokens are ready (the first token and the last at "
             "once), as vLLM's and SGLang's flag; larger: fewer, larger messages, more throughput, burstier "
             "streams. 1: every engine step, with the steps that queued up meanwhile together")
    add("--trust-request-chat-template", action="store_true", default=False,
        help="accept `chat_template` in chat requests (a template is code; off by default, as vLLM)")
    add("--enable-prompt-tokens-details", action="store_true", default=False,
        help="usage.prompt_tokens_details.cached_tokens in responses: the prompt tokens served from the prefix "
             "cache (vLLM's flag)")
    add("--expert-distribution-recorder-dir", default=None,
        help="/dump_expert_distribution_record also writes each record here as expert_distribution_recorder_<time>"
             ".npy and .json (default: only in the response)")


def _add_triton_flags(add) -> None:
    add("--triton-api-key", default=None,
        help="let Triton clients in: gRPC and HTTP listen on --triton-host and need the header "
             f"'{KEY_NAME}: <key>' (gRPC metadata 'triton-grpc-protocol-{KEY_NAME}'); without it Triton has no "
             "HTTP port and its gRPC is a private unix socket")
    add("--triton-api-key-file", default=None, help="file whose first line is the Triton API key")
    add("--triton-http-port", type=int, default=8000, help="tritonserver HTTP port (with --triton-api-key)")
    add("--triton-grpc-port", type=int, default=8001, help="tritonserver gRPC port (with --triton-api-key)")
    add("--triton-metrics-port", type=int, default=8002, help="tritonserver metrics port (always on 127.0.0.1)")
    add("--triton-host", default="127.0.0.1",
        help="tritonserver bind address with --triton-api-key (an address beyond loopback needs the key)")
    add("--tritonserver", default=None, help="tritonserver binary (default: PATH, else the pytriton wheel's)")
    add("--model-repository", default=str(DEFAULT_MODEL_REPOSITORY), help="Triton model repository")
    add("--moe-backend", default=str(DEFAULT_MOE_BACKEND), help="directory of the moe backend's model.py")
    add("--run-dir", default=None, help="where the Triton backend directory is assembled (must allow exec)")
    add("--triton-shm-mb", type=int, default=64, help="python backend shared memory per model (MiB)")
    add("--num-threads", type=int, default=None, help="torch CPU threads in the engine (default: cores - 1)")
    add("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    # Benchmarks and tests of the serving path only: an engine stand-in that computes nothing (JSON arguments of
    # backends/moe_engine/standin.py's StandInEngine, e.g. '{"step_interval_s": 0.017}'); hidden from --help.
    add("--standin-engine", default="", help=argparse.SUPPRESS)


def resolve_checkpoint(model: str | None) -> Path:
    if model is None:
        from moe_engine.tiny import ensure_tiny_checkpoint

        return ensure_tiny_checkpoint()
    path = Path(model).expanduser()
    if not path.is_dir():
        raise SystemExit(f"moe-serve: error: --model {model}: no such directory")
    return path.resolve()


def _num_gpus() -> int:
    """NVIDIA GPUs the driver lists (no CUDA import in the frontend), narrowed by CUDA_VISIBLE_DEVICES."""
    root = Path("/proc/driver/nvidia/gpus")
    n = len(list(root.iterdir())) if root.is_dir() else 0
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        n = min(n, len([d for d in visible.split(",") if d.strip()]))
    return n


def instance_groups(data_parallel: int, tensor_parallel: int, device: str) -> list[dict] | None:
    """Triton instance groups for --data-parallel-size replicas (None: config.pbtxt's single instance): on CPU
    N instances of KIND_CPU; on GPUs instance i on GPU i*tp (KIND_GPU), its other ranks on the GPUs after it."""
    if data_parallel < 1:
        raise ValueError(f"the data-parallel size must be >= 1, got {data_parallel}")
    gpus = _num_gpus() if device != "cpu" else 0
    if (device == "cuda" or gpus) and data_parallel * tensor_parallel > gpus:
        raise ValueError(f"{data_parallel} replicas x {tensor_parallel} GPUs each need "
                         f"{data_parallel * tensor_parallel} GPUs, {gpus} visible")
    if data_parallel == 1:
        return None
    if device == "cpu" or gpus == 0:
        return [{"count": data_parallel, "kind": "KIND_CPU"}]
    return [{"count": 1, "kind": "KIND_GPU", "gpus": [i * tensor_parallel]} for i in range(data_parallel)]


def usage_error(message: str) -> SystemExit:
    print(f"moe-serve: error: {message}", file=sys.stderr)
    return SystemExit(2)


def read_key(value: str | None, path: str | None, flag: str) -> str | None:
    """A key from its flag/env or from a file (first line); SystemExit on a bad combination."""
    if path is None:
        return value or None
    if value:
        raise usage_error(f"give {flag} or {flag}-file, not both")
    try:
        lines = Path(path).read_text().strip().splitlines()
    except OSError as exc:
        raise usage_error(f"{flag}-file {path}: {exc.strerror}") from None
    key = lines[0].strip() if lines else ""
    if not key:
        raise usage_error(f"{flag}-file {path} is empty")
    return key


def triton_access(args) -> TritonAccess:  # noqa: ANN001 - argparse namespace
    key = read_key(args.triton_api_key, args.triton_api_key_file, "--triton-api-key")
    if key is None:
        if not is_loopback(args.triton_host):
            raise usage_error(
                f"--triton-host {args.triton_host} would expose Triton beyond this machine; "
                "that needs --triton-api-key (or MOE_SERVE_TRITON_API_KEY / --triton-api-key-file)"
            )
        return TritonAccess.private()
    try:
        return TritonAccess.with_key(key, args.triton_host)
    except TritonError as exc:
        raise usage_error(str(exc)) from None


def _uvicorn_server(config):  # noqa: ANN001, ANN202
    """A uvicorn.Server whose signal handling stays moe-serve's (graceful shutdown, second signal)."""
    import uvicorn

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):  # noqa: ANN202
            yield

    return Server(config)


# How long a thread may hold the interpreter before another gets it (Python's default: 5 ms). The API's event loop
# shares it with the workers that build large responses and render chat templates (bounded.py): at 1 ms, /health
# and the streams wait less for their turn.
SWITCH_INTERVAL_S = 0.001


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    logging.basicConfig(
        level=args.log_level.upper(), stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    api_key = read_key(args.api_key, args.api_key_file, "--api-key")
    if any(a == "--api-key" or a.startswith("--api-key=") for a in (sys.argv if argv is None else argv)):
        log.warning("--api-key on the command line is visible to every local user in `ps`; "
                    "use MOE_SERVE_API_KEY or --api-key-file")
    access = triton_access(args)
    checkpoint = resolve_checkpoint(args.model)
    try:
        cfg, engine_config, groups = check_model_and_engine(args, checkpoint)
        triton = make_triton_server(args, access, checkpoint, cfg, engine_config, groups)
    except SystemExit as exc:
        return exc.code
    return Serving(args, api_key, access, triton, checkpoint, cfg, engine_config).run()


def check_model_and_engine(args, checkpoint: Path):  # noqa: ANN001 - argparse namespace
    """(model config, engine config, Triton instance groups) for the flags; SystemExit(2) naming a bad one."""
    try:
        cfg = load_config(checkpoint)
    except (UnsupportedModelError, FileNotFoundError, ValueError) as exc:
        raise usage_error(f"--model {checkpoint}: {exc}") from None
    engine_config = EngineConfig.from_cli_args(args)
    if args.stream_interval < 1:
        raise usage_error("--stream-interval must be >= 1")
    max_model_len = engine_config.model_len(cfg)
    if max_model_len > cfg.max_position_embeddings:
        raise usage_error(f"--max-model-len {max_model_len} exceeds the model's max_position_embeddings "
                          f"({cfg.max_position_embeddings})")
    if not 0 < engine_config.gpu_memory_utilization <= 1:
        raise usage_error("--gpu-memory-utilization must be in (0, 1]")
    if not engine_config.expert_load_window > 0:
        raise usage_error("--expert-load-window must be > 0 seconds")
    if engine_config.expert_distribution_recorder_buffer_size < -1:
        raise usage_error("--expert-distribution-recorder-buffer-size must be >= 0, or -1 (every step)")
    try:
        resolve_kv_cache_dtype(engine_config, engine_config.deterministic_inference or batch_invariant_env())
    except ValueError as exc:
        raise usage_error(str(exc)) from None
    try:
        check_parallel(cfg, engine_config.tensor_parallel_size, engine_config.enable_expert_parallel)
        groups = instance_groups(args.data_parallel_size, engine_config.tensor_parallel_size, args.device)
    except ValueError as exc:
        raise usage_error(f"--tensor-parallel-size / --data-parallel-size: {exc}") from None
    return cfg, engine_config, groups


def served_name(args, checkpoint: Path) -> str:  # noqa: ANN001 - argparse namespace
    return args.served_model_name or (checkpoint.name if args.model else "tiny-mixtral")


def make_triton_server(args, access: TritonAccess, checkpoint: Path, cfg, engine_config: EngineConfig,
                       groups) -> TritonServer:  # noqa: ANN001
    """The tritonserver with the moe model configured: checkpoint, dtype, device, the engine's settings and the
    metadata the API serves (not started)."""
    metadata = dict(
        cfg.metadata(),
        max_model_len=engine_config.model_len(cfg),
        eos_token_ids=list(cfg.eos_token_ids),
        vocab_size=cfg.vocab_size,
        served_model_name=served_name(args, checkpoint),
        enable_prefix_caching=engine_config.enable_prefix_caching and cfg.prefix_caching_off_reason is None,
    )
    if engine_config.enable_prefix_caching and cfg.prefix_caching_off_reason is not None:
        metadata["prefix_caching_disabled_reason"] = cfg.prefix_caching_off_reason
    parameters = {
        "checkpoint": str(checkpoint),
        "dtype": args.dtype,
        "device": args.device,
        "engine_config": engine_config.to_json(),
        "num_threads": args.num_threads or "",
        "standin_engine": args.standin_engine or "",
        "stream_interval": str(args.stream_interval),
        "moe_metadata": json.dumps(metadata),
        # Relative: in the model's folder of the private run directory (new for each moe-serve process). A restarted
        # backend reads it to come back on the weights it last served (backends/moe/weights_state.py).
        "weights_state_file": "weights_state.json",
    }
    repo = Path(args.model_repository)
    try:
        config = model_config_with_parameters(repo / TRITON_MODEL / "config.pbtxt", parameters)
        if groups is not None:
            config["instance_group"] = groups
        return TritonServer(
            model_config=config,
            model_name=TRITON_MODEL,
            ports=TritonPorts(args.triton_http_port, args.triton_grpc_port, args.triton_metrics_port),
            access=access,
            binary=args.tritonserver,
            shm_bytes=args.triton_shm_mb * 2**20,
            moe_backend=Path(args.moe_backend),
            run_dir=args.run_dir,
        )
    except (TritonError, OSError) as exc:
        raise usage_error(str(exc)) from None


class Serving:
    """One moe-serve run once the flags are checked: tritonserver started and watched, the API served until a
    signal or a failure the watchdog gives up on; ``run`` returns the exit status."""

    def __init__(self, args, api_key: str | None, access: TritonAccess, triton: TritonServer, checkpoint: Path,
                 cfg, engine_config: EngineConfig):  # noqa: ANN001
        self.args, self.api_key, self.access, self.triton = args, api_key, access, triton
        self.checkpoint, self.cfg, self.engine_config = checkpoint, cfg, engine_config
        self.uvicorn_server = None
        self.state = None
        self.watchdog = None
        self.exit_code = 0
        self.signals = 0

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self.on_signal)
        signal.signal(signal.SIGINT, self.on_signal)
        try:
            self.start_triton()
            self.serve_api()
        except TritonError as exc:
            log.error("%s", exc)
            self.exit_code = 1
        except KeyboardInterrupt:
            log.info("interrupted")
        finally:
            if self.watchdog is not None:
                self.watchdog.finish()  # from now on Triton going away is intended
            self.triton.stop()
            if self.watchdog is not None:
                self.watchdog.join(10)
        log.info("stopped")
        return self.exit_code

    def on_signal(self, signum, frame) -> None:  # noqa: ANN001
        self.signals += 1
        if self.watchdog is not None:
            self.watchdog.shutting_down.set()
        if self.uvicorn_server is None:
            raise KeyboardInterrupt  # still starting: stop Triton and leave
        if self.signals == 1:
            log.info("%s: finishing in-flight requests (at most %.0f s), then stopping",
                     signal.Signals(signum).name, self.args.shutdown_timeout)
            self.state.begin_shutdown(self.args.shutdown_timeout)
            self.uvicorn_server.should_exit = True
        else:
            log.info("%s again: ending in-flight requests now", signal.Signals(signum).name)
            self.state.end_now()

    def start_triton(self) -> None:
        self.triton.start()
        log.info("loading %s from %s", self.cfg.architecture, self.checkpoint)
        self.triton.wait_ready()
        log.info("model %r is READY on tritonserver (%s)", TRITON_MODEL,
                 f"gRPC {self.triton.grpc_url}, HTTP {self.triton.http_url}, key header {KEY_NAME!r}"
                 if self.access.shared else "private: gRPC on a unix socket, no HTTP")

    def make_app(self):  # noqa: ANN201
        from .app import create_app
        from .config import FrontendConfig

        args = self.args
        return create_app(
            FrontendConfig(
                triton_grpc_url=self.triton.grpc_url,
                served_model_name=served_name(args, self.checkpoint),
                checkpoint_dir=str(self.checkpoint),
                triton_model_name=TRITON_MODEL,
                api_key=self.api_key,
                enable_routed_experts=self.engine_config.enable_routed_experts,
                max_pending_requests=args.max_pending_requests,
                triton_headers=self.access.grpc_headers,
                triton_metrics_url=self.triton.metrics_url,
                max_request_bytes=args.max_request_bytes or None,
                request_timeout_s=args.request_timeout or None,
                trust_request_chat_template=args.trust_request_chat_template,
                enable_prompt_tokens_details=args.enable_prompt_tokens_details,
                max_response_logprobs=args.max_response_logprobs or None,
                expert_distribution_recorder_dir=args.expert_distribution_recorder_dir,
            )
        )

    def serve_api(self) -> None:
        import uvicorn

        from .lifecycle import CLEANUP_WAIT_S
        from .watchdog import BackendWatchdog

        args = self.args
        app = self.make_app()
        self.state = app.state.server_state
        metrics = app.state.ctx.metrics
        self.uvicorn_server = _uvicorn_server(
            uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                           timeout_graceful_shutdown=args.shutdown_timeout + CLEANUP_WAIT_S + 2)
        )

        def on_up():
            metrics.backend_restarts.inc()
            self.state.backend_up()

        self.watchdog = BackendWatchdog(
            self.triton, on_down=self.state.backend_down, on_up=on_up, on_give_up=self.on_give_up,
            max_restarts=args.max_backend_restarts, stall_timeout_s=args.engine_stall_timeout,
        )
        self.watchdog.arm()
        self.watchdog.start()
        log.info("OpenAI API on http://%s:%d/v1 (model %r)", args.host, args.port, served_name(args, self.checkpoint))
        self.uvicorn_server.run()
        if self.signals == 0 and self.exit_code == 0 and not self.uvicorn_server.started:
            self.exit_code = 1  # e.g. the API port was taken

    def on_give_up(self, reason) -> None:  # noqa: ANN001
        log.error("the backend failed (%s); moe-serve exits (status 1) for its supervisor to restart it", reason)
        self.exit_code = 1
        self.uvicorn_server.should_exit = True


if __name__ == "__main__":
    sys.exit(main())
