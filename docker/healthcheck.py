"""Container HEALTHCHECK: exit 0 when moe-serve's GET /health answers 200.

Reads the port from MOE_SERVE_PORT (default 9000), as moe-serve does, so set the
port through the environment rather than --port if you change it. Standard library
only: the image needs no curl.
"""
import os
import sys
import urllib.request

port = os.environ.get("MOE_SERVE_PORT", "9000")
try:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=4) as r:
        sys.exit(0 if r.status == 200 else 1)
except Exception as exc:  # connection refused while starting, HTTP 503, timeout, ...
    print(f"unhealthy: {exc}", file=sys.stderr)
    sys.exit(1)
