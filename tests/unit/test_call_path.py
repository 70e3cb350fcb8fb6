"""Every inference entry point goes through the one call path: same labels, one count, one timing.

Each case drives a real adapter over its real transport (grpc.aio on port 0, the inference app
on uvicorn) against one fake DataPlane, then reads the metrics: a call is counted exactly once,
under the code label of what the client was answered, with exactly one duration observation,
and an unexpected exception reaches the client as a sanitized INTERNAL.
"""

from __future__ import annotations

import asyncio
import importlib
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import grpc
import numpy as np
import pytest
import requests

from mariner.server import protogen
from mariner.server.common.handler_status import handler_error
from mariner.server.contracts.errors import Code, ServingError
from mariner.server.contracts.types import InferResult
from mariner.server.frontend.protocols import call as call_path
from mariner.server.frontend.protocols.call import Failed, Ok, run_call
from tests.unit.fakes import (
    PREDICTION_PATHS,
    FakePlane,
    QuietMetrics,
    grpc_inference_channel,
    serve_inference,
)

pytestmark = pytest.mark.unit

MAX_MESSAGE = 1 << 20
TIMEOUT = 10
PIXELS = (np.arange(2 * 64, dtype=np.float32).reshape(2, 64) % 17).astype(np.float32)


@pytest.fixture(scope="module")
def pb() -> SimpleNamespace:
    protogen.generate()
    return SimpleNamespace(
        ts=importlib.import_module("mariner.server._proto.torchserve.inference_pb2"),
        ts_grpc=importlib.import_module("mariner.server._proto.torchserve.inference_pb2_grpc"),
        oip=importlib.import_module("mariner.server._proto.inference.grpc_service_pb2"),
        oip_grpc=importlib.import_module("mariner.server._proto.inference.grpc_service_pb2_grpc"),
    )


@pytest.fixture(scope="module")
def shared_plane() -> FakePlane:
    return FakePlane()


@pytest.fixture
def plane(shared_plane: FakePlane) -> FakePlane:
    shared_plane.metrics = QuietMetrics()  # the adapters read it per call: fresh counts per test
    shared_plane.mode = "ok"
    shared_plane.seen.clear()
    return shared_plane


@pytest.fixture(scope="module", params=PREDICTION_PATHS)
def url(shared_plane: FakePlane, request: pytest.FixtureRequest) -> Iterator[str]:
    """The inference listener, answering predictions on its fast path and through the app."""
    from mariner.server.frontend.protocols.http_listener import inference_app

    app = inference_app(shared_plane, max_body_bytes=MAX_MESSAGE)  # type: ignore[arg-type]
    with serve_inference(shared_plane, app, request.param, max_body_bytes=MAX_MESSAGE) as base:
        yield base


# -- one call per entry point: (wire status as an HTTP-equivalent int, error text) ----------
Answer = tuple[int, str]
_GRPC_HTTP = {
    grpc.StatusCode.OK: 200,
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.INTERNAL: 500,
}


def _grpc(pb: SimpleNamespace, plane: FakePlane, rpc: Callable[[grpc.aio.Channel], Any]) -> Answer:
    async def main() -> Answer:
        async with grpc_inference_channel(plane, MAX_MESSAGE) as channel:
            try:
                return await rpc(channel)
            except grpc.aio.AioRpcError as err:
                return _GRPC_HTTP[err.code()], err.details() or ""

    return asyncio.run(main())


def _oip_request(pb: SimpleNamespace, model: str) -> Any:
    tensor = pb.oip.ModelInferRequest.InferInputTensor(name="pixels", datatype="FP32", shape=PIXELS.shape)
    return pb.oip.ModelInferRequest(model_name=model, inputs=[tensor], raw_input_contents=[PIXELS.tobytes()])


