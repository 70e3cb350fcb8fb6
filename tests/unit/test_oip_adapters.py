"""The Open Inference Protocol adapters (gRPC and REST) against a fake DataPlane on port 0.

The gRPC side runs on the real `build_grpc_servers` (so OIP is proven mounted next to
TorchServe's service, with health) and is called through stubs generated from our proto; the
REST side runs the real inference app on uvicorn and is called with `requests`, with request
bodies framed exactly as tritonclient frames them (JSON, then binary tensors, with
Inference-Header-Content-Length). The fake models compute outputs from their inputs, so row
order, output selection and datatypes are all checked on real bytes.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import grpc
import numpy as np
import pytest
import requests

from mariner.server import protogen
from mariner.server.common.metrics import Metrics
from mariner.server.contracts.errors import Code, ServingError
from mariner.server.contracts.tensors import ModelSignature, TensorSpec, encode_raw
from mariner.server.contracts.types import InferRequest, InferResult, ModelInfo
from tests.unit.fakes import (
    DIGITS,
    PREDICTION_PATHS,
    QuietMetrics,
    TransportCalls,
    digits_outputs,
    grpc_inference_channel,
    make_info,
    serve_inference,
)

pytestmark = pytest.mark.unit

MAX_MESSAGE = 1 << 20
TIMEOUT = 10
TEXT = ModelSignature(
    inputs=(TensorSpec("text", "BYTES", (-1,)),),
    outputs=(TensorSpec("upper", "BYTES", (-1,)), TensorSpec("length", "INT32", (-1,))),
)
SIGNATURES: dict[str, ModelSignature | None] = {
    "digits": DIGITS,
    "reject": DIGITS,
    "text": TEXT,
    "legacy": None,
}


def _info(name: str, version: str, default: bool) -> ModelInfo:
    return make_info(name, version, SIGNATURES[name], default=default)


@dataclass
class FakePlane(TransportCalls):
    metrics: Metrics = field(default_factory=QuietMetrics)
    ready: bool = True
    infos: list[ModelInfo] = field(
        default_factory=lambda: [
            _info("digits", "1", True),
            _info("digits", "2", False),
            _info("reject", "1", True),
            _info("text", "1", True),
            _info("legacy", "1", True),
        ]
    )
    seen: list[InferRequest] = field(default_factory=list)

    def resolve(self, model: str, version: str | None = None) -> ModelInfo:
        for i in self.infos:
            if i.name == model and (i.version == version if version else i.is_default):
                return i
        raise ServingError(Code.NOT_FOUND, f"model {model!r} version {version!r} is not served here")

    def describe(self, model: str, version: str | None = None) -> list[ModelInfo]:
        self.resolve(model, version)
        return [i for i in self.infos if i.name == model and version in (None, i.version)]

    def models(self) -> list[ModelInfo]:
        return list(self.infos)

    def is_live(self) -> bool:
        return True

    def is_ready(self) -> bool:
        return self.ready

    def model_ready(self, model: str, version: str | None = None) -> bool:
        try:
            self.resolve(model, version)
        except ServingError:
            return False
        return self.ready

    def known_label(self, model: str, version: str | None) -> tuple[str, str]:
        try:
            i = self.resolve(model, version)
        except ServingError:
            return "unknown", "unknown"
        return i.name, i.version

    async def infer(self, req: InferRequest) -> InferResult:
        self.seen.append(req)
        tensors = req.tensors
        assert tensors is not None, "an OIP request travels with typed tensors"
        if req.model == "reject":
            return InferResult(body=b'{"error": "pixels must be in [0, 16]", "code": 400}', status=400)
        if req.model == "text":
            words = tensors["text"]
            upper = np.array([bytes(w).upper() for w in words], dtype=object)
            return InferResult(
                body=b"",
                tensors={"upper": upper, "length": np.array([len(w) for w in words], np.int32)},
                model_version=req.version or "1",
            )
        return InferResult(
            body=b"", tensors=digits_outputs(tensors["pixels"]), model_version=req.version or "1"
        )


def requests_total(
    plane: FakePlane, protocol: str, code: str, model: str = "digits", version: str = "1"
) -> float:
    labels = {"model": model, "version": version, "protocol": protocol, "code": code}
    return plane.metrics.registry.get_sample_value("mariner_requests_total", labels) or 0.0


PIXELS = np.arange(3 * 64, dtype=np.float32).reshape(3, 64) % 17


# ==============================================================================================
# gRPC
# ==============================================================================================
@pytest.fixture(scope="module")
def pb() -> SimpleNamespace:
    protogen.generate()
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from mariner.server._proto.inference import grpc_service_pb2, grpc_service_pb2_grpc
    from mariner.server.frontend.protocols.oip import grpc as grpc_oip

    return SimpleNamespace(
        m=grpc_service_pb2,
        stub=grpc_service_pb2_grpc.GRPCInferenceServiceStub,
        service=grpc_oip.SERVICE_NAME,
        health=health_pb2,
        health_grpc=health_pb2_grpc,
    )


def run_grpc(
    pb: SimpleNamespace, plane: FakePlane, body: Callable[[Any, grpc.aio.Channel], Awaitable[None]]
) -> None:
    async def main() -> None:
        async with grpc_inference_channel(plane, MAX_MESSAGE) as channel:
            await body(pb.stub(channel), channel)

    asyncio.run(main())


def infer_request(pb: SimpleNamespace, pixels: np.ndarray = PIXELS, *, raw: bool = True, **kw: Any) -> Any:
    tensor = pb.m.ModelInferRequest.InferInputTensor(name="pixels", datatype="FP32", shape=pixels.shape)
    kw.setdefault("model_name", "digits")
    if raw:
        return pb.m.ModelInferRequest(inputs=[tensor], raw_input_contents=[pixels.tobytes()], **kw)
    tensor.contents.fp32_contents.extend(pixels.reshape(-1).tolist())
    return pb.m.ModelInferRequest(inputs=[tensor], **kw)


def outputs_of(response: Any) -> dict[str, np.ndarray]:
    dtypes = {"FP32": np.float32, "INT64": np.int64, "INT32": np.int32}
    return {
        o.name: np.frombuffer(raw, dtypes[o.datatype]).reshape(list(o.shape))
        for o, raw in zip(response.outputs, response.raw_output_contents, strict=True)
    }


async def grpc_error(call: Awaitable[Any]) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call
    return info.value


def test_grpc_health_and_metadata(pb: SimpleNamespace) -> None:
    plane = FakePlane()

    async def body(stub: Any, channel: grpc.aio.Channel) -> None:
        assert (await stub.ServerLive(pb.m.ServerLiveRequest())).live
        assert (await stub.ServerReady(pb.m.ServerReadyRequest())).ready
        meta = await stub.ServerMetadata(pb.m.ServerMetadataRequest())
        assert meta.name == "mariner"
        assert meta.version
        assert "binary_tensor_data" in meta.extensions
        model = await stub.ModelMetadata(pb.m.ModelMetadataRequest(name="digits"))
        assert (model.name, list(model.versions), model.platform) == (
            "digits",
            ["1", "2"],
            "pytorch_torchserve",
        )
        assert [(t.name, t.datatype, list(t.shape)) for t in model.inputs] == [("pixels", "FP32", [-1, 64])]
        assert [t.name for t in model.outputs] == ["logits", "probabilities", "label"]
        legacy = await stub.ModelMetadata(pb.m.ModelMetadataRequest(name="legacy"))
        assert (list(legacy.inputs), list(legacy.outputs)) == ([], [])
        err = await grpc_error(stub.ModelMetadata(pb.m.ModelMetadataRequest(name="nope")))
        assert err.code() is grpc.StatusCode.NOT_FOUND
        assert (await stub.ModelReady(pb.m.ModelReadyRequest(name="digits", version="2"))).ready
        assert not (await stub.ModelReady(pb.m.ModelReadyRequest(name="nope"))).ready
        health = pb.health_grpc.HealthStub(channel)
        status = await health.Check(pb.health.HealthCheckRequest(service=pb.service))
        assert status.status == pb.health.HealthCheckResponse.SERVING
        # A Triton RPC we do not serve is UNIMPLEMENTED, and the server carries on.
        shm = channel.unary_unary("/inference.GRPCInferenceService/SystemSharedMemoryStatus")
        assert (await grpc_error(shm(b""))).code() is grpc.StatusCode.UNIMPLEMENTED
        assert (await stub.ServerLive(pb.m.ServerLiveRequest())).live

    run_grpc(pb, plane, body)


@pytest.mark.parametrize("raw", [True, False], ids=["raw_input_contents", "contents"])
def test_grpc_infer_returns_every_declared_output_raw(pb: SimpleNamespace, raw: bool) -> None:
    plane = FakePlane()

    async def body(stub: Any, channel: grpc.aio.Channel) -> None:
        params = {"timeout": pb.m.InferParameter(int64_param=5_000_000)}
        sent = time.monotonic()
        response = await stub.ModelInfer(
            infer_request(pb, raw=raw, id="req-7", parameters=params), timeout=30
        )
        answered = time.monotonic()
        assert (response.id, response.model_name, response.model_version) == ("req-7", "digits", "1")
        assert [o.datatype for o in response.outputs] == ["FP32", "FP32", "INT64"]
        got, want = outputs_of(response), digits_outputs(PIXELS)
        assert list(got) == ["logits", "probabilities", "label"]
        for name in want:
            np.testing.assert_array_equal(got[name], want[name])
        (req,) = plane.seen
        assert (req.model, req.version, req.items, req.request_id) == ("digits", "1", 3, "req-7")
        np.testing.assert_array_equal(req.tensors["pixels"], PIXELS)
        assert req.deadline is not None
        # 5 s (the request's timeout parameter, not the 30 s gRPC deadline) from its arrival
        assert sent + 5.0 <= req.deadline <= answered + 5.0
        assert requests_total(plane, "oip-grpc", "200") == 1

    run_grpc(pb, plane, body)


def test_grpc_requested_outputs_in_request_order_and_versions(pb: SimpleNamespace) -> None:
    plane = FakePlane()
    wanted = pb.m.ModelInferRequest.InferRequestedOutputTensor

    async def body(stub: Any, channel: grpc.aio.Channel) -> None:
        request = infer_request(pb, model_version="2", outputs=[wanted(name="label"), wanted(name="logits")])
        response = await stub.ModelInfer(request)
        assert [o.name for o in response.outputs] == ["label", "logits"]
        assert response.model_version == "2"
        assert response.id == ""  # no id given, none echoed
        assert plane.seen[0].request_id  # but the request still has one for logs and handlers
        bad = infer_request(pb, outputs=[wanted(name="scores")])
        err = await grpc_error(stub.ModelInfer(bad))
        assert err.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert "['scores']" in err.details()
        assert "label INT64[-1]" in err.details()
        assert len(plane.seen) == 1  # refused before queueing

    run_grpc(pb, plane, body)


def test_grpc_errors_map_to_status_codes_with_clear_messages(pb: SimpleNamespace) -> None:
    plane = FakePlane()
    tensor = pb.m.ModelInferRequest.InferInputTensor

    async def body(stub: Any, channel: grpc.aio.Channel) -> None:
        cases = [
            (infer_request(pb, model_name="nope"), grpc.StatusCode.NOT_FOUND, "'nope'"),
            (
                infer_request(pb, PIXELS[:, :63].copy()),
                grpc.StatusCode.INVALID_ARGUMENT,
                "input 'pixels': expected shape [-1, 64], received [3, 63]",
            ),
            (
                pb.m.ModelInferRequest(
                    model_name="digits",
                    inputs=[tensor(name="pixels", datatype="FP32", shape=[3, 64])],
                    raw_input_contents=[PIXELS.tobytes()[:-4]],
                ),
                grpc.StatusCode.INVALID_ARGUMENT,
                "tensor 'pixels': shape [3, 64] x FP32 needs 768 bytes, received 764",
            ),
            (
                pb.m.ModelInferRequest(
                    model_name="digits",
                    inputs=[tensor(name="pixels", datatype="FP16", shape=[1, 64])],
                ),
                grpc.StatusCode.INVALID_ARGUMENT,
                "FP16 data must be sent in raw_input_contents",
            ),
            (
                pb.m.ModelInferRequest(
                    model_name="text",
                    inputs=[tensor(name="text", datatype="BYTES", shape=[1 << 40])],
                    raw_input_contents=[b""],
                ),
                grpc.StatusCode.INVALID_ARGUMENT,
                f"at most {MAX_MESSAGE} are accepted",
            ),
            (
                infer_request(pb, model_name="legacy"),
                grpc.StatusCode.INVALID_ARGUMENT,
                "model legacy declares no tensor signature; use the TorchServe API",
            ),
            (
                infer_request(pb, model_name="reject"),
                grpc.StatusCode.INVALID_ARGUMENT,
                "pixels must be in [0, 16]",
            ),
            (
                infer_request(pb, parameters={"sequence_id": pb.m.InferParameter(int64_param=4)}),
                grpc.StatusCode.INVALID_ARGUMENT,
                "sequence_id is not supported",
            ),
        ]
        for request, code, needle in cases:
            err = await grpc_error(stub.ModelInfer(request))
            assert err.code() is code, err.details()
            assert needle in err.details()
        assert [r.model for r in plane.seen] == ["reject"]  # only the handler's own rejection was queued
        assert requests_total(plane, "oip-grpc", "404", "unknown", "unknown") == 1
        assert requests_total(plane, "oip-grpc", "400") == 4  # shape, bytes, FP16, sequence

    run_grpc(pb, plane, body)


def test_grpc_input_header_is_refused_before_its_data_is_read(pb: SimpleNamespace) -> None:
    """Contents that are not even valid protobuf: only a header that passed gets them read."""
    from mariner.server.frontend.protocols.oip.grpc import ShallowInferRequest

    plane = FakePlane()

    def wire(datatype: str, shape: list[int]) -> bytes:
        tensor = ShallowInferRequest.InferInputTensor(
            name="pixels", datatype=datatype, shape=shape, contents=b"\xff" * 64
        )
        return ShallowInferRequest(model_name="digits", inputs=[tensor]).SerializeToString()

    async def body(stub: Any, channel: grpc.aio.Channel) -> None:
        send = channel.unary_unary(f"/{pb.service}/ModelInfer")
        cases = [
            (wire("INT64", [2, 64]), "input 'pixels': expected datatype FP32, received INT64"),
            (wire("FP32", [2, 8, 8]), "input 'pixels': expected shape [-1, 64], received [2, 8, 8]"),
            (wire("FP32", [9, 64]), "shape [9, 64] has 9 rows; the model accepts at most 8 per request"),
            (wire("FP32", [2, 64]), "input 'pixels': `contents` is not a valid InferTensorContents"),
        ]
        for request, needle in cases:
            err = await grpc_error(send(request))
            assert err.code() is grpc.StatusCode.INVALID_ARGUMENT
            assert needle in err.details()
        assert plane.seen == []

    run_grpc(pb, plane, body)


def test_grpc_bytes_and_integer_contents_are_decoded(pb: SimpleNamespace) -> None:
    plane = FakePlane()
    tensor = pb.m.ModelInferRequest.InferInputTensor(name="text", datatype="BYTES", shape=[3])
    tensor.contents.bytes_contents.extend([b"ab", b"", b"xyz"])

    async def body(stub: Any, channel: grpc.aio.Channel) -> None:
        request = pb.m.ModelInferRequest(model_name="text", inputs=[tensor], outputs=[{"name": "length"}])
        response = await stub.ModelInfer(request)
        np.testing.assert_array_equal(outputs_of(response)["length"], [2, 0, 3])
        assert plane.seen[0].tensors["text"].tolist() == [b"ab", b"", b"xyz"]
        ints = pb.m.ModelInferRequest.InferInputTensor(name="text", datatype="INT32", shape=[3])
        ints.contents.int_contents.extend([1, 2, 3])
        err = await grpc_error(stub.ModelInfer(pb.m.ModelInferRequest(model_name="text", inputs=[ints])))
        assert "input 'text': expected datatype BYTES, received INT32" in err.details()
        assert len(plane.seen) == 1

    run_grpc(pb, plane, body)


def test_grpc_stream_answers_each_request_by_id_with_errors_in_stream(pb: SimpleNamespace) -> None:
    plane = FakePlane()

    async def body(stub: Any, channel: grpc.aio.Channel) -> None:
        requests_in = [
            infer_request(pb, PIXELS[:1].copy(), id="a"),
            infer_request(pb, PIXELS[:, :63].copy(), id="b"),
            infer_request(pb, model_name="nope", id="c"),
            infer_request(pb, PIXELS[1:].copy(), id="d", model_version="2"),
        ]
        answered = [r async for r in stub.ModelStreamInfer(iter(requests_in))]
        answers = {a.infer_response.id: a for a in answered}  # completion order: matched by id
        assert sorted(a.infer_response.id for a in answered) == ["a", "b", "c", "d"]
        assert {i: bool(a.error_message) for i, a in answers.items()} == {
            "a": False,
            "b": True,
            "c": True,
            "d": False,
        }
        assert "expected shape [-1, 64], received [3, 63]" in answers["b"].error_message
        assert "'nope'" in answers["c"].error_message
        assert answers["c"].infer_response.model_name == "nope"
        np.testing.assert_array_equal(
            outputs_of(answers["d"].infer_response)["label"], digits_outputs(PIXELS[1:])["label"]
        )
        assert answers["d"].infer_response.model_version == "2"

    run_grpc(pb, plane, body)


# ==============================================================================================
# REST
# ==============================================================================================
@pytest.fixture(scope="module")
def shared_plane() -> FakePlane:
    return FakePlane()


@pytest.fixture
def plane(shared_plane: FakePlane) -> FakePlane:
    shared_plane.seen.clear()
    shared_plane.ready = True
    return shared_plane


@pytest.fixture(scope="module", params=PREDICTION_PATHS)
def url(shared_plane: FakePlane, request: pytest.FixtureRequest) -> Iterator[str]:
    """The inference listener, answering infer calls on its fast path and through the app."""
    from mariner.server.frontend.protocols.http_listener import inference_app

    app = inference_app(shared_plane, max_body_bytes=MAX_MESSAGE)
    with serve_inference(shared_plane, app, request.param, max_body_bytes=MAX_MESSAGE) as base:
        yield base


def triton_body(inputs: list[tuple[str, str, np.ndarray]], **doc: Any) -> tuple[bytes, dict[str, str]]:
    """A request framed as tritonclient's HTTP client frames it with binary_data=True."""
    doc["inputs"] = []
    blobs = []
    for name, datatype, arr in inputs:
        raw = encode_raw(arr)
        doc["inputs"].append(
            {
                "name": name,
                "shape": list(arr.shape),
                "datatype": datatype,
                "parameters": {"binary_data_size": len(raw)},
            }
        )
        blobs.append(raw)
    if not doc.get("outputs"):
        doc.setdefault("parameters", {})["binary_data_output"] = True
    head = json.dumps(doc).encode()
    return head + b"".join(blobs), {"Inference-Header-Content-Length": str(len(head))}


