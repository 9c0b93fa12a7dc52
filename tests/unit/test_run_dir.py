"""Run directories (openai_frontend/triton_server.py): a moe-serve killed with SIGKILL cannot remove its own; the
next moe-serve that starts with the same parent removes it (issue 47), and never one whose server still runs."""
from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

from openai_frontend.triton_server import TritonServer, model_config_with_parameters

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "model_repository" / "moe" / "config.pbtxt"


def _server(parent: Path) -> TritonServer:
    return TritonServer(model_config=model_config_with_parameters(CONFIG, {}), run_dir=str(parent))


def test_the_run_directory_of_a_sigkilled_server_is_removed_at_the_next_start(tmp_path):
    # A process that assembles its run directory (as moe-serve does before starting tritonserver), leaves a
    # shared-memory region of its run behind, and dies by SIGKILL: nothing of its own clean-up runs.
    code = (
        "import os, signal, sys\n"
        "from pathlib import Path\n"
        "from openai_frontend.triton_server import TritonServer, model_config_with_parameters\n"
        f"t = TritonServer(model_config=model_config_with_parameters(Path({str(CONFIG)!r}), {{}}), "
        f"run_dir={str(tmp_path)!r})\n"
        "Path('/dev/shm/' + t.shm_prefix + 'region').write_bytes(b'x')\n"
        "print(t.run_dir, t.shm_prefix, flush=True)\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    left, shm_prefix = proc.stdout.split()
    assert Path(left).is_dir() and Path(f"/dev/shm/{shm_prefix}region").exists()

    alive = _server(tmp_path)  # the next start: removes what the dead one left, keeps its own
    try:
        assert not Path(left).exists()
        assert not Path(f"/dev/shm/{shm_prefix}region").exists()
        assert alive.run_dir.is_dir()
        again = _server(tmp_path)  # a third start leaves the second's directory alone: its process still runs
        assert alive.run_dir.is_dir() and again.run_dir.is_dir()
        again.stop()
        assert not again.run_dir.exists()
    finally:
        alive.stop()
    assert sorted(p.name for p in tmp_path.iterdir()) == []
