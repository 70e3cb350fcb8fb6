"""Turn undecodable gRPC requests into INVALID_ARGUMENT instead of grpc.aio's UNKNOWN, and
keep big repeated fields opaque until their header is checked.

grpc.aio deserializes a request before any servicer or interceptor code runs; when the bytes
are not a message of the method's request type, its Cython layer answers UNKNOWN with the
exception text. This interceptor (outermost, so it wraps whatever the others return) swaps in a
deserializer that never raises and a behaviour that answers INVALID_ARGUMENT for such requests.

That parse runs on the event loop and holds the GIL (so a thread does not help): 8 million
INT64 zeros took 0.4 s to parse, a 650,000-entry map 4 s, before any check could refuse them.
`shallow_class` builds a wire-compatible twin of a request type in which chosen fields (a
message, or a map's entries) are plain `bytes`, which upb parses in O(1) per field; the servicer
checks the header and parses the opaque part itself, bounded by what the model accepts.
`register` mounts a generated servicer with such deserializers in place of the stock ones.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Callable, Mapping
from contextvars import ContextVar
from typing import Any

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.descriptor import Descriptor, FileDescriptor

from mariner.server.common.batch_policy import CALLER
from mariner.server.common.grpc_server import HandlerInterceptor
from mariner.server.common.grpc_status import abort, grpc_code
from mariner.server.common.held_bytes import HeldBytes
from mariner.server.contracts.errors import RETRY_AFTER_SECONDS, Code, ServingError

RETRY_AFTER_HEADER = "retry-after"

_INVALID = grpc_code(Code.INVALID_ARGUMENT)


class _Undecodable:
    """Stands in for a request whose bytes did not parse."""


_BAD = _Undecodable()


def _message(method: str) -> str:
    return f"the request is not a valid protobuf message for {method}"


# The size on the wire of the message last decoded in this task. grpc.aio decodes a message in
# the task that reads it (a unary call's own task, a stream's reader), so whoever reads a message
# finds its size here right after: the frontend's budget of held bytes counts it (held_bytes).
_MESSAGE_BYTES: ContextVar[int] = ContextVar("mariner_grpc_message_bytes", default=0)


def message_bytes(_request: object = None) -> int:
    """The wire size of the message this task read last (see _MESSAGE_BYTES)."""
    return _MESSAGE_BYTES.get()


def _safe(deserializer: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    if deserializer is None:
        return None

    def deserialize(raw: bytes) -> Any:
        _MESSAGE_BYTES.set(len(raw))
        try:
            return deserializer(raw)
        except Exception:  # DecodeError and whatever a generated parser raises on garbage
            return _BAD

    deserialize.safe_decoding = True  # type: ignore[attr-defined]
    return deserialize


def _is_wrapped(handler: grpc.RpcMethodHandler) -> bool:
    return getattr(handler.request_deserializer, "safe_decoding", False) is True


async def _drain(result: Any) -> AsyncIterator[Any]:
    """Yield from a streaming behaviour, whether it is an async generator or a coroutine."""
    if inspect.isasyncgen(result):
        async for item in result:
            yield item
    else:
        await result


def _wrap(
    handler: grpc.RpcMethodHandler, method: str, held: HeldBytes | None = None
) -> grpc.RpcMethodHandler:
    """`handler` with its undecodable requests answered INVALID_ARGUMENT naming `method`, its
    caller (grpc's peer, read when the call starts) set for the batcher's fair order, and,
    with `held`, a unary request's bytes held in the frontend's budget while it runs (refused
    RESOURCE_EXHAUSTED with retry-after when they do not fit; a stream's are counted by its
    pipeline, message by message).

    Done once per method when the service is registered (`register`), not per call: building
    the wrapper per call cost more than the rest of the interceptor chain together."""
    message = _message(method)

    async def admit(request: Any, context: grpc.aio.ServicerContext) -> int:
        """A unary call's start: its caller set, an undecodable request ended INVALID_ARGUMENT,
        and with `held`, the bytes of the message this call read taken from it (or the call
        ended RESOURCE_EXHAUSTED with retry-after when they do not fit); the bytes taken."""
        CALLER.set(context.peer())
        if request is _BAD:
            await context.abort(_INVALID, message)
        if held is None:
            return 0
        size = _MESSAGE_BYTES.get()
        if not held.take(size):
            context.set_trailing_metadata(((RETRY_AFTER_HEADER, str(RETRY_AFTER_SECONDS)),))
            await abort(context, held.refusal(size))
        return size

    def release(size: int) -> None:
        if held is not None:
            held.release(size)

    kw = {
        "request_deserializer": _safe(handler.request_deserializer),
        "response_serializer": handler.response_serializer,
    }

    async def checked(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        async for request in requests:
            if request is _BAD:
                await context.abort(_INVALID, message)
            yield request

    async def checked_stream(requests: AsyncIterator[Any]) -> AsyncIterator[Any]:
        """A bidirectional stream's requests: an undecodable one ends the request side with
        INVALID_ARGUMENT raised to the servicer, which answers what it has in flight first
        (an abort here would end the call at once and lose those answers)."""
        async for request in requests:
            if request is _BAD:
                raise ServingError(Code.INVALID_ARGUMENT, message)
            yield request

    if handler.unary_unary:
        inner_uu = handler.unary_unary

        async def unary_unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
            size = await admit(request, context)
            try:
                result = inner_uu(request, context)
                return await result if inspect.isawaitable(result) else result
            finally:
                release(size)

        return grpc.unary_unary_rpc_method_handler(unary_unary, **kw)
    if handler.unary_stream:
        inner_us = handler.unary_stream

        async def unary_stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            size = await admit(request, context)
            try:
                async for item in _drain(inner_us(request, context)):
                    yield item
            finally:
                release(size)

        return grpc.unary_stream_rpc_method_handler(unary_stream, **kw)
    if handler.stream_unary:
        inner_su = handler.stream_unary

        async def stream_unary(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> Any:
            CALLER.set(context.peer())
            result = inner_su(checked(requests, context), context)
            return await result if inspect.isawaitable(result) else result

        return grpc.stream_unary_rpc_method_handler(stream_unary, **kw)
    inner_ss = handler.stream_stream

    async def stream_stream(
        requests: AsyncIterator[Any], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[Any]:
        CALLER.set(context.peer())
        async for item in _drain(inner_ss(checked_stream(requests), context)):
            yield item

    return grpc.stream_stream_rpc_method_handler(stream_stream, **kw)


class SafeDecoding(HandlerInterceptor):
    """Must be the first interceptor, so it wraps the handler every other one returns.

    Our own services are wrapped when registered (`register`) and pass through untouched; this
    covers the handlers grpc's own services (health, reflection) bring.
    """

    def intercept(
        self, handler: grpc.RpcMethodHandler, details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler:
        if handler.request_deserializer is None or _is_wrapped(handler):
            return handler
        return _wrap(handler, details.method)


def _add_with_dependencies(
    pool: descriptor_pool.DescriptorPool, file: FileDescriptor, done: set[str]
) -> None:
    for dep in file.dependencies:
        _add_with_dependencies(pool, dep, done)
    if file.name not in done:
        proto = descriptor_pb2.FileDescriptorProto()
        file.CopyToProto(proto)
        pool.Add(proto)
        done.add(file.name)


def shallow_class(message: Descriptor, opaque: Mapping[str, tuple[str, ...]]) -> type[Any]:
    """A class parsing the same wire bytes as `message`, with `opaque` fields kept as raw bytes.

    `opaque` maps a message's full name (the request or one nested in its file) to field names;
    each becomes `bytes` (a map field: `repeated bytes`, one serialized entry each). Message and
    map fields are length-delimited on the wire, so the twin parses every valid request.
    """
    proto = descriptor_pb2.FileDescriptorProto()
    message.file.CopyToProto(proto)
    del proto.service[:]
    package = proto.package

    def visit(types: Any, prefix: str) -> None:
        for m in types:
            full = f"{prefix}.{m.name}" if prefix else m.name
            for f in m.field:
                if f.name in opaque.get(full, ()):
                    f.type = descriptor_pb2.FieldDescriptorProto.TYPE_BYTES
                    f.ClearField("type_name")
            visit(m.nested_type, full)

    visit(proto.message_type, package)
    pool = descriptor_pool.DescriptorPool()
    done: set[str] = set()
    for dep in message.file.dependencies:
        _add_with_dependencies(pool, dep, done)
    pool.Add(proto)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName(message.full_name))


class _Capture:
    """Stands in for a server while a generated `add_*Servicer_to_server` registers its handlers."""

    handlers: dict[str, grpc.RpcMethodHandler]

    def add_generic_rpc_handlers(self, handlers: Any) -> None:
        pass

    def add_registered_method_handlers(
        self, service: str, handlers: dict[str, grpc.RpcMethodHandler]
    ) -> None:
        self.service = service
        self.handlers = handlers


def register(
    server: grpc.aio.Server,
    add_to_server: Callable[[Any, Any], None],
    servicer: Any,
    deserializers: Mapping[str, Callable[[bytes], Any]],
    held: HeldBytes | None = None,
) -> None:
    """`add_to_server(servicer, server)` with the named methods' request deserializers replaced,
    every method's undecodable requests answered INVALID_ARGUMENT (see `SafeDecoding`) and, with
    `held`, unary requests held in the frontend's budget (see `_wrap`)."""
    capture = _Capture()
    add_to_server(servicer, capture)
    handlers = dict(capture.handlers)
    for method, deserializer in deserializers.items():
        handlers[method] = handlers[method]._replace(request_deserializer=deserializer)
    for method, handler in handlers.items():
        if handler.request_deserializer is not None:
            handlers[method] = _wrap(handler, f"/{capture.service}/{method}", held)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(capture.service, handlers),))
    server.add_registered_method_handlers(capture.service, handlers)
