"""Find, start, load and stop a real tritonserver for `moe-serve`.

The binary is the one on PATH (official containers), else the one bundled in
the nvidia-pytriton wheel (developer machines). The backend directory is
assembled in a run directory: Triton's python backend (plus the stub for this
Python) and this project's Python-based ``moe`` backend. The python stub finds
its interpreter through PATH, so this environment's bin directory goes first.
"""
from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger("moe_serve")

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MODEL_REPOSITORY = REPO_ROOT / "model_repository"
DEFAULT_MOE_BACKEND = REPO_ROOT / "backends" / "moe"
PY_VERSION = f"{sys.version_info.major}.{sys.version_info.minor}"


class TritonError(RuntimeError):
    """tritonserver could not be found, started or loaded."""


@dataclass
class TritonPaths:
    binary: Path
    python_backend: Path  # holds libtriton_python.so and triton_python_backend_utils.py
    stub: Path | None  # triton_python_backend_stub, when not already in python_backend
    lib_dirs: list[Path] = field(default_factory=list)


def find_tritonserver(explicit: str | None = None) -> TritonPaths:
    if explicit or shutil.which("tritonserver"):
        binary = Path(explicit or shutil.which("tritonserver")).resolve()
        root = binary.parent.parent  # /opt/tritonserver
        backend = root / "backends" / "python"
        if not (backend / "libtriton_python.so").exists():
            raise TritonError(f"{binary}: no python backend at {backend}")
        return TritonPaths(binary, backend, None)
    # Locate the wheel without importing it (pytriton's own imports need packages we skip).
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        raise TritonError("no tritonserver on PATH and the nvidia-pytriton wheel is not installed (run `make serve`)")
    package_dir = Path(list(spec.submodule_search_locations)[0]).resolve()
    root = package_dir / "tritonserver"
    stub = root / "python_backend_stubs" / PY_VERSION / "triton_python_backend_stub"
    if not stub.exists():
        raise TritonError(f"nvidia-pytriton has no python backend stub for Python {PY_VERSION}")
    libs = package_dir.parent / "nvidia_pytriton.libs"
    return TritonPaths(root / "bin" / "tritonserver", root / "backends" / "python", stub, [libs])


def assemble_backends(paths: TritonPaths, run_dir: Path, moe_backend: Path = DEFAULT_MOE_BACKEND) -> Path:
    """<run_dir>/backends/{python,moe}: the python backend's files copied (Triton refuses a
    backend library that resolves outside its directory), the moe backend linked."""
    backends = run_dir / "backends"
    py = backends / "python"
    py.mkdir(parents=True, exist_ok=True)
    for f in paths.python_backend.iterdir():
        if f.name == "__pycache__":
            continue
        if f.is_dir():
            shutil.copytree(f, py / f.name)
        else:
            shutil.copy2(f, py / f.name)
    if paths.stub is not None:
        shutil.copy2(paths.stub, py / "triton_python_backend_stub")
    (backends / "moe").symlink_to(moe_backend.resolve(), target_is_directory=True)
    return backends


@dataclass
class TritonPorts:
    http: int = 8000
    grpc: int = 8001
    metrics: int = 8002


