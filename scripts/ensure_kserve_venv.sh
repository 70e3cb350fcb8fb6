#!/usr/bin/env bash
# KServe's Python SDK (the conformance tests' KServe client) gets its own virtualenv, .venv-kserve:
# it pins its own fastapi/starlette/pydantic/protobuf stack, which must not move the server's.
set -euo pipefail
SPEC='kserve==0.21.0'
exec bash "$(dirname "$0")/ensure_client_venv.sh" "${KSERVE_VENV:-.venv-kserve}" "$SPEC" \
  'from kserve import InferenceRESTClient, RESTConfig, InferRequest, InferInput'
