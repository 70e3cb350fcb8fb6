"""Mariner with the real archives from the pipeline, on port 0, over real gRPC and HTTP.

One `mariner serve` loads every variant; clients are `requests` and stubs generated from our
proto/. Answers are judged against the eager model; batching is read from /metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import json
import os
import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import grpc
import numpy as np
import pytest
import requests

from mariner.server import protogen
from tests.mariner_serve import MarinerServe

pytestmark = pytest.mark.integration

FP32 = ["digits_torchscript", "digits_onnx", "digits_aoti", "digits_eager", "digits_compiled"]
INT8 = ["digits_int8_dynamic", "digits_int8_pt2e"]
SAMPLES = 6
MAX_REQUEST = 256 * 1024


@pytest.fixture(scope="module")
def pb() -> SimpleNamespace:
    protogen.generate()
    return SimpleNamespace(
        inference=importlib.import_module("mariner.server._proto.torchserve.inference_pb2"),
        inference_grpc=importlib.import_module("mariner.server._proto.torchserve.inference_pb2_grpc"),
    )


@pytest.fixture(scope="module")
def mariner(model_store: Path) -> Iterator[MarinerServe]:
    models = ",".join(f"{m}.mar" for m in FP32 + INT8)
    srv = MarinerServe(model_store, models, max_request_bytes=MAX_REQUEST).start()
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def stub(mariner: MarinerServe, pb: SimpleNamespace) -> Iterator[object]:
    with grpc.insecure_channel(mariner.grpc_target) as channel:
        yield pb.inference_grpc.InferenceAPIsServiceStub(channel)


def _body(pixels: np.ndarray) -> bytes:
    return json.dumps([float(v) for v in pixels]).encode()


def _check_answer(answer: dict, expected_probs: np.ndarray, model: str) -> None:
    assert answer["label"] == int(expected_probs.argmax())
    if model in FP32:
        for entry in answer["topk"]:
            assert entry["probability"] == pytest.approx(float(expected_probs[entry["label"]]), abs=1e-4)


@pytest.mark.parametrize("model", FP32 + INT8)
def test_http_predictions_match_eager(mariner: MarinerServe, eager_reference, model: str) -> None:
    pixels = eager_reference.test_pixels[:SAMPLES]
    probs = eager_reference.probabilities(pixels)
    for px, p in zip(pixels, probs, strict=True):
        r = requests.post(
            f"{mariner.http}/predictions/{model}",
            data=_body(px),
            headers={"Content-Type": "application/json"},
        )
        assert r.status_code == 200, r.text
        _check_answer(r.json(), p, model)


@pytest.mark.parametrize("model", FP32 + INT8)
def test_grpc_predictions_match_eager(stub, pb, eager_reference, model: str) -> None:
    pixels = eager_reference.test_pixels[SAMPLES : 2 * SAMPLES]
    probs = eager_reference.probabilities(pixels)
    for px, p in zip(pixels, probs, strict=True):
        reply = stub.Predictions(pb.inference.PredictionsRequest(model_name=model, input={"data": _body(px)}))
        _check_answer(json.loads(reply.prediction), p, model)


def test_versioned_path_serves_the_default_version(mariner: MarinerServe, eager_reference) -> None:
    px = eager_reference.test_pixels[0]
    r = requests.post(f"{mariner.http}/predictions/digits_torchscript/1.0", json=[float(v) for v in px])
    assert r.status_code == 200
    assert r.json()["label"] == int(eager_reference.probabilities(px).argmax())


def _metric(text: str, name: str, model: str) -> float:
    pattern = rf'^{name}\{{model="{model}",version="1.0"\}} (\S+)$'
    m = re.search(pattern, text, re.MULTILINE)
    assert m, f"{name} for {model} not in /metrics"
    return float(m.group(1))


def test_64_concurrent_requests_are_batched(mariner: MarinerServe, pb, eager_reference) -> None:
    model = "digits_torchscript"
    before = requests.get(f"{mariner.metrics}/metrics").text
    pixels = eager_reference.test_pixels[:64]
    expected = eager_reference.probabilities(pixels).argmax(1)

    async def fire() -> list[int]:
        async with grpc.aio.insecure_channel(mariner.grpc_target) as ch:
            s = pb.inference_grpc.InferenceAPIsServiceStub(ch)
            replies = await asyncio.gather(
                *(
                    s.Predictions(
                        pb.inference.PredictionsRequest(model_name=model, input={"data": _body(px)})
                    )
                    for px in pixels
                )
            )
        return [json.loads(r.prediction)["label"] for r in replies]

    labels = asyncio.run(fire())
    assert labels == expected.tolist()
    after = requests.get(f"{mariner.metrics}/metrics").text
    batches = _metric(after, "mariner_batch_size_count", model) - _metric(
        before, "mariner_batch_size_count", model
    )
    items = _metric(after, "mariner_batch_size_sum", model) - _metric(before, "mariner_batch_size_sum", model)
    assert items == 64
    assert batches < 64, "64 concurrent requests should share handler calls"


# -- errors: the codes in DESIGN.md, with messages that say what was wrong ------------------------


def test_http_errors(mariner: MarinerServe) -> None:
    url = f"{mariner.http}/predictions"
    json_hdr = {"Content-Type": "application/json"}
    r = requests.post(f"{url}/digits_torchscript", data=b"[1, 2,", headers=json_hdr)
    assert r.status_code == 400
    assert "JSON" in r.json()["message"]
    r = requests.post(f"{url}/digits_torchscript", data=b"[1, 2, 3]", headers=json_hdr)
    assert r.status_code == 400
    assert "64" in r.text
    r = requests.post(f"{url}/digits_torchscript", data=b"", headers=json_hdr)
    assert r.status_code == 400
    assert "empty" in r.text.lower()
    r = requests.post(f"{url}/no_such_model", data=b"[1]", headers=json_hdr)
    assert r.status_code == 404
    assert "no_such_model" in r.json()["message"]
    r = requests.post(f"{url}/digits_torchscript/9.9", data=b"[1]", headers=json_hdr)
    assert r.status_code == 404
    assert "9.9" in r.json()["message"]
    r = requests.post(f"{url}/digits_torchscript", data=b"0" * (MAX_REQUEST + 1), headers=json_hdr)
    assert r.status_code == 413
    assert str(MAX_REQUEST) in r.text


def _grpc_error(stub, pb, model: str, data: bytes, version: str = "") -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        stub.Predictions(
            pb.inference.PredictionsRequest(model_name=model, model_version=version, input={"data": data})
        )
    return info.value


def test_grpc_errors(stub, pb) -> None:
    err = _grpc_error(stub, pb, "digits_torchscript", b"[1, 2,")
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "JSON" in err.details()
    err = _grpc_error(stub, pb, "digits_torchscript", b"[1, 2, 3]")
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "64" in err.details()
    err = _grpc_error(stub, pb, "digits_torchscript", b"")
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "empty" in err.details().lower()
    err = _grpc_error(stub, pb, "no_such_model", b"[1]")
    assert err.code() == grpc.StatusCode.NOT_FOUND
    err = _grpc_error(stub, pb, "digits_torchscript", b"[1]", version="9.9")
    assert err.code() == grpc.StatusCode.NOT_FOUND
    err = _grpc_error(stub, pb, "digits_torchscript", b"0" * (MAX_REQUEST + 1))
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def _batch_totals(mariner: MarinerServe, model: str) -> tuple[int, int]:
    """(batches, items) the model's batcher has dispatched so far, from mariner_batch_size."""
    text = requests.get(f"{mariner.metrics}/metrics", timeout=10).text
    return int(_metric(text, "mariner_batch_size_count", model)), int(
        _metric(text, "mariner_batch_size_sum", model)
    )


