#!/usr/bin/env python
"""bench_real_shape.py for several versions of the code, alternated on one machine: the A/B runs behind the
"before / after" figures of reports/real_shape_h200.md, in one command.

A variant is ``NAME=DIR[,VAR=VALUE...][,--FLAG...]``: a tree holding backends/ and loadtest/ (the checkout, or an older
commit unpacked with ``git archive REV backends loadtest | tar -x -C DIR``), environment settings (``MOE_PDL=0``) and
benchmark flags of that variant alone (``--disable-expert-load``: a setting A/B on one tree). Each
round runs every variant once, in the order given, each as its own process started in its tree with that tree first
on the path (a tree's benchmark imports that tree's engine: running the checkout's script against an older
backends/ would time a mix). The benchmark's arguments after ``--`` go to every run. Alternating rounds is what
makes the variants comparable: GPU clocks, temperature and the machine's other load drift over all of them alike.

    PYTHONPATH=backends:. python3 loadtest/bench/ab_real_shape.py --rounds 2 --variant base=/tmp/base \\
        --variant pdl-off=.,MOE_PDL=0 --variant new=. --out OUT -- --quick --cases a --reps 2

Prints every run's decode ITL p50 / output tok/s per case as it ends, then per case and variant the medians over
all its repetitions and their ratio to the first variant's. ``--out``: ab.json (every repetition) and each run's
own results.json, report.md and log under NAME-rR/.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

METRICS = ("itl_p50_s", "tok_s", "ttft_p50_s")  # per repetition, from results.json's cases.<case>.reps
SCRIPTS = ("loadtest/bench/bench_real_shape.py", "loadtest/bench_real_shape.py")  # this layout, then older trees'


def bench_script(tree: Path) -> Path | None:
    """The tree's own bench_real_shape.py (an older commit has it directly in loadtest/)."""
    return next((tree / s for s in SCRIPTS if (tree / s).is_file()), None)


def parse_variant(text: str) -> tuple[str, Path, dict[str, str], list[str]]:
    name, _, rest = text.partition("=")
    parts = rest.split(",")
    tree, env, flags = Path(parts[0]).resolve(), {}, []
    for item in parts[1:]:
        if item.startswith("--"):  # a benchmark flag of this variant
            flags.append(item)
            continue
        var, eq, value = item.partition("=")
        if not eq:
            raise SystemExit(f"--variant {text!r}: {item!r} is not VAR=VALUE")
        env[var] = value
    if not name or bench_script(tree) is None or not (tree / "backends").is_dir():
        raise SystemExit(f"--variant {text!r}: want NAME=DIR with DIR/backends and DIR/{SCRIPTS[0]}")
    return name, tree, env, flags


def run_one(name: str, tree: Path, env: dict[str, str], bench_args: list[str], out: Path, timeout: float) -> dict:
    """One benchmark process of one variant -> {case: [rep metrics]} (empty if it failed; its log says why)."""
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, str(bench_script(tree)), *bench_args, "--out", str(out)]
    full_env = {**os.environ, "PYTHONPATH": f"{tree / 'backends'}{os.pathsep}{tree}", **env}
    t0 = time.monotonic()
    try:
        proc = subprocess.run(cmd, cwd=tree, env=full_env, capture_output=True, text=True, timeout=timeout)
        log, rc = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as err:  # its captured output may come back as bytes despite text=True
        text = [x.decode(errors="replace") if isinstance(x, bytes) else x or "" for x in (err.stdout, err.stderr)]
        log, rc = "".join(text) + f"\n(killed after {timeout:.0f} s)", "timeout"
    (out / "log.txt").write_text(log)
    results = out / "results.json"
    cases = json.loads(results.read_text()).get("cases", {}) if results.is_file() else {}
    reps = {case: [{k: r.get(k) for k in METRICS} for r in res.get("reps", [])]
            for case, res in cases.items() if isinstance(res, dict) and res.get("reps")}
    line = "; ".join(f"{case}: ITL " + "/".join(_ms(r["itl_p50_s"]) for r in rs) + " ms, "
                     + "/".join(_num(r["tok_s"]) for r in rs) + " tok/s" for case, rs in reps.items())
    status = "" if rc == 0 else f" [exit {rc}: see {out / 'log.txt'}]"
    print(f"{name:>12s}  {line or 'no repetitions'}{status}  ({time.monotonic() - t0:.0f} s)", flush=True)
    return reps


def _ms(s) -> str:
    return "-" if s is None else f"{s * 1e3:.2f}"


def _num(x) -> str:
    return "-" if x is None else f"{x:,.0f}"


def summarize(variants: list[str], runs: list[dict]) -> list[dict]:
    """Per case and variant: medians of each metric over every repetition of every round, ratio to variant 0."""
    rows = []
    cases = sorted({case for r in runs for case in r["reps"]})
    for case in cases:
        first = None
        for name in variants:
            reps = [rep for r in runs if r["variant"] == name for rep in r["reps"].get(case, [])]
            med = {k: statistics.median(v) if (v := [rep[k] for rep in reps if rep[k] is not None]) else None
                   for k in METRICS}
            first = first or med
            ratio = (med["itl_p50_s"] / first["itl_p50_s"]) if med["itl_p50_s"] and first["itl_p50_s"] else None
            rows.append(dict(case=case, variant=name, reps=len(reps), **med, itl_ratio=ratio))
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                usage="%(prog)s --variant NAME=DIR[,VAR=VALUE...][,--FLAG...] [...] [options] -- "
                                      "BENCH_ARGS")
    p.add_argument("--variant", action="append", required=True,
                   help="NAME=DIR[,VAR=VALUE...][,--FLAG...] (two or more)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per benchmark run")
    p.add_argument("--out", default=None)
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)
    args, bench_args = p.parse_args(argv[:split]), argv[split + 1:]
    if "--out" in bench_args:
        raise SystemExit("give --out before --: every run gets its own directory under it")
    variants = [parse_variant(v) for v in args.variant]
    names = [v[0] for v in variants]
    if len(set(names)) != len(names):
        raise SystemExit(f"variant names must differ: {names}")
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="ab_real_shape_"))
    print(f"ab_real_shape: {len(variants)} variants x {args.rounds} rounds of bench_real_shape.py "
          f"{' '.join(bench_args)}; runs under {out}", flush=True)
    runs = []
    for r in range(1, args.rounds + 1):
        for name, tree, env, flags in variants:
            reps = run_one(name, tree, env, bench_args + flags, out / f"{name}-r{r}", args.timeout)
            runs.append(dict(variant=name, round=r, tree=str(tree), env=env, flags=flags, reps=reps))
    rows = summarize(names, runs)
    print(f"\n| case | variant | reps | decode ITL p50 ms | vs {names[0]} | output tok/s | TTFT p50 ms |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for row in rows:
        ratio = "-" if row["itl_ratio"] is None else f"{row['itl_ratio']:.3f}"
        print(f"| {row['case']} | {row['variant']} | {row['reps']} | {_ms(row['itl_p50_s'])} | {ratio} | "
              f"{_num(row['tok_s'])} | {_ms(row['ttft_p50_s'])} |")
    (out / "ab.json").write_text(json.dumps(dict(bench_args=bench_args, runs=runs, summary=rows), indent=1))
    return 0 if all(r["reps"] for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
