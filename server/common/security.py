"""Bearer-token auth for gRPC and HTTP, TLS material, and the refuse-to-expose check.

A model server executes archive code and answers anyone who can reach it, so Mariner is
closed by default: every listener binds 127.0.0.1, and binding anything else without tokens
refuses to start unless the operator says `--insecure`. Tokens (separate for inference and
management) are compared in constant time, never logged, and a refusal never says which part
was wrong. Health endpoints (and metrics) may stay open so probes and scrapers need no secret.

A listener accepts a `Credential`: Mariner's own tokens (`Tokens`, from the token settings),
TorchServe's current key (`torchserve_tokens.KeyCheck`), or either of them (`AnyCredential`).
How a refusal is answered (`Refusal`) is the listener's: TorchServe's 400 InvalidKeyException /
PERMISSION_DENIED wherever TorchServe's token authorization is on, as its clients expect, else
Mariner's 401 / UNAUTHENTICATED.
"""

from __future__ import annotations

import hmac
import inspect
import ipaddress
import json
import logging
import ssl
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import grpc

from mariner.server.common.grpc_server import HandlerInterceptor
from mariner.server.common.grpc_status import grpc_code
from mariner.server.common.raw_headers import first_header
from mariner.server.contracts.errors import STATUS, TORCHSERVE_TYPES, Code, ServingError
from mariner.server.contracts.worker_wire import CREDENTIAL_HEADERS

log = logging.getLogger("mariner")

UNAUTHENTICATED_MESSAGE = "missing or invalid bearer token"
# TorchServe 0.12's words for a refused key (TokenAuthorizationHandler, GRPCInterceptor).
TORCHSERVE_REFUSED_MESSAGE = (
    "Token Authorization failed. Token either incorrect, expired, or not provided correctly"
)
HEALTH_METHOD_PREFIX = "/grpc.health.v1.Health/"
# The one grpc.health.v1 service open without a token: the whole server's status.
OPEN_HEALTH_SERVICE = ""
OPEN_HTTP_HEALTH_PATHS = frozenset({"/ping", "/healthz", "/readyz", "/v2/health/live", "/v2/health/ready"})
# Headers only the server sets: TorchServe's mode switches that BaseHandler-style handlers read
# (`explain: True` on explanation routes, `describe: True` for a customized describe). A client
# sending them on a prediction must not flip the handler into another path.
SERVER_SET_HEADERS = frozenset({"explain", "describe"})
HIDDEN_FROM_HANDLERS = CREDENTIAL_HEADERS | SERVER_SET_HEADERS
# TLS 1.2 suites HTTP accepts: forward-secret AEAD only, as gRPC's BoringSSL defaults are (no CBC,
# no static RSA key exchange). TLS 1.3 suites are all AEAD and are not restricted by this string.
HTTP_TLS12_CIPHERS = "ECDHE+AESGCM:ECDHE+CHACHA20"


def bearer_token(authorization: str | None) -> bytes | None:
    """The token of an `Authorization: Bearer <token>` value (the scheme in any case, as RFC 9110
    has it), or None when the value is absent or of another form."""
    if not authorization or authorization[:7].lower() != "bearer ":
        return None
    token = authorization[7:].strip()
    return token.encode() if token else None


class Credential(Protocol):
    """What a listener checks a caller's `Authorization` value against. False when it protects
    nothing (no tokens configured): such a listener answers without a token."""

    def __bool__(self) -> bool: ...

    def accepts(self, authorization: str | None) -> bool: ...


@dataclass(frozen=True)
class Tokens:
    """Accepted bearer tokens for one API; empty means that API is not protected."""

    values: tuple[str, ...] = field(default=(), repr=False)

    def __bool__(self) -> bool:
        return bool(self.values)

    def accepts(self, authorization: str | None) -> bool:
        if not self.values:
            return True
        presented = bearer_token(authorization)
        if presented is None:
            return False
        ok = False
        for token in self.values:  # check every token: timing must not depend on which matched
            ok |= hmac.compare_digest(presented, token.encode())
        return ok


