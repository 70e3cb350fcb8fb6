"""TorchServe's access log: one line per HTTP request answered and per gRPC call ended, on every
listener (inference, management, metrics), in access_log.log (and ts_log.log, the console).

TorchServe writes the line when it sends the response (`NettyUtils.sendHttpResponse`) or
closes the call (`GRPCInterceptor`): `/127.0.0.1:51234 "POST /predictions/mnist HTTP/1.1" 200 12`
and `/127.0.0.1:51234 "gRPC org.pytorch.serve.grpc.inference.InferenceAPIsService/Predictions
HTTP/2.0" 0 12` (the gRPC status code's number). A request refused before routing (a bad token,
an oversized head) is not logged, as TorchServe does not log one its interceptors refuse.

Per request this costs a closure around `send` and one record put in the process's record
buffer (`emit`); the buffer is written once per event-loop turn.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, MutableMapping
from typing import Any

from mariner.server.compat.torchserve.logs.emit import current, emit, enabled
from mariner.server.compat.torchserve.logs.lines import access_message, remote_address
from mariner.server.compat.torchserve.logs.records import Kind
from mariner.server.compat.torchserve.logs.words import ACCESS_LOG

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


class HttpAccessLog:
    """ASGI middleware: TorchServe's access line for each HTTP request `app` answers.
    `thread` stands in the line's thread field (log4j's %t) for the listener."""

    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]], thread: str) -> None:
        self.app = app
        self.thread = thread

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not enabled():
            await self.app(scope, receive, send)
            return
        start = time.time()
        status = 0

        async def sending(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            if status:
                log_http_access(self.thread, scope, status, start)


def log_http_access(thread: str, scope: Mapping[str, Any], status: int, start: float) -> None:
    """TorchServe's access line for one HTTP request answered `status` (`start`: time.time()
    when it arrived); nothing when its access log is off."""
    target = current()
    if target is None:
        return
    path = scope.get("raw_path") or scope["path"].encode()
    query = scope.get("query_string")
    uri = (path + b"?" + query if query else path).decode("latin-1")
    now = time.time()
    protocol = f"HTTP/{scope.get('http_version', '1.1')}"
    remote = remote_address(scope.get("client"))
    message = access_message(remote, scope["method"], uri, protocol, status, int((now - start) * 1000))
    target(Kind.ACCESS, now, "INFO", thread, ACCESS_LOG, message)


def _peer(context: Any) -> str:
    """grpc's peer (`ipv4:127.0.0.1:51234`, `ipv6:[::1]:51234`) as Java writes the address.

    Read when the call starts, never once it ended: a streaming call's generator can be closed
    after grpc finished and freed the call, and `peer()` on a freed call reads freed memory (the
    frontend died with SIGSEGV under the fuzz tests)."""
    try:
        peer = str(context.peer())
    except Exception:  # noqa: BLE001 - no peer known: TorchServe's fallback
        return "127.0.0.1"
    for prefix in ("ipv4:", "ipv6:"):
        if peer.startswith(prefix):
            host, _, port = peer[len(prefix) :].rpartition(":")
            return f"/{host.strip('[]')}:{port}"
    return peer


def _status_number(context: Any, failed: bool) -> int:
    code = None
    try:
        code = context.code()
    except Exception:  # noqa: BLE001 - an older grpc without code(): from what happened
        code = None
    if code is None:
        return 2 if failed else 0  # UNKNOWN for an exception grpc turns into one, else OK
    value = getattr(code, "value", code)
    return int(value[0] if isinstance(value, tuple) else value)


def grpc_access_log(thread: str) -> Any:
    """A grpc.aio server interceptor writing TorchServe's access line for each call it lets
    through (put after the token check, as TorchServe's access line follows its own)."""
    import grpc

    class GrpcAccessLog(grpc.aio.ServerInterceptor):
        async def intercept_service(self, continuation: Any, details: Any) -> Any:
            handler = await continuation(details)
            if handler is None or not enabled():
                return handler
            method = details.method.lstrip("/")
            return _wrapped(grpc, handler, method, thread)

    return GrpcAccessLog()


def _log_call(context: Any, peer: str, method: str, thread: str, start: float, failed: bool) -> None:
    message = access_message(
        peer,
        "gRPC",
        method,
        "HTTP/2.0",
        _status_number(context, failed),
        int((time.monotonic() - start) * 1000),
    )
    emit(Kind.ACCESS, "INFO", thread, ACCESS_LOG, message)


def _wrapped(grpc: Any, handler: Any, method: str, thread: str) -> Any:
    """`handler` with its behaviour timed and logged, whatever its kind of streaming."""
    codec = {
        "request_deserializer": handler.request_deserializer,
        "response_serializer": handler.response_serializer,
    }
    if handler.unary_unary is not None or handler.stream_unary is not None:
        inner = handler.unary_unary or handler.stream_unary

        async def unary(request: Any, context: Any) -> Any:
            start, failed, peer = time.monotonic(), True, _peer(context)
            try:
                result = await inner(request, context)
                failed = False
                return result
            finally:
                _log_call(context, peer, method, thread, start, failed)

        return _same_kind(grpc, handler)(unary, **codec)
    inner_stream = handler.unary_stream or handler.stream_stream

    async def streaming(request: Any, context: Any) -> AsyncIterator[Any]:
        start, failed, peer = time.monotonic(), True, _peer(context)
        try:
            produced = inner_stream(request, context)
            if inspect.isasyncgen(produced):
                async for item in produced:
                    yield item
            else:  # a coroutine that writes with context.write
                await produced
            failed = False
        finally:
            _log_call(context, peer, method, thread, start, failed)

    return _same_kind(grpc, handler)(streaming, **codec)


def _same_kind(grpc: Any, handler: Any) -> Any:
    """grpc's constructor of a handler of `handler`'s kind (unary or streaming, each way)."""
    kind = next(
        (k for k in ("unary_unary", "stream_unary", "unary_stream") if getattr(handler, k)), "stream_stream"
    )
    return getattr(grpc, f"{kind}_rpc_method_handler")
