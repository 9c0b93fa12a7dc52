#!/usr/bin/env bash
# End-to-end smoke test of the project's Docker image, with no container registry:
#   1. uses the running Docker daemon, or installs docker.io (apt-get) and starts one whose
#      data and exec roots live in a scratch directory (stopped again at the end);
#   2. builds a local stand-in for nvcr.io/nvidia/tritonserver:<yy.mm>-py3: Debian bookworm
#      (debootstrap --variant=minbase, imported once and cached) + tritonserver 2.51 from the
#      nvidia-pytriton wheel laid out as /opt/tritonserver (docker/base/Dockerfile);
#   3. builds ./Dockerfile FROM it with the CPU torch wheel (BuildKit, Debian's docker client);
#   4. runs the image, waits for /health, sends a completion with routed experts and checks
#      the routing array (shape, dtype, ids < num_experts), the HEALTHCHECK, the non-root
#      user and a clean stop; prints the time taken and the image size.
# Images are kept between runs (builds are then cached); --clean removes them at the end.
#
# Usage: docker/smoke.sh [--clean] [--rebuild-base]
# Environment:
#   MOE_SMOKE_DIR     scratch directory for a daemon started here and debootstrap (default
#                     /var/tmp/moe-serve-docker; keep it to reuse the cached images)
#   MOE_SMOKE_PORT    host port for the API (default: a free one), bound on 127.0.0.1 only
#   MOE_SMOKE_IMAGE   tag of the project image (default moe-serve:smoke)
#   MOE_SMOKE_CA      CA bundle handed to pip in the builds as a BuildKit secret (default
#                     /etc/ssl/certs/ca-certificates.crt, if present; never stored in a layer)
#   DEBIAN_MIRROR     for debootstrap (default http://deb.debian.org/debian)
#   DOCKER            docker client (default /usr/bin/docker, Debian's, which runs BuildKit
#                     without buildx)
# Exit status: 0 when every check passed, non-zero otherwise.
set -euo pipefail

CLEAN=0
REBUILD_BASE=0
for arg in "$@"; do
    case "$arg" in
        --clean) CLEAN=1 ;;
        --rebuild-base) REBUILD_BASE=1 ;;
        -h|--help) sed -n '2,27p' "$0"; exit 0 ;;
        *) echo "smoke: unknown argument: $arg (see --help)" >&2; exit 2 ;;
    esac
done

REPO="$(cd "$(dirname "$0")/.." && pwd)"
SCRATCH="${MOE_SMOKE_DIR:-/var/tmp/moe-serve-docker}"
IMAGE="${MOE_SMOKE_IMAGE:-moe-serve:smoke}"
PYTRITON_VERSION=0.7.0
ROOTFS_IMAGE="local/bookworm-minbase:moe-serve"
BASE_IMAGE="local/tritonserver-pytriton:${PYTRITON_VERSION}-bookworm"
CA="${MOE_SMOKE_CA:-/etc/ssl/certs/ca-certificates.crt}"
MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
CONTAINER="moe-serve-smoke-$$"
T0=$(date +%s)

log() { printf '[smoke %3ds] %s\n' "$(( $(date +%s) - T0 ))" "$*"; }
die() { log "FAIL: $*"; exit 1; }

