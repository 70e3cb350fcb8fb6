"""Stock TorchServe 0.12 is the oracle: our archives must answer on it exactly as the eager model.

If an archive is right on stock TorchServe, any difference seen later on Mariner is Mariner's bug,
not the archive's. One TorchServe serves every archive for the whole module (starting it costs
~10-15 s on two cores); batching is on (batchSize 8, maxBatchDelay 20 ms) so the per-item error
path is exercised the way production uses it.
"""

from __future__ import annotations

import io
import shutil
import threading
import zipfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest
import requests
from PIL import Image

from mariner.loadtest.servers import ServerError, StockTorchServe, leftover_processes

if TYPE_CHECKING:  # conftest is pytest's to import; the class is only needed for annotations
    from tests.conftest import EagerReference

pytestmark = pytest.mark.integration

FP32 = ("digits_torchscript", "digits_onnx", "digits_aoti")
INT8 = ("digits_int8_pt2e", "digits_int8_dynamic")
N_SAMPLES = 20
PROB_TOL = 1e-4  # the handler rounds to 6 decimals; kernels differ by ~1e-6
INT8_MIN_AGREEMENT = 0.95
TIMEOUT_S = 30.0


@pytest.fixture(scope="module")
def torchserve(model_store: Path) -> Iterator[StockTorchServe]:
    if shutil.which("java") is None:
        pytest.fail("stock TorchServe needs Java 17 on PATH: run `make java`")
    with StockTorchServe(model_store, [*FP32, *INT8], batch_size=8, max_batch_delay_ms=20) as ts:
        workdir = ts.workdir
        assert workdir is not None
        yield ts
    assert leftover_processes(workdir) == [], "stock TorchServe left processes running after stop()"


def test_a_handler_that_cannot_load_fails_start_fast_and_leaves_nothing_behind(
    model_store: Path, tmp_path: Path
) -> None:
    """Stock TorchServe restarts a dying worker forever; start() must give up, say why, clean up.

    Runs before the module's TorchServe starts (file order), so only one instance is up at a time.
    """
    store = tmp_path / "store"
    store.mkdir()
    with (
        zipfile.ZipFile(model_store / "digits_onnx.mar") as src,
        zipfile.ZipFile(store / "digits_onnx.mar", "w") as dst,
    ):
        for item in src.infolist():
            data = src.read(item)
            if item.filename == "model-config.yaml":
                data = data.replace(b"format: onnx", b"format: bogus")
            dst.writestr(item, data)
    ts = StockTorchServe(store, "digits_onnx", max_worker_restarts=1, temp_root=tmp_path)
    with pytest.raises(ServerError, match="handler fails to load") as failure:
        ts.start(timeout=60)
    assert "handler.format must be one of" in str(failure.value)  # the worker's error, from the log
    assert not ts.running
    assert ts.workdir is None
    assert leftover_processes(tmp_path) == []
    assert list(tmp_path.glob("stock-torchserve-*")) == []


def predict(ts: StockTorchServe, model: str, body: Any, content_type: str | None = None) -> requests.Response:
    if content_type is None:
        return requests.post(f"{ts.http_url}/predictions/{model}", json=body, timeout=TIMEOUT_S)
    return requests.post(
        f"{ts.http_url}/predictions/{model}",
        data=body,
        headers={"Content-Type": content_type},
        timeout=TIMEOUT_S,
    )


def predict_many(ts: StockTorchServe, model: str, bodies: list[Any]) -> list[requests.Response]:
    """Concurrently, so TorchServe batches them; results stay in request order."""
    with ThreadPoolExecutor(max_workers=8) as pool:
        return list(pool.map(lambda b: predict(ts, model, b), bodies))


def assert_matches_eager(answer: dict[str, Any], eager_probs: np.ndarray) -> None:
    """Label is the eager argmax; every top-k entry carries the eager probability of its label."""
    assert answer["label"] == int(eager_probs.argmax())
    topk = answer["topk"]
    assert len(topk) == 3
    assert topk[0]["label"] == answer["label"]
    assert [t["probability"] for t in topk] == sorted((t["probability"] for t in topk), reverse=True)
    for entry in topk:
        assert entry["probability"] == pytest.approx(float(eager_probs[entry["label"]]), abs=PROB_TOL)


