"""Run `moe-serve` as a child process and wait until it is healthy.

For scripts that need a whole server (integration tests, load tests,
benchmarks): free ports are picked, output goes to a log file, and ``stop``
sends SIGTERM as a user's Ctrl-C would. Keys travel in the environment
(MOE_SERVE_API_KEY, MOE_SERVE_TRITON_API_KEY), not on the command line.

By default the server lets Triton clients in with a generated key
(``triton_api_key=True``: gRPC and HTTP on 127.0.0.1, ``triton_grpc_headers``
/ ``triton_http_headers`` to send); ``triton_api_key=None`` starts it as
users get it by default, with Triton private (no port but metrics).
"""
from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


@dataclass
class ServerProcess:
    proc: subprocess.Popen
    port: int
    triton_http_port: int
    triton_grpc_port: int
    triton_metrics_port: int
    api_key: str | None
    model: str
    log_path: Path
    checkpoint_dir: str = ""
    triton_api_key: str | None = None

    @property
    def triton_grpc_headers(self) -> dict[str, str]:
        return {"triton-grpc-protocol-moe-serve-key": self.triton_api_key} if self.triton_api_key else {}

    @property
    def triton_http_headers(self) -> dict[str, str]:
        return {"moe-serve-key": self.triton_api_key} if self.triton_api_key else {}

    @property
    def root_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def base_url(self) -> str:
        return self.root_url + "/v1"

    @property
    def triton_grpc_url(self) -> str:
        return f"127.0.0.1:{self.triton_grpc_port}"

    @property
    def triton_http_url(self) -> str:
        return f"127.0.0.1:{self.triton_http_port}"

    @property
    def triton_metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.triton_metrics_port}/metrics"

    def log_tail(self, n: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def stop(self, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def start_server(
    log_dir: str | os.PathLike,
    args: list[str] = (),
    api_key: str | None = None,
    model_name: str = "tiny-mixtral",
    timeout: float = 600.0,
    env: dict | None = None,
    triton_api_key: str | bool | None = True,
) -> ServerProcess:
    """Start `moe-serve` (the console script next to this Python) and wait for /health = 200."""
    port, http, grpc, metrics = free_ports(4)
    log_path = Path(log_dir) / f"moe-serve-{port}.log"
    cmd = [
        str(Path(sys.executable).parent / "moe-serve"),
        "--port", str(port),
        "--triton-http-port", str(http),
        "--triton-grpc-port", str(grpc),
        "--triton-metrics-port", str(metrics),
        *args,
    ]
    if triton_api_key is True:
        triton_api_key = secrets.token_urlsafe(16)
    child_env = {k: v for k, v in os.environ.items() if not (k.startswith("MOE_SERVE_") and k.endswith("API_KEY"))}
    child_env.update(env or {})
    if api_key:
        child_env["MOE_SERVE_API_KEY"] = api_key
    if triton_api_key:
        child_env["MOE_SERVE_TRITON_API_KEY"] = triton_api_key
    with open(log_path, "wb") as log_file:
        proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, env=child_env)
    server = ServerProcess(proc, port, http, grpc, metrics, api_key, model_name, log_path,
                           triton_api_key=triton_api_key or None)
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"moe-serve exited with {proc.returncode}:\n{server.log_tail()}")
        try:
            with urllib.request.urlopen(server.root_url + "/health", timeout=2) as r:
                if r.status == 200:
                    return server
        except (urllib.error.URLError, OSError):
            pass
        if time.monotonic() > deadline:
            server.stop()
            raise RuntimeError(f"moe-serve not healthy after {timeout:.0f} s:\n{server.log_tail()}")
        time.sleep(0.25)