STARTED_DAEMON=0
OWN_DAEMON=0   # the daemon's data root is $SCRATCH (started now or by an earlier run)
DAEMON_PID=""
cleanup() {
    local rc=$?
    set +e
    if [ -n "${DOCKER_CMD:-}" ]; then
        if "$DOCKER_CMD" container inspect "$CONTAINER" > /dev/null 2>&1; then
            if [ "$rc" -ne 0 ]; then
                log "container logs (last 60 lines):"
                "$DOCKER_CMD" logs --tail 60 "$CONTAINER" 2>&1 | sed 's/^/    /'
            fi
            "$DOCKER_CMD" rm -f "$CONTAINER" > /dev/null 2>&1
        fi
        if [ "$CLEAN" -eq 1 ]; then
            log "--clean: removing $IMAGE, $BASE_IMAGE, $ROOTFS_IMAGE"
            "$DOCKER_CMD" image rm -f "$IMAGE" "$BASE_IMAGE" "$ROOTFS_IMAGE" > /dev/null 2>&1
            if [ "$OWN_DAEMON" -eq 1 ]; then   # never prune the build cache of someone else's daemon
                log "--clean: pruning the build cache of the scratch daemon"
                "$DOCKER_CMD" builder prune -af > /dev/null 2>&1
            fi
        fi
    fi
    if [ "$STARTED_DAEMON" -eq 1 ] && [ -n "$DAEMON_PID" ]; then
        log "stopping the Docker daemon started here (pid $DAEMON_PID)"
        kill "$DAEMON_PID" 2> /dev/null
        for _ in $(seq 1 30); do kill -0 "$DAEMON_PID" 2> /dev/null || break; sleep 1; done
    fi
    if [ "$rc" -eq 0 ]; then
        log "PASS in $(( $(date +%s) - T0 )) s"
    else
        log "FAILED (exit $rc) after $(( $(date +%s) - T0 )) s"
    fi
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

need_root() { [ "$(id -u)" -eq 0 ] || die "$1 needs root (or run with a Docker daemon already up)"; }

apt_install() {
    need_root "installing $*"
    log "apt-get install $*"
    if [ -z "${APT_UPDATED:-}" ]; then
        DEBIAN_FRONTEND=noninteractive apt-get update -q > /dev/null
        APT_UPDATED=1
    fi
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "$@" > /dev/null
}

mkdir -p "$SCRATCH"

# ---------------------------------------------------------------- 1. Docker daemon
DOCKER_CMD="${DOCKER:-/usr/bin/docker}"
if ! [ -x "$DOCKER_CMD" ] || ! command -v dockerd > /dev/null; then
    if ! [ -x "$DOCKER_CMD" ] && command -v docker > /dev/null && docker info > /dev/null 2>&1; then
        DOCKER_CMD="$(command -v docker)"   # a daemon runs and some client reaches it; use them
    else
        apt_install docker.io
    fi
fi
[ -x "$DOCKER_CMD" ] || DOCKER_CMD="$(command -v docker)"

if "$DOCKER_CMD" info > /dev/null 2>&1; then
    log "using the running Docker daemon (${DOCKER_HOST:-default socket})"
elif [ -S "$SCRATCH/docker.sock" ] && DOCKER_HOST="unix://$SCRATCH/docker.sock" "$DOCKER_CMD" info > /dev/null 2>&1; then
    export DOCKER_HOST="unix://$SCRATCH/docker.sock"
    OWN_DAEMON=1
    log "using the Docker daemon already running on $DOCKER_HOST"
else
    need_root "starting dockerd"
    mkdir -p "$SCRATCH/data" "$SCRATCH/exec"
    log "starting dockerd (data root $SCRATCH/data, log $SCRATCH/dockerd.log)"
    dockerd --data-root "$SCRATCH/data" --exec-root "$SCRATCH/exec" --pidfile "$SCRATCH/docker.pid" \
        -H "unix://$SCRATCH/docker.sock" > "$SCRATCH/dockerd.log" 2>&1 &
    DAEMON_PID=$!
    STARTED_DAEMON=1
    OWN_DAEMON=1
    export DOCKER_HOST="unix://$SCRATCH/docker.sock"
    for _ in $(seq 1 60); do
        "$DOCKER_CMD" info > /dev/null 2>&1 && break
        kill -0 "$DAEMON_PID" 2> /dev/null || { tail -20 "$SCRATCH/dockerd.log"; die "dockerd exited"; }
        sleep 0.5
    done
    "$DOCKER_CMD" info > /dev/null 2>&1 || { tail -20 "$SCRATCH/dockerd.log"; die "dockerd did not come up"; }
fi
"$DOCKER_CMD" version --format 'docker client {{.Client.Version}}, server {{.Server.Version}}' | sed 's/^/    /'

SECRET=()
if [ -s "$CA" ]; then
    SECRET=(--secret "id=pip_ca,src=$CA")
fi
build() { DOCKER_BUILDKIT=1 "$DOCKER_CMD" build --progress=plain "${SECRET[@]}" "$@"; }
image_id() { "$DOCKER_CMD" image inspect -f '{{.Id}}' "$1" 2> /dev/null || true; }
# After a rebuild, drop the image the tag pointed to before (it would linger as <none>).
drop_previous() {
    local old="$1" tag="$2"
    if [ -n "$old" ] && [ "$old" != "$(image_id "$tag")" ]; then
        "$DOCKER_CMD" image rm "$old" > /dev/null 2>&1 || true
    fi
}

# ---------------------------------------------------------------- 2. local tritonserver base
if [ "$REBUILD_BASE" -eq 1 ]; then
    "$DOCKER_CMD" image rm -f "$BASE_IMAGE" "$ROOTFS_IMAGE" > /dev/null 2>&1 || true
fi
if ! "$DOCKER_CMD" image inspect "$ROOTFS_IMAGE" > /dev/null 2>&1; then
    command -v debootstrap > /dev/null || apt_install debootstrap
    need_root "debootstrap"
    rootfs="$SCRATCH/rootfs.$$"
    rm -rf "$rootfs"
    mkdir -p "$SCRATCH"
    log "debootstrap bookworm (minbase) into $rootfs (about a minute)"
    debootstrap --variant=minbase --include=python3,python3-venv,libpython3.11,ca-certificates \
        bookworm "$rootfs" "$MIRROR" > "$SCRATCH/debootstrap.log" 2>&1 \
        || { tail -20 "$SCRATCH/debootstrap.log"; rm -rf "$rootfs"; die "debootstrap failed"; }
    rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
    log "importing the rootfs as $ROOTFS_IMAGE"
    tar -C "$rootfs" -c . | "$DOCKER_CMD" import -c 'CMD ["/bin/bash"]' - "$ROOTFS_IMAGE" > /dev/null
    rm -rf "$rootfs"
fi
log "building $BASE_IMAGE (docker/base/Dockerfile; cached after the first run)"
previous="$(image_id "$BASE_IMAGE")"
build --build-arg ROOTFS_IMAGE="$ROOTFS_IMAGE" --build-arg PYTRITON_VERSION="$PYTRITON_VERSION" \
    -t "$BASE_IMAGE" "$REPO/docker/base" > "$SCRATCH/base-build.log" 2>&1 \
    || { tail -30 "$SCRATCH/base-build.log"; die "building the base image failed"; }
drop_previous "$previous" "$BASE_IMAGE"

# ---------------------------------------------------------------- 3. project image (CPU torch)
TORCH_VERSION="$(sed -n 's/^torch==\([^ #]*\).*/\1/p' "$REPO/requirements.txt")"
[ -n "$TORCH_VERSION" ] || die "no torch==X pin in requirements.txt"
PY_TAG="$("$DOCKER_CMD" run --rm "$BASE_IMAGE" python3 -c 'import sys; print("%d%d" % sys.version_info[:2])')"
if ! compgen -G "$REPO/docker/wheels/torch-${TORCH_VERSION}+cpu-cp${PY_TAG}-*.whl" > /dev/null; then
    log "fetching the CPU wheel torch==${TORCH_VERSION}+cpu (cp${PY_TAG}) into docker/wheels/"
    dl=(python3 -m pip download -q --no-deps --only-binary=:all: --python-version "${PY_TAG:0:1}.${PY_TAG:1}"
        --platform manylinux_2_28_x86_64 -d "$REPO/docker/wheels" "torch==${TORCH_VERSION}+cpu")
    "${dl[@]}" 2> /dev/null || "${dl[@]}" --extra-index-url https://download.pytorch.org/whl/cpu \
        || die "cannot get torch==${TORCH_VERSION}+cpu; drop the wheel into docker/wheels/"
fi
log "building $IMAGE FROM $BASE_IMAGE (torch==${TORCH_VERSION}+cpu)"
t_build=$(date +%s)
previous="$(image_id "$IMAGE")"
build --build-arg BASE_IMAGE="$BASE_IMAGE" --build-arg TORCH_INDEX_URL= \
    --build-arg TORCH_SPEC="torch==${TORCH_VERSION}+cpu" -t "$IMAGE" "$REPO" > "$SCRATCH/build.log" 2>&1 \
    || { tail -40 "$SCRATCH/build.log"; die "docker build failed (log: $SCRATCH/build.log)"; }
BUILD_S=$(( $(date +%s) - t_build ))
drop_previous "$previous" "$IMAGE"
grep -h 'image check ok' "$SCRATCH/build.log" | sed 's/^#[0-9]* [0-9.]* /    /' | tail -1 || true
# The CA bundle went in as a secret mount: neither a file nor a COPY of it in the image.
"$DOCKER_CMD" history --no-trunc "$IMAGE" | grep -qi 'host-ca' && die "a CA bundle was copied into the image"
"$DOCKER_CMD" run --rm --entrypoint /bin/sh "$IMAGE" -c 'test ! -e /run/secrets/pip_ca' \
    || die "the pip CA secret was left in the image"
log "built in ${BUILD_S} s"

# ---------------------------------------------------------------- 4. run and check
PORT="${MOE_SMOKE_PORT:-$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}"
log "docker run $IMAGE on 127.0.0.1:$PORT"
t_run=$(date +%s)
"$DOCKER_CMD" run -d --name "$CONTAINER" -p "127.0.0.1:$PORT:9000" --shm-size=1g "$IMAGE" > /dev/null
URL="http://127.0.0.1:$PORT"
for _ in $(seq 1 240); do
    code="$(python3 - "$URL/health" <<'EOF'
import sys, urllib.request, urllib.error
try:
    print(urllib.request.urlopen(sys.argv[1], timeout=2).status)
except urllib.error.HTTPError as e:
    print(e.code)
except Exception:
    print(0)
EOF
)"
    [ "$code" = 200 ] && break
    [ "$("$DOCKER_CMD" inspect -f '{{.State.Running}}' "$CONTAINER")" = true ] || die "the container exited (code $("$DOCKER_CMD" inspect -f '{{.State.ExitCode}}' "$CONTAINER"))"
    sleep 0.5
