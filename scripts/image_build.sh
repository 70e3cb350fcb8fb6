#!/usr/bin/env bash
# Build Mariner's images with podman, from a local base, with this machine's package-index settings.
#
#   scripts/image_build.sh cpu   -> localhost/mariner:<version> and localhost/mariner-models:<version>
#   scripts/image_build.sh gpu   -> localhost/mariner-gpu:<version>
#
# <version> is pyproject.toml's; the kustomize overlays name exactly these references (a test checks).
# No registry is reachable here, so both Dockerfiles get the local Debian base as their base-image
# build arguments (scripts/image_base.sh makes it on demand). pip inside a build does not see the
# host's PIP_* variables or pip.conf: they are read here (`pip config list`) and passed as build
# arguments, and each local directory or file they name (a wheel directory, a file:// index, a CA
# bundle) is mounted read-only into the build at the same path, for the build only. Nothing about
# this machine is written into the repository. podman's layer cache makes a rebuild with unchanged
# inputs take seconds.
#
# Environment: BASE_IMAGE (skip the local base), IMAGE_REPO (default localhost), PYTHON (for pip
# config; default .venv/bin/python, else python3), EXTRA_BUILD_ARGS (appended to podman build),
# GPU_TORCH_INDEX_URL (the GPU image's torch index, e.g. https://download.pytorch.org/whl/cu128 where
# reachable; empty by default: the configured indexes, i.e. the CPU wheel here).
#
# Disk: a build writes about 6 GB into podman's storage (the build stage's virtualenv, then the image
# that copies it), and every rebuild after a source change leaves the previous image and its build
# stage behind, untagged: a machine that builds many times fills its disk (a CI run here died with
# "no space left on device" behind 55 GB of such leftovers). So each build first checks the free
# space under podman's storage: below IMAGE_PRUNE_BELOW_GB (default 20) it removes dangling images
# (`podman image prune`: untagged and used by no container, its layer cache included) and says so;
# below IMAGE_NEED_GB (default 8) after that it stops with what is free and what it needs, before
# podman fails halfway. After a build, the image the tag named before is removed if nothing else
# names it. IMAGE_PRUNE_BELOW_GB=0 never prunes.
set -euo pipefail
cd "$(dirname "$0")/.."

flavour=${1:?usage: image_build.sh cpu|gpu}
repo=${IMAGE_REPO:-localhost}
version=$(sed -n 's/^version = "\(.*\)"$/\1/p' pyproject.toml)
[ -n "$version" ] || { echo "image_build: no version in pyproject.toml" >&2; exit 1; }
python=${PYTHON:-.venv/bin/python}
[ -x "$python" ] || python=python3
base=${BASE_IMAGE:-$(bash scripts/image_base.sh)}