def split_binary(resp: requests.Response) -> tuple[dict[str, Any], dict[str, bytes]]:
    """Parse a response as tritonclient's InferResult does."""
    n = int(resp.headers["Inference-Header-Content-Length"])
    head, buffer = json.loads(resp.content[:n]), resp.content[n:]
    parts, pos = {}, 0
    for out in head["outputs"]:
        size = (out.get("parameters") or {}).get("binary_data_size")
        if size is not None:
            parts[out["name"]] = buffer[pos : pos + size]
            pos += size
    assert pos == len(buffer)
    return head, parts


def test_rest_health_and_metadata(url: str, plane: FakePlane) -> None:
    assert requests.get(f"{url}/v2/health/live", timeout=TIMEOUT).status_code == 200
    assert requests.get(f"{url}/v2/health/ready", timeout=TIMEOUT).status_code == 200
    meta = requests.get(f"{url}/v2", timeout=TIMEOUT).json()
    assert meta["name"] == "mariner"
    assert "binary_tensor_data" in meta["extensions"]
    model = requests.get(f"{url}/v2/models/digits/versions/2", timeout=TIMEOUT).json()
    assert model["inputs"] == [{"name": "pixels", "datatype": "FP32", "shape": [-1, 64]}]
    assert (model["name"], model["versions"], model["platform"]) == (
        "digits",
        ["1", "2"],
        "pytorch_torchserve",
    )
    assert requests.get(f"{url}/v2/models/legacy", timeout=TIMEOUT).json()["outputs"] == []
    assert requests.get(f"{url}/v2/models/digits/ready", timeout=TIMEOUT).status_code == 200
    missing = requests.get(f"{url}/v2/models/nope", timeout=TIMEOUT)
    assert missing.status_code == 404
    assert "'nope'" in missing.json()["error"]
    assert requests.get(f"{url}/v2/models/digits/versions/9/ready", timeout=TIMEOUT).status_code == 404
    plane.ready = False
    assert requests.get(f"{url}/v2/health/ready", timeout=TIMEOUT).status_code == 503
    assert requests.get(f"{url}/v2/models/digits/ready", timeout=TIMEOUT).status_code == 503


