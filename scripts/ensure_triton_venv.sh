#!/usr/bin/env bash
# tritonclient (the conformance tests' independent client) gets its own virtualenv, .venv-triton:
# tritonclient 2.x needs protobuf < 7 while the server's grpcio-tools 1.85 needs protobuf >= 7.35,
# and its generated `inference` stubs clash with ours in one process. The tests run it in a
# subprocess with this venv's python. Idempotent: a stamp records the pinned spec, so a re-run
# is a no-op until the pin changes.
set -euo pipefail
PYTHON="${PYTHON:-python3}"
VENV="${TRITON_VENV:-.venv-triton}"
# Newest release pip resolves here; pulls its own grpcio and protobuf (< 7), kept apart from .venv.
SPEC='tritonclient[grpc,http]==2.73.0'
STAMP="$VENV/.installed-stamp"

if [ -x "$VENV/bin/python" ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$SPEC" ]; then
  exit 0
fi
test -x "$VENV/bin/python" || "$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q "$SPEC"
# Fail here, not in the tests, when the install cannot import (e.g. a protobuf it cannot load).
"$VENV/bin/python" -c 'import numpy, tritonclient.grpc, tritonclient.http, tritonclient.grpc.aio'
echo "$SPEC" > "$STAMP"
echo "ensure_triton_venv: $VENV has $SPEC" >&2
