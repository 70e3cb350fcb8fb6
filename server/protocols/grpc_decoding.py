"""Turn undecodable gRPC requests into INVALID_ARGUMENT instead of grpc.aio's UNKNOWN.

grpc.aio deserializes a request before any servicer or interceptor code runs; when the bytes
are not a message of the method's request type, its Cython layer answers UNKNOWN with the
exception text. This interceptor (outermost, so it wraps whatever the others return) swaps in a
deserializer that never raises and a behaviour that answers INVALID_ARGUMENT for such requests.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from mariner.server.core.errors import STATUS, Code

_INVALID = STATUS[Code.INVALID_ARGUMENT].grpc


class _Undecodable:
    """Stands in for a request whose bytes did not parse."""


_BAD = _Undecodable()


def _message(details: grpc.HandlerCallDetails) -> str:
    return f"the request is not a valid protobuf message for {details.method}"


def _safe(deserializer: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    if deserializer is None:
        return None

    def deserialize(raw: bytes) -> Any:
        try:
            return deserializer(raw)
        except Exception:  # DecodeError and whatever a generated parser raises on garbage
            return _BAD

    return deserialize


async def _drain(result: Any) -> AsyncIterator[Any]:
    """Yield from a streaming behaviour, whether it is an async generator or a coroutine."""
    if inspect.isasyncgen(result):
        async for item in result:
            yield item
    else:
        await result


def _wrap(handler: grpc.RpcMethodHandler, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
    message = _message(details)
    kw = {
        "request_deserializer": _safe(handler.request_deserializer),
        "response_serializer": handler.response_serializer,
    }

    async def checked(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        async for request in requests:
            if request is _BAD:
                await context.abort(_INVALID, message)
            yield request

    if handler.unary_unary:
        inner_uu = handler.unary_unary

        async def unary_unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
            if request is _BAD:
                await context.abort(_INVALID, message)
            result = inner_uu(request, context)
            return await result if inspect.isawaitable(result) else result

        return grpc.unary_unary_rpc_method_handler(unary_unary, **kw)
    if handler.unary_stream:
        inner_us = handler.unary_stream

        async def unary_stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            if request is _BAD:
                await context.abort(_INVALID, message)
            async for item in _drain(inner_us(request, context)):
                yield item

        return grpc.unary_stream_rpc_method_handler(unary_stream, **kw)
    if handler.stream_unary:
        inner_su = handler.stream_unary

        async def stream_unary(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> Any:
            result = inner_su(checked(requests, context), context)
            return await result if inspect.isawaitable(result) else result

        return grpc.stream_unary_rpc_method_handler(stream_unary, **kw)
    inner_ss = handler.stream_stream

    async def stream_stream(
        requests: AsyncIterator[Any], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[Any]:
        async for item in _drain(inner_ss(checked(requests, context), context)):
            yield item

    return grpc.stream_stream_rpc_method_handler(stream_stream, **kw)


class SafeDecoding(grpc.aio.ServerInterceptor):
    """Must be the first interceptor, so it wraps the handler every other one returns."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or handler.request_deserializer is None:
            return handler
        return _wrap(handler, details)