# The host's pip settings as build arguments plus read-only mounts. Python prints one shell word per
# line: --build-arg=K=V or --volume=P:P:ro (values never contain newlines).
mapfile -t pip_args < <("$python" - <<'PY'
import os
import subprocess
import sys

out = subprocess.run(
    [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True, check=False
).stdout
settings: dict[str, tuple[int, str]] = {}
for line in out.splitlines():
    scope_key, sep, value = line.partition("=")
    if not sep:
        continue
    scope, _, key = scope_key.rpartition(".")
    # Environment variables beat configuration files, as in pip itself.
    rank = 1 if scope.startswith(":env:") else 0
    if key not in settings or rank >= settings[key][0]:
        settings[key] = (rank, value.strip().strip("'\""))
wanted = {
    "index-url": "PIP_INDEX_URL",
    "extra-index-url": "PIP_EXTRA_INDEX_URL",
    "find-links": "PIP_FIND_LINKS",
    "trusted-host": "PIP_TRUSTED_HOST",
    "cert": "PIP_CERT",
}
mounts: list[str] = []
for key, arg in wanted.items():
    if key not in settings:
        continue
    value = " ".join(settings[key][1].split())
    print(f"--build-arg={arg}={value}")
    for item in value.split():
        path = item.removeprefix("file://").rstrip("/")
        if key.endswith("index-url") and item.startswith("file://"):
            # A local PEP 503 index links its files relative to itself (`../../files/x.whl`): mount the
            # directory holding the index, not the index alone.
            path = os.path.dirname(path)
        if path.startswith("/") and os.path.exists(path) and path not in mounts:
            mounts.append(path)
for path in mounts:
    print(f"--volume={path}:{path}:ro")
PY
)

graphroot=$(podman info --format '{{.Store.GraphRoot}}')
prune_below_gb=${IMAGE_PRUNE_BELOW_GB:-20}
need_gb=${IMAGE_NEED_GB:-8}
free_gb() {
    df -Pk "$graphroot" | awk 'NR == 2 { printf "%d", $4 / 1048576 }'
}

# Room for one build, made by dropping dangling images when short, or a clear stop.
ensure_room() {
    local free
    free=$(free_gb)
    if [ "$free" -lt "$prune_below_gb" ]; then
        local dangling
        dangling=$(podman images --quiet --filter dangling=true | wc -l)
        echo "image_build: $free GB free under $graphroot (below $prune_below_gb GB):" \
            "removing $dangling dangling images (podman image prune)"
        podman image prune --force > /dev/null
        free=$(free_gb)
        echo "image_build: $free GB free after pruning"
    fi
    if [ "$free" -lt "$need_gb" ]; then
        echo "image_build: only $free GB free under $graphroot; a build needs about $need_gb GB." \
            "Free some (podman images; podman rmi ...) or set IMAGE_NEED_GB." >&2
        exit 1
    fi
}

build() {
    local file=$1 target=$2 tag=$3
    shift 3
    ensure_room
    local before
    before=$(podman image inspect --format '{{.Id}}' "$tag" 2> /dev/null || true)
    local start=$SECONDS
    # chroot isolation: `podman run`'s OCI runtime cannot start containers on this machine (cgroups),
    # but RUN steps in a chroot work, apt included.
    podman build --isolation chroot --layers -f "$file" --target "$target" -t "$tag" \
        "${pip_args[@]}" "$@" ${EXTRA_BUILD_ARGS:-} .
    echo "image_build: $tag built in $((SECONDS - start)) s," \
        "$(podman image inspect --format '{{.Size}}' "$tag" | awk '{printf "%.0f MB", $1 / 1e6}')"
    # The image this tag named before is now nameless: removed unless a container or a tag still holds
    # it (then podman refuses, and it stays).
    local after
    after=$(podman image inspect --format '{{.Id}}' "$tag")
    if [ -n "$before" ] && [ "$before" != "$after" ]; then
        podman rmi "$before" > /dev/null 2>&1 \
            && echo "image_build: removed the image $tag named before (${before:0:12})" || true
    fi
}

case $flavour in
    cpu)
        # TORCH_INDEX_URL empty: torch comes from the indexes above (the CPU wheel on this disk).
        build Dockerfile models "$repo/mariner-models:$version" --build-arg "MODELS_BASE_IMAGE=$base"
        build Dockerfile runtime "$repo/mariner:$version" --build-arg "PYTHON_IMAGE=$base" \
            --build-arg TORCH_INDEX_URL=
        ;;
    gpu)
        # No CUDA torch wheel is reachable here: the pinned CPU wheel stands in (the image's torch
        # then cannot use the GPU; onnxruntime-gpu and NVML are the real GPU packages). On a machine
        # that reaches the CUDA index, set GPU_TORCH_INDEX_URL to it.
        build Dockerfile.gpu runtime "$repo/mariner-gpu:$version" --build-arg "CUDA_IMAGE=$base" \
            --build-arg "TORCH_INDEX_URL=${GPU_TORCH_INDEX_URL-}"
        ;;
    *)
        echo "image_build: unknown flavour $flavour (cpu or gpu)" >&2
        exit 2
        ;;
esac
