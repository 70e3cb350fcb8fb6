"""Oversized or mistyped tensors are refused from their header, before their data is decoded.

A real Mariner (digits archive: `pixels FP32[-1, 64]`, max batch 32) on port 0 receives what an
attacker would send: millions of INT64 or BYTES elements for an FP32 input over gRPC
`contents`, REST JSON and REST binary, far more rows than the max batch, and a TorchServe
`Predictions` with a huge `input` map. Each must be refused with INVALID_ARGUMENT / 400 naming
the tensor and what is allowed, while `ServerLive` calls sent meanwhile keep being answered.
Their latencies are printed (`-s`), not asserted: this machine's speed is not the verdict.

The mistyped payloads carry one element more than their header claims: a server that decoded
the data first would answer with that count error, so the datatype error proves the header was
judged before the data was read.
"""

from __future__ import annotations

import json
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from types import SimpleNamespace

import grpc
import numpy as np
import pytest
import requests

from mariner.server import protogen
from tests.mariner_serve import MarinerServe

pytestmark = pytest.mark.integration

MODEL = "digits_torchscript"
MAX_BATCH = 32  # the archive's batchSize
ELEMENTS = 2_000_000
TIMEOUT = 120


@pytest.fixture(scope="module")
def pb() -> SimpleNamespace:
    protogen.generate()
    from mariner.server._proto.inference import grpc_service_pb2
    from mariner.server._proto.torchserve import inference_pb2

    return SimpleNamespace(m=grpc_service_pb2, ts=inference_pb2)


@pytest.fixture(scope="module")
def mariner(shared_digits_torchscript: MarinerServe) -> MarinerServe:
    """The session's shared server (tests/integration/conftest.py): these tests only send requests,
    and each checks the server still answers while it is attacked."""
    return shared_digits_torchscript.alive()


@pytest.fixture(scope="module")
def channel(mariner: MarinerServe) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(mariner.grpc_target) as ch:
        yield ch


def _liveness_during(mariner: MarinerServe, pb: SimpleNamespace, attack: Callable[[], object]) -> object:
    """Run `attack` while another connection sends ServerLive calls; every one must be answered."""
    latencies: list[float] = []
    failures: list[str] = []
    started, stop = threading.Event(), threading.Event()

    def ping() -> None:
        with grpc.insecure_channel(mariner.grpc_target) as ch:
            live = ch.unary_unary(
                "/inference.GRPCInferenceService/ServerLive",
                request_serializer=pb.m.ServerLiveRequest.SerializeToString,
                response_deserializer=pb.m.ServerLiveResponse.FromString,
            )
            while not stop.is_set():
                t0 = time.perf_counter()
                try:
                    answer = live(pb.m.ServerLiveRequest(), timeout=TIMEOUT)
                except grpc.RpcError as exc:
                    failures.append(exc.code().name)
                else:
                    latencies.append(time.perf_counter() - t0)
                    if not answer.live:
                        failures.append("not live")
                started.set()
                stop.wait(0.005)

    thread = threading.Thread(target=ping, daemon=True)
    thread.start()
    assert started.wait(TIMEOUT), "ServerLive never answered"
    try:
        outcome = attack()
    finally:
        stop.set()
        thread.join(TIMEOUT)
    assert not failures, failures
    print(
        f"ServerLive during the attack: n={len(latencies)} p50={statistics.median(latencies) * 1e3:.1f} ms "
        f"max={max(latencies) * 1e3:.1f} ms"
    )
    return outcome


def _grpc_refusal(channel: grpc.Channel, method: str, wire: bytes) -> grpc.RpcError:
    call = channel.unary_unary(method)
    with pytest.raises(grpc.RpcError) as info:
        call(wire, timeout=TIMEOUT)
    return info.value


def _model_infer(pb: SimpleNamespace, datatype: str, shape: list[int], field: str, values: list) -> bytes:
    tensor = pb.m.ModelInferRequest.InferInputTensor(name="pixels", datatype=datatype, shape=shape)
    getattr(tensor.contents, field).extend(values)
    return pb.m.ModelInferRequest(model_name=MODEL, inputs=[tensor]).SerializeToString()


