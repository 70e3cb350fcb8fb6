"""The Open Inference Protocol on a real Mariner with the digits archives, over real sockets.

Answers are judged against the eager model's logits (1e-4); batching is read from /metrics.
The clients are stubs generated from our proto and `requests` (tritonclient itself runs in the
conformance tests, in its own virtualenv).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import grpc
import numpy as np
import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from mariner.server import protogen
from tests.mariner_serve import MarinerServe

pytestmark = pytest.mark.integration

MODELS = ["digits_torchscript", "digits_onnx"]
ROWS = 16
TOL = 1e-4


@pytest.fixture(scope="module")
def pb() -> SimpleNamespace:
    protogen.generate()
    from mariner.server._proto.inference import grpc_service_pb2, grpc_service_pb2_grpc
    from mariner.server._proto.torchserve import inference_pb2, inference_pb2_grpc

    return SimpleNamespace(
        m=grpc_service_pb2,
        stub=grpc_service_pb2_grpc.GRPCInferenceServiceStub,
        ts=inference_pb2,
        ts_stub=inference_pb2_grpc.InferenceAPIsServiceStub,
    )


@pytest.fixture(scope="module")
def mariner(model_store: Path) -> Iterator[MarinerServe]:
    srv = MarinerServe(model_store, ",".join(f"{m}.mar" for m in MODELS)).start()
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def stub(mariner: MarinerServe, pb: SimpleNamespace) -> Iterator[object]:
    with grpc.insecure_channel(mariner.grpc_target) as channel:
        yield pb.stub(channel)


def eager_logits(reference, pixels: np.ndarray) -> np.ndarray:
    import torch

    from mariner.training.data import to_model_input

    with torch.inference_mode():
        return reference.model(to_model_input(pixels, reference.norm)).float().numpy()


def oip_request(pb: SimpleNamespace, model: str, pixels: np.ndarray, **kw: object) -> object:
    tensor = pb.m.ModelInferRequest.InferInputTensor(name="pixels", datatype="FP32", shape=pixels.shape)
    return pb.m.ModelInferRequest(
        model_name=model, inputs=[tensor], raw_input_contents=[np.ascontiguousarray(pixels).tobytes()], **kw
    )


def decode(response: object) -> dict[str, np.ndarray]:
    dtypes = {"FP32": np.float32, "INT64": np.int64}
    return {
        o.name: np.frombuffer(raw, dtypes[o.datatype]).reshape(list(o.shape))
        for o, raw in zip(response.outputs, response.raw_output_contents, strict=True)
    }


@pytest.mark.parametrize("model", MODELS)
def test_grpc_infer_matches_eager_logits_row_for_row(stub, pb, eager_reference, model: str) -> None:
    pixels = eager_reference.test_pixels[:ROWS]
    want = eager_logits(eager_reference, pixels)
    response = stub.ModelInfer(oip_request(pb, model, pixels, id=f"{model}-1"), timeout=60)
    assert response.id == f"{model}-1"
    out = decode(response)
    assert out["logits"].shape == (ROWS, 10)
    np.testing.assert_allclose(out["logits"], want, atol=TOL)
    np.testing.assert_array_equal(out["label"], want.argmax(1))
    # The same rows reversed come back reversed: rows keep their order through the batcher.
    reversed_out = decode(stub.ModelInfer(oip_request(pb, model, pixels[::-1]), timeout=60))
    np.testing.assert_allclose(reversed_out["logits"], want[::-1], atol=TOL)


@pytest.mark.parametrize("model", MODELS)
def test_rest_infer_json_and_binary_match_eager(mariner: MarinerServe, eager_reference, model: str) -> None:
    pixels = eager_reference.test_pixels[ROWS : 2 * ROWS]
    want = eager_logits(eager_reference, pixels)
    url = f"{mariner.http}/v2/models/{model}/infer"
    doc = {
        "id": "j",
        "inputs": [{"name": "pixels", "datatype": "FP32", "shape": [ROWS, 64], "data": pixels.tolist()}],
        "outputs": [{"name": "logits"}],
    }
    resp = requests.post(url, json=doc, timeout=60)
    assert resp.status_code == 200, resp.text
    (logits,) = resp.json()["outputs"]
    np.testing.assert_allclose(np.array(logits["data"], np.float32).reshape(ROWS, 10), want, atol=TOL)

    head = json.dumps(
        {
            "inputs": [
                {
                    "name": "pixels",
                    "datatype": "FP32",
                    "shape": [ROWS, 64],
                    "parameters": {"binary_data_size": pixels.nbytes},
                }
            ],
            "parameters": {"binary_data_output": True},
        }
    ).encode()
    resp = requests.post(
        url,
        data=head + pixels.tobytes(),
        headers={"Inference-Header-Content-Length": str(len(head))},
        timeout=60,
    )
    assert resp.status_code == 200, resp.text
    n = int(resp.headers["Inference-Header-Content-Length"])
    outputs = json.loads(resp.content[:n])["outputs"]
    assert [o["name"] for o in outputs] == ["logits", "probabilities", "label"]
    size = outputs[0]["parameters"]["binary_data_size"]
    np.testing.assert_allclose(
        np.frombuffer(resp.content[n : n + size], np.float32).reshape(ROWS, 10), want, atol=TOL
    )


def test_metadata_and_errors(mariner: MarinerServe, stub, pb) -> None:
    meta = stub.ModelMetadata(pb.m.ModelMetadataRequest(name="digits_torchscript"))
    assert [(t.name, t.datatype, list(t.shape)) for t in meta.inputs] == [("pixels", "FP32", [-1, 64])]
    assert [(t.name, t.datatype) for t in meta.outputs] == [
        ("logits", "FP32"),
        ("probabilities", "FP32"),
        ("label", "INT64"),
    ]
    assert stub.ServerReady(pb.m.ServerReadyRequest()).ready
    with pytest.raises(grpc.RpcError) as info:
        stub.ModelInfer(oip_request(pb, "digits_torchscript", np.zeros((2, 8, 8), np.float32)))
    assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "expected shape [-1, 64], received [2, 8, 8]" in info.value.details()
    # The handler's own check (pixel range) comes back as INVALID_ARGUMENT with its message.
    with pytest.raises(grpc.RpcError) as info:
        stub.ModelInfer(oip_request(pb, "digits_torchscript", np.full((1, 64), 99, np.float32)))
    assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "[0, 16]" in info.value.details()
    with pytest.raises(grpc.RpcError) as info:
        stub.ModelInfer(oip_request(pb, "nope", np.zeros((1, 64), np.float32)))
    assert info.value.code() is grpc.StatusCode.NOT_FOUND
    assert requests.get(f"{mariner.http}/v2/models/nope", timeout=10).status_code == 404


def batch_metrics(mariner: MarinerServe, model: str) -> tuple[float, float]:
    """(batches, items) so far for the model's default version, from /metrics."""
    text = requests.get(f"{mariner.metrics}/metrics", timeout=10).text
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name == "mariner_batch_size":
            for s in family.samples:
                if s.labels.get("model") == model and s.name.endswith(("_count", "_sum")):
                    values[s.name.rsplit("_", 1)[1]] = s.value
    return values["count"], values["sum"]


