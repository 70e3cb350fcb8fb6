#!/usr/bin/env bash
# KServe's Python SDK (the conformance tests' KServe client) gets its own virtualenv, .venv-kserve:
# it pins its own fastapi/starlette/pydantic/protobuf stack, which must not move the server's.
# The tests run it in a subprocess with this venv's python. Idempotent: a stamp records the
# pinned spec, so a re-run is a no-op until the pin changes.
set -euo pipefail
PYTHON="${PYTHON:-python3}"
VENV="${KSERVE_VENV:-.venv-kserve}"
SPEC='kserve==0.21.0'
STAMP="$VENV/.installed-stamp"

if [ -x "$VENV/bin/python" ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$SPEC" ]; then
  exit 0
fi
test -x "$VENV/bin/python" || "$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q "$SPEC"
# Fail here, not in the tests, when the install cannot import.
"$VENV/bin/python" -c 'from kserve import InferenceRESTClient, RESTConfig, InferRequest, InferInput'
echo "$SPEC" > "$STAMP"
echo "ensure_kserve_venv: $VENV has $SPEC" >&2
