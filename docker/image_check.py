"""Build-time self-check of the image (run by the Dockerfile, cheap, no server started).

Fails the build, with a message, if moe-serve would fail at start-up in this image:
- `tritonserver` is on PATH and has a python backend that moe-serve can assemble
  (with the moe backend next to it) into a backend directory;
- the python backend stub is there (it embeds this venv's Python, found on PATH);
- numpy < 2 when the server is older than 2.52 (r24.10 stubs break on numpy 2);
- the engine and the frontend import, and torch reports its build.
"""
import os
import pathlib
import shutil
import sys
import tempfile


def main() -> int:
    from openai_frontend.triton_server import DEFAULT_MOE_BACKEND, assemble_backends, find_tritonserver

    paths = find_tritonserver()
    run_dir = pathlib.Path(tempfile.mkdtemp(prefix="moe-serve-image-check-"))
    try:
        backends = assemble_backends(paths, run_dir)
        have = sorted(p.name for p in (backends / "python").iterdir())
        for need in ("libtriton_python.so", "triton_python_backend_stub", "triton_python_backend_utils.py"):
            if need not in have:
                print(f"image check: {need} missing from the python backend ({have})", file=sys.stderr)
                return 1
        if not (backends / "moe" / "model.py").is_file():
            print(f"image check: no moe backend at {DEFAULT_MOE_BACKEND}", file=sys.stderr)
            return 1
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)

    import numpy
    import torch

    import moe_engine.engine  # noqa: F401
    import openai_frontend.cli  # noqa: F401

    version_file = pathlib.Path(paths.binary).parent.parent / "TRITON_VERSION"
    triton_version = os.environ.get("TRITON_SERVER_VERSION") or (
        version_file.read_text().strip() if version_file.exists() else "unknown"
    )
    try:
        old_stubs = tuple(int(x) for x in triton_version.split(".")[:2]) < (2, 52)
    except ValueError:
        old_stubs = False
    if old_stubs and int(numpy.__version__.split(".")[0]) >= 2:
        print(f"image check: tritonserver {triton_version} stubs need numpy<2, found {numpy.__version__}", file=sys.stderr)
        return 1
    print(
        f"image check ok: tritonserver {triton_version} at {paths.binary}, python {sys.version.split()[0]}, "
        f"numpy {numpy.__version__}, torch {torch.__version__} (CUDA {torch.version.cuda})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
