"""The drain gate of gRPC inference calls, at the moment a call's metadata arrives.

A frontend that drains refuses a new call with UNAVAILABLE before grpc reads its message (see
security.refusing_handler: a refused client costs no read and no decode of its tensor), and a
unary call that started before the drain is marked admitted in its own task: its inference is
then served even when its message (a large tensor takes a while) is still arriving as the drain
begins, and grpc's `server.stop(grace)` waits for it. A stream's messages are admitted one by
one (the DataPlane refuses those that arrive once draining). Health and reflection are never
refused: probes must see NOT_SERVING while the frontend drains.
"""

from __future__ import annotations

from typing import Protocol

import grpc

from mariner.server.common.grpc_server import HandlerInterceptor
from mariner.server.common.grpc_status import grpc_code
from mariner.server.common.security import HEALTH_METHOD_PREFIX, refusing_handler
from mariner.server.contracts.errors import Code

DRAINING_MESSAGE = "server is shutting down; retry on another replica"
# Services answered while draining: health (probes read NOT_SERVING) and server reflection.
ALWAYS_OPEN_PREFIXES = (HEALTH_METHOD_PREFIX, "/grpc.reflection.")


class Admitting(Protocol):
    """The DataPlane's admission (frontend.dataplane.DataPlane.admit)."""

    draining: bool

    def admit(self) -> bool: ...


class GrpcDrainGate(HandlerInterceptor):
    """Admits inference calls while the plane serves; refuses them, unread, once it drains."""

    def __init__(self, plane: Admitting) -> None:
        self._plane = plane
        self._code = grpc_code(Code.UNAVAILABLE)

    def intercept(
        self, handler: grpc.RpcMethodHandler, details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler:
        if details.method.startswith(ALWAYS_OPEN_PREFIXES):
            return handler
        if handler.request_streaming:
            # A stream is one long call: its messages are admitted one by one by the DataPlane
            # (one that arrives once the drain began is answered UNAVAILABLE in the stream, and
            # the client moves on), so only a new stream is refused here.
            if self._plane.draining:
                return refusing_handler(handler, self._code, DRAINING_MESSAGE)
            return handler
        # grpc.aio runs the interceptors in the call's own task, so the admission set here is
        # the one the call's handler sees when it reaches the DataPlane.
        if self._plane.admit():
            return handler
        return refusing_handler(handler, self._code, DRAINING_MESSAGE)