done
[ "$code" = 200 ] || die "/health did not answer 200 within 120 s (last: $code)"
READY_S=$(( $(date +%s) - t_run ))
log "/health 200 after ${READY_S} s"

python3 - "$URL" <<'EOF' || die "API check failed"
"""A completion with routed experts; decode the base64 .npy without numpy and check it."""
import ast, base64, json, struct, sys, urllib.request

url = sys.argv[1]

def call(path, body=None):
    req = urllib.request.Request(url + path, data=None if body is None else json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())

def load_npy(blob):
    assert blob[:6] == b"\x93NUMPY", "not an .npy payload"
    major = blob[6]
    n = struct.unpack("<H" if major == 1 else "<I", blob[8:10] if major == 1 else blob[8:12])[0]
    start = 10 if major == 1 else 12
    header = ast.literal_eval(blob[start:start + n].decode("latin-1"))
    data = blob[start + n:]
    return header, data

card = call("/v1/models")["data"][0]
L, K, E = card["num_hidden_layers"], card["num_experts_per_tok"], card["num_experts"]
request = {
    "model": card["id"], "prompt": "The router picks the top-k experts for each token",
    "max_tokens": 8, "temperature": 0, "ignore_eos": True,
    "return_routed_experts": True, "return_token_ids": True,
}
out = call("/v1/completions", request)
again = call("/v1/completions", request)["choices"][0]
choice, usage = out["choices"][0], out["usage"]
P, C = usage["prompt_tokens"], usage["completion_tokens"]
assert C == 8 and choice["finish_reason"] == "length", (C, choice["finish_reason"])
assert isinstance(choice["text"], str) and choice["text"], choice["text"]
assert len(choice["prompt_token_ids"]) == P and len(choice["token_ids"]) == C
header, data = load_npy(base64.b64decode(choice["routed_experts"]))
shape, descr = tuple(header["shape"]), header["descr"]
itemsize = {"|u1": 1, "<u2": 2}[descr]
assert descr == ("|u1" if E <= 256 else "<u2"), (descr, E)
assert shape == (P + C - 1, L, K), f"shape {shape}, expected {(P + C - 1, L, K)}"
assert not header["fortran_order"] and len(data) == (P + C - 1) * L * K * itemsize
ids = data if itemsize == 1 else struct.unpack(f"<{len(data) // 2}H", data)
assert max(ids) < E, f"expert id {max(ids)} >= num_experts {E}"
rows = [ids[i * L * K:(i + 1) * L * K] for i in range(shape[0])]
assert all(len(set(r[j * K:(j + 1) * K])) == K for r in rows for j in range(L)), "repeated expert within a top-k"
assert (again["text"], again["token_ids"], again["routed_experts"]) == (
    choice["text"], choice["token_ids"], choice["routed_experts"]), "greedy repeat differs"