class FirstBatchGate:
    """Holds the model's only worker process on its first batch until `release`.

    The worker is stopped (SIGSTOP) before the first request: the frontend's batcher hands it the
    first batch, so the instance is busy from then on and whatever arrives queues; SIGCONT lets it
    answer, and the queue then runs as one batch. The test decides which requests share a batch
    instead of hoping they happen to. Batch sizes are read from mariner_batch_size in /metrics.
    """

    def __init__(self, mariner: MarinerServe, model: str) -> None:
        (self.pid,) = mariner.worker_pids(model)
        self.mariner, self.model = mariner, model
        self.start = _batch_totals(mariner, model)
        self.first: tuple[int, int] | None = None

    def wait_started(self) -> bool:
        """True once the first batch was handed to the (stopped) worker."""
        for _ in range(6000):
            now = _batch_totals(self.mariner, self.model)
            if now[0] > self.start[0]:
                self.first = now
                return True
            time.sleep(0.02)
        return False

    def release(self) -> None:
        os.kill(self.pid, signal.SIGCONT)

    def sizes(self) -> list[object]:
        """The first batch's size, then the next one's (or how many batches the rest took)."""
        assert self.first is not None
        end = _batch_totals(self.mariner, self.model)
        batches, items = end[0] - self.first[0], end[1] - self.first[1]
        rest: list[object] = [items] if batches == 1 else [f"{items} items in {batches} batches"]
        return [self.first[1] - self.start[1], *rest]


@contextlib.contextmanager
def first_batch_blocks(mariner: MarinerServe, model: str) -> Iterator[FirstBatchGate]:
    gate = FirstBatchGate(mariner, model)
    os.kill(gate.pid, signal.SIGSTOP)
    try:
        yield gate
    finally:
        gate.release()


def wait_for_queue_depth(mariner: MarinerServe, model: str, depth: int) -> None:
    """Poll /metrics until `depth` items wait in the model's queue (an event, not a time)."""
    for _ in range(6000):
        text = requests.get(f"{mariner.metrics}/metrics", timeout=10).text
        if _metric(text, "mariner_queue_depth", model) == depth:
            return
        time.sleep(0.02)
    raise AssertionError(f"{depth} requests never queued for {model}")