class TritonServer:
    """One tritonserver process (its own process group, so stopping it leaves no stubs behind)."""

    def __init__(
        self,
        model_repository: Path = DEFAULT_MODEL_REPOSITORY,
        ports: TritonPorts | None = None,
        binary: str | None = None,
        shm_bytes: int = 64 * 2**20,
        log_verbose: int = 0,
        host: str = "127.0.0.1",
        moe_backend: Path = DEFAULT_MOE_BACKEND,
        run_dir: str | None = None,
    ):
        self.model_repository = Path(model_repository)
        self.ports = ports or TritonPorts()
        self.paths = find_tritonserver(binary)
        self.shm_bytes = shm_bytes
        self.log_verbose = log_verbose
        self.host = host
        self.moe_backend = Path(moe_backend)
        # Holds a copy of libtriton_python.so: the directory must allow exec (not a noexec tmpfs).
        self.run_dir = Path(tempfile.mkdtemp(prefix="moe-serve-", dir=run_dir))
        self.proc: subprocess.Popen | None = None

    @property
    def http_url(self) -> str:
        return f"127.0.0.1:{self.ports.http}"

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.ports.grpc}"

    def command(self) -> list[str]:
        backends = assemble_backends(self.paths, self.run_dir, self.moe_backend)
        # A distinct shm prefix per server lets several run on one host (tests, benchmarks).
        prefix = f"moe_serve_{os.getpid()}_{self.ports.grpc}_"
        cmd = [
            str(self.paths.binary),
            f"--model-repository={self.model_repository}",
            f"--backend-directory={backends}",
            "--model-control-mode=explicit",
            "--disable-auto-complete-config",
            f"--http-port={self.ports.http}",
            f"--grpc-port={self.ports.grpc}",
            f"--metrics-port={self.ports.metrics}",
            f"--http-address={self.host}",
            f"--grpc-address={self.host}",
            "--allow-gpu-metrics=false",
            # Large routed-experts outputs (a 32k-token request is ~24 MB) travel through the
            # python backend's shared memory; start big and grow in big steps.
            f"--backend-config=python,shm-default-byte-size={self.shm_bytes}",
            f"--backend-config=python,shm-growth-byte-size={self.shm_bytes}",
            f"--backend-config=python,shm-region-prefix-name={prefix}",
            f"--log-verbose={self.log_verbose}",
            "--exit-timeout-secs=10",  # in-flight requests get this long on shutdown
        ]
        if not _has_cuda():
            cmd.append("--pinned-memory-pool-byte-size=0")
        return cmd

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        # The stub embeds Python and finds sys.prefix through `python3` on PATH: this venv's.
        env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
        libs = [str(p) for p in self.paths.lib_dirs]
        if libs:
            env["LD_LIBRARY_PATH"] = os.pathsep.join(libs + [env.get("LD_LIBRARY_PATH", "")]).rstrip(os.pathsep)
        return env

    def start(self) -> None:
        cmd = self.command()
        log.info("starting tritonserver: %s", " ".join(cmd))
        self.proc = subprocess.Popen(cmd, env=self.env(), start_new_session=True, preexec_fn=_die_with_parent)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def _get(self, path: str, timeout: float = 2.0) -> int:
        try:
            with urllib.request.urlopen(f"http://{self.http_url}{path}", timeout=timeout) as r:
                return r.status
        except urllib.error.HTTPError as e:
            return e.code
        except (urllib.error.URLError, OSError):
            return 0

    def wait_live(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.alive():
                raise TritonError(f"tritonserver exited with code {self.proc.returncode} while starting")
            if self._get("/v2/health/live") == 200:
                return
            time.sleep(0.1)
        raise TritonError(f"tritonserver did not become live within {timeout:.0f} s")

    def load_model(self, name: str, config: dict, timeout: float = 3600.0) -> None:
        """Load `name` with a full config override (explicit model control) and wait until READY."""
        body = json.dumps({"parameters": {"config": json.dumps(config)}}).encode()
        req = urllib.request.Request(
            f"http://{self.http_url}/v2/repository/models/{name}/load",
            data=body,
            method="POST",
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                r.read()
        except urllib.error.HTTPError as e:
            detail = e.read().decode(errors="replace")
            try:
                detail = json.loads(detail).get("error", detail)
            except ValueError:
                pass
            raise TritonError(f"loading model {name!r} failed: {detail}") from None
        except (urllib.error.URLError, OSError) as e:
            if not self.alive():
                raise TritonError(f"tritonserver exited with code {self.proc.returncode} while loading") from None
            raise TritonError(f"loading model {name!r} failed: {e}") from None
        if self._get(f"/v2/models/{name}/ready") != 200:
            raise TritonError(f"model {name!r} is not ready after loading")

    def stop(self, timeout: float = 20.0) -> None:
        if self.proc is not None and self.proc.poll() is None:
            log.info("stopping tritonserver (pid %d)", self.proc.pid)
            _signal_group(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                log.warning("tritonserver did not stop in %.0f s; killing it", timeout)
        if self.proc is not None:
            _signal_group(self.proc.pid, signal.SIGKILL)  # stubs left in the group, if any
            self.proc.wait()
        shutil.rmtree(self.run_dir, ignore_errors=True)


def _die_with_parent() -> None:
    """In the child: get SIGTERM when moe-serve dies, even by SIGKILL, so tritonserver is never orphaned."""
    try:
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass  # not Linux: the normal stop path still applies


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _has_cuda() -> bool:
    return any(Path(p).exists() for p in ("/dev/nvidia0", "/dev/nvidiactl"))


def model_config_with_parameters(config_pbtxt: Path, parameters: dict[str, str]) -> dict:
    """Parse config.pbtxt, override/add string parameters, return Triton's JSON form."""
    from google.protobuf import json_format, text_format
    from tritonclient.grpc import model_config_pb2

    cfg = model_config_pb2.ModelConfig()
    text_format.Parse(config_pbtxt.read_text(), cfg)
    for key, value in parameters.items():
        cfg.parameters[key].string_value = str(value)
    return json_format.MessageToDict(cfg, preserving_proto_field_name=True)
