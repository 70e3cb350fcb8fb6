#!/usr/bin/env bash
# The local base image the builds here start from, made on demand and cached.
#
# No container registry is reachable on the build machines, so python:3.11-slim and the CUDA images
# cannot be pulled. mmdebstrap makes a Debian 12 (bookworm) root filesystem from the Debian mirror
# apt already uses, with what python:3.11-slim gives the Dockerfiles: python3 3.11 with venv,
# ca-certificates and useradd. The tarball is kept in build/image/ and imported once; later builds
# find the image with `podman image exists` and cost nothing.
#
# Usage: scripts/image_base.sh  -> prints the image reference (localhost/mariner-debian-base:bookworm-<key>)
set -euo pipefail
self=$(readlink -f "$0")
cd "$(dirname "$self")/.."

PACKAGES=python3,python3-venv,ca-certificates,passwd
# Documentation, manual pages and translations are never read in a container (about 45 MB);
# copyright files stay.
DPKG_OPTS=(
    --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-include=/usr/share/doc/*/copyright'
    --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/info/*'
    --dpkgopt='path-exclude=/usr/share/locale/*'
)
# The cache key is this script's content: a change to what goes into the base names a new tarball
# and tag, so a stale base is never taken for the current one.
key=$(sha256sum "$self" | cut -c1-12)
BASE_IMAGE=${BASE_IMAGE:-localhost/mariner-debian-base:bookworm-$key}
TARBALL=${BASE_TARBALL:-build/image/debian-base-$key.tar}

# podman builds and mounts images without a daemon; mmdebstrap makes the base. Installed from
# Debian when missing (as root, as on the CI machines).
need() {
    command -v "$1" > /dev/null && return
    if [ "$(id -u)" = 0 ] && command -v apt-get > /dev/null; then
        echo "image_base: installing $2" >&2
        apt-get install -y -q "$2" >&2 || { apt-get update -q >&2 && apt-get install -y -q "$2" >&2; }
    fi
    command -v "$1" > /dev/null || {
        echo "image_base: $1 is missing: apt-get install $2" >&2
        exit 1
    }
}
need podman podman

if podman image exists "$BASE_IMAGE"; then
    echo "$BASE_IMAGE"
    exit 0
fi
if [ ! -s "$TARBALL" ]; then
    need mmdebstrap mmdebstrap
    mkdir -p "$(dirname "$TARBALL")"
    # minbase: essential packages and apt; the rest is named. Written next to the target and moved,
    # so an interrupted run never leaves a truncated tarball that looks cached.
    mmdebstrap --format=tar --variant=minbase --include="$PACKAGES" "${DPKG_OPTS[@]}" \
        bookworm "$TARBALL.partial" >&2
    mv "$TARBALL.partial" "$TARBALL"
fi
# A tarball carries no image config: give it the PATH and CMD Debian's own images have (the
# Dockerfiles extend PATH, and an unset one would leave them a PATH ending in an empty entry).
podman import --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'CMD ["bash"]' "$TARBALL" "$BASE_IMAGE" > /dev/null
echo "$BASE_IMAGE"