def test_every_model_is_served_with_the_requested_batching(torchserve: StockTorchServe) -> None:
    # The archives say batchSize 32 / maxBatchDelay 5; the explicit settings must have won.
    for name in (*FP32, *INT8):
        (desc,) = torchserve.describe(name)
        assert (desc["batchSize"], desc["maxBatchDelay"]) == (8, 20), name
        assert [w["status"] for w in desc["workers"]] == ["READY"]


@pytest.mark.parametrize("model", FP32)
def test_fp32_archive_matches_eager(
    torchserve: StockTorchServe, eager_reference: EagerReference, model: str
) -> None:
    pixels = eager_reference.test_pixels[:N_SAMPLES]
    eager = eager_reference.probabilities(pixels)
    responses = predict_many(torchserve, model, [row.tolist() for row in pixels])
    for i, (r, probs) in enumerate(zip(responses, eager, strict=True)):
        assert r.status_code == 200, f"sample {i}: {r.status_code} {r.text}"
        assert_matches_eager(r.json(), probs)


@pytest.mark.parametrize("model", INT8)
def test_int8_archive_agrees_with_eager(
    torchserve: StockTorchServe, eager_reference: EagerReference, model: str
) -> None:
    pixels = eager_reference.test_pixels[:N_SAMPLES]
    eager_labels = eager_reference.probabilities(pixels).argmax(axis=1)
    responses = predict_many(torchserve, model, [row.tolist() for row in pixels])
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses if r.status_code != 200]
    served = np.array([r.json()["label"] for r in responses])
    agreement = float((served == eager_labels).mean())
    assert agreement >= INT8_MIN_AGREEMENT, f"{model}: top-1 agreement {agreement:.2%}"


def test_bad_item_fails_alone_in_a_concurrent_batch(
    torchserve: StockTorchServe, eager_reference: EagerReference
) -> None:
    """16 requests released together (TorchServe batches up to 8); item 5 has 10 numbers, not 64.

    Stock TorchServe answers the bad item with HTTP 400 whose body is the handler's result for
    that item verbatim (JSON, no Content-Type header) and whose reason phrase is the message given
    to context.set_response_status; its batch-mates get 200 and their own answers (distinct samples, so a
    mix-up between batch slots would show).
    """
    n, bad = 16, 5
    pixels = eager_reference.test_pixels[N_SAMPLES : N_SAMPLES + n]
    eager = eager_reference.probabilities(pixels)
    bodies: list[Any] = [row.tolist() for row in pixels]
    bodies[bad] = [1.0] * 10
    gate = threading.Barrier(n)

    def send(body: Any) -> requests.Response:
        gate.wait(timeout=TIMEOUT_S)
        return predict(torchserve, "digits_torchscript", body)

    with ThreadPoolExecutor(max_workers=n) as pool:
        responses = list(pool.map(send, bodies))

    expected = (
        "expected 64 pixels as a flat list of 64 numbers or an 8x8 nested list, but the list has 10 items"
    )
    rejected = responses[bad]
    assert rejected.status_code == 400, rejected.text
    assert rejected.json() == {"error": expected, "code": 400}
    assert rejected.reason == expected  # set_response_status's phrase becomes the HTTP reason
    for i, (r, probs) in enumerate(zip(responses, eager, strict=True)):
        if i == bad:
            continue
        assert r.status_code == 200, f"request {i}: {r.status_code} {r.text}"
        assert_matches_eager(r.json(), probs)


def test_nested_8x8_list_is_accepted(torchserve: StockTorchServe, eager_reference: EagerReference) -> None:
    pixels = eager_reference.test_pixels[0]
    r = predict(torchserve, "digits_onnx", pixels.reshape(8, 8).tolist())
    assert r.status_code == 200, r.text
    assert_matches_eager(r.json(), eager_reference.probabilities(pixels)[0])


def test_png_image_is_accepted(torchserve: StockTorchServe, eager_reference: EagerReference) -> None:
    """A test digit as an 8-bit grayscale PNG (light ink on dark, 4x upscaled) decodes to that digit."""
    pixels = eager_reference.test_pixels[1]
    gray = np.round(pixels.reshape(8, 8) * (255.0 / 16.0)).astype(np.uint8)
    image = Image.fromarray(gray).resize((32, 32), Image.Resampling.NEAREST)
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    r = predict(torchserve, "digits_torchscript", buf.getvalue(), content_type="image/png")
    assert r.status_code == 200, r.text
    # The handler sees the 8-bit quantised intensities, so judge it against exactly those.
    decoded = gray.reshape(64).astype(np.float32) * (16.0 / 255.0)
    assert_matches_eager(r.json(), eager_reference.probabilities(decoded)[0])