def test_torchserve_and_oip_requests_share_batches(mariner: MarinerServe, pb, eager_reference) -> None:
    """Concurrent TorchServe-API and OIP requests to one model go through one batcher: every
    row is counted once as an item, and there are fewer batches than requests."""
    model = "digits_torchscript"
    n_ts, n_oip, rows = 48, 48, 3
    pixels = eager_reference.test_pixels
    labels = eager_logits(eager_reference, pixels[: n_ts + n_oip * rows]).argmax(1)
    before = batch_metrics(mariner, model)

    async def fire() -> tuple[list[int], list[list[int]]]:
        async with grpc.aio.insecure_channel(mariner.grpc_target) as channel:
            ts, oip = pb.ts_stub(channel), pb.stub(channel)
            ts_calls = [
                ts.Predictions(
                    pb.ts.PredictionsRequest(
                        model_name=model, input={"data": json.dumps(pixels[i].tolist()).encode()}
                    )
                )
                for i in range(n_ts)
            ]
            oip_calls = [
                oip.ModelInfer(oip_request(pb, model, pixels[n_ts + j * rows : n_ts + (j + 1) * rows]))
                for j in range(n_oip)
            ]
            # Interleave the two kinds so they arrive mixed.
            mixed = [c for pair in zip(ts_calls, oip_calls, strict=True) for c in pair]
            replies = await asyncio.gather(*mixed)
        ts_labels = [json.loads(r.prediction)["label"] for r in replies[0::2]]
        oip_labels = [decode(r)["label"].tolist() for r in replies[1::2]]
        return ts_labels, oip_labels

    ts_labels, oip_labels = asyncio.run(fire())
    assert ts_labels == labels[:n_ts].tolist()
    assert [v for block in oip_labels for v in block] == labels[n_ts:].tolist()
    after = batch_metrics(mariner, model)
    batches, items = after[0] - before[0], after[1] - before[1]
    assert items == n_ts + n_oip * rows
    assert batches < n_ts + n_oip, f"{n_ts + n_oip} concurrent requests ran in {batches} batches"


