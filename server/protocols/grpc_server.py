"""The gRPC server pieces both processes build: options, binding, reflection, and the management
server (7071), which the supervisor serves.

Kept apart from `grpc_listener` (the inference server, with every inference adapter) so the
supervisor builds its management server without importing an inference adapter.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import grpc
from grpc_health.v1 import health_pb2_grpc
from grpc_health.v1.health import SERVICE_NAME as HEALTH_SERVICE_NAME
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection, reflection_pb2, reflection_pb2_grpc

from mariner.server.control import management_grpc as grpc_management
from mariner.server.protocols.grpc_decoding import SafeDecoding
from mariner.server.protocols.oip import grpc_ext as oip_ext


def server_options(max_message_bytes: int, reuse_port: bool = False) -> list[tuple[str, Any]]:
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.so_reuseport", 1 if reuse_port else 0),
    ]


def bind(
    server: grpc.aio.Server, address: str, what: str, credentials: grpc.ServerCredentials | None = None
) -> int:
    try:
        if credentials is None:
            port = server.add_insecure_port(address)
        else:
            port = server.add_secure_port(address, credentials)
    except RuntimeError as exc:
        raise RuntimeError(f"cannot listen for gRPC {what} on {address!r}: {exc}") from exc
    if port == 0:  # older grpc versions report a failed bind as port 0
        raise RuntimeError(f"cannot listen for gRPC {what} on {address!r}: address in use or invalid")
    return port


def build_management_server(
    plane: grpc_management.ManagementPlane,
    *,
    max_message_bytes: int,
    health: health_aio.HealthServicer,
    on_change: Callable[[], Awaitable[None]] | None = None,
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
) -> grpc.aio.Server:
    """The gRPC management server (7071), not yet bound: management, health and reflection.

    The single-process server and the supervisor of `mariner serve` both serve it.
    """
    management = grpc.aio.server(
        options=server_options(max_message_bytes), interceptors=[SafeDecoding(), *interceptors]
    )
    grpc_management.add_to_server(plane, management, on_change)
    # Triton's repository load/unload/index: management calls, so served here (management token).
    oip_ext.add_repository_to_server(plane, management)
    health_pb2_grpc.add_HealthServicer_to_server(health, management)
    enable_reflection((grpc_management.SERVICE_NAME, oip_ext.SERVICE_NAME, HEALTH_SERVICE_NAME), management)
    return management


# grpcio-reflection serves only v1alpha; v1 (what current grpcurl and Postman ask first) has the
# same messages with the same field numbers under another package, so the v1alpha servicer
# answers it too, registered under v1's service name.
REFLECTION_V1_SERVICE_NAME = "grpc.reflection.v1.ServerReflection"


def enable_reflection(services: Sequence[str], server: grpc.aio.Server) -> None:
    """Server reflection, v1alpha and v1, listing `services` and both reflection services."""
    names = (*services, reflection.SERVICE_NAME, REFLECTION_V1_SERVICE_NAME)
    servicer = reflection.aio.ReflectionServicer(names)
    reflection_pb2_grpc.add_ServerReflectionServicer_to_server(servicer, server)
    v1 = {
        "ServerReflectionInfo": grpc.stream_stream_rpc_method_handler(
            servicer.ServerReflectionInfo,
            request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
            response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString,
        )
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(REFLECTION_V1_SERVICE_NAME, v1),))
    server.add_registered_method_handlers(REFLECTION_V1_SERVICE_NAME, v1)


def bind_port(
    server: grpc.aio.Server, address: str, what: str, credentials: grpc.ServerCredentials | None = None
) -> int:
    """Bind `server` to `address` ("host:port"); a clear RuntimeError when that fails."""
    return bind(server, address, what, credentials)
