"""KServe's v1 REST protocol against a live Mariner: by hand, then with KServe's own Python SDK.

The SDK runs in its own virtualenv (.venv-kserve, made by scripts/ensure_kserve_venv.sh) in a
subprocess (kserve_conformance.py): it pins its own fastapi/pydantic/protobuf stack. Each of its
checks is asserted here as its own test, so a failure names what KServe users would see break.
Answers are compared with /predictions and /explanations on the same server, so v1 is proven to
be the same handler call, wrapped as TorchServe's kserve envelope wraps it.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import requests

from tests.mariner_serve import MarinerServe

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
KSERVE_PYTHON = REPO / ".venv-kserve" / "bin" / "python"
ENSURE_SCRIPT = REPO / "scripts" / "ensure_kserve_venv.sh"
SCRIPT = Path(__file__).with_name("kserve_conformance.py")
MODEL = "digits_torchscript"
ONNX = "digits_onnx"
TIMEOUT = 60
N_ROWS = 4


@pytest.fixture(scope="module")
def server(shared_current_digits: MarinerServe) -> MarinerServe:
    """The session's shared server (tests/integration/conftest.py): MODEL and ONNX with this
    tree's digits handler (`current_digits_archive`). These tests only send requests, and count
    metrics as a difference they measure."""
    return shared_current_digits.alive()


@pytest.fixture(scope="module")
def rows(eager_reference: Any) -> list[list[float]]:
    return [r.tolist() for r in eager_reference.test_pixels[:N_ROWS]]


def v1(srv: MarinerServe, path: str, body: Any = None, **kw: Any) -> requests.Response:
    if body is None and "data" not in kw:
        return requests.get(f"{srv.http}{path}", timeout=TIMEOUT)
    return requests.post(f"{srv.http}{path}", json=body, timeout=TIMEOUT, **kw)


def assert_error(resp: requests.Response, status: int, fragment: str) -> None:
    assert resp.status_code == status, resp.text
    assert resp.headers["content-type"] == "application/json"
    body = resp.json()
    assert set(body) == {"error"}, body
    assert fragment in body["error"], body


# -- by hand ------------------------------------------------------------------------------------
def test_models_list_readiness_and_liveness(server: MarinerServe) -> None:
    assert v1(server, "/v1/models").json() == {"models": sorted([MODEL, ONNX])}
    assert v1(server, f"/v1/models/{MODEL}").json() == {"name": MODEL, "ready": True}
    assert v1(server, "/").json() == {"status": "alive"}
    assert_error(v1(server, "/v1/models/nope"), 404, "nope")


def test_predict_answers_what_predictions_answers(server: MarinerServe, rows: list[list[float]]) -> None:
    # An instance that is a list arrives as {"body": list}; an object is the handler's row itself.
    instances: list[Any] = [rows[0], {"data": rows[1]}, rows[2]]
    resp = v1(server, f"/v1/models/{MODEL}:predict", {"instances": instances})
    assert resp.status_code == 200, resp.text
    predictions = resp.json()["predictions"]
    expected = [
        requests.post(f"{server.http}/predictions/{MODEL}", json=r, timeout=TIMEOUT).json() for r in rows[:3]
    ]
    assert predictions == expected


def test_explain_answers_what_explanations_answers(server: MarinerServe, rows: list[list[float]]) -> None:
    resp = v1(server, f"/v1/models/{MODEL}:explain", {"instances": [rows[0], {"data": rows[1], "target": 4}]})
    assert resp.status_code == 200, resp.text
    explanations = resp.json()["explanations"]
    direct = requests.post(f"{server.http}/explanations/{MODEL}", json=rows[0], timeout=TIMEOUT).json()
    assert explanations[0] == direct
    assert explanations[1]["target"] == 4
    assert np.asarray(explanations[1]["saliency"]).shape == (8, 8)


def test_errors_have_kserve_shape_and_status(server: MarinerServe, rows: list[list[float]]) -> None:
    path = f"/v1/models/{MODEL}:predict"
    assert_error(v1(server, path, data=b"{not json"), 400, "not valid JSON")
    assert_error(v1(server, path, {"inputs": rows}), 400, '{"instances": [...]}')
    assert_error(v1(server, path, {"instances": []}), 400, "at least one instance")
    assert_error(v1(server, path, {"instances": [rows[0]] * 1025}), 400, "at most 1024")
    # One bad instance fails the call with the handler's own message (v1 has no per-item error).
    assert_error(
        v1(server, path, {"instances": [rows[0], [99.0] * 64]}), 400, "pixel intensities must be in [0, 16]"
    )
    assert_error(v1(server, "/v1/models/nope:predict", {"instances": rows}), 404, "nope")
    assert_error(v1(server, f"/v1/models/{ONNX}:explain", {"instances": rows[:1]}), 501, "cannot explain")


def test_v1_calls_are_counted_under_their_own_protocol(server: MarinerServe, rows: list[list[float]]) -> None:
    def count() -> float:
        text = requests.get(f"{server.metrics}/metrics", timeout=TIMEOUT).text
        wanted = ('protocol="kserve-v1-http"', f'model="{MODEL}"', 'code="200"')
        return sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("mariner_requests_total{") and all(w in line for w in wanted)
        )

    before = count()
    assert v1(server, f"/v1/models/{MODEL}:predict", {"instances": rows[:2]}).status_code == 200
    assert count() == before + 1  # one call, however many instances


# -- KServe's SDK -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def report(
    server: MarinerServe, eager_reference: Any, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Any]:
    if not KSERVE_PYTHON.is_file():
        pytest.fail(f".venv-kserve is missing: run `bash {ENSURE_SCRIPT.relative_to(REPO)}`")
    pin = re.search(r"^SPEC='([^']+)'", ENSURE_SCRIPT.read_text(), re.MULTILINE)
    stamp = KSERVE_PYTHON.parents[1] / ".installed-stamp"
    if pin is None or not stamp.is_file() or stamp.read_text().strip() != pin[1]:
        pytest.fail(f".venv-kserve is not at the pinned kserve: run `bash {ENSURE_SCRIPT.relative_to(REPO)}`")
    data = tmp_path_factory.mktemp("kserve-sdk") / "pixels.npz"
    np.savez(data, pixels=eager_reference.test_pixels[:N_ROWS].astype(np.float32))
    done = subprocess.run(
        [str(KSERVE_PYTHON), str(SCRIPT), "--url", server.http, "--model", MODEL, "--data", str(data)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_sdk_v1_liveness_and_readiness(report: dict[str, Any]) -> None:
    assert report["live"] is True
    assert report["ready"] is True
    assert report["ready_unknown"]["status"] == 404


def test_sdk_v1_predict_matches_the_eager_model(report: dict[str, Any], eager_reference: Any) -> None:
    labels = [p["label"] for p in report["predict"]["predictions"]]
    expected = eager_reference.probabilities(eager_reference.test_pixels[:N_ROWS]).argmax(axis=1)
    assert labels == expected.tolist()


def test_sdk_v1_explain(report: dict[str, Any]) -> None:
    explanations = report["explain"]["explanations"]
    assert len(explanations) == 2
    assert all(np.asarray(e["saliency"]).shape == (8, 8) for e in explanations)


def test_sdk_v1_errors_carry_the_server_message(report: dict[str, Any]) -> None:
    assert report["predict_bad"]["status"] == 400
    assert "pixel intensities must be in [0, 16]" in report["predict_bad"]["raised"]
    assert report["predict_unknown"]["status"] == 404


def test_sdk_v2_infer_and_readiness(report: dict[str, Any], eager_reference: Any) -> None:
    assert report["v2_ready"] is True
    probabilities = np.asarray(report["v2_infer"]["probabilities"])
    expected = eager_reference.probabilities(eager_reference.test_pixels[:N_ROWS])
    np.testing.assert_allclose(probabilities, expected, atol=1e-4)
