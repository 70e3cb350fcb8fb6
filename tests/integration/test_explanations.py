"""TorchServe's Explanations API and SageMaker's /invocations against a live Mariner.

A test archive's handler reports what it was handed: the `explain` header of each request in
its batch (TorchServe's frontend sets it, BaseHandler reads request 0's) and the keys of its
row. That proves the header reaches `context.get_request_header` on /explanations, KServe's
`:explain` and /predictions, and that explanations and predictions queued together never share
a handler call. The digits archives prove the real explanation (saliency) and the clear 501 of
a variant without gradients, through the handler in this tree (see `current_digits_archive`).
"""

from __future__ import annotations

import zipfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import requests

from tests.integration.fault_archive import write_handler_archive
from tests.integration.test_faults import counter, wait_for
from tests.mariner_serve import MarinerServe

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
TIMEOUT = 60

HANDLER = """
import json
import os
import time


class EchoHandler:
    def initialize(self, context):
        self.initialized = True

    def handle(self, data, context):
        flags = [context.get_request_header(i, "explain") for i in range(len(data))]
        bodies = []
        for row in data:
            body = row["data"] if "data" in row else row.get("body", row)
            if isinstance(body, (bytes, bytearray)):
                body = json.loads(body)
            bodies.append(body)
        for body in bodies:
            if isinstance(body, dict) and body.get("op") == "block":
                open(os.path.join(body["value"], "started"), "w").close()
                while not os.path.exists(os.path.join(body["value"], "release")):
                    time.sleep(0.005)
        explaining = context.get_request_header(0, "explain") == "True"  # BaseHandler's rule
        if explaining and any(isinstance(b, dict) and b.get("op") == "no_explain" for b in bodies):
            raise NotImplementedError("this handler has no explain_handle")
        return [
            {"explained": explaining, "batch_flags": flags, "keys": sorted(str(k) for k in row)}
            for row in data
        ]
"""

CONFIG = "minWorkers: 1\\nmaxWorkers: 1\\nbatchSize: 8\\nmaxBatchDelay: 0\\nresponseTimeout: 60\\n"


def build_echo_archive(store: Path, name: str) -> Path:
    files = {"echo_handler.py": HANDLER, "model-config.yaml": CONFIG.replace("\\n", "\n")}
    return write_handler_archive(store / f"{name}.mar", name, "echo_handler.py", files)


def current_digits_archive(model_store: Path, name: str, out: Path) -> Path:
    """`name` from the model store with this tree's digits handler inside, so the test checks
    the handler under review even when the store was built before it changed."""
    target = out / name
    with zipfile.ZipFile(model_store / name) as src, zipfile.ZipFile(target, "w") as dst:
        for item in src.infolist():
            data = src.read(item.filename)
            if item.filename == "digits_handler.py":
                data = (REPO / "handlers" / "digits_handler.py").read_bytes()
            dst.writestr(item, data)
    return target


@pytest.fixture(scope="module")
def echo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MarinerServe]:
    store = tmp_path_factory.mktemp("echo")
    build_echo_archive(store, "echo")
    srv = MarinerServe(store, "echo.mar").start()
    try:
        yield srv
    finally:
        srv.stop()


def test_explanations_reach_the_handler_with_the_explain_header(echo: MarinerServe) -> None:
    explained = requests.post(f"{echo.http}/explanations/echo", json={"op": "x"}, timeout=TIMEOUT)
    assert explained.status_code == 200, explained.text
    assert explained.json()["explained"] is True
    versioned = requests.post(f"{echo.http}/explanations/echo/1.0", json={"op": "x"}, timeout=TIMEOUT)
    assert versioned.json()["explained"] is True
    # A client cannot turn a prediction into an explanation: TorchServe overrides the header too.
    predicted = requests.post(
        f"{echo.http}/predictions/echo", json={"op": "x"}, headers={"explain": "True"}, timeout=TIMEOUT
    )
    assert (predicted.json()["explained"], predicted.json()["batch_flags"]) == (False, ["False"])
    kserve = requests.post(
        f"{echo.http}/v1/models/echo:explain", json={"instances": [{"op": "x"}]}, timeout=TIMEOUT
    )
    assert kserve.json()["explanations"][0]["explained"] is True


def test_unknown_model_is_404(echo: MarinerServe) -> None:
    resp = requests.post(f"{echo.http}/explanations/nope", json={"op": "x"}, timeout=TIMEOUT)
    assert resp.status_code == 404
    assert "nope" in resp.json()["message"]


def test_a_handler_that_cannot_explain_answers_a_clear_error(echo: MarinerServe) -> None:
    resp = requests.post(f"{echo.http}/explanations/echo", json={"op": "no_explain"}, timeout=TIMEOUT)
    # Stock TorchServe's answer to a handler that raised, on its endpoint.
    assert (resp.status_code, resp.json()) == (
        503,
        {"code": 503, "type": "InternalServerException", "message": "Prediction failed"},
    )
    assert "Traceback" not in resp.text
    assert "NotImplementedError" not in resp.text
    ok = requests.post(f"{echo.http}/predictions/echo", json={"op": "no_explain"}, timeout=TIMEOUT)
    assert ok.status_code == 200, "the same input predicts: only the explanation failed"


