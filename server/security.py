"""Bearer-token auth for gRPC and HTTP, TLS material, and the refuse-to-expose check.

A model server executes archive code and answers anyone who can reach it, so Mariner is
closed by default: every listener binds 127.0.0.1, and binding anything else without tokens
refuses to start unless the operator says `--insecure`. Tokens (separate for inference and
management) are compared in constant time, never logged, and a refusal never says which part
was wrong. Health endpoints (and metrics) may stay open so probes and scrapers need no secret.
"""

from __future__ import annotations

import hmac
import inspect
import ipaddress
import json
import ssl
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from mariner.server.core.errors import STATUS, TORCHSERVE_TYPES, Code

UNAUTHENTICATED_MESSAGE = "missing or invalid bearer token"
HEALTH_METHOD_PREFIX = "/grpc.health.v1.Health/"
# The one grpc.health.v1 service open without a token: the whole server's status.
OPEN_HEALTH_SERVICE = ""
OPEN_HTTP_HEALTH_PATHS = frozenset({"/ping", "/healthz", "/readyz", "/v2/health/live", "/v2/health/ready"})
# Request headers that carry credentials: checked here, never handed to handler code (archives
# are third-party code; a token they can read is a token they can leak). Lower-case, as HTTP
# header names reach us from uvicorn and gRPC metadata keys are.
CREDENTIAL_HEADERS = frozenset({"authorization", "proxy-authorization"})
# Headers only the server sets: TorchServe's mode switches that BaseHandler-style handlers read
# (`explain: True` on explanation routes, `describe: True` for a customized describe). A client
# sending them on a prediction must not flip the handler into another path.
SERVER_SET_HEADERS = frozenset({"explain", "describe"})
HIDDEN_FROM_HANDLERS = CREDENTIAL_HEADERS | SERVER_SET_HEADERS
# TLS 1.2 suites HTTP accepts: forward-secret AEAD only, as gRPC's BoringSSL defaults are (no CBC,
# no static RSA key exchange). TLS 1.3 suites are all AEAD and are not restricted by this string.
HTTP_TLS12_CIPHERS = "ECDHE+AESGCM:ECDHE+CHACHA20"


@dataclass(frozen=True)
class Tokens:
    """Accepted bearer tokens for one API; empty means that API is not protected."""

    values: tuple[str, ...] = field(default=(), repr=False)

    def __bool__(self) -> bool:
        return bool(self.values)

    def accepts(self, authorization: str | None) -> bool:
        if not self.values:
            return True
        if not authorization or authorization[:7].lower() != "bearer ":
            return False
        presented = authorization[7:].strip().encode()
        ok = False
        for token in self.values:  # check every token: timing must not depend on which matched
            ok |= hmac.compare_digest(presented, token.encode())
        return ok


def load_tokens(value: str | None, file: Path | None) -> Tokens:
    """Tokens from a value (comma-separated) and/or a file (one per line, '#' comments)."""
    found: list[str] = []
    if value:
        found += [t.strip() for t in value.split(",") if t.strip()]
    if file is not None:
        for line in Path(file).read_text().splitlines():
            line = line.strip()
            if line and not line.startswith("#"):
                found.append(line)
    return Tokens(tuple(found))


def is_loopback(host: str) -> bool:
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a hostname other than localhost may resolve anywhere


def exposure_problems(listeners: Mapping[str, tuple[str, Tokens]]) -> list[str]:
    """Listeners bound beyond loopback without tokens (name -> (host:port, tokens)).

    Callers leave out a listener that is open by the operator's choice (metrics with
    --open-metrics); every other one that answers without a token is a problem."""
    problems = []
    for name, (address, tokens) in listeners.items():
        host = address.rpartition(":")[0]
        if not is_loopback(host) and not tokens:
            problems.append(f"{name} on {address}")
    return problems