# -- Mariner vs the oracle: same archive, same requests, same bytes --------------------------------


@pytest.fixture(scope="module")
def mariner(model_store: Path, torchserve: StockTorchServe) -> Iterator[Any]:
    from tests.mariner_serve import MarinerServe

    srv = MarinerServe(model_store, ",".join(f"{m}.mar" for m in (*FP32, *INT8))).start()
    try:
        yield srv
    finally:
        srv.stop()


def _grpc_predict(target: str, model: str, data: bytes) -> bytes:
    import grpc

    from mariner.server import protogen

    protogen.generate()
    from mariner.server._proto.torchserve import inference_pb2, inference_pb2_grpc

    with grpc.insecure_channel(target) as ch:
        stub = inference_pb2_grpc.InferenceAPIsServiceStub(ch)
        request = inference_pb2.PredictionsRequest(model_name=model, input={"data": data})
        return stub.Predictions(request).prediction


@pytest.mark.parametrize("model", [*FP32, *INT8])
def test_mariner_returns_the_same_bytes_as_torchserve(
    torchserve: StockTorchServe, mariner: Any, eager_reference: EagerReference, model: str
) -> None:
    """Our gRPC client is built from our proto/, so equal answers from TorchServe also prove the
    proto is wire-compatible with TorchServe's."""
    import json

    for px in eager_reference.test_pixels[:8]:
        body = json.dumps([float(v) for v in px]).encode()
        hdr = {"Content-Type": "application/json"}
        ts_url, ours_url = f"{torchserve.http_url}/predictions/{model}", f"{mariner.http}/predictions/{model}"
        ts_http = requests.post(ts_url, data=body, headers=hdr, timeout=30)
        ours_http = requests.post(ours_url, data=body, headers=hdr, timeout=30)
        assert ts_http.status_code == ours_http.status_code == 200
        assert ours_http.content == ts_http.content
        ts_grpc = _grpc_predict(torchserve.grpc_target, model, body)
        ours_grpc = _grpc_predict(mariner.grpc_target, model, body)
        assert ours_grpc == ts_grpc == ts_http.content


def test_mariner_bad_request_matches_torchserve(torchserve: StockTorchServe, mariner: Any) -> None:
    bad = b"[1, 2, 3]"
    hdr = {"Content-Type": "application/json"}
    ts = requests.post(f"{torchserve.http_url}/predictions/digits_onnx", data=bad, headers=hdr, timeout=30)
    ours = requests.post(f"{mariner.http}/predictions/digits_onnx", data=bad, headers=hdr, timeout=30)
    assert ts.status_code == ours.status_code == 400
    assert ours.content == ts.content


# -- Management: the same archive registered the same way is described and managed the same way --

# Keys whose values must be equal on both servers. Per-worker ids, pids, times and memory differ
# by nature; maxRetryTimeoutInSec & co are TorchServe's defaults for features Mariner does not have.
EQUAL_KEYS = (
    "modelName", "modelVersion", "modelUrl", "runtime", "minWorkers", "maxWorkers", "batchSize",
    "maxBatchDelay", "responseTimeout", "startupTimeout", "maxRetryTimeoutInSec", "clientTimeoutInMills",
    "parallelType", "parallelLevel", "deviceType", "continuousBatching", "useJobTicket", "useVenv",
    "stateful", "sequenceMaxIdleMSec", "sequenceTimeoutMSec", "maxNumSequence", "maxSequenceJobQueueSize",
    "loadedAtStartup",
)  # fmt: skip
MANAGED = "digits_onnx"