def test_rest_json_infer_with_requested_outputs_and_id(url: str, plane: FakePlane) -> None:
    before = requests_total(plane, "oip-http", "200")
    doc = {
        "id": "json-1",
        "inputs": [{"name": "pixels", "datatype": "FP32", "shape": [3, 64], "data": PIXELS.tolist()}],
        "outputs": [{"name": "label"}, {"name": "logits"}],
    }
    resp = requests.post(f"{url}/v2/models/digits/infer", json=doc, timeout=TIMEOUT)
    assert resp.status_code == 200, resp.text
    assert "inference-header-content-length" not in resp.headers
    body = resp.json()
    assert (body["id"], body["model_name"], body["model_version"]) == ("json-1", "digits", "1")
    want = digits_outputs(PIXELS)
    assert [o["name"] for o in body["outputs"]] == ["label", "logits"]
    assert body["outputs"][0] == {
        "name": "label",
        "datatype": "INT64",
        "shape": [3],
        "data": want["label"].tolist(),
    }
    np.testing.assert_array_equal(
        np.array(body["outputs"][1]["data"], np.float32).reshape(3, 10), want["logits"]
    )
    assert plane.seen[0].items == 3
    assert requests_total(plane, "oip-http", "200") - before == 1


def test_rest_binary_extension_round_trip_as_tritonclient_speaks_it(url: str, plane: FakePlane) -> None:
    body, headers = triton_body([("pixels", "FP32", PIXELS)], id="bin-1")
    resp = requests.post(
        f"{url}/v2/models/digits/versions/2/infer", data=body, headers=headers, timeout=TIMEOUT
    )
    assert resp.status_code == 200, resp.text
    assert resp.headers["content-type"] == "application/octet-stream"
    head, parts = split_binary(resp)
    assert (head["id"], head["model_version"]) == ("bin-1", "2")
    want = digits_outputs(PIXELS)
    assert [o["name"] for o in head["outputs"]] == ["logits", "probabilities", "label"]
    for out in head["outputs"]:
        assert "data" not in out
        got = np.frombuffer(parts[out["name"]], want[out["name"]].dtype).reshape(out["shape"])
        np.testing.assert_array_equal(got, want[out["name"]])
    np.testing.assert_array_equal(plane.seen[0].tensors["pixels"], PIXELS)


