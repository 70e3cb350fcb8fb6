#!/usr/bin/env bash
# One virtualenv per independent client the conformance tests drive (tritonclient, the KServe
# SDK): each pins its own protobuf/grpcio/fastapi stack, which must not move the server's, so the
# tests run it in a subprocess with that venv's python. Idempotent: a stamp records the pinned
# spec, so a re-run is a no-op until the pin changes.
#   usage: ensure_client_venv.sh VENV SPEC IMPORT-CHECK   (IMPORT-CHECK: python code that must run)
set -euo pipefail
PYTHON="${PYTHON:-python3}"
VENV="$1"
SPEC="$2"
CHECK="$3"
STAMP="$VENV/.installed-stamp"

if [ -x "$VENV/bin/python" ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$SPEC" ]; then
  exit 0
fi
test -x "$VENV/bin/python" || "$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q "$SPEC"
# Fail here, not in the tests, when the install cannot import (e.g. a protobuf it cannot load).
"$VENV/bin/python" -c "$CHECK"
echo "$SPEC" > "$STAMP"
echo "ensure_client_venv: $VENV has $SPEC" >&2
