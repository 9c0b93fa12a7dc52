"""Two ranks over gloo for model-level tensor-parallel checks: the test process is rank 0, this module (run as
``python -m tests.unit.parallel_harness``) is rank 1. Both load each case's checkpoint sharded
(``moe_engine.distributed.ranks.load_rank_model``, the loader the engine's ranks use) and run the same whole-sequence forward
(``reference_forward``); rank 0 hands its logits and routed experts to the test.
"""
from __future__ import annotations

import contextlib
import datetime
import json
import subprocess
import sys
from pathlib import Path

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[2]


def rank_processes(root_pid: int | None = None) -> list:
    """Live rank processes (``python -m moe_engine.distributed.ranks``) under ``root_pid`` (default: this process)."""
    import psutil

    out = []
    for p in psutil.Process(root_pid).children(recursive=True):
        try:
            if "moe_engine.distributed.ranks" in p.cmdline() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out


def run_cases(group, cases: list[dict]):
    """Per case {checkpoint, expert_parallel, ids}: (logits [T, V] float32, routed ids [T, L, K]) of this rank."""
    from moe_engine.distributed.ranks import load_rank_model
    from moe_engine.models.decoder import reference_forward

    for case in cases:
        model = load_rank_model(case["checkpoint"], "float32", torch.device("cpu"), group, case["expert_parallel"],
                                progress=False)
        yield reference_forward(model, case["ids"])


@contextlib.contextmanager
def two_ranks():
    """Yields ``run(cases)`` -> list of rank 0's results; rank 1 runs in a child process and is always reaped."""
    from moe_engine.distributed.parallel import ParallelGroup

    store = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=120))
    child = None
    group = None

    def run(cases: list[dict]) -> list:
        nonlocal child, group
        child = subprocess.Popen([sys.executable, "-m", "tests.unit.parallel_harness", str(store.port),
                                  json.dumps(cases)], cwd=REPO)
        group = ParallelGroup.join(store, 0, 2, torch.device("cpu"))
        return list(run_cases(group, cases))

    try:
        yield run
    finally:
        if group is not None:
            group.destroy()
        if child is not None:
            try:
                child.wait(30)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()


def main() -> None:
    from moe_engine.distributed.parallel import ParallelGroup

    torch.set_num_threads(1)
    port, cases = int(sys.argv[1]), json.loads(sys.argv[2])
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=False, timeout=datetime.timedelta(seconds=120))
    group = ParallelGroup.join(store, 1, 2, torch.device("cpu"))
    try:
        for _ in run_cases(group, cases):
            pass
    finally:
        group.destroy()


if __name__ == "__main__":
    main()
