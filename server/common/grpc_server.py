"""The gRPC server pieces both processes build: options, binding, reflection, the base of our
interceptors, and the management server (7071), which the supervisor serves.

Kept apart from `grpc_listener` (the inference server, with every inference adapter) so the
supervisor builds its management server without importing an inference adapter.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2, reflection_pb2_grpc

# How long a connection may take to finish its handshake (TLS, HTTP/2 preface and SETTINGS):
# grpc core's default is 120 s, which lets a client that connects and says nothing hold a
# descriptor for two minutes. The same bound as an HTTP request head's.
HANDSHAKE_TIMEOUT_S = 20.0
# Server keepalive: a PING after this long without traffic, and the connection is closed when
# no answer comes within KEEPALIVE_TIMEOUT_S, so peers that vanished (no FIN) give their
# descriptors back instead of holding them until the idle timeout.
KEEPALIVE_TIME_S = 60.0
KEEPALIVE_TIMEOUT_S = 20.0
# Clients may ping no more often than this; more pings are strikes, and after grpc's two strikes
# the connection ends with GOAWAY ENHANCE_YOUR_CALM (a ping flood costs the server a write each).
MIN_CLIENT_PING_INTERVAL_S = 10.0
# How long a connection may leave the server's SETTINGS unacknowledged before it is closed. A
# real HTTP/2 client acknowledges them within a round trip; a connection that sends the preface
# and nothing more (the review's flood: 1,000 of them held every slot for the 60 s idle timeout,
# and new clients got UNAVAILABLE) now gives its slot back after this.
SETTINGS_ACK_TIMEOUT_S = 5.0
# The flow-control window of one call: what a client may send before the server has asked for
# it. grpc's default grows it by probing the link (BDP), to several MiB on loopback, so a call
# refused on its metadata (no token, draining) still had most of its message pushed into the
# server, whose CPU took it in and threw it away (~7 ms per 8 MiB refusal here, 1.8 ms with this
# window). A fixed 1 MiB keeps a large tensor's transfer as fast here (one window per round
# trip: 100 MiB/s per call even at a 10 ms RTT) and bounds what a refused call costs.
STREAM_WINDOW_BYTES = 1 << 20


@dataclass(frozen=True)
class GrpcLimits:
    """Per-server connection limits, enforced by grpc core before any call reaches Python.

    `max_connections` caps open connections (one more is closed at once, before its HTTP/2
    preface is read); `max_concurrent_streams` is advertised in SETTINGS, so a client opens no
    more calls than that on one connection and the server refuses those that do (RST_STREAM
    REFUSED_STREAM): a connection cannot pile up half-open streams; `idle_timeout_s` ends a
    connection with no call in progress (GOAWAY; a client reconnects when it next calls)."""

    max_connections: int = 1000
    max_concurrent_streams: int = 256
    idle_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        for name in ("max_connections", "max_concurrent_streams", "idle_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"grpc_{name} must be positive, got {getattr(self, name)!r}")


def server_options(
    max_message_bytes: int, reuse_port: bool = False, limits: GrpcLimits | None = None
) -> list[tuple[str, Any]]:
    """grpc core channel arguments for one of our servers (grpc ignores a name it does not
    know, so each of these is checked against the server's behaviour by the listener tests)."""
    limits = limits or GrpcLimits()
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.so_reuseport", 1 if reuse_port else 0),
        ("grpc.max_allowed_incoming_connections", limits.max_connections),
        ("grpc.max_concurrent_streams", limits.max_concurrent_streams),
        ("grpc.max_connection_idle_ms", int(limits.idle_timeout_s * 1000)),
        ("grpc.server_handshake_timeout_ms", int(HANDSHAKE_TIMEOUT_S * 1000)),
        ("grpc.keepalive_time_ms", int(KEEPALIVE_TIME_S * 1000)),
        ("grpc.keepalive_timeout_ms", int(KEEPALIVE_TIMEOUT_S * 1000)),
        ("grpc.http2.min_ping_interval_without_data_ms", int(MIN_CLIENT_PING_INTERVAL_S * 1000)),
        ("grpc.http2.bdp_probe", 0),
        ("grpc.http2.lookahead_bytes", STREAM_WINDOW_BYTES),
        ("grpc.http2.settings_timeout", int(SETTINGS_ACK_TIMEOUT_S * 1000)),
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


class HandlerInterceptor(grpc.aio.ServerInterceptor):
    """An interceptor that decides, once grpc found the method's handler, what serves the call:
    `intercept` returns that handler, a wrapper of it or a refusal. A method with no handler
    (grpc answers UNIMPLEMENTED) passes through untouched."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None:
            return handler
        return self.intercept(handler, details)

    def intercept(
        self, handler: grpc.RpcMethodHandler, details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler:
        raise NotImplementedError


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
