#!/usr/bin/env bash
# tritonclient (the conformance tests' independent client) gets its own virtualenv, .venv-triton:
# tritonclient 2.x needs protobuf < 7 while the server's grpcio-tools 1.85 needs protobuf >= 7.35,
# and its generated `inference` stubs clash with ours in one process.
set -euo pipefail
# Newest release pip resolves here; pulls its own grpcio and protobuf (< 7), kept apart from .venv.
SPEC='tritonclient[grpc,http]==2.73.0'
exec bash "$(dirname "$0")/ensure_client_venv.sh" "${TRITON_VENV:-.venv-triton}" "$SPEC" \
  'import numpy, tritonclient.grpc, tritonclient.http, tritonclient.grpc.aio'