print(f"    completion: {P} prompt + {C} output tokens, text={choice['text']!r}")
print(f"    routed_experts: {descr} {shape} (= prompt+output-1, layers, top_k), ids in [0, {E}), "
      f"{len(set(ids))} distinct experts used; a greedy repeat is identical")
chat = call("/v1/chat/completions", {"model": card["id"], "max_tokens": 4, "temperature": 0,
                                     "messages": [{"role": "user", "content": "Hello!"}]})
assert chat["choices"][0]["message"]["role"] == "assistant"
print(f"    chat completion ok ({chat['usage']['completion_tokens']} tokens)")
EOF

uid="$("$DOCKER_CMD" exec "$CONTAINER" id -u)"
[ "$uid" != 0 ] || die "the container runs as root"
log "runs as uid $uid"
for _ in $(seq 1 90); do
    health="$("$DOCKER_CMD" inspect -f '{{.State.Health.Status}}' "$CONTAINER")"
    [ "$health" = healthy ] && break
    [ "$health" = unhealthy ] && die "HEALTHCHECK reports unhealthy"
    sleep 1
done
[ "$health" = healthy ] || die "HEALTHCHECK status is '$health' after 90 s"
log "HEALTHCHECK: healthy"

"$DOCKER_CMD" stop -t 30 "$CONTAINER" > /dev/null
exit_code="$("$DOCKER_CMD" inspect -f '{{.State.ExitCode}}' "$CONTAINER")"
[ "$exit_code" = 0 ] || die "moe-serve exited with $exit_code on docker stop"
log "docker stop: clean exit (0)"

size_bytes="$("$DOCKER_CMD" image inspect -f '{{.Size}}' "$IMAGE")"
base_bytes="$("$DOCKER_CMD" image inspect -f '{{.Size}}' "$BASE_IMAGE")"
log "image $IMAGE: $(( size_bytes / 1000000 )) MB (base $BASE_IMAGE: $(( base_bytes / 1000000 )) MB)"
log "times: build ${BUILD_S} s, start to /health ${READY_S} s, total $(( $(date +%s) - T0 )) s"
