"""The generated gRPC stubs (`mariner.server._proto`, written by protogen), imported in this one
place: a build without them fails here, saying how to generate them, whichever module needed them."""

from __future__ import annotations

from mariner.server.protogen import stubs_missing

try:
    from mariner.server._proto.google.rpc import status_pb2
    from mariner.server._proto.inference import grpc_service_pb2, grpc_service_pb2_grpc
    from mariner.server._proto.torchserve import (
        inference_pb2,
        inference_pb2_grpc,
        management_pb2,
        management_pb2_grpc,
    )
except ModuleNotFoundError as exc:  # pragma: no cover - depends on the build step
    raise stubs_missing(exc) from exc

__all__ = [
    "grpc_service_pb2",
    "grpc_service_pb2_grpc",
    "inference_pb2",
    "inference_pb2_grpc",
    "management_pb2",
    "management_pb2_grpc",
    "status_pb2",
]
