"""gRPC server reflection, v1 and v1alpha, on both gRPC ports of a real Mariner.

grpcio-reflection's own client (ProtoReflectionDescriptorDatabase) only speaks v1alpha, while
current grpcurl, Postman and Evans ask `grpc.reflection.v1.ServerReflection` first. The v1
client here calls the v1 method path directly with the v1alpha messages: v1's messages have the
same names and field numbers, so the bytes on the wire are v1's.
"""

from __future__ import annotations

import grpc
import pytest
from google.protobuf import descriptor_pb2
from grpc_reflection.v1alpha import reflection_pb2 as r

from mariner.server import protogen
from tests.mariner_serve import MarinerServe

pytestmark = pytest.mark.integration

V1 = "grpc.reflection.v1.ServerReflection"
V1ALPHA = "grpc.reflection.v1alpha.ServerReflection"
INFERENCE_SERVICES = {
    "grpc.health.v1.Health",
    V1,
    V1ALPHA,
    "inference.GRPCInferenceService",
    "org.pytorch.serve.grpc.inference.InferenceAPIsService",
    "org.pytorch.serve.grpc.openinference.GRPCInferenceService",
}
MANAGEMENT_SERVICES = {
    "grpc.health.v1.Health",
    V1,
    V1ALPHA,
    "inference.GRPCInferenceService",  # its repository RPCs
    "org.pytorch.serve.grpc.management.ManagementAPIsService",
}


@pytest.fixture(scope="module")
def mariner(shared_digits_torchscript: MarinerServe) -> MarinerServe:
    """The session's shared server (tests/integration/conftest.py): reflection only reads what the
    ports serve. It was started here without waiting for the model (`settle=False`), only because
    reflection does not need it; the shared one has settled, which changes no answer here."""
    protogen.generate()
    return shared_digits_torchscript.alive()


def ask(target: str, service: str, *requests: r.ServerReflectionRequest) -> list[r.ServerReflectionResponse]:
    with grpc.insecure_channel(target) as channel:
        call = channel.stream_stream(
            f"/{service}/ServerReflectionInfo",
            request_serializer=r.ServerReflectionRequest.SerializeToString,
            response_deserializer=r.ServerReflectionResponse.FromString,
        )
        return list(call(iter(requests), timeout=30))


@pytest.mark.parametrize("service", [V1, V1ALPHA])
@pytest.mark.parametrize("port", ["inference", "management"])
def test_lists_every_service_served(mariner: MarinerServe, service: str, port: str) -> None:
    target = mariner.grpc_target if port == "inference" else mariner.grpc_management_target
    (answer,) = ask(target, service, r.ServerReflectionRequest(list_services=""))
    names = {s.name for s in answer.list_services_response.service}
    assert names == (INFERENCE_SERVICES if port == "inference" else MANAGEMENT_SERVICES)


def test_v1_describes_a_service_by_symbol(mariner: MarinerServe) -> None:
    (answer,) = ask(
        mariner.grpc_target,
        V1,
        r.ServerReflectionRequest(file_containing_symbol="inference.GRPCInferenceService"),
    )
    assert answer.WhichOneof("message_response") == "file_descriptor_response"
    files = [
        descriptor_pb2.FileDescriptorProto.FromString(b)
        for b in answer.file_descriptor_response.file_descriptor_proto
    ]
    service = next(s for f in files if f.package == "inference" for s in f.service)
    methods = {m.name for m in service.method}
    assert {"ModelInfer", "ModelConfig", "ModelStatistics", "RepositoryIndex"} <= methods


def test_v1_unknown_symbol_is_an_in_stream_not_found(mariner: MarinerServe) -> None:
    (answer,) = ask(
        mariner.grpc_target, V1, r.ServerReflectionRequest(file_containing_symbol="no.such.Service")
    )
    assert answer.error_response.error_code == grpc.StatusCode.NOT_FOUND.value[0]