class AnyCredential:
    """Accepts what any of its configured credentials accepts (Mariner's tokens and TorchServe's
    key on one listener); protects when any of them does. Every member is asked, so the time a
    check takes does not say which one matched."""

    def __init__(self, *members: Credential) -> None:
        self._members = tuple(m for m in members if m)

    def __bool__(self) -> bool:
        return bool(self._members)

    def accepts(self, authorization: str | None) -> bool:
        if not self._members:
            return True
        ok = False
        for member in self._members:
            ok |= member.accepts(authorization)
        return ok


@dataclass(frozen=True)
class Refusal:
    """How a listener answers a call without a valid credential, over HTTP and gRPC."""

    http_status: int
    http_body: bytes = field(repr=False)
    grpc_code: grpc.StatusCode
    grpc_message: str


def error_body(status: int, kind: str, message: str) -> bytes:
    """TorchServe's error JSON (`{"code", "type", "message"}`, Gson's pretty printing, a newline)."""
    return (json.dumps({"code": status, "type": kind, "message": message}, indent=2) + "\n").encode()


def authorization_header(scope: Mapping[str, Any]) -> str | None:
    """An ASGI request's `Authorization` value, if it has one."""
    value = first_header(scope["headers"], b"authorization")
    return None if value is None else value.decode("latin-1")


# Mariner's own tokens: 401 / UNAUTHENTICATED, TorchServe's exception name in the body.
MARINER_REFUSAL = Refusal(
    STATUS[Code.UNAUTHENTICATED].http,
    error_body(
        STATUS[Code.UNAUTHENTICATED].http, TORCHSERVE_TYPES[Code.UNAUTHENTICATED], UNAUTHENTICATED_MESSAGE
    ),
    grpc_code(Code.UNAUTHENTICATED),
    UNAUTHENTICATED_MESSAGE,
)
# TorchServe's token authorization: what TorchServe 0.12 answers (InvalidKeyException is one of
# its ModelExceptions, which its HTTP frontend answers 400; its gRPC interceptor PERMISSION_DENIED).
TORCHSERVE_REFUSAL = Refusal(
    400,
    error_body(400, TORCHSERVE_TYPES[Code.UNAUTHENTICATED], TORCHSERVE_REFUSED_MESSAGE),
    grpc.StatusCode.PERMISSION_DENIED,
    TORCHSERVE_REFUSED_MESSAGE,
)


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


def exposure_problems(listeners: Mapping[str, tuple[str, bool]]) -> list[str]:
    """Listeners bound beyond loopback without a credential (name -> (host:port, protected)).

    Callers leave out a listener that is open by the operator's choice (metrics with
    --open-metrics); every other one that answers without a token is a problem."""
    problems = []
    for name, (address, protected) in listeners.items():
        host = address.rpartition(":")[0]
        if not is_loopback(host) and not protected:
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


def _overall_health_only(
    method: str, handler: grpc.RpcMethodHandler, refusal: Refusal
) -> grpc.RpcMethodHandler:
    """`handler` for a caller without a token while health is open: the overall status
    (service "") answers, as probes need; a named service is a model's name, so asking about
    one (Check, Watch) or listing them all (List) is refused like any other call without a token."""
    code, message = refusal.grpc_code, refusal.grpc_message
    kw = {
        "request_deserializer": handler.request_deserializer,
        "response_serializer": handler.response_serializer,
    }
    if method == HEALTH_METHOD_PREFIX + "Check" and handler.unary_unary:
        check = handler.unary_unary

        async def checked(request: Any, context: grpc.aio.ServicerContext) -> Any:
            if request.service != OPEN_HEALTH_SERVICE:
                await context.abort(code, message)
            return await check(request, context)

        return grpc.unary_unary_rpc_method_handler(checked, **kw)
    if method == HEALTH_METHOD_PREFIX + "Watch" and handler.unary_stream:
        watch = handler.unary_stream

        async def watched(request: Any, context: grpc.aio.ServicerContext) -> None:
            if request.service != OPEN_HEALTH_SERVICE:
                await context.abort(code, message)
            stream = watch(request, context)
            if inspect.isasyncgen(stream):
                async for reply in stream:
                    await context.write(reply)
            else:  # grpc's HealthServicer.Watch writes through the context itself
                await stream

        return grpc.unary_stream_rpc_method_handler(watched, **kw)
    return refusing_handler(handler, code, message)


