"""Find, start, probe and stop a real, locked-down tritonserver for `moe-serve`.

The binary is the one on PATH (official containers), else the one bundled in
the nvidia-pytriton wheel (developer machines). Everything tritonserver reads
is assembled in a private run directory (mode 0700): Triton's python backend
(plus the stub for this Python), this project's ``moe`` backend, and a model
repository holding only ``moe/config.pbtxt`` with moe-serve's parameters.

What Triton exposes (the contract README.md "Security" documents):
- Model control is off (``--model-control-mode=none``): the model is loaded
  when tritonserver starts and no repository API can load, unload or upload
  anything afterwards.
- Private (the default): no HTTP endpoint; gRPC listens on a unix socket in
  the run directory, so only moe-serve's user can connect, and every gRPC API
  needs a per-run secret header (:class:`TritonAccess`) that only moe-serve
  holds. The metrics endpoint (read-only) stays on 127.0.0.1.
- Shared (``--triton-api-key``): gRPC and HTTP listen on ``--triton-host``
  for clients that send the key; the admin APIs (model repository, shared
  memory, trace, logging) stay behind a per-run secret nobody uses.
"""
from __future__ import annotations

import importlib.util
import ipaddress
import json
import logging
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from . import procfs

log = logging.getLogger("moe_serve")

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MODEL_REPOSITORY = REPO_ROOT / "model_repository"
DEFAULT_MOE_BACKEND = REPO_ROOT / "backends" / "moe"
PY_VERSION = f"{sys.version_info.major}.{sys.version_info.minor}"

# Triton's restricted-API groups. Each API is in exactly one group; a request to a restricted API without
# the group's header is refused (gRPC: UNAVAILABLE, HTTP: 403).
CLIENT_APIS = ("health", "metadata", "inference", "model-config", "statistics")
ADMIN_APIS = ("model-repository", "shared-memory", "trace", "logging")
KEY_NAME = "moe-serve-key"  # HTTP clients send this header; gRPC clients "triton-grpc-protocol-moe-serve-key"
_ADMIN_KEY_NAME = "moe-serve-admin"
_GRPC_HEADER_PREFIX = "triton-grpc-protocol-"  # tritonserver prefixes restricted gRPC header names with this


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


