#!/usr/bin/env bash
# The GPU half of the suite, which CI (no GPU) cannot run: every unit-test file that honours MOE_TEST_DEVICE, with
# compiled kernels, CUDA graphs and overlapped steps on CUDA, one file at a time under its own time limit, so a slow
# or hanging file costs only itself. Per file: OUT/<file>.log (failures with tracebacks) and OUT/<file>.xml (JUnit);
# one summary line each on stdout.
#   tests/run_on_gpu.sh [OUT] [SECONDS_PER_FILE] [FILE ...]     (from the repo root; python3 with torch + CUDA)
set -u
out=${1:-loadtest/results/gpu_tests}
limit=${2:-300}
shift $(( $# < 2 ? $# : 2 ))
files=("$@")
[ ${#files[@]} -gt 0 ] || mapfile -t files < <(grep -l MOE_TEST_DEVICE tests/unit/test_*.py)
mkdir -p "$out"
export MOE_TEST_DEVICE=cuda PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}backends:."
failed=0
for f in "${files[@]}"; do
  name=$(basename "$f" .py)
  start=$(date +%s)
  timeout "$limit" python3 -m pytest -q -p no:cacheprovider -rfEs --tb=short --junitxml="$out/$name.xml" "$f" \
    >"$out/$name.log" 2>&1
  rc=$?
  [ $rc -eq 0 ] || failed=1
  [ $rc -eq 124 ] && echo "(stopped after ${limit} s)" >>"$out/$name.log"
  echo "$name ($(( $(date +%s) - start )) s): $(grep -E '(passed|failed|error|skipped)' "$out/$name.log" | tail -1 || echo "rc $rc")"
done
exit $failed