def test_rest_per_output_binary_choice_overrides_the_request_default(url: str) -> None:
    outputs = [
        {"name": "label", "parameters": {"binary_data": True}},
        {"name": "logits", "parameters": {"binary_data": False}},
    ]
    body, headers = triton_body([("pixels", "FP32", PIXELS)], outputs=outputs)
    resp = requests.post(f"{url}/v2/models/digits/infer", data=body, headers=headers, timeout=TIMEOUT)
    head, parts = split_binary(resp)
    assert list(parts) == ["label"]
    np.testing.assert_array_equal(np.frombuffer(parts["label"], np.int64), digits_outputs(PIXELS)["label"])
    assert len(head["outputs"][1]["data"]) == 30


def test_rest_bytes_tensors_json_and_binary(url: str) -> None:
    words = np.array([b"abc", b"", "d\u00e9".encode()], dtype=object)
    body, headers = triton_body([("text", "BYTES", words)])
    head, parts = split_binary(
        requests.post(f"{url}/v2/models/text/infer", data=body, headers=headers, timeout=TIMEOUT)
    )
    assert parts["upper"] == encode_raw(np.array([b"ABC", b"", "D\u00e9".encode()], dtype=object))
    assert np.frombuffer(parts["length"], np.int32).tolist() == [3, 0, 3]
    doc = {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [2], "data": ["hi", "yo"]}]}
    out = requests.post(f"{url}/v2/models/text/infer", json=doc, timeout=TIMEOUT).json()["outputs"]
    assert out[0]["data"] == ["HI", "YO"]
    doc["inputs"][0]["data"] = [104, 105]  # numbers are not BYTES elements
    resp = requests.post(f"{url}/v2/models/text/infer", json=doc, timeout=TIMEOUT)
    assert resp.status_code == 400
    assert "must be strings" in resp.json()["error"]
    # Non-UTF-8 BYTES cannot be JSON strings: that output comes back binary even if JSON was asked.
    as_json = [{"name": "upper", "parameters": {"binary_data": False}}, {"name": "length"}]
    body, headers = triton_body([("text", "BYTES", np.array([b"\xff"], dtype=object))], outputs=as_json)
    head, parts = split_binary(
        requests.post(f"{url}/v2/models/text/infer", data=body, headers=headers, timeout=TIMEOUT)
    )
    assert parts == {"upper": b"\x01\x00\x00\x00\xff"}
    assert head["outputs"][1]["data"] == [1]


