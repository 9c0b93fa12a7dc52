"""The Dockerfiles pass hadolint (building and running the image is docker/smoke.sh, too slow for CI)."""
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HADOLINT = Path(sys.executable).parent / "hadolint"


@pytest.mark.parametrize("dockerfile", ["Dockerfile", "docker/base/Dockerfile"])
def test_hadolint_passes(dockerfile):
    r = subprocess.run([str(HADOLINT), str(ROOT / dockerfile)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


def test_image_runs_moe_serve_as_non_root_with_a_healthcheck():
    text = (ROOT / "Dockerfile").read_text()
    assert 'ENTRYPOINT ["moe-serve"]' in text
    assert "HEALTHCHECK" in text and "/health" in (ROOT / "docker/healthcheck.py").read_text()
    users = [line.split()[1] for line in text.splitlines() if line.startswith("USER ")]
    assert users and users[-1] not in ("root", "0")