@pytest.mark.parametrize(
    ("method", "path", "status", "allow"),
    [
        ("GET", "/v2/no/such/route", 404, None),
        ("POST", "/v2/systemsharedmemory/register", 404, None),
        ("PUT", "/v2/health/live", 405, "GET, HEAD"),
        ("GET", "/v2/models/digits_onnx/infer", 405, "POST"),
        ("GET", "/v2/repository/index", 405, "POST"),
    ],
)
def test_every_v2_error_is_oip_shaped(
    mariner: MarinerServe, method: str, path: str, status: int, allow: str | None
) -> None:
    """tritonclient reads only {"error": message}: the /v2 prefix's own 404 and 405 included."""
    resp = requests.request(method, mariner.http + path, timeout=30)
    assert resp.status_code == status
    body = resp.json()
    assert set(body) == {"error"}
    assert path in body["error"]
    assert resp.headers.get("allow") == allow


def test_model_config_is_the_same_over_rest_and_grpc(mariner: MarinerServe, stub, pb) -> None:
    from google.protobuf import json_format

    rest = requests.get(f"{mariner.http}/v2/models/digits_onnx/config", timeout=30)
    assert rest.status_code == 200, rest.text
    config = rest.json()
    assert config["input"] == [{"name": "pixels", "data_type": "TYPE_FP32", "dims": [64]}]
    assert config["max_batch_size"] > 1
    over_grpc = stub.ModelConfig(pb.m.ModelConfigRequest(name="digits_onnx"), timeout=30).config
    parsed = json_format.ParseDict(config, type(over_grpc)())
    assert over_grpc == parsed


@pytest.mark.parametrize("action", ["load", "unload"])
def test_repository_changes_are_refused_while_model_management_is_off(
    mariner: MarinerServe, pb, action: str
) -> None:
    """Same refusal as the management API's own register/unregister, on the management ports;
    the inference port sends the caller there."""
    resp = requests.post(f"{mariner.management}/v2/repository/models/digits_onnx/{action}", timeout=30)
    assert resp.status_code == 403
    assert "--enable-model-management" in resp.json()["error"]
    resp = requests.post(f"{mariner.http}/v2/repository/models/digits_onnx/{action}", timeout=30)
    assert resp.status_code == 403
    assert "management address" in resp.json()["error"]
    with grpc.insecure_channel(mariner.grpc_management_target) as channel:
        stub = pb.stub(channel)
        call = stub.RepositoryModelLoad if action == "load" else stub.RepositoryModelUnload
        request = (
            pb.m.RepositoryModelLoadRequest if action == "load" else pb.m.RepositoryModelUnloadRequest
        )(model_name="digits_onnx")
        with pytest.raises(grpc.RpcError) as caught:
            call(request, timeout=30)
    assert caught.value.code() is grpc.StatusCode.PERMISSION_DENIED
    assert "--enable-model-management" in caught.value.details()
    index = requests.post(f"{mariner.management}/v2/repository/index", timeout=30).json()
    assert sorted(e["name"] for e in index) == sorted(MODELS)  # nothing changed
