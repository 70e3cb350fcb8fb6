#!/usr/bin/env bash
# Stock TorchServe (our compatibility oracle and benchmark baseline) needs Java 17+.
set -euo pipefail
if command -v java >/dev/null 2>&1; then
  major=$(java -version 2>&1 | sed -nE 's/.*version "([0-9]+).*/\1/p' | head -n1)
  if [ "${major:-0}" -ge 17 ]; then exit 0; fi
fi
echo "Java 17+ not found: installing openjdk-17-jre-headless" >&2
SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
$SUDO apt-get update -q
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q openjdk-17-jre-headless
