"""What /proc says about processes (Linux): one process's state, the processes below a pid, the members of a
process group, each from one scan of ``/proc/<pid>/stat``. Elsewhere (no /proc) every process looks gone.

Used by the watchdog (is tritonserver or a stub dead or stopped?) and by ``TritonServer.kill`` (is anything of
the killed server's process group still alive?).
"""
from __future__ import annotations

import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ProcStat:
    pid: int
    name: str  # the kernel's comm: at most 15 characters
    state: str  # one letter: R, S, D, T, t, Z, X, ...
    ppid: int
    pgrp: int


def _parse(pid: int, stat: str) -> ProcStat:
    # The name (field 2) may contain spaces and parentheses: it ends at the last ')'.
    fields = stat[stat.rindex(")") + 2 :].split()
    return ProcStat(pid, stat[stat.index("(") + 1 : stat.rindex(")")], fields[0], int(fields[1]), int(fields[2]))


def stat(pid: int) -> ProcStat | None:
    """One process's /proc stat, None when it is gone."""
    try:
        return _parse(pid, Path(f"/proc/{pid}/stat").read_text())
    except OSError:
        return None


def start_time(pid: int) -> int | None:
    """When the process started (clock ticks since boot: with the pid, names one process for good), None when gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(text[text.rindex(")") + 2 :].split()[19])


def process_state(pid: int) -> str | None:
    """One-letter state (R, S, D, T, t, Z, X, ...), None when gone."""
    s = stat(pid)
    return None if s is None else s.state


def all_processes() -> Iterator[ProcStat]:
    """Every process /proc lists now (those that end during the scan are skipped)."""
    if not os.path.isdir("/proc"):
        return
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            s = stat(int(entry.name))
            if s is not None:
                yield s


def descendants(pid: int) -> dict[int, str]:
    """{pid: name} of every process below ``pid`` (one /proc scan)."""
    parents = {s.pid: (s.ppid, s.name) for s in all_processes()}
    out: dict[int, str] = {}
    frontier = [pid]
    while frontier:
        p = frontier.pop()
        for child, (ppid, name) in parents.items():
            if ppid == p and child not in out:
                out[child] = name
                frontier.append(child)
    return out


def group_members(pgid: int) -> list[int]:
    """Pids of the live (not zombie) processes of process group ``pgid``."""
    return [s.pid for s in all_processes() if s.pgrp == pgid and s.state not in "ZX"]


def wait_group_gone(pgid: int, timeout: float) -> list[int]:
    """Wait until no live process of group ``pgid`` is left; the pids still there after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        left = group_members(pgid)
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.05)
