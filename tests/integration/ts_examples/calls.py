"""One call, sent alike to a server, and its answer: REST (requests) or TorchServe's gRPC.

The gRPC messages come from TorchServe's own `inference.proto` and `management.proto`, read out
of the torchserve wheel's `ts/frontend/model-server.jar` and compiled to a descriptor set at test
time. The
message classes live in a private descriptor pool, never the default one, so they cannot clash
with Mariner's stubs of the same package should a test process hold both.
"""

from __future__ import annotations

import importlib.util
import tempfile
import zipfile
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import grpc
import requests

TIMEOUT_S = 20.0
REGISTER_TIMEOUT_S = 150.0  # a synchronous register waits for the worker (TorchServe: up to 120 s)
UNLOADABLE_TIMEOUT_S = 5.0  # a model whose handler cannot import here never answers on TorchServe
SERVICE = "org.pytorch.serve.grpc.inference.InferenceAPIsService"


@dataclass(frozen=True)
class Answer:
    """What a server said: HTTP status or gRPC code name, and the body (or gRPC details)."""

    status: str
    body: bytes
    content_type: str = ""

    def text(self, limit: int = 160) -> str:
        text = self.body.decode("utf-8", errors="replace").replace("\n", " ").strip()
        return text if len(text) <= limit else text[: limit - 1] + "…"


def not_serving(why: str) -> Answer:
    return Answer("no server", why.encode())


def http(
    method: str,
    url: str,
    *,
    body: bytes | None = None,
    content_type: str | None = None,
    headers: tuple[tuple[str, str], ...] = (),
    params: dict[str, Any] | None = None,
    timeout: float = TIMEOUT_S,
) -> Answer:
    """One HTTP call; a transport failure or a timeout is an answer too, never an exception."""
    sent = dict(headers)
    if content_type:
        sent["Content-Type"] = content_type
    try:
        r = requests.request(method, url, data=body, headers=sent, params=params, timeout=timeout)
    except requests.Timeout:
        return Answer("timeout", f"no answer within {timeout:.0f} s".encode())
    except requests.RequestException as exc:
        return Answer("transport error", type(exc).__name__.encode())
    return Answer(str(r.status_code), r.content, r.headers.get("content-type", ""))


def torchserve_jar() -> Path:
    spec = importlib.util.find_spec("ts")
    assert spec is not None, "the torchserve wheel is not installed"
    assert spec.submodule_search_locations, "the torchserve wheel is not installed"
    return Path(next(iter(spec.submodule_search_locations))) / "frontend" / "model-server.jar"


@cache
def _pool() -> Any:
    """A private descriptor pool holding TorchServe's inference.proto and management.proto, and
    the google.rpc messages its StreamPredictions2 puts in an in-stream status."""
    from google.protobuf import descriptor_pb2, descriptor_pool
    from grpc_tools import protoc

    names = (
        "proto/inference.proto",
        "proto/management.proto",
        "google/rpc/error_details.proto",
        "google/rpc/status.proto",
    )
    with tempfile.TemporaryDirectory(prefix="ts-proto-") as tmp:
        out = Path(tmp)
        with zipfile.ZipFile(torchserve_jar()) as jar:
            for name in names:
                (out / name).parent.mkdir(parents=True, exist_ok=True)
                (out / name).write_bytes(jar.read(name))
        well_known = Path(protoc.__file__).parent / "_proto"
        args = ["protoc", f"-I{out / 'proto'}", f"-I{out}", f"-I{well_known}", "--include_imports"]
        args += [f"--descriptor_set_out={out / 'ts.pb'}", *(str(out / n) for n in names[:3])]
        assert protoc.main(args) == 0, "protoc could not compile TorchServe's protos"
        files = descriptor_pb2.FileDescriptorSet.FromString((out / "ts.pb").read_bytes())
    pool = descriptor_pool.DescriptorPool()
    for file in files.file:
        pool.Add(file)
    return pool


@cache
def message(full_name: str) -> Any:
    """The message class for `full_name` (e.g. org.pytorch.serve.grpc.inference.PredictionsRequest)."""
    from google.protobuf import message_factory

    return message_factory.GetMessageClass(_pool().FindMessageTypeByName(full_name))


def _messages() -> tuple[Any, Any, Any]:
    """PredictionsRequest, PredictionResponse and TorchServeHealthResponse from TorchServe's proto."""
    package = "org.pytorch.serve.grpc.inference."
    return tuple(
        message(package + n) for n in ("PredictionsRequest", "PredictionResponse", "TorchServeHealthResponse")
    )  # type: ignore[return-value]


def _grpc_error(exc: grpc.RpcError) -> Answer:
    code = exc.code() if isinstance(exc, grpc.Call) else None
    details = exc.details() if isinstance(exc, grpc.Call) else str(exc)
    return Answer(f"grpc {code.name if code else 'UNKNOWN'}", (details or "").encode())


def grpc_predict(
    target: str, model: str, body: bytes, version: str = "", timeout: float = TIMEOUT_S
) -> Answer:
    """InferenceAPIsService/Predictions with input {"data": body}, as TorchServe's example client."""
    request_cls, response_cls, _ = _messages()
    with grpc.insecure_channel(target) as channel:
        call = channel.unary_unary(
            f"/{SERVICE}/Predictions",
            request_serializer=lambda m: m.SerializeToString(),
            response_deserializer=response_cls.FromString,
        )
        try:
            response = call(
                request_cls(model_name=model, model_version=version, input={"data": body}), timeout=timeout
            )
        except grpc.RpcError as exc:
            return _grpc_error(exc)
    return Answer("grpc OK", bytes(response.prediction))


def grpc_ping(target: str) -> Answer:
    from google.protobuf import empty_pb2

    _, _, health_cls = _messages()
    with grpc.insecure_channel(target) as channel:
        call = channel.unary_unary(
            f"/{SERVICE}/Ping",
            request_serializer=lambda m: m.SerializeToString(),
            response_deserializer=health_cls.FromString,
        )
        try:
            response = call(empty_pb2.Empty(), timeout=TIMEOUT_S)
        except grpc.RpcError as exc:
            return _grpc_error(exc)
    return Answer("grpc OK", response.health.encode())


MANAGEMENT = "org.pytorch.serve.grpc.management."


def grpc_manage(target: str, method: str, request: str, **fields: Any) -> Answer:
    """ManagementAPIsService/<method> with a <request> message; the answer's body is its `msg`."""
    response_cls = message(MANAGEMENT + "ManagementResponse")
    with grpc.insecure_channel(target) as channel:
        call = channel.unary_unary(
            f"/{MANAGEMENT}ManagementAPIsService/{method}",
            request_serializer=lambda m: m.SerializeToString(),
            response_deserializer=response_cls.FromString,
        )
        try:
            response = call(message(MANAGEMENT + request)(**fields), timeout=TIMEOUT_S)
        except grpc.RpcError as exc:
            return _grpc_error(exc)
    return Answer("grpc OK", response.msg.encode())