def test_bad_request_does_not_fail_its_batch_mates(mariner: MarinerServe, pb, eager_reference) -> None:
    model = "digits_onnx"
    pixels = eager_reference.test_pixels[:16]
    expected = eager_reference.probabilities(pixels).argmax(1).tolist()
    bodies = [_body(px) for px in pixels[1:]]
    bodies.insert(7, b"[1, 2, 3]")  # decoded by the handler, inside the shared batch
    bodies.insert(3, b"[1, 2,")

    async def fire(gate: FirstBatchGate) -> tuple[object, list[object]]:
        async with grpc.aio.insecure_channel(mariner.grpc_target) as ch:
            s = pb.inference_grpc.InferenceAPIsServiceStub(ch)

            def call(body: bytes) -> object:
                return s.Predictions(pb.inference.PredictionsRequest(model_name=model, input={"data": body}))

            blocker = asyncio.ensure_future(call(_body(pixels[0])))
            assert await asyncio.to_thread(gate.wait_started), "the first request never ran"
            calls = [asyncio.ensure_future(call(b)) for b in bodies]
            await asyncio.to_thread(wait_for_queue_depth, mariner, model, len(bodies))
            gate.release()
            return await blocker, await asyncio.gather(*calls, return_exceptions=True)

    with first_batch_blocks(mariner, model) as gate:
        first, out = asyncio.run(fire(gate))
    assert gate.sizes() == [1, len(bodies)], "everything queued behind the first batch runs as one batch"
    assert json.loads(first.prediction)["label"] == expected[0]
    truncated, short = out.pop(3), out.pop(7)
    for bad, what in ((truncated, "JSON"), (short, "64")):
        assert isinstance(bad, grpc.aio.AioRpcError)
        assert bad.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert what in bad.details()
    failed = [r.code() for r in out if isinstance(r, grpc.aio.AioRpcError)]
    assert not failed, f"a bad request failed {len(failed)} of its batch-mates: {failed}"
    assert [json.loads(r.prediction)["label"] for r in out] == expected[1:]


# -- readiness -----------------------------------------------------------------------------------


GATED_HANDLER = """
import os
import time


class Gated:
    def initialize(self, context):
        gate = os.environ["MARINER_TEST_LOAD_GATE"]
        end = time.monotonic() + 300  # a cap only so a forgotten gate cannot hang the run
        while not os.path.exists(gate) and time.monotonic() < end:
            time.sleep(0.01)

    def handle(self, data, context):
        return ["ok" for _ in data]
"""


def test_health_is_serving_only_after_load(tmp_path: Path) -> None:
    """A model whose handler is still initialising: the frontend listens, health and /readyz
    say NOT_SERVING/503 (liveness 200); once it has loaded, SERVING/200."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from tests.integration.fault_archive import write_handler_archive

    store = tmp_path / "store"
    store.mkdir()
    write_handler_archive(
        store / "gated.mar",
        "gated",
        "gated_handler.py",
        {"gated_handler.py": GATED_HANDLER, "model-config.yaml": "batchSize: 1\n"},
    )
    gate = tmp_path / "loaded"
    srv = MarinerServe(store, "gated.mar", env={"MARINER_TEST_LOAD_GATE": str(gate)}).start(settle=False)
    try:
        srv.wait_http_ok(f"{srv.http}/healthz")  # the frontend listens; the handler waits on the gate
        with grpc.insecure_channel(srv.grpc_target) as ch:
            health = health_pb2_grpc.HealthStub(ch)

            def status(service: str) -> int:
                return health.Check(health_pb2.HealthCheckRequest(service=service)).status

            not_serving = health_pb2.HealthCheckResponse.NOT_SERVING
            assert status("gated") == not_serving
            assert status("") == not_serving
            assert requests.get(f"{srv.http}/readyz").status_code == 503
            assert requests.get(f"{srv.http}/healthz").status_code == 200
            gate.touch()
            assert srv.wait_settled(), srv.log_tail()
            assert status("gated") == health_pb2.HealthCheckResponse.SERVING
            assert status("") == health_pb2.HealthCheckResponse.SERVING
            assert requests.get(f"{srv.http}/readyz").status_code == 200
    finally:
        srv.stop()


# -- resources ------------------------------------------------------------------------------------


def _mapped_aoti_dirs(pid: int | str = "self") -> set[Path]:
    """aotinductor_* temp dirs whose files process `pid` has mapped (ours, not another process's)."""
    found = set()
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        path = line.split(maxsplit=5)[-1] if line.count(" ") >= 5 else ""
        for parent in Path(path).parents:
            if parent.name.startswith("aotinductor_"):
                found.add(parent)
    return found


def test_an_aoti_model_leaves_no_temp_dir_behind(model_store: Path) -> None:
    """torch extracts an AOTInductor package into $TMPDIR/aotinductor_*; stopping must remove it."""
    srv = MarinerServe(model_store, "digits_aoti.mar").start()
    try:
        (pid,) = srv.worker_pids("digits_aoti")
        ours = _mapped_aoti_dirs(pid)  # the model runs in its worker process
        assert ours, "the AOTI model should run from an extracted package"
        assert all(d.is_dir() for d in ours)
    finally:
        srv.stop()
    assert [d for d in ours if d.exists()] == [], "the extracted package outlived the server"
