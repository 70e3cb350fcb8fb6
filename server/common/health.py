"""Health for probes: /healthz (liveness) and /readyz (readiness) over HTTP, and the
grpc.health.v1 service every gRPC listener carries.

TorchServe's `/ping` and the Open Inference Protocol's `/v2/health/*` live with their
protocols; these two are ours and answer the questions a kubelet asks. The gRPC service is
grpc's own HealthServicer with two gaps closed: `List` (newer clients call it; the stock servicer
answers with an ERROR traceback in our log per call) and the number of `Watch` streams, each of
which holds a task and a slot in the servicer until the client leaves.
"""

from __future__ import annotations

from typing import Any, Protocol

from grpc_health.v1 import health_pb2
from grpc_health.v1.health import aio as health_aio
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from mariner.server.common.grpc_status import grpc_code
from mariner.server.common.http_common import NOT_READY_STATUS, json_response
from mariner.server.contracts.errors import Code

# Concurrent Watch streams per health servicer (one per process). Probes use Check; a few load
# balancers watch.
MAX_HEALTH_WATCHERS = 64


class Probed(Protocol):
    """What the probes ask: a frontend's DataPlane or the supervisor's ModelRegistry."""

    draining: bool

    def is_live(self) -> bool: ...

    def is_ready(self) -> bool: ...


def http_routes(dataplane: Probed) -> list[Route]:
    """GET /healthz and GET /readyz over the plane's liveness and readiness."""

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


class GrpcHealth(health_aio.HealthServicer):
    """grpc.health.v1 with `List` answered and at most `max_watchers` concurrent `Watch` streams;
    beyond that a Watch is refused with RESOURCE_EXHAUSTED (a client may fall back to Check)."""

    def __init__(self, max_watchers: int = MAX_HEALTH_WATCHERS) -> None:
        super().__init__()
        self.max_watchers = max_watchers
        self.watchers = 0

    async def List(
        self, request: health_pb2.HealthListRequest, context: Any
    ) -> health_pb2.HealthListResponse:
        """Every known service (the overall "" and one per model) with its status, as a snapshot."""
        statuses = dict(self._server_status)
        return health_pb2.HealthListResponse(
            statuses={
                name: health_pb2.HealthCheckResponse(status=status) for name, status in statuses.items()
            }
        )

    async def Watch(self, request: health_pb2.HealthCheckRequest, context: Any) -> None:
        if self.watchers >= self.max_watchers:
            await context.abort(
                grpc_code(Code.RESOURCE_EXHAUSTED),
                f"at most {self.max_watchers} health Watch streams at a time: use Check, or retry later",
            )
        self.watchers += 1
        try:
            await super().Watch(request, context)
        finally:
            self.watchers -= 1
