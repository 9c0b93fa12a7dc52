"""loadtest/bench/bench_fp8.py on the CPU (tiny shape): both engines run, the report and results are written, and on
the tiny random model the W8A8 forward routes as its dequantised reference does (the GPU run reports the real shape).
The script run is a subprocess (about 20 s here)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_bench_fp8_runs_on_cpu(tmp_path):
    cmd = [sys.executable, str(REPO / "loadtest/bench/bench_fp8.py"), "--shape", "tiny", "--device", "cpu",
           "--scale", "0.05", "--ref-prompts", "1", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    assert {"bf16", "fp8", "agreement", "ratios"} <= set(results)
    assert results["fp8"]["a"]["itl_p50_s"] > 0 and results["fp8"]["b"]["tok_s"] > 0
    assert results["agreement"]["routed_sets_equal_min"] >= 0.9
    assert "routed sets" in (tmp_path / "report.md").read_text()