@pytest.mark.parametrize(
    ("mutate", "status", "needle"),
    [
        (lambda b, h: (b[:-4], h), 400, "runs past the body"),
        (lambda b, h: (b + b"xx", h), 400, "2 bytes of binary data follow"),
        (
            lambda b, h: (b, {"Inference-Header-Content-Length": str(len(b) + 1)}),
            400,
            "Inference-Header-Content-Length",
        ),
        (lambda b, h: (b"{not json" + b, h), 400, "not valid JSON"),
    ],
)
def test_rest_malformed_binary_framing(
    url: str, plane: FakePlane, mutate: Any, status: int, needle: str
) -> None:
    body, headers = mutate(*triton_body([("pixels", "FP32", PIXELS)]))
    resp = requests.post(f"{url}/v2/models/digits/infer", data=body, headers=headers, timeout=TIMEOUT)
    assert resp.status_code == status
    assert needle in resp.json()["error"]
    assert plane.seen == []


def test_rest_errors_use_the_protocol_error_shape(url: str, plane: FakePlane) -> None:
    wrong = {"inputs": [{"name": "pixels", "datatype": "FP32", "shape": [2, 3], "data": [0] * 6}]}
    resp = requests.post(f"{url}/v2/models/digits/infer", json=wrong, timeout=TIMEOUT)
    assert resp.status_code == 400
    assert resp.json() == {"error": "input 'pixels': expected shape [-1, 64], received [2, 3]"}
    assert requests.post(f"{url}/v2/models/nope/infer", json=wrong, timeout=TIMEOUT).status_code == 404
    rejected = requests.post(
        f"{url}/v2/models/reject/infer",
        data=triton_body([("pixels", "FP32", PIXELS)])[0],
        headers=triton_body([("pixels", "FP32", PIXELS)])[1],
        timeout=TIMEOUT,
    )
    assert rejected.status_code == 400
    assert rejected.json() == {"error": "pixels must be in [0, 16]"}
    legacy = requests.post(f"{url}/v2/models/legacy/infer", json=wrong, timeout=TIMEOUT)
    assert "declares no tensor signature" in legacy.json()["error"]
    assert [r.model for r in plane.seen] == ["reject"]