@dataclass(frozen=True)
class TritonAccess:
    """Who may use tritonserver's APIs.

    ``client_key`` opens health, metadata, model-config, statistics and
    inference; ``admin_key`` (random, never sent by anyone) guards the rest.
    ``shared`` = the key is the user's (``--triton-api-key``) and the ports
    listen on ``host``; otherwise the key is a per-run secret and gRPC is a
    unix socket.
    """

    client_key: str
    admin_key: str
    shared: bool = False
    host: str = "127.0.0.1"

    @classmethod
    def private(cls) -> TritonAccess:
        return cls(client_key=secrets.token_urlsafe(32), admin_key=secrets.token_urlsafe(32))

    @classmethod
    def with_key(cls, key: str, host: str = "127.0.0.1") -> TritonAccess:
        if not key or any(c in key for c in " \t\r\n,:="):
            raise TritonError("the Triton API key must be non-empty, without spaces, ',', ':' or '='")
        return cls(client_key=key, admin_key=secrets.token_urlsafe(32), shared=True, host=host)

    @property
    def grpc_headers(self) -> dict[str, str]:
        return {_GRPC_HEADER_PREFIX + KEY_NAME: self.client_key}

    @property
    def http_headers(self) -> dict[str, str]:
        return {KEY_NAME: self.client_key}

    def restriction_flags(self, protocol: str) -> list[str]:
        """``--grpc-restricted-protocol`` / ``--http-restricted-api`` arguments for both groups."""
        flag = "--grpc-restricted-protocol" if protocol == "grpc" else "--http-restricted-api"
        return [
            f"{flag}={','.join(CLIENT_APIS)}:{KEY_NAME}={self.client_key}",
            f"{flag}={','.join(ADMIN_APIS)}:{_ADMIN_KEY_NAME}={self.admin_key}",
        ]


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class TritonServer:
    """One tritonserver process (its own process group, so stopping it leaves no stubs behind).

    ``start`` / ``wait_ready`` / ``kill`` may run again (the watchdog restarts a failed backend);
    ``stop`` ends it for good and removes the run directory and its shared-memory regions.
    """

    def __init__(
        self,
        model_config: dict,
        model_name: str = "moe",
        ports: TritonPorts | None = None,
        access: TritonAccess | None = None,
        binary: str | None = None,
        shm_bytes: int = 64 * 2**20,
        log_verbose: int = 0,
        moe_backend: Path = DEFAULT_MOE_BACKEND,
        run_dir: str | None = None,
    ):
        self.model_name = model_name
        self.ports = ports or TritonPorts()
        self.access = access or TritonAccess.private()
        self.paths = find_tritonserver(binary)
        self.shm_bytes = shm_bytes
        self.log_verbose = log_verbose
        # Holds a copy of libtriton_python.so: the directory must allow exec (not a noexec tmpfs). mkdtemp: 0700.
        reap_stale_run_dirs(Path(run_dir or tempfile.gettempdir()))  # what a SIGKILLed moe-serve left behind
        self.run_dir = Path(tempfile.mkdtemp(prefix=RUN_DIR_PREFIX, dir=run_dir))
        self.backends = assemble_backends(self.paths, self.run_dir, Path(moe_backend))
        self.repository = self._write_repository(model_config)
        # A distinct shm prefix per run lets several servers share a host (tests, benchmarks) and lets
        # stop/kill remove exactly this run's regions, also those a killed stub leaves behind.
        self.shm_prefix = f"moe_serve_{os.getpid()}_{secrets.token_hex(4)}_"
        self.proc: subprocess.Popen | None = None
        self._lock = threading.Lock()  # start vs stop: the watchdog may be restarting while moe-serve stops
        self._stopped = False
        self._socket_dir: Path | None = None
        if not self.access.shared:
            sock = self.run_dir / "grpc.sock"
            if len(str(sock)) > 90:  # unix socket paths are limited to 108 bytes (and Triton appends ":0")
                self._socket_dir = Path(tempfile.mkdtemp(prefix="moe-serve-sock-"))
                sock = self._socket_dir / "grpc.sock"
            self._socket = sock
        # Who owns this directory: a later moe-serve removes it (and what it names) once this process is gone.
        owner = {"pid": os.getpid(), "start_time": procfs.start_time(os.getpid()), "shm_prefix": self.shm_prefix,
                 "socket_dir": str(self._socket_dir) if self._socket_dir else None}
        (self.run_dir / OWNER_FILE).write_text(json.dumps(owner))

    # ------------------------------------------------------------------ addresses

    @property
    def grpc_url(self) -> str:
        """What a gRPC client (tritonclient) connects to."""
        if not self.access.shared:
            return f"unix:{self._socket}:0"  # tritonserver binds "<address>:<port>"
        return f"{_client_host(self.access.host)}:{self.ports.grpc}"

    @property
    def http_url(self) -> str | None:
        return f"{_client_host(self.access.host)}:{self.ports.http}" if self.access.shared else None

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.ports.metrics}/metrics"

    # ------------------------------------------------------------------ process

    def _write_repository(self, model_config: dict) -> Path:
        from google.protobuf import json_format, text_format
        from tritonclient.grpc import model_config_pb2

        cfg = json_format.ParseDict(model_config, model_config_pb2.ModelConfig())
        repo = self.run_dir / "models"
        (repo / self.model_name / "1").mkdir(parents=True)
        (repo / self.model_name / "config.pbtxt").write_text(text_format.MessageToString(cfg))
        return repo

    def command(self) -> list[str]:
        a = self.access
        cmd = [
            str(self.paths.binary),
            f"--model-repository={self.repository}",
            f"--backend-directory={self.backends}",
            "--model-control-mode=none",  # loaded at start; no load/unload/upload API afterwards
            "--disable-auto-complete-config",
            "--strict-readiness=true",
            "--metrics-address=127.0.0.1",
            f"--metrics-port={self.ports.metrics}",
            "--allow-gpu-metrics=false",
            # Large routed-experts outputs (a 32k-token request is ~24 MB) travel through the
            # python backend's shared memory; start big and grow in big steps.
            f"--backend-config=python,shm-default-byte-size={self.shm_bytes}",
            f"--backend-config=python,shm-growth-byte-size={self.shm_bytes}",
            f"--backend-config=python,shm-region-prefix-name={self.shm_prefix}",
            f"--log-verbose={self.log_verbose}",
            "--exit-timeout-secs=10",  # moe-serve ends its own requests first (--shutdown-timeout)
        ]
        if a.shared:
            cmd += [f"--grpc-address={a.host}", f"--grpc-port={self.ports.grpc}",
                    "--allow-http=true", f"--http-address={a.host}", f"--http-port={self.ports.http}"]
            cmd += a.restriction_flags("http")
        else:
            cmd += [f"--grpc-address=unix:{self._socket}", "--grpc-port=0", "--allow-http=false"]
        cmd += a.restriction_flags("grpc")
        if not _has_cuda():
            cmd.append("--pinned-memory-pool-byte-size=0")
        return cmd

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        for key in [k for k in env if k.endswith("API_KEY") and k.startswith("MOE_SERVE_")]:
            del env[key]  # tritonserver and the stub need none of moe-serve's keys
        # The stub embeds Python and finds sys.prefix through `python3` on PATH: this venv's.
        env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
        libs = [str(p) for p in self.paths.lib_dirs]
        if libs:
            env["LD_LIBRARY_PATH"] = os.pathsep.join(libs + [env.get("LD_LIBRARY_PATH", "")]).rstrip(os.pathsep)
        return env

    def start(self) -> None:
        with self._lock:
            if self._stopped:
                raise TritonError("tritonserver is being stopped for good")
            if not self.access.shared:
                Path(f"{self._socket}:0").unlink(missing_ok=True)
            cmd = self.command()
            shown = [c if "restrict" not in c else c.split("=")[0] + "=<hidden>" for c in cmd]
            log.info("starting tritonserver: %s", " ".join(shown))
            # Its own session: a Ctrl-C in the terminal reaches moe-serve only, which then stops Triton in order.
            self.proc = subprocess.Popen(cmd, env=self.env(), start_new_session=True, preexec_fn=_die_with_parent)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def client(self):
        """A synchronous tritonclient gRPC client (with the key, via ``headers=self.access.grpc_headers``)."""
        import tritonclient.grpc as grpcclient

        return grpcclient.InferenceServerClient(self.grpc_url)

    def is_ready(self, client=None, timeout_s: float = 2.0) -> bool:
        """Server and model ready (gRPC, with the key)."""
        own = client is None
        client = client or self.client()
        try:
            h = self.access.grpc_headers
            return bool(client.is_server_ready(headers=h, client_timeout=timeout_s)
                        and client.is_model_ready(self.model_name, headers=h, client_timeout=timeout_s))
        except Exception:  # noqa: BLE001 - not up (yet), refused, timed out: all mean "not ready"
            return False
        finally:
            if own:
                client.close()

    def wait_ready(self, timeout: float = 3600.0) -> None:
        """Until the model is READY (tritonserver loads it while starting); raises if tritonserver exits."""
        deadline = time.monotonic() + timeout
        client = None
        try:
            while time.monotonic() < deadline:
                if not self.alive():
                    raise TritonError(
                        f"tritonserver exited with code {self.proc.returncode} while loading model "
                        f"{self.model_name!r} (its log above says why)"
                    )
                if client is None and (self.access.shared or Path(f"{self._socket}:0").exists()):
                    client = self.client()
                if client is not None and self.is_ready(client, timeout_s=2.0):
                    return
                time.sleep(0.2)
        finally:
            if client is not None:
                client.close()
        raise TritonError(f"model {self.model_name!r} was not ready within {timeout:.0f} s")

    def kill(self, timeout: float = 10.0) -> None:
        """SIGKILL the whole process group (tritonserver and its stubs, stopped ones too), wait until none of
        them is left, remove its shm.

        Waiting for tritonserver alone is not enough before a restart: its stubs are not its children once it is
        gone, and one still exiting holds its memory (GPU memory too) while the next server loads.
        """
        if self.proc is not None:
            _signal_group(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            left = procfs.wait_group_gone(self.proc.pid, timeout)
            if left:
                log.warning("processes of tritonserver's group still there %.0f s after SIGKILL: %s", timeout, left)
        self.remove_shm()

    def stop(self, timeout: float = 20.0) -> None:
        with self._lock:
            self._stopped = True  # no restart from here on
        if self.proc is not None and self.proc.poll() is None:
            log.info("stopping tritonserver (pid %d)", self.proc.pid)
            _signal_group(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                log.warning("tritonserver did not stop in %.0f s; killing it", timeout)
        self.kill()  # stubs left in the group, if any; regions a crashed stub left behind
        shutil.rmtree(self.run_dir, ignore_errors=True)
        if self._socket_dir is not None:
            shutil.rmtree(self._socket_dir, ignore_errors=True)

    def shm_regions(self) -> list[Path]:
        return sorted(Path("/dev/shm").glob(self.shm_prefix + "*")) if Path("/dev/shm").is_dir() else []

    def remove_shm(self) -> None:
        for p in self.shm_regions():
            try:
                p.unlink()
                log.info("removed shared-memory region %s", p.name)
            except OSError:
                pass


RUN_DIR_PREFIX = "moe-serve-"
OWNER_FILE = "owner.json"


def reap_stale_run_dirs(parent: Path) -> list[Path]:
    """Remove the run directories under ``parent`` whose moe-serve is gone without its ``stop`` (SIGKILL, a crash),
    with their socket directories and shared-memory regions. A directory is removed only when its owner file names
    a process (pid and start time) that no longer runs, and belongs to this user: running servers keep theirs."""
    removed = []
    try:
        candidates = list(parent.glob(RUN_DIR_PREFIX + "*"))
    except OSError:
        return removed
    for d in candidates:
        try:
            if d.stat().st_uid != os.getuid():
                continue
            owner = json.loads((d / OWNER_FILE).read_text())
            pid, started = int(owner["pid"]), owner["start_time"]
        except (OSError, ValueError, KeyError, TypeError):
            continue  # not a run directory, one being assembled, or another user's
        if procfs.start_time(pid) == started and started is not None:
            continue  # its moe-serve still runs
        log.warning("removing %s, left by moe-serve pid %d, which is gone", d, pid)
        shutil.rmtree(d, ignore_errors=True)
        if owner.get("socket_dir"):
            shutil.rmtree(owner["socket_dir"], ignore_errors=True)
        prefix = owner.get("shm_prefix")
        if prefix and Path("/dev/shm").is_dir():
            for region in Path("/dev/shm").glob(prefix + "*"):
                region.unlink(missing_ok=True)
        removed.append(d)
    return removed


def _client_host(host: str) -> str:
    if host in ("0.0.0.0", ""):
        return "127.0.0.1"
    if host == "::":
        return "[::1]"
    return f"[{host}]" if ":" in host else host


def _load_prctl():
    try:
        import ctypes

        return ctypes.CDLL("libc.so.6", use_errno=True).prctl
    except OSError:
        return None  # not Linux: the normal stop path still applies


# Loaded here, in the parent: the child of a threaded process must not dlopen between fork and exec (a lock
# another thread held at the fork would never be released there).
_PRCTL = _load_prctl()
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """In the child: get SIGTERM when moe-serve dies, even by SIGKILL, so tritonserver is never orphaned.

    Linux sends it when the *thread* that forked exits: start tritonserver from a thread that lives as long as
    moe-serve needs it (the main thread, or the watchdog for restarts).
    """
    if _PRCTL is not None:
        _PRCTL(_PR_SET_PDEATHSIG, signal.SIGTERM)


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