def ts_grpc(pb: SimpleNamespace, plane: FakePlane, url: str, model: str) -> Answer:
    async def rpc(channel: grpc.aio.Channel) -> Answer:
        stub = pb.ts_grpc.InferenceAPIsServiceStub(channel)
        reply = await stub.Predictions(pb.ts.PredictionsRequest(model_name=model, input={"data": b"[1]"}))
        return 200, reply.prediction.decode()

    return _grpc(pb, plane, rpc)


def ts_grpc_stream(pb: SimpleNamespace, plane: FakePlane, url: str, model: str) -> Answer:
    async def rpc(channel: grpc.aio.Channel) -> Answer:
        stub = pb.ts_grpc.InferenceAPIsServiceStub(channel)
        call = stub.StreamPredictions(pb.ts.PredictionsRequest(model_name=model, input={"data": b"[1]"}))
        replies = [r.prediction async for r in call]
        assert len(replies) == 1
        return 200, replies[0].decode()

    return _grpc(pb, plane, rpc)


def ts_http(pb: SimpleNamespace, plane: FakePlane, url: str, model: str) -> Answer:
    resp = requests.post(f"{url}/predictions/{model}", data=b"[1]", timeout=TIMEOUT)
    return resp.status_code, resp.text


def oip_grpc(pb: SimpleNamespace, plane: FakePlane, url: str, model: str) -> Answer:
    async def rpc(channel: grpc.aio.Channel) -> Answer:
        stub = pb.oip_grpc.GRPCInferenceServiceStub(channel)
        response = await stub.ModelInfer(_oip_request(pb, model))
        assert [o.name for o in response.outputs] == ["logits", "probabilities", "label"]
        return 200, ""

    return _grpc(pb, plane, rpc)


def oip_grpc_stream(pb: SimpleNamespace, plane: FakePlane, url: str, model: str) -> Answer:
    """Errors travel in-stream (the stream itself stays OK): map them back by their message."""

    async def rpc(channel: grpc.aio.Channel) -> Answer:
        stub = pb.oip_grpc.GRPCInferenceServiceStub(channel)
        (answer,) = [a async for a in stub.ModelStreamInfer(iter([_oip_request(pb, model)]))]
        message = answer.error_message
        if not message:
            return 200, ""
        status = 404 if "not served" in message else 500 if "internal error" in message else 400
        return status, message

    return _grpc(pb, plane, rpc)


def oip_http(pb: SimpleNamespace, plane: FakePlane, url: str, model: str) -> Answer:
    doc = {"inputs": [{"name": "pixels", "datatype": "FP32", "shape": [2, 64], "data": PIXELS.tolist()}]}
    resp = requests.post(f"{url}/v2/models/{model}/infer", json=doc, timeout=TIMEOUT)
    return resp.status_code, resp.text


ENTRY_POINTS = {
    "torchserve-grpc": (ts_grpc, "torchserve-grpc"),
    "torchserve-grpc-stream": (ts_grpc_stream, "torchserve-grpc"),
    "torchserve-http": (ts_http, "torchserve-http"),
    "oip-grpc": (oip_grpc, "oip-grpc"),
    "oip-grpc-stream": (oip_grpc_stream, "oip-grpc"),
    "oip-http": (oip_http, "oip-http"),
}
# (mode, model asked for) -> (wire status, code label, model label)
SCENARIOS = {
    "success": ("ok", "digits", 200, "200", "digits"),
    "handler-400": ("reject", "digits", 400, "400", "digits"),
    "unknown-model": ("ok", "no-such-model", 404, "404", "unknown"),
    "unexpected-exception": ("boom", "digits", 500, "500", "digits"),
}