def test_rest_input_header_is_checked_before_its_data_is_converted(url: str, plane: FakePlane) -> None:
    def doc(datatype: str, shape: list[int], data: list[Any]) -> dict[str, Any]:
        return {"inputs": [{"name": "pixels", "datatype": datatype, "shape": shape, "data": data}]}

    head = json.dumps(
        {
            "inputs": [
                {"name": "pixels", "datatype": "BYTES", "shape": [4], "parameters": {"binary_data_size": 3}}
            ]
        }
    ).encode()
    binary = (head + b"\xff" * 3, {"Inference-Header-Content-Length": str(len(head))})
    cases = [
        (doc("INT64", [1, 64], ["x"] * 64), None, "input 'pixels': expected datatype FP32, received INT64"),
        (doc("FP32", [9, 64], ["x"] * 576), None, "shape [9, 64] has 9 rows; the model accepts at most 8"),
        (doc("FP32", [1, 64], [True] + [0.0] * 63), None, "FP32 values must be numbers, not booleans"),
        (None, binary, "input 'pixels': expected datatype FP32, received BYTES"),
    ]
    for body, raw, needle in cases:
        if raw is None:
            resp = requests.post(f"{url}/v2/models/digits/infer", json=body, timeout=TIMEOUT)
        else:
            resp = requests.post(
                f"{url}/v2/models/digits/infer", data=raw[0], headers=raw[1], timeout=TIMEOUT
            )
        assert resp.status_code == 400
        assert needle in resp.json()["error"]
    assert plane.seen == []


def test_rest_gzip_body_and_size_limit(url: str) -> None:
    body, headers = triton_body([("pixels", "FP32", PIXELS)])
    resp = requests.post(
        f"{url}/v2/models/digits/infer",
        data=gzip.compress(body),
        headers={**headers, "Content-Encoding": "gzip"},
        timeout=TIMEOUT,
    )
    assert resp.status_code == 200, resp.text
    bomb = gzip.compress(b" " * (MAX_MESSAGE + 10))
    resp = requests.post(
        f"{url}/v2/models/digits/infer", data=bomb, headers={"Content-Encoding": "gzip"}, timeout=TIMEOUT
    )
    assert resp.status_code == 413
    assert "larger than the limit" in resp.json()["error"]
