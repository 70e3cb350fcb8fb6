"""Health over HTTP for Kubernetes probes: /healthz (liveness) and /readyz (readiness).

TorchServe's `/ping` and the Open Inference Protocol's `/v2/health/*` live with their
protocols; these two are ours and answer the questions a kubelet asks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from mariner.server.protocols.http_common import NOT_READY_STATUS, json_response

if TYPE_CHECKING:
    from mariner.server.core.dataplane import DataPlane


def http_routes(dataplane: DataPlane) -> list[Route]:
    """GET /healthz and GET /readyz over the DataPlane's liveness and readiness."""

    async def healthz(request: Request) -> Response:
        """Liveness: the process answers. Kubernetes restarts the pod when this fails."""
        if dataplane.is_live():
            return json_response({"status": "alive"})
        return json_response({"status": "not alive"}, NOT_READY_STATUS)

    async def readyz(request: Request) -> Response:
        """Readiness: every model loaded and not draining, so load balancers send traffic here."""
        if dataplane.draining:
            return json_response({"status": "draining"}, NOT_READY_STATUS)
        if dataplane.is_ready():
            return json_response({"status": "ready"})
        return json_response({"status": "not ready"}, NOT_READY_STATUS)

    return [Route("/healthz", healthz, methods=["GET"]), Route("/readyz", readyz, methods=["GET"])]