@pytest.mark.parametrize("scenario", list(SCENARIOS))
@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
def test_every_entry_point_counts_and_times_each_call_once(
    pb: SimpleNamespace, plane: FakePlane, url: str, entry: str, scenario: str
) -> None:
    send, protocol = ENTRY_POINTS[entry]
    mode, model, status, code, model_label = SCENARIOS[scenario]
    plane.mode = mode  # type: ignore[assignment]
    got_status, text = send(pb, plane, url, model)
    assert got_status == status, text
    if scenario == "handler-400":
        assert "pixels must be in [0, 16]" in text  # the handler's own message reaches the client
    if scenario == "unexpected-exception":
        assert "secret" not in text
        assert "internal error" in text
    version_label = "1" if model_label == "digits" else "unknown"
    labels = {"model": model_label, "version": version_label, "protocol": protocol}
    assert plane.samples("mariner_requests_total", protocol=protocol) == 1
    assert plane.samples("mariner_requests_total", code=code, **labels) == 1
    assert plane.samples("mariner_request_duration_seconds_count", protocol=protocol) == 1
    assert plane.samples("mariner_request_duration_seconds_count", **labels) == 1


# -- the call path itself ---------------------------------------------------------------------
def test_cancellation_is_counted_as_499_and_propagates() -> None:
    plane = FakePlane()
    started = asyncio.Event()

    async def hang(infer: Any) -> None:
        started.set()
        await asyncio.Event().wait()

    async def main() -> None:
        task = asyncio.create_task(run_call(plane, call_path.WireProtocol.OIP_GRPC, "digits", None, hang))
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    labels = {"model": "digits", "version": "1", "protocol": "oip-grpc"}
    assert plane.samples("mariner_requests_total", code="499", **labels) == 1
    assert plane.samples("mariner_requests_total") == 1
    assert plane.samples("mariner_request_duration_seconds_count") == 1


def test_outcome_carries_the_value_or_the_mapped_error() -> None:
    plane = FakePlane()

    async def work(infer: Any) -> Any:
        from mariner.server.contracts.types import InferRequest, WireProtocol

        req = InferRequest("digits", None, {"body": [1]}, WireProtocol.TS_HTTP, "r1")
        return await infer(req)

    ok = asyncio.run(run_call(plane, call_path.WireProtocol.TS_HTTP, "digits", None, work))
    assert isinstance(ok, Ok)
    assert ok.value.body == b'{"label": 3}'
    assert call_path.code_label(ok) == "200"
    plane.mode = "reject"
    failed = asyncio.run(run_call(plane, call_path.WireProtocol.TS_HTTP, "digits", None, work))
    assert isinstance(failed, Failed)
    assert (failed.error.code, failed.http_status) == (Code.INVALID_ARGUMENT, 400)
    assert failed.answer is not None  # the handler's own answer, for protocols that pass it on
    assert failed.answer.status == 400
    assert call_path.code_label(failed) == "400"


@pytest.mark.parametrize(
    ("result", "code", "message"),
    [
        (InferResult(body=b'{"error": "bad pixels", "code": 400}', status=400), Code.INVALID_ARGUMENT,
         "bad pixels"),
        (InferResult(body=b"plain words", status=400, phrase="the phrase"), Code.INVALID_ARGUMENT,
         "the phrase"),
        (InferResult(body=b"plain words", status=503), Code.UNAVAILABLE, "plain words"),
        (InferResult(body=b"", status=418), Code.INVALID_ARGUMENT,
         "the model's handler answered with status 418"),
        (InferResult(body=b"x", status=999), Code.INTERNAL, "x"),
    ],
)  # fmt: skip
def test_handler_error_maps_status_and_takes_the_handlers_own_message(
    result: InferResult, code: Code, message: str
) -> None:
    err = handler_error(result)
    assert isinstance(err, ServingError)
    assert (err.code, err.message) == (code, message)


def test_oip_requests_reach_the_plane_with_typed_tensors(
    pb: SimpleNamespace, plane: FakePlane, url: str
) -> None:
    """The OIP success cases above went through the tensor path: the typed field arrived."""
    assert oip_http(pb, plane, url, "digits")[0] == 200
    (req,) = plane.seen
    assert req.tensors is not None
    assert req.data == {}
    np.testing.assert_array_equal(req.tensors["pixels"], PIXELS)