# -- gRPC ---------------------------------------------------------------------------------------
def refusing_handler(
    handler: grpc.RpcMethodHandler, code: grpc.StatusCode, message: str
) -> grpc.RpcMethodHandler:
    """A handler answering `code` for a call that `handler` would have served, without reading
    the request.

    The refusal takes the request-streaming shape of the same method (the wire does not tell a
    unary request from a stream of one) and no deserializer: grpc.aio starts a request-streaming
    behaviour as soon as the call's metadata is in, so a refused caller costs neither the read
    nor the decoding of its message (a unary handler would first take in the whole message,
    up to max_request_bytes), and what it still sends is dropped with the stream.
    """

    async def unary(requests: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(code, message)

    async def streaming(requests: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(code, message)
        yield  # pragma: no cover - abort raises

    if handler.unary_unary or handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(unary, response_serializer=handler.response_serializer)
    return grpc.stream_stream_rpc_method_handler(streaming, response_serializer=handler.response_serializer)


def _refusal(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same method as `handler` that answers UNAUTHENTICATED, unread."""
    return refusing_handler(handler, STATUS[Code.UNAUTHENTICATED].grpc, UNAUTHENTICATED_MESSAGE)


def _overall_health_only(method: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """`handler` for a caller without a token while health is open: the overall status
    (service "") answers, as probes need; a named service is a model's name, so asking about
    one (Check, Watch) or listing them all (List) is refused like any other call without a token."""
    code = STATUS[Code.UNAUTHENTICATED].grpc
    kw = {
        "request_deserializer": handler.request_deserializer,
        "response_serializer": handler.response_serializer,
    }
    if method == HEALTH_METHOD_PREFIX + "Check" and handler.unary_unary:
        check = handler.unary_unary

        async def checked(request: Any, context: grpc.aio.ServicerContext) -> Any:
            if request.service != OPEN_HEALTH_SERVICE:
                await context.abort(code, UNAUTHENTICATED_MESSAGE)
            return await check(request, context)

        return grpc.unary_unary_rpc_method_handler(checked, **kw)
    if method == HEALTH_METHOD_PREFIX + "Watch" and handler.unary_stream:
        watch = handler.unary_stream

        async def watched(request: Any, context: grpc.aio.ServicerContext) -> None:
            if request.service != OPEN_HEALTH_SERVICE:
                await context.abort(code, UNAUTHENTICATED_MESSAGE)
            stream = watch(request, context)
            if inspect.isasyncgen(stream):
                async for reply in stream:
                    await context.write(reply)
            else:  # grpc's HealthServicer.Watch writes through the context itself
                await stream

        return grpc.unary_stream_rpc_method_handler(watched, **kw)
    return _refusal(handler)


class GrpcTokenAuth(grpc.aio.ServerInterceptor):
    """Checks `authorization: Bearer <token>` metadata on every call; with `open_health`, the
    overall health status (grpc.health.v1 service "") needs none, per-model health does."""

    def __init__(self, tokens: Tokens, *, open_health: bool) -> None:
        self._tokens = tokens
        self._open_health = open_health

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or not self._tokens:
            return handler
        authorization = None
        for key, value in details.invocation_metadata or ():
            if key == "authorization":
                authorization = value if isinstance(value, str) else value.decode("latin-1")
                break
        if self._tokens.accepts(authorization):
            return handler
        if self._open_health and details.method.startswith(HEALTH_METHOD_PREFIX):
            return _overall_health_only(details.method, handler)
        return _refusal(handler)


def grpc_credentials(cert: Path, key: Path, client_ca: Path | None) -> grpc.ServerCredentials:
    """TLS for gRPC; with `client_ca`, clients must present a certificate it signed (mTLS)."""
    root = client_ca.read_bytes() if client_ca else None
    return grpc.ssl_server_credentials(
        [(key.read_bytes(), cert.read_bytes())], root_certificates=root, require_client_auth=root is not None
    )


def http_ssl_context(cert: Path, key: Path, client_ca: Path | None) -> ssl.SSLContext:
    """TLS for the HTTP listeners: TLS 1.2 with HTTP_TLS12_CIPHERS or TLS 1.3, nothing older or
    weaker (Python's default server context still accepts CBC suites); with `client_ca`, clients
    must present a certificate it signed (mTLS)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.set_ciphers(HTTP_TLS12_CIPHERS)
    ctx.load_cert_chain(str(cert), str(key))
    if client_ca is not None:
        ctx.verify_mode = ssl.CERT_REQUIRED
        ctx.load_verify_locations(str(client_ca))
    return ctx


# -- HTTP (ASGI middleware: no per-request objects beyond the header lookup) ---------------------
class HttpTokenAuth:
    """401 unless `Authorization: Bearer <token>` is valid; `open_paths` pass without one.

    It runs as soon as the request head is parsed, before anything reads the body, and its 401
    closes the connection: a refused client cannot make the server read (and discard) a body it
    announced, nor keep the connection for another try."""

    def __init__(self, app: Any, tokens: Tokens, *, open_paths: Iterable[str] = ()) -> None:
        self.app = app
        self.tokens = tokens
        self.open_paths = frozenset(open_paths)
        self._body = json.dumps(
            {"code": 401, "type": TORCHSERVE_TYPES[Code.UNAUTHENTICATED], "message": UNAUTHENTICATED_MESSAGE}
        ).encode()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not self.tokens or scope["path"] in self.open_paths:
            await self.app(scope, receive, send)
            return
        authorization = None
        for key, value in scope["headers"]:
            if key == b"authorization":
                authorization = value.decode("latin-1")
                break
        if self.tokens.accepts(authorization):
            await self.app(scope, receive, send)
            return
        await send(
            {
                "type": "http.response.start",
                "status": STATUS[Code.UNAUTHENTICATED].http,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"www-authenticate", b"Bearer"),
                    (b"content-length", str(len(self._body)).encode()),
                    (b"connection", b"close"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": self._body})
