"""Load tests, benchmarks, tuners and probes of moe-serve (README.md). A package: scripts import each other as
loadtest.<folder>.<module>, with the repo root on sys.path (each script run by path puts it there)."""
