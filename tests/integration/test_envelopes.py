"""TorchServe's service envelopes (`service_envelope=kserve | kservev2`) against a live server.

With an envelope, TorchServe hands the request body to the envelope as its backend decodes it (a
dict for JSON, bytes otherwise), the envelope unwraps it for the handler and wraps the answer,
and the frontend sends that answer as it is: on /predictions, on KServe v1's `:predict` /
`:explain` and, for kservev2, on the Open Inference Protocol's `/v2/models/{m}/infer`.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import requests

from tests.integration.fault_archive import write_handler_archive
from tests.mariner_serve import MarinerServe

pytestmark = pytest.mark.integration

TIMEOUT = 60

HANDLER = """
class EnvelopeProbe:
    def initialize(self, context):
        pass

    def handle(self, data, context):
        explain = context.get_request_header(0, "explain")
        if data and isinstance(data[0], dict) and "datatype" in data[0]:  # kservev2: one per input
            return [[2 * v for v in item["data"]] for item in data]
        return [{"row": row, "explain": explain} for row in data]  # kserve: one per instance
"""

CONFIG = "minWorkers: 1\nmaxWorkers: 1\nbatchSize: 1\nmaxBatchDelay: 0\n"


def served(tmp_path_factory: pytest.TempPathFactory, envelope: str) -> Iterator[MarinerServe]:
    store = tmp_path_factory.mktemp(envelope)
    files = {"probe.py": HANDLER, "model-config.yaml": CONFIG}
    write_handler_archive(store / "probe.mar", "probe", "probe.py", files)
    srv = MarinerServe(store, "probe.mar", service_envelope=envelope).start()
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def kserve(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MarinerServe]:
    yield from served(tmp_path_factory, "kserve")


@pytest.fixture(scope="module")
def kservev2(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MarinerServe]:
    yield from served(tmp_path_factory, "kservev2")


INSTANCES = {"instances": [{"data": "first"}, {"data": "second"}]}


def test_kserve_v1_predict_and_explain_go_through_the_envelope(kserve: MarinerServe) -> None:
    predicted = requests.post(f"{kserve.http}/v1/models/probe:predict", json=INSTANCES, timeout=TIMEOUT)
    assert predicted.status_code == 200, predicted.text
    # The envelope's own answer, once (not wrapped again by the route).
    assert predicted.json() == {
        "predictions": [
            {"row": {"data": "first"}, "explain": "False"},
            {"row": {"data": "second"}, "explain": "False"},
        ]
    }
    explained = requests.post(f"{kserve.http}/v1/models/probe:explain", json=INSTANCES, timeout=TIMEOUT)
    assert explained.status_code == 200, explained.text
    assert explained.json() == {
        "explanations": [
            {"row": {"data": "first"}, "explain": "True"},
            {"row": {"data": "second"}, "explain": "True"},
        ]
    }


def test_the_envelope_gets_the_body_as_torchserves_backend_decodes_it(kserve: MarinerServe) -> None:
    import json

    as_json = requests.post(f"{kserve.http}/predictions/probe", json=INSTANCES, timeout=TIMEOUT)
    raw = requests.post(
        f"{kserve.http}/predictions/probe",
        data=json.dumps(INSTANCES).encode(),
        headers={"content-type": "application/octet-stream"},  # bytes: the envelope parses them
        timeout=TIMEOUT,
    )
    assert as_json.status_code == raw.status_code == 200
    assert (
        as_json.json()
        == raw.json()
        == {
            "predictions": [
                {"row": {"data": "first"}, "explain": "False"},
                {"row": {"data": "second"}, "explain": "False"},
            ]
        }
    )


def test_an_unknown_model_is_still_kserves_404(kserve: MarinerServe) -> None:
    resp = requests.post(f"{kserve.http}/v1/models/nope:predict", json=INSTANCES, timeout=TIMEOUT)
    assert resp.status_code == 404


def test_kservev2_infer_goes_through_the_envelope(kservev2: MarinerServe) -> None:
    body = {
        "id": "req-7",
        "inputs": [{"name": "input-0", "shape": [3], "datatype": "INT64", "data": [1, 2, 3]}],
    }
    resp = requests.post(f"{kservev2.http}/v2/models/probe/infer", json=body, timeout=TIMEOUT)
    assert resp.status_code == 200, resp.text
    assert resp.json() == {
        "id": "req-7",
        "model_name": "probe",
        "model_version": "1.0",
        "outputs": [{"name": "input-0", "datatype": "INT64", "data": [2, 4, 6], "shape": [3]}],
    }
    versioned = requests.post(
        f"{kservev2.http}/v2/models/probe/versions/1.0/infer", json=body, timeout=TIMEOUT
    )
    assert versioned.json() == resp.json()
