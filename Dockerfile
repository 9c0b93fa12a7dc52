# moe-serve on the official Triton Inference Server image.
#
#   DOCKER_BUILDKIT=1 docker build -t moe-serve .
#   docker run --gpus all --shm-size=1g -p 9000:9000 moe-serve                      # tiny model
#   docker run --gpus all --shm-size=1g -v /path/to/ckpt:/models/x:ro -p 9000:9000 moe-serve --model /models/x
#
# --shm-size: Triton's python backend moves every tensor through /dev/shm, starting with a
# 64 MiB region per model (MOE_SERVE_TRITON_SHM_MB) that grows in 64 MiB steps; Docker's
# default /dev/shm is 64 MiB in all. The image writes only under /tmp (moe-serve's run
# directory, which holds a copy of the python backend library): with --read-only, add
# --tmpfs /tmp:exec (Docker mounts a plain --tmpfs noexec, and the library must be mapped).
#
# Needs BuildKit (RUN --mount): DOCKER_BUILDKIT=1 with Docker >= 20.10, or docker buildx.
# There is deliberately no "# syntax=" line, so no frontend image has to be pulled.
#
# Base image: nvcr.io/nvidia/tritonserver:26.09-py3 = Triton 2.73.0, the newest release
# whose version matches the Triton client this project pins (tritonclient==2.73.0 in
# requirements.txt; 2.73.0 is also the newest client on PyPI as of 2026-11). It ships
# tritonserver on PATH and the python backend (libtriton_python.so + the stub built
# for the image's own python3) in /opt/tritonserver/backends/python; its stubs are
# r24.11+ and work with numpy 1 and 2 (the pinned numpy 1.26.4 is what 2.51 needs).
# CPU-only machines and CI build FROM a local stand-in with the same layout (Debian
# bookworm + tritonserver 2.51 from the nvidia-pytriton wheel): docker/smoke.sh.
ARG BASE_IMAGE=nvcr.io/nvidia/tritonserver:26.09-py3
FROM ${BASE_IMAGE}

# torch: a CUDA build by default (PyTorch's CUDA 13.0 wheels need an NVIDIA driver >= 580,
# as the 26.09 base does). An empty TORCH_INDEX_URL uses PyPI, whose Linux x86_64 torch is
# a CUDA build as well. CPU-only: TORCH_SPEC="torch==2.13.0+cpu" with the CPU index or a
# wheel dropped into docker/wheels/ (pip looks there first; see docker/wheels/README.md).
# Keep the version equal to the torch pin in requirements.txt.
ARG TORCH_SPEC="torch==2.13.0"
ARG TORCH_INDEX_URL="https://download.pytorch.org/whl/cu130"
# The runtime user (not the base image's triton-server, uid 1000, so the two never mix).
ARG MOE_UID=10001

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

ENV VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:${PATH} \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1

RUN groupadd -g "${MOE_UID}" moe \
    && useradd -l -m -u "${MOE_UID}" -g moe -s /usr/sbin/nologin moe

# A venv on the base image's python3 (the version the python backend stub was built for).
# The official image has no ensurepip (python3-venv) but ships virtualenv; Debian has venv.
# moe-serve puts this venv's bin first on PATH, which is how the stub finds its packages.
RUN if ! python3 -m venv "${VIRTUAL_ENV}" 2> /dev/null; then \
        rm -rf "${VIRTUAL_ENV}" && python3 -m virtualenv -q "${VIRTUAL_ENV}"; \
    fi \
    && "${VIRTUAL_ENV}/bin/python" -m pip --version

WORKDIR /opt/moe-serve

# Pip certificates: pass a CA bundle as a build secret where egress goes through a private
# CA (docker build --secret id=pip_ca,src=/etc/ssl/certs/ca-certificates.crt). A secret
# mount is never written to a layer, so the image does not carry the host's CA bundle.
# docker/wheels/ is bind-mounted (not copied) as an extra wheel source.
# DL3013 (unpinned pip package): TORCH_SPEC is a pinned spec ("torch==X.Y.Z"), which the
# linter cannot see through the variable.
# hadolint ignore=DL3013
RUN --mount=type=secret,id=pip_ca \
    --mount=type=bind,source=docker/wheels,target=/tmp/wheels \
    if [ -s /run/secrets/pip_ca ]; then export PIP_CERT=/run/secrets/pip_ca; fi \
    && pip install --find-links /tmp/wheels ${TORCH_INDEX_URL:+--index-url "${TORCH_INDEX_URL}"} "${TORCH_SPEC}"

# The pinned dependencies (torch is already satisfied: "torch==2.13.0" matches 2.13.0+cu130/+cpu).
COPY requirements.txt constraints.txt ./
RUN --mount=type=secret,id=pip_ca \
    --mount=type=bind,source=docker/wheels,target=/tmp/wheels \
    if [ -s /run/secrets/pip_ca ]; then export PIP_CERT=/run/secrets/pip_ca; fi \
    && pip install --find-links /tmp/wheels -c constraints.txt -r requirements.txt \
    && python -c "import numpy, torch; print('numpy', numpy.__version__, 'torch', torch.__version__, 'cuda', torch.version.cuda)"

# The project, installed editable: moe-serve finds model_repository/ and backends/moe/
# next to its sources (openai_frontend/triton_server.py: REPO_ROOT), so they stay here.
COPY pyproject.toml ./
COPY backends/ backends/
COPY openai_frontend/ openai_frontend/
COPY model_repository/ model_repository/
COPY docker/healthcheck.py docker/image_check.py docker/
RUN --mount=type=secret,id=pip_ca \
    if [ -s /run/secrets/pip_ca ]; then export PIP_CERT=/run/secrets/pip_ca; fi \
    && pip install --no-deps -e . \
    && rm -rf ./*.egg-info \
    && python -m compileall -q backends openai_frontend \
    && ln -s /opt/moe-serve/backends/moe /opt/tritonserver/backends/moe \
    && python docker/image_check.py

# The embedded tiny checkpoint, generated now into the runtime user's cache, so that a
# plain `docker run IMAGE` writes nothing but moe-serve's run directory under /tmp.
# Numeric, so that runtimes can check it is not root (Kubernetes runAsNonRoot).
USER ${MOE_UID}:${MOE_UID}
ENV HOME=/home/moe \
    MOE_SERVE_CACHE=/home/moe/.cache/moe-serve \
    MOE_SERVE_HOST=0.0.0.0 \
    MOE_SERVE_PORT=9000
RUN python -c "from moe_engine.tiny import ensure_tiny_checkpoint; print(ensure_tiny_checkpoint())"

# The OpenAI API. Triton has no port by default (gRPC is a unix socket in moe-serve's run
# directory, HTTP is off, metrics stay on the container's loopback); Triton clients get in only
# with a key: -e MOE_SERVE_TRITON_API_KEY=... -e MOE_SERVE_TRITON_HOST=0.0.0.0 -p 8000-8001:8000-8001.
# Keys go in the environment or a mounted file (--api-key-file), never in the command.
# Stopping: moe-serve gives in-flight requests --shutdown-timeout (30 s) after SIGTERM, so
# `docker stop -t 40`; with --restart=on-failure Docker restarts it when it gives up on a backend.
EXPOSE 9000
HEALTHCHECK --interval=15s --timeout=5s --start-period=600s --retries=3 \
    CMD ["python", "/opt/moe-serve/docker/healthcheck.py"]
ENTRYPOINT ["moe-serve"]