@pytest.fixture(scope="module")
def managed_mariner(model_store: Path, torchserve: StockTorchServe) -> Iterator[Any]:
    """Mariner with model management, `MANAGED` registered exactly as the oracle registered it
    (batch size 8, delay 20 ms, one worker, through the management API)."""
    from tests.mariner_serve import MarinerServe

    srv = MarinerServe(model_store, "digits_torchscript.mar", enable_model_management=True).start()
    try:
        params = {"url": f"{MANAGED}.mar", "batch_size": 8, "max_batch_delay": 20, "initial_workers": 1}
        r = requests.post(f"{srv.management}/models", params=params, timeout=120)
        assert r.status_code == 200, r.text
        yield srv
    finally:
        srv.stop()


def _management(base: str, method: str, path: str, **params: Any) -> requests.Response:
    return requests.request(method, f"{base}{path}", params=params or None, timeout=120)


def test_describe_has_torchserves_keys_order_and_values(
    torchserve: StockTorchServe, managed_mariner: Any
) -> None:
    (stock,) = _management(torchserve.management_url, "GET", f"/models/{MANAGED}").json()
    (ours,) = _management(managed_mariner.management, "GET", f"/models/{MANAGED}").json()
    assert [k for k in ours if k != "mariner"] == list(stock)  # key set and order
    for key in EQUAL_KEYS:
        assert ours[key] == stock[key], f"{key}: Mariner {ours[key]!r}, TorchServe {stock[key]!r}"
    assert [list(w) for w in ours["workers"]] == [list(w) for w in stock["workers"]]
    assert [w["status"] for w in ours["workers"]] == [w["status"] for w in stock["workers"]] == ["READY"]
    assert list(ours["jobQueueStatus"]) == list(stock["jobQueueStatus"])


def test_management_answers_as_torchserve(torchserve: StockTorchServe, managed_mariner: Any) -> None:
    """Same calls, same status codes and bodies: customized describe (the handler's answer and
    status), a duplicate register, set-default, the OpenAPI document's envelope."""
    calls: list[tuple[str, str, dict[str, Any]]] = [
        ("GET", f"/models/{MANAGED}", {"customized": "true"}),
        ("POST", "/models", {"url": f"{MANAGED}.mar"}),
        ("PUT", f"/models/{MANAGED}/1.0/set-default", {}),
        ("PUT", f"/models/{MANAGED}/9.9/set-default", {}),
        ("PUT", f"/models/{MANAGED}", {"min_worker": 2, "max_worker": 1}),
    ]
    for method, path, params in calls:
        stock = _management(torchserve.management_url, method, path, **params)
        ours = _management(managed_mariner.management, method, path, **params)
        assert ours.status_code == stock.status_code, f"{method} {path} {params}: {ours.text} vs {stock.text}"
        if stock.status_code < 300:
            if method == "GET":
                assert ours.json()[0]["customizedMetadata"] == stock.json()[0]["customizedMetadata"]
            else:
                assert ours.json() == stock.json()
    duplicate = _management(managed_mariner.management, "POST", "/models", url=f"{MANAGED}.mar")
    stock_duplicate = _management(torchserve.management_url, "POST", "/models", url=f"{MANAGED}.mar")
    assert duplicate.json()["message"] == stock_duplicate.json()["message"]
    customized = _management(managed_mariner.management, "GET", f"/models/{MANAGED}", customized="true")
    stock_customized = _management(torchserve.management_url, "GET", f"/models/{MANAGED}", customized="true")
    assert customized.json()[0]["customizedMetadata"] == stock_customized.json()[0]["customizedMetadata"]
    for ours_base, stock_base in (
        (managed_mariner.management, torchserve.management_url),
        (managed_mariner.http, torchserve.http_url),
    ):
        ours_doc = requests.options(f"{ours_base}/", timeout=30).json()
        stock_doc = requests.options(f"{stock_base}/", timeout=30).json()
        assert list(ours_doc) == list(stock_doc) == ["openapi", "info", "paths"]
        assert ours_doc["openapi"] == stock_doc["openapi"]


def test_asynchronous_register_answers_as_torchserve(
    torchserve: StockTorchServe, managed_mariner: Any
) -> None:
    params = {"url": "digits_eager.mar", "synchronous": "false", "initial_workers": 1}
    stock = _management(torchserve.management_url, "POST", "/models", **params)
    ours = _management(managed_mariner.management, "POST", "/models", **params)
    assert (
        (ours.status_code, ours.json())
        == (stock.status_code, stock.json())
        == (
            202,
            {"status": "Processing worker updates..."},
        )
    )
