"""gRPC answers of Triton's extensions (`triton_ext`): ModelConfig, ModelStatistics and the
repository RPCs, in `inference.GRPCInferenceService`'s messages.

The dicts of `triton_ext` are copied into the generated messages with `json_format` (Triton's
JSON and protobuf's agree on these messages), so REST and gRPC say the same thing. The
inference port answers configuration, statistics and the repository index, and refuses load
and unload (PERMISSION_DENIED, saying where to send them); the management server (7071) serves
the three repository RPCs under the same service name, behind the management token.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from google.protobuf import json_format

from mariner.server.common import triton_ext
from mariner.server.common.grpc_status import abort
from mariner.server.common.grpc_stubs import grpc_service_pb2 as pb
from mariner.server.common.triton_ext_http import MANAGEMENT_ONLY
from mariner.server.contracts.errors import Code, ServingError, as_serving_error

log = logging.getLogger("mariner.grpc.oip")

SERVICE_NAME: str = pb.DESCRIPTOR.services_by_name["GRPCInferenceService"].full_name


async def answer(context: grpc.aio.ServicerContext, what: str, make: Callable[[], Awaitable[Any]]) -> Any:
    """`make()`'s message, or the call aborted with its ServingError (INTERNAL, sanitized, else)."""
    try:
        return await make()
    except Exception as exc:
        error = as_serving_error(exc, what)
        if error.code is Code.INTERNAL:
            log.exception("%s failed", what)
        await abort(context, error)


def config_response(plane: Any, request: Any) -> Any:
    config = triton_ext.model_config(plane, request.name, request.version or None)
    return pb.ModelConfigResponse(config=json_format.ParseDict(config, pb.ModelConfigResponse().config))


def statistics_response(plane: Any, request: Any) -> Any:
    stats = triton_ext.model_statistics(plane, request.name or None, request.version or None)
    return json_format.ParseDict({"model_stats": stats}, pb.ModelStatisticsResponse())


def index_response(plane: Any, request: Any) -> Any:
    models = triton_ext.repository_index(plane, request.ready)
    return json_format.ParseDict({"models": models}, pb.RepositoryIndexResponse())


def refuse_on_inference_port(what: str) -> ServingError:
    return ServingError(Code.PERMISSION_DENIED, MANAGEMENT_ONLY.format(what=what))


class RepositoryServicer:
    """RepositoryIndex, RepositoryModelLoad and RepositoryModelUnload over the management plane."""

    def __init__(self, plane: Any) -> None:
        self._plane = plane

    async def RepositoryIndex(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        async def make() -> Any:
            return index_response(self._plane, request)

        return await answer(context, "listing the repository", make)

    async def RepositoryModelLoad(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        async def make() -> Any:
            await triton_ext.load(self._plane, request.model_name)
            return pb.RepositoryModelLoadResponse()

        return await answer(context, "loading a model", make)

    async def RepositoryModelUnload(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        async def make() -> Any:
            await triton_ext.unload(self._plane, request.model_name)
            return pb.RepositoryModelUnloadResponse()

        return await answer(context, "unloading a model", make)


def add_repository_to_server(plane: Any, server: grpc.aio.Server) -> None:
    """The repository RPCs on the management server, under `inference.GRPCInferenceService`."""
    servicer = RepositoryServicer(plane)
    handlers = {
        name: grpc.unary_unary_rpc_method_handler(
            getattr(servicer, name),
            request_deserializer=getattr(pb, f"{name}Request").FromString,
            response_serializer=getattr(pb, f"{name}Response").SerializeToString,
        )
        for name in ("RepositoryIndex", "RepositoryModelLoad", "RepositoryModelUnload")
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)
