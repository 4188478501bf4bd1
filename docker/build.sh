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
rm -rf "$CTX/wheels" && mkdir -p "$CTX/wheels"
ln "$CACHE"/wheels/*.whl "$CTX/wheels/" 2>/dev/null || cp "$CACHE"/wheels/*.whl "$CTX/wheels/"
log "project wheel"
python3 -m pip wheel --no-deps --no-build-isolation -q "$ROOT" -w "$CTX/wheels" 2> >(grep -v "is ignored: it is neither" >&2)
# a fresh build dir per build: a stale egg-info must not leak into the wheel
rm -rf "$ROOT/build"

for target in bootstrap peer; do
    log "image dilocox-p2p/$target:$TAG (base $BASE_IMAGE)"
    docker build -q -f "$HERE/Dockerfile" --target "$target" --build-arg BASE_IMAGE="$BASE_IMAGE" \
        -t "dilocox-p2p/$target:$TAG" "$CTX" >/dev/null
done
# the legacy builder leaves each build's dependency stage behind, untagged: 1.8 GB a build
docker image prune -f --filter label=org.dilocox.build-stage=deps >/dev/null
docker image ls --format '{{.Repository}}:{{.Tag}} {{.Size}}' | grep "^dilocox-p2p/" | grep ":$TAG " >&2
log "done in $((SECONDS - t0)) s"
