#!/usr/bin/env bash
# The exposition test (tests/integration/test_promtool.py) lints a live /metrics with
# `promtool check metrics`. Debian ships promtool in its `prometheus` package; we take only the
# binary (`apt-get download` + `dpkg-deb -x`) into .tools/bin, so no Prometheus service is
# installed or started and no root is needed. Idempotent: exit 0 at once when .tools/bin/promtool
# or a promtool on PATH already runs.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DEST="$ROOT/.tools/bin"

works() { [ -n "$1" ] && "$1" --version >/dev/null 2>&1; }

if works "$DEST/promtool" || works "$(command -v promtool || true)"; then
  exit 0
fi

mkdir -p "$DEST"
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
cd "$TMP"
if ! apt-get download prometheus >&2; then
  # The package lists may be stale or missing (a fresh container): refresh them when allowed.
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -q >&2
  apt-get download prometheus >&2
fi
dpkg-deb -x prometheus_*.deb extracted
install -m 0755 extracted/usr/bin/promtool "$DEST/promtool"
if ! works "$DEST/promtool"; then
  echo "promtool from the prometheus package does not run here" >&2
  exit 1
fi
echo "promtool installed in $DEST" >&2
