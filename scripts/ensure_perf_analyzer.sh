#!/usr/bin/env bash
# Triton's load generator, perf_analyzer, for `mariner.loadtest.perf_analyzer`, into
# .tools/perf_analyzer (ignored by git). PyPI's `perf-analyzer` resolves here to 0.1.0, an empty
# placeholder: the 2.60 wheel is tagged manylinux_2_38, so it is asked for by platform. Its
# binary needs glibc 2.38 / GLIBCXX_3.4.32, newer than Debian 12's; when it does not run as is,
# Debian 13's libc6, libstdc++6 and libgcc-s1 are unpacked (never installed) into
# .tools/perf_analyzer/glibc with a private apt list for suite trixie, and the runner starts the
# binary through that directory's ld-linux. Idempotent: exit 0 at once when it already runs.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DEST="$ROOT/.tools/perf_analyzer"
BIN="$DEST/bin/perf_analyzer"
LIB="$DEST/glibc/usr/lib/x86_64-linux-gnu"
VERSION="${PERF_ANALYZER_VERSION:-2.60}"
PIP="${PIP:-$ROOT/.venv/bin/pip}"

native() { "$BIN" --version >/dev/null 2>&1; }
private() {
  [ -x "$LIB/ld-linux-x86-64.so.2" ] &&
    "$LIB/ld-linux-x86-64.so.2" --library-path "$LIB:/lib/x86_64-linux-gnu:/usr/lib/x86_64-linux-gnu" \
      "$BIN" --version >/dev/null 2>&1
}

if [ -x "$BIN" ] && { native || private; }; then
  exit 0
fi

mkdir -p "$DEST/bin"
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
"$PIP" download --no-deps --only-binary=:all: --platform manylinux_2_38_x86_64 \
  --python-version 3.11 "perf-analyzer==$VERSION" -d "$TMP/wheel" >&2
python3 -m zipfile -e "$TMP"/wheel/perf_analyzer-*.whl "$TMP/unpacked"
install -m 0755 "$TMP/unpacked/perf_analyzer/bin/perf_analyzer" "$BIN"
if native; then
  echo "perf_analyzer $VERSION runs as is: $BIN" >&2
  exit 0
fi

# A private apt state: the machine's own lists and status are neither read nor changed.
APT="$TMP/apt"
mkdir -p "$APT/lists/partial" "$APT/cache/archives/partial"
echo "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian trixie main" \
  >"$APT/sources.list"
OPTS=(-o "Dir::Etc::SourceList=$APT/sources.list" -o Dir::Etc::SourceParts=/dev/null
  -o "Dir::State::Lists=$APT/lists" -o "Dir::Cache=$APT/cache" -o Dir::State::status=/dev/null
  -o APT::Architecture=amd64)
apt-get "${OPTS[@]}" update -q >&2
(cd "$TMP" && apt-get "${OPTS[@]}" download libc6 libstdc++6 libgcc-s1 >&2)
rm -rf "$DEST/glibc"
for deb in "$TMP"/*.deb; do dpkg-deb -x "$deb" "$DEST/glibc"; done
if ! private; then
  echo "perf_analyzer does not run, neither as is nor under Debian 13's glibc in $DEST/glibc" >&2
  exit 1
fi
echo "perf_analyzer $VERSION in $BIN, run under the glibc in $LIB" >&2