def test_explanations_and_predictions_never_share_a_handler_call(echo: MarinerServe, tmp_path: Path) -> None:
    """Queued together behind a busy instance, each kind runs in its own handler call."""
    gate = tmp_path / "gate"
    gate.mkdir()
    urls = [f"{echo.http}/{kind}/echo" for kind in ("predictions", "explanations") * 2]

    def post(url: str, body: Any) -> requests.Response:
        return requests.post(url, json=body, timeout=TIMEOUT)

    with ThreadPoolExecutor(len(urls) + 1) as pool:
        blocker = pool.submit(post, f"{echo.http}/predictions/echo", {"op": "block", "value": str(gate)})
        wait_for(lambda: (gate / "started").exists() or blocker.done(), "the blocker never ran")
        futures = [pool.submit(post, url, {"op": "x"}) for url in urls]
        wait_for(
            lambda: counter(echo, "mariner_queue_depth", model="echo") == len(urls) or blocker.done(),
            "the requests never queued behind the blocker",
        )
        (gate / "release").touch()
        assert blocker.result().status_code == 200
        answers = [f.result().json() for f in futures]
    for url, answer in zip(urls, answers, strict=True):
        want = "True" if "/explanations/" in url else "False"
        assert answer["explained"] is (want == "True")
        assert answer["batch_flags"] == [want, want], f"{url}: {answer['batch_flags']}"


# -- SageMaker /invocations ---------------------------------------------------------------------
def test_invocations_serves_the_only_model_and_passes_query_parameters(echo: MarinerServe) -> None:
    resp = requests.post(f"{echo.http}/invocations", json={"op": "x"}, timeout=TIMEOUT)
    assert resp.status_code == 200, resp.text
    assert resp.json()["keys"] == ["body"]
    named = requests.post(f"{echo.http}/invocations?model_name=echo&x=1", json={"op": "x"}, timeout=TIMEOUT)
    assert named.json()["keys"] == ["body", "model_name", "x"]  # as TorchServe hands them over
    invoke = requests.post(f"{echo.http}/models/echo/invoke", json={"op": "x"}, timeout=TIMEOUT)
    assert invoke.json()["explained"] is False
    missing = requests.post(f"{echo.http}/invocations?model_name=nope", json={"op": "x"}, timeout=TIMEOUT)
    assert missing.status_code == 404


def test_invocations_needs_a_model_name_when_several_are_loaded(tmp_path: Path) -> None:
    build_echo_archive(tmp_path, "one")
    build_echo_archive(tmp_path, "two")
    srv = MarinerServe(tmp_path, "one.mar,two.mar").start()
    try:
        resp = requests.post(f"{srv.http}/invocations", json={"op": "x"}, timeout=TIMEOUT)
        assert resp.status_code == 400
        assert "model_name is required" in resp.json()["message"]
        chosen = requests.post(f"{srv.http}/invocations?model_name=two", json={"op": "x"}, timeout=TIMEOUT)
        assert chosen.status_code == 200, chosen.text
    finally:
        srv.stop()


# -- the digits handler ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def digits(model_store: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[MarinerServe]:
    store = tmp_path_factory.mktemp("digits")
    names = ("digits_torchscript.mar", "digits_onnx.mar", "digits_int8_dynamic.mar")
    for name in names:
        current_digits_archive(model_store, name, store)
    srv = MarinerServe(store, ",".join(names)).start()
    try:
        yield srv
    finally:
        srv.stop()


def explain_digit(srv: MarinerServe, model: str, body: Any) -> requests.Response:
    return requests.post(f"{srv.http}/explanations/{model}", json=body, timeout=TIMEOUT)


def test_digits_explanation_is_a_saliency_map(digits: MarinerServe, eager_reference: Any) -> None:
    px = eager_reference.test_pixels[0]
    resp = explain_digit(digits, "digits_torchscript", px.tolist())
    assert resp.status_code == 200, resp.text
    answer = resp.json()
    expected_label = int(np.argmax(eager_reference.probabilities(px)[0]))
    assert (answer["label"], answer["target"], answer["method"]) == (
        expected_label,
        expected_label,
        "input_gradient",
    )
    saliency = np.asarray(answer["saliency"])
    assert saliency.shape == (8, 8)
    assert np.isfinite(saliency).all()
    assert np.abs(saliency).max() > 0
    other = explain_digit(
        digits, "digits_torchscript", {"data": px.tolist(), "target": (expected_label + 1) % 10}
    )
    assert other.json()["target"] == (expected_label + 1) % 10
    assert not np.allclose(np.asarray(other.json()["saliency"]), saliency)


@pytest.mark.parametrize(
    ("model", "variant"), [("digits_onnx", "onnx"), ("digits_int8_dynamic", "torchscript")]
)
def test_digits_variant_without_gradients_answers_501(
    digits: MarinerServe, eager_reference: Any, model: str, variant: str
) -> None:
    """ONNX has no autograd at all; the dynamic-int8 TorchScript's quantized linear has no backward."""
    px = eager_reference.test_pixels[0].tolist()
    resp = explain_digit(digits, model, px)
    assert resp.status_code == 501
    assert f"{variant} variant of this model cannot explain" in resp.json()["error"]
    assert requests.post(f"{digits.http}/predictions/{model}", json=px, timeout=TIMEOUT).status_code == 200