class GrpcTokenAuth(HandlerInterceptor):
    """Checks `authorization: Bearer <token>` metadata on every call; with `open_health`, the
    overall health status (grpc.health.v1 service "") needs none, per-model health does. A call
    refused is answered `refusal`'s status, unread."""

    def __init__(self, tokens: Credential, *, open_health: bool, refusal: Refusal = MARINER_REFUSAL) -> None:
        self._tokens = tokens
        self._open_health = open_health
        self._refusal = refusal

    def intercept(
        self, handler: grpc.RpcMethodHandler, details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler:
        if not self._tokens:
            return handler
        authorization = None
        for key, value in details.invocation_metadata or ():
            if key == "authorization":
                authorization = value if isinstance(value, str) else value.decode("latin-1")
                break
        if self._tokens.accepts(authorization):
            return handler
        if self._open_health and details.method.startswith(HEALTH_METHOD_PREFIX):
            return _overall_health_only(details.method, handler, self._refusal)
        return refusing_handler(handler, self._refusal.grpc_code, self._refusal.grpc_message)


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
    try:
        ctx.load_cert_chain(str(cert), str(key))
    except ssl.SSLError as exc:
        if "KEY_TOO_SMALL" not in str(exc) and "too small" not in str(exc):
            raise
        if client_ca is not None:
            # A lower security level would also let weak client keys and CAs through mutual TLS.
            raise ServingError(
                Code.INVALID_ARGUMENT,
                f"TLS key {key} is weaker than OpenSSL's default security level allows "
                f"({getattr(exc, 'reason', None) or exc}); with client certificates required, only "
                "keys at that level are served: use an RSA key of 2048 bits or more, or an EC key",
            ) from None
        # The operator's own key, below OpenSSL's default security level (RSA < 2048 bits, as the
        # 1024-bit pair in TorchServe's own examples). Java serves it; so do we, with the same
        # suites and versions, and say it is weak. (Clients still judge the key themselves.)
        ctx.set_ciphers(HTTP_TLS12_CIPHERS + ":@SECLEVEL=1")
        ctx.load_cert_chain(str(cert), str(key))
        log.warning(
            "TLS key %s is weaker than OpenSSL's default security level allows (%s): served anyway, "
            "as TorchServe serves it; use an RSA key of 2048 bits or more, or an EC key",
            key, getattr(exc, "reason", None) or exc,
        )  # fmt: skip
    if client_ca is not None:
        ctx.verify_mode = ssl.CERT_REQUIRED
        ctx.load_verify_locations(str(client_ca))
    return ctx


# -- HTTP (ASGI middleware: no per-request objects beyond the header lookup) ---------------------
class HttpTokenAuth:
    """`refusal` (401, or TorchServe's 400) unless `Authorization: Bearer <token>` is valid;
    `open_paths` pass without one.

    It runs as soon as the request head is parsed, before anything reads the body, and its refusal
    closes the connection: a refused client cannot make the server read (and discard) a body it
    announced, nor keep the connection for another try."""

    def __init__(
        self,
        app: Any,
        tokens: Credential,
        *,
        open_paths: Iterable[str] = (),
        refusal: Refusal = MARINER_REFUSAL,
    ) -> None:
        self.app = app
        self.tokens = tokens
        self.open_paths = frozenset(open_paths)
        self._status = refusal.http_status
        self._body = refusal.http_body
        # The authentication challenge belongs to a 401 only.
        challenge = [(b"www-authenticate", b"Bearer")] if refusal.http_status == 401 else []
        self._headers = [
            (b"content-type", b"application/json"),
            *challenge,
            (b"content-length", str(len(self._body)).encode()),
            (b"connection", b"close"),
        ]

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not self.tokens or scope["path"] in self.open_paths:
            await self.app(scope, receive, send)
            return
        if self.tokens.accepts(authorization_header(scope)):
            await self.app(scope, receive, send)
            return
        await send({"type": "http.response.start", "status": self._status, "headers": self._headers})
        await send({"type": "http.response.body", "body": self._body})
