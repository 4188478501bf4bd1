#!/usr/bin/env bash
# Build the dilocox-p2p images without an image registry (works offline once wheels are cached):
#   1. dockerd up (ensure-docker.sh), 2. the base image (build-base-image.sh: debootstrap -> docker import,
#   unless BASE_IMAGE names another image), 3. a wheelhouse for the project's dependencies
#   (wheelhouse.sh, cached) plus the project's own wheel, 4. `docker build` of the peer and bootstrap targets.
#
# Usage: docker/build.sh
# Env:
#   BASE_IMAGE            default local/debian-py:bookworm (built here); e.g. python:3.11-slim with a registry
#   TAG                   image tag (default dev): dilocox-p2p/peer:TAG, dilocox-p2p/bootstrap:TAG
#   TORCH_REQ             the torch requirement (default torch==2.13.0: the CPU build on this machine's index)
#   DILOCOX_DOCKER_CACHE  cache for the base rootfs and the wheelhouse (default ~/.cache/dilocox-docker)
set -euo pipefail

HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(dirname "$HERE")
BASE_IMAGE="${BASE_IMAGE:-local/debian-py:bookworm}"
TAG="${TAG:-dev}"
TORCH_REQ="${TORCH_REQ:-torch==2.13.0}"
CACHE="${DILOCOX_DOCKER_CACHE:-$HOME/.cache/dilocox-docker}"
CTX="$CACHE/context"
export DOCKER_BUILDKIT=0 DILOCOX_DOCKER_CACHE="$CACHE"
log() { echo "[build] $*" >&2; }
t0=$SECONDS

bash "$HERE/ensure-docker.sh"
# one build at a time per cache (a second one, e.g. the docker tier's after .ci/run's, waits, then finds
# every layer cached). Taken after ensure-docker.sh: a dockerd it starts must not inherit the lock
mkdir -p "$CACHE"
exec 9>"$CACHE/build.lock"
flock 9
if [[ "$BASE_IMAGE" == local/debian-py:* ]]; then
    bash "$HERE/build-base-image.sh" "${BASE_IMAGE#local/debian-py:}"
fi

# the dependencies, as pyproject.toml lists them, torch pinned (an open range would resolve to a CUDA build)
mkdir -p "$CTX"
python3 - "$ROOT/pyproject.toml" "$TORCH_REQ" > "$CTX/requirements.txt" <<'PY'
import sys, tomllib
deps = tomllib.load(open(sys.argv[1], "rb"))["project"]["dependencies"]
print("\n".join(sys.argv[2] if d.split(">")[0].split("=")[0].strip() == "torch" else d for d in deps))
PY
bash "$HERE/wheelhouse.sh" "$CTX/requirements.txt" "$CACHE/wheels"
rm -rf "$CTX/wheels" "$CTX/project" && mkdir -p "$CTX/wheels" "$CTX/project"
ln "$CACHE"/wheels/*.whl "$CTX/wheels/" 2>/dev/null || cp "$CACHE"/wheels/*.whl "$CTX/wheels/"
log "project wheel"
# with this python's setuptools where it builds wheels (offline: a venv of the project), else in pip's isolated
# build environment (a python without the `wheel` package or setuptools >= 70.1, e.g. before .ci/run's venv)
python3 -m pip wheel --no-deps --no-build-isolation -q "$ROOT" -w "$CTX/project" >/dev/null 2>&1 ||
    python3 -m pip wheel --no-deps -q "$ROOT" -w "$CTX/project" 2> >(grep -v "is ignored: it is neither" >&2)
# a fresh build dir per build: a stale egg-info must not leak into the wheel
rm -rf "$ROOT/build"

# the images this build replaces: removed once nothing names them any more (1.5 GB each)
old_ids=$(docker image inspect -f '{{.Id}}' "dilocox-p2p/deps:$TAG" "dilocox-p2p/bootstrap:$TAG" \
    "dilocox-p2p/peer:$TAG" 2>/dev/null || true)
for target in deps bootstrap peer; do
    log "image dilocox-p2p/$target:$TAG (base $BASE_IMAGE)"
    docker build -q -f "$HERE/Dockerfile" --target "$target" --build-arg BASE_IMAGE="$BASE_IMAGE" \
        -t "dilocox-p2p/$target:$TAG" "$CTX" >/dev/null
done
for id in $old_ids; do  # an image still tagged, or under a running container, stays
    [[ -z "$(docker image inspect -f '{{join .RepoTags ","}}' "$id" 2>/dev/null)" ]] &&
        docker image rm "$id" >/dev/null 2>&1 || true
done
docker image ls --format '{{.Repository}}:{{.Tag}} {{.Size}}' | grep "^dilocox-p2p/" | grep ":$TAG " >&2
log "done in $((SECONDS - t0)) s"
