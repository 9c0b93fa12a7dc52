"""One real `moe-serve` (tritonserver + moe backend + OpenAI API) per test session.

Started as a user would start it (the installed console script), on the embedded
tiny model, with free ports; every integration test shares it.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

API_KEY = "test-key-123"
MAX_MODEL_LEN = 1024


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


@dataclass
class MoeServer:
    proc: subprocess.Popen
    port: int
    triton_http_port: int
    triton_grpc_port: int
    triton_metrics_port: int
    api_key: str
    model: str
    checkpoint_dir: str
    log_path: Path

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


def start_moe_serve(tmp_dir: Path, extra_args: list[str] = (), timeout: float = 300.0, **env) -> MoeServer:
    port, http, grpc, metrics = free_ports(4)
    log_path = tmp_dir / f"moe-serve-{port}.log"
    cmd = [
        str(Path(sys.executable).parent / "moe-serve"),
        "--port", str(port),
        "--triton-http-port", str(http),
        "--triton-grpc-port", str(grpc),
        "--triton-metrics-port", str(metrics),
        "--api-key", API_KEY,
        "--max-model-len", str(MAX_MODEL_LEN),
        *extra_args,
    ]
    log_file = open(log_path, "wb")
    proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, env={**os.environ, **env})
    server = MoeServer(proc, port, http, grpc, metrics, API_KEY, "tiny-mixtral", "", log_path)
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"moe-serve exited with {proc.returncode}:\n{server.log_tail()}")
        try:
            with urllib.request.urlopen(server.root_url + "/health", timeout=2) as r:
                if r.status == 200:
                    break
        except (urllib.error.URLError, OSError):
            pass
        if time.monotonic() > deadline:
            stop_moe_serve(server)
            raise RuntimeError(f"moe-serve not healthy after {timeout:.0f} s:\n{server.log_tail()}")
        time.sleep(0.25)
    return server


def stop_moe_serve(server: MoeServer, timeout: float = 60.0) -> int:
    if server.proc.poll() is None:
        server.proc.send_signal(signal.SIGTERM)
        try:
            server.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            server.proc.kill()
            server.proc.wait()
    return server.proc.returncode


@pytest.fixture(scope="session")
def moe_server(tmp_path_factory, tiny_checkpoint):
    server = start_moe_serve(tmp_path_factory.mktemp("moe_serve"))
    server.checkpoint_dir = str(tiny_checkpoint)
    yield server
    code = stop_moe_serve(server)
    assert code == 0, f"moe-serve exited with {code} on SIGTERM:\n{server.log_tail()}"


@pytest.fixture(scope="session")
def openai_client(moe_server):
    import openai

    return openai.OpenAI(base_url=moe_server.base_url, api_key=moe_server.api_key, max_retries=0, timeout=120)
