"""A frontend's gRPC inference listener (7070) with health and reflection.

It carries the standard `grpc.health.v1.Health` service, backed by one shared
HealthServicer: "" (overall) and the inference service name are SERVING only when every model
is ready; each model has a service of its own name, SERVING once that model is ready, so a
load balancer can route per model. With tokens, only "" answers a caller without one (see
security.GrpcTokenAuth); `List` is answered and `Watch` streams are capped (common.health).
Server reflection (v1alpha and v1) lets grpcurl and friends list the services.

Message size limits are set explicitly on both directions (grpc's defaults are asymmetric:
4 MiB in, unlimited out), and SO_REUSEPORT is off, so a second server on the same port (say a
stock TorchServe still running) fails to start instead of silently sharing the traffic. The
frontends of `mariner serve` turn it on for the inference port only: they share it on purpose,
and the supervisor holds a SO_REUSEPORT socket on it so that no foreign server can join.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from typing import Any, Protocol

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import SERVICE_NAME as HEALTH_SERVICE_NAME
from grpc_health.v1.health import aio as health_aio

from mariner.server.common import oip_codec as oip
from mariner.server.common.grpc_decoding import SafeDecoding
from mariner.server.common.grpc_server import (
    REFLECTION_V1_SERVICE_NAME,
    GrpcLimits,
    bind,
    bind_port,
    enable_reflection,
    server_options,
)
from mariner.server.common.health import GrpcHealth
from mariner.server.common.held_bytes import HeldBytes
from mariner.server.contracts.types import ModelInfo
from mariner.server.frontend.protocols.oip import grpc as grpc_oip
from mariner.server.frontend.protocols.torchserve import grpc as grpc_inference

__all__ = [
    "REFLECTION_V1_SERVICE_NAME",
    "GrpcPlane",
    "GrpcServers",
    "bind_port",
    "build_grpc_servers",
    "enable_reflection",
]

log = logging.getLogger("mariner.grpc")

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING

# How often health follows the DataPlane on its own (model loads, failures, registrations
# through HTTP); explicit refresh_health() calls make changes visible at once.
DEFAULT_HEALTH_POLL_S = 1.0


class GrpcPlane(grpc_inference.InferencePlane, oip.OipPlane, Protocol):
    """Everything the inference adapters and the health service need from the DataPlane."""

    def model_ready(self, model: str, version: str | None = None) -> bool: ...

    def is_ready(self) -> bool: ...

    def models(self) -> list[ModelInfo]: ...


class StoppableHealth(GrpcHealth):
    """grpc.health.v1 whose `Watch` streams end when the server stops.

    A Watch never ends on its own, and grpc's `server.stop(grace)` waits for every call in
    progress: one watcher would hold a draining server for its whole grace period after the
    calls that matter (inference, accepted before the drain) were answered. Watchers have been
    sent NOT_SERVING by then (set_not_serving)."""

    def __init__(self) -> None:
        super().__init__()
        self._watching: set[asyncio.Task[object]] = set()

    async def Watch(self, request: health_pb2.HealthCheckRequest, context: Any) -> None:  # noqa: N802 - grpc's name
        task = asyncio.current_task()
        if task is not None:
            self._watching.add(task)
        try:
            await super().Watch(request, context)
        finally:
            self._watching.discard(task)

    def end_watches(self) -> None:
        for task in list(self._watching):
            task.cancel()


class GrpcServers:
    """Both grpc.aio servers, their bound ports and the shared health state.

    Build with `build_grpc_servers` inside the running event loop; then `start()`, and on
    shutdown `set_not_serving()` (readiness first) followed by `stop(grace)`.
    """

    def __init__(
        self,
        dataplane: GrpcPlane,
        *,
        inference: grpc.aio.Server,
        inference_port: int,
        health: health_aio.HealthServicer,
        health_poll_s: float | None,
    ) -> None:
        self.dataplane = dataplane
        self.inference = inference
        self.inference_port = inference_port
        self.health = health
        self._health_poll_s = health_poll_s
        self._poller: asyncio.Task[None] | None = None
        self._known_models: set[str] = set()
        self._shutting_down = False

    async def start(self) -> None:
        """Publish health first (grpc's HealthServicer starts out SERVING), then listen."""
        await self.refresh_health()
        await self.inference.start()
        if self._health_poll_s and self._poller is None:
            self._poller = asyncio.create_task(
                self._poll_health(self._health_poll_s), name="grpc-health-poll"
            )
        log.info("gRPC listening: inference %s", self.inference_port)

    async def refresh_health(self) -> None:
        """Set every health status from the DataPlane: overall, inference service, one per model."""
        if self._shutting_down:
            return
        overall = SERVING if self.dataplane.is_ready() else NOT_SERVING
        await self.health.set("", overall)
        await self.health.set(grpc_inference.SERVICE_NAME, overall)
        await self.health.set(grpc_oip.SERVICE_NAME, overall)
        names = {info.name for info in self.dataplane.models()}
        for name in sorted(names):
            await self.health.set(name, SERVING if self.dataplane.model_ready(name) else NOT_SERVING)
        # A model that was unregistered stays known to health checkers, as NOT_SERVING.
        for gone in sorted(self._known_models - names):
            await self.health.set(gone, NOT_SERVING)
        self._known_models |= names

    async def set_not_serving(self) -> None:
        """Shutdown step one: every status NOT_SERVING, for good (later refreshes are ignored)."""
        self._shutting_down = True
        await self._stop_poller()
        await self.health.enter_graceful_shutdown()

    async def stop(self, grace: float) -> None:
        """Stop the listener; calls in flight get up to `grace` seconds to finish."""
        await self.set_not_serving()
        if isinstance(self.health, StoppableHealth):
            self.health.end_watches()
        await self.inference.stop(grace)

    async def _stop_poller(self) -> None:
        poller, self._poller = self._poller, None
        if poller is not None:
            poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await poller

    async def _poll_health(self, interval: float) -> None:
        while True:
            await asyncio.sleep(interval)
            try:
                await self.refresh_health()
            except Exception:  # keep polling: a failed refresh must not freeze health forever
                log.exception("gRPC health refresh failed")


def build_grpc_servers(
    dataplane: GrpcPlane,
    *,
    inference_address: str,
    max_message_bytes: int,
    health_poll_s: float | None = DEFAULT_HEALTH_POLL_S,
    inference_interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
    credentials: grpc.ServerCredentials | None = None,
    reuse_port: bool = False,
    limits: GrpcLimits | None = None,
    held: HeldBytes | None = None,
) -> GrpcServers:
    """Create and bind (not start) a frontend's inference server (management is the supervisor's:
    `supervisor.management.grpc.build_management_server`).

    The address is "host:port"; port 0 picks a free port, reported in `inference_port`. Must run
    inside the event loop that will serve the calls. `health_poll_s` None disables the background
    health refresh. `reuse_port` shares the inference port with the other frontends
    (SO_REUSEPORT). `limits` bound the inference
    server's connections (grpc_server.GrpcLimits; its defaults when None). `held` is the
    frontend's budget of request bytes its inference calls hold (common.held_bytes).
    """
    if max_message_bytes <= 0:
        raise ValueError(f"max_message_bytes must be positive, got {max_message_bytes}")
    health = StoppableHealth()

    inference = grpc.aio.server(
        options=server_options(max_message_bytes, reuse_port, limits),
        interceptors=[SafeDecoding(), *inference_interceptors],
    )
    grpc_inference.add_to_server(dataplane, inference, held)
    # The Open Inference Protocol (KServe v2 / Triton) shares the port and the DataPlane.
    grpc_oip.add_to_server(dataplane, inference, max_message_bytes=max_message_bytes, held=held)
    health_pb2_grpc.add_HealthServicer_to_server(health, inference)
    enable_reflection(
        (
            grpc_inference.SERVICE_NAME,
            grpc_oip.SERVICE_NAME,
            grpc_oip.TORCHSERVE_SERVICE_NAME,
            HEALTH_SERVICE_NAME,
        ),
        inference,
    )

    inference_port = bind(inference, inference_address, "inference", credentials)
    return GrpcServers(
        dataplane,
        inference=inference,
        inference_port=inference_port,
        health=health,
        health_poll_s=health_poll_s,
    )
