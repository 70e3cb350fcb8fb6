#!/usr/bin/env bash
# The manifest tests (tests/integration/test_k8s_manifests.py) render k8s/ offline with
# `kubectl kustomize`, which needs kubectl >= 1.27 (kustomize v5: `labels`, `patches`, the sleep
# preStop action). Exit 0 when one is on PATH; otherwise install one from the distribution's
# packages if a recent enough one is offered; otherwise say how to get one and exit 1.
set -euo pipefail

MIN_MINOR=27

client_minor() {  # "32" for "Client Version: v1.32.4-...", empty when kubectl is missing or odd
  command -v kubectl >/dev/null 2>&1 || return 0
  kubectl version --client 2>/dev/null | sed -nE 's/^Client Version: v?1\.([0-9]+).*/\1/p' | head -n1
}

recent_enough() {
  local minor
  minor=$(client_minor)
  [ -n "$minor" ] && [ "$minor" -ge "$MIN_MINOR" ]
}

if recent_enough; then
  exit 0
fi

SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
echo "kubectl >= 1.$MIN_MINOR not found (have: $(command -v kubectl || echo none) $(client_minor))" >&2
$SUDO apt-get update -q >&2

# Candidate's upstream minor: "1:1.32.4-1.1" -> 32, "1.20.5+really1.20.2-1.1" -> 20. Version
# schemes that are not 1.x (a cloud SDK's own numbering) are trusted and checked after installing.
candidate() { apt-cache policy "$1" 2>/dev/null | awk '/Candidate:/ {print $2}'; }
candidate_minor() {
  sed -E 's/^[0-9]+://; s/.*really//' <<<"$1" | sed -nE 's/^1\.([0-9]+)\..*/\1/p'
}

for pkg in kubectl kubernetes-client; do
  cand=$(candidate "$pkg")
  if [ -z "$cand" ] || [ "$cand" = "(none)" ]; then
    continue
  fi
  minor=$(candidate_minor "$cand")
  if [ -n "$minor" ] && [ "$minor" -lt "$MIN_MINOR" ]; then
    echo "apt offers $pkg $cand: too old (kubectl 1.$minor; kustomize there cannot render k8s/)" >&2
    continue
  fi
  echo "installing $pkg $cand with apt" >&2
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q "$pkg" >&2
  if recent_enough; then
    exit 0
  fi
  echo "$pkg $cand installed, but kubectl is still missing or older than 1.$MIN_MINOR" >&2
done

cat >&2 <<MSG
No package for kubectl >= 1.$MIN_MINOR is available here. Install it by hand, then rerun:
  - the Kubernetes project's apt repository (packages kubectl), per
    https://kubernetes.io/docs/tasks/tools/install-kubectl-linux/
  - or a release binary of kubectl >= v1.$MIN_MINOR placed on PATH (e.g. /usr/local/bin/kubectl).
Check with: kubectl version --client && kubectl kustomize k8s/overlays/cpu >/dev/null
MSG
exit 1