@pytest.mark.parametrize(
    ("datatype", "shape", "field", "value", "needles"),
    [
        ("INT64", [ELEMENTS // 64, 64], "int64_contents", 0, ["expected datatype FP32", "received INT64"]),
        ("BYTES", [ELEMENTS], "bytes_contents", b"", ["expected datatype FP32", "received BYTES"]),
        (
            "FP32",
            [ELEMENTS // 2 // 64, 64],
            "fp32_contents",
            0.0,
            [f"has {ELEMENTS // 2 // 64} rows", f"at most {MAX_BATCH} per request"],
        ),
    ],
    ids=["int64", "bytes", "rows"],
)
def test_grpc_contents_refused_from_the_header(
    mariner: MarinerServe,
    pb: SimpleNamespace,
    channel: grpc.Channel,
    datatype: str,
    shape: list[int],
    field: str,
    value: object,
    needles: list[str],
) -> None:
    extra = 0 if datatype == "FP32" else 1  # see the module docstring
    wire = _model_infer(pb, datatype, shape, field, [value] * (int(np.prod(shape)) + extra))
    method = "/inference.GRPCInferenceService/ModelInfer"
    err = _liveness_during(mariner, pb, lambda: _grpc_refusal(channel, method, wire))
    assert err.code() is grpc.StatusCode.INVALID_ARGUMENT
    for needle in ["input 'pixels'", *needles]:
        assert needle in err.details()


def test_grpc_contents_within_the_signature_are_served(pb: SimpleNamespace, channel: grpc.Channel) -> None:
    pixels = np.linspace(0, 16, 4 * 64, dtype=np.float32)
    wire = _model_infer(pb, "FP32", [4, 64], "fp32_contents", pixels.tolist())
    answer = pb.m.ModelInferResponse.FromString(
        channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")(wire, timeout=TIMEOUT)
    )
    shapes = {o.name: list(o.shape) for o in answer.outputs}
    assert shapes["logits"] == [4, 10]


@pytest.mark.parametrize("form", ["json", "binary"])
def test_rest_tensors_refused_from_the_header(mariner: MarinerServe, pb: SimpleNamespace, form: str) -> None:
    url = f"{mariner.http}/v2/models/{MODEL}/infer"
    if form == "json":
        doc = {"inputs": [{"name": "pixels", "datatype": "INT64", "shape": [ELEMENTS // 64, 64]}]}
        doc["inputs"][0]["data"] = [0] * (ELEMENTS + 1)  # see the module docstring
        body, headers, received = json.dumps(doc).encode(), {"content-type": "application/json"}, "INT64"
    else:
        n = ELEMENTS // 2  # 4 bytes of length prefix each: within the body limit
        size = 4 * (n + 1)  # framing of n + 1 empty elements, see the module docstring
        params = {"binary_data_size": size}
        entry = {"name": "pixels", "datatype": "BYTES", "shape": [n], "parameters": params}
        head = json.dumps({"inputs": [entry]}).encode()
        body, headers, received = (
            head + bytes(size),
            {"inference-header-content-length": str(len(head))},
            "BYTES",
        )
    resp = _liveness_during(
        mariner, pb, lambda: requests.post(url, data=body, headers=headers, timeout=TIMEOUT)
    )
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"] == f"input 'pixels': expected datatype FP32, received {received}"


def test_predictions_input_map_is_capped_before_it_is_read(
    mariner: MarinerServe, pb: SimpleNamespace, channel: grpc.Channel
) -> None:
    request = pb.ts.PredictionsRequest(model_name=MODEL)
    for i in range(200_000):
        request.input[str(i)] = b""
    wire = request.SerializeToString()
    method = "/org.pytorch.serve.grpc.inference.InferenceAPIsService/Predictions"
    err = _liveness_during(mariner, pb, lambda: _grpc_refusal(channel, method, wire))
    assert err.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert err.details() == "the input map has 200000 entries; at most 1024 are accepted per request"
