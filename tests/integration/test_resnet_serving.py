"""The default ResNet-18 archives of model_store/ (as `make models` built and verified them),
linked into a store of their own and served by Mariner on port 0: a JPEG as a raw body, as a
multipart file field and as an Open Inference Protocol BYTES tensor gets the same top-5 from
every variant; a preprocessed FP32 batch gets the JPEG's answer.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import requests

from mariner.client import GrpcClient
from mariner.server import protogen
from tests.conftest import FamilyStore, family_store
from tests.mariner_serve import MarinerServe

pytestmark = [pytest.mark.integration, pytest.mark.slow]

VARIANTS = ("eager", "torchscript", "onnx")
TIMEOUT_S = 120.0  # generous: a first batch on a loaded 2-core machine, never a verdict on speed


@pytest.fixture(scope="module")
def built(model_store: Path, tmp_path_factory: pytest.TempPathFactory) -> FamilyStore:
    return family_store(model_store, "resnet18_", "resnet", tmp_path_factory.mktemp("resnet") / "store")


@pytest.fixture(scope="module")
def server(built: FamilyStore) -> Iterator[MarinerServe]:
    protogen.generate()
    srv = MarinerServe(built.store, ",".join(f"resnet18_{v}.mar" for v in VARIANTS)).start()
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def jpeg() -> bytes:
    from mariner.training.image_data import encoded_set

    return encoded_set(1, seed=77)[0]


def _indices(answer: dict[str, Any]) -> list[int]:
    topk = answer["topk"]
    assert len(topk) == 5
    assert all(t["label"] == f"class_{t['index']:03d}" for t in topk)
    return [t["index"] for t in topk]


def test_the_store_holds_every_default_variant_verified(built: FamilyStore) -> None:
    models = {e["model"] for e in built.entries}
    assert {f"resnet18_{v}" for v in VARIANTS} <= models
    for entry in built.entries:
        assert (built.store / entry["file"]).stat().st_size == entry["bytes"]
        assert entry["verification"]["passed"] is True
    assert "PERFORMANCE workload" in built.report


def test_jpeg_raw_body_and_multipart_agree_across_variants(server: MarinerServe, jpeg: bytes) -> None:
    answers = []
    for variant in VARIANTS:
        url = f"{server.http}/predictions/resnet18_{variant}"
        raw = requests.post(url, data=jpeg, headers={"Content-Type": "image/jpeg"}, timeout=TIMEOUT_S)
        assert raw.status_code == 200, raw.text
        form = requests.post(url, files={"data": ("photo.jpg", jpeg, "image/jpeg")}, timeout=TIMEOUT_S)
        assert form.status_code == 200, form.text
        assert _indices(form.json()) == _indices(raw.json())
        answers.append(_indices(raw.json()))
    assert answers[1:] == answers[:1] * (len(VARIANTS) - 1)


def test_a_bad_image_is_a_400_for_that_request(server: MarinerServe, jpeg: bytes) -> None:
    url = f"{server.http}/predictions/resnet18_onnx"
    bad = requests.post(
        url, data=jpeg[: len(jpeg) // 3], headers={"Content-Type": "image/jpeg"}, timeout=TIMEOUT_S
    )
    assert bad.status_code == 400
    assert "could not be decoded" in bad.text
    good = requests.post(url, data=jpeg, headers={"Content-Type": "image/jpeg"}, timeout=TIMEOUT_S)
    assert good.status_code == 200


def test_oip_bytes_tensor_matches_the_raw_body(server: MarinerServe, jpeg: bytes) -> None:
    url = f"{server.http}/predictions/resnet18_torchscript"
    expected = _indices(
        requests.post(url, data=jpeg, headers={"Content-Type": "image/jpeg"}, timeout=TIMEOUT_S).json()
    )
    with GrpcClient(server.grpc_target, timeout_s=TIMEOUT_S) as client:
        out = client.infer("resnet18_torchscript", {"image": np.array([jpeg, jpeg], dtype=object)})
    assert out["probabilities"].shape == (2, 5)
    assert out["indices"].shape == (2, 5)
    assert out["indices"][0].tolist() == expected
    assert out["indices"][1].tolist() == expected
    assert np.all(np.diff(out["probabilities"][0]) <= 0)


def test_oip_fp32_pixels_match_the_encoded_image(server: MarinerServe, jpeg: bytes) -> None:
    """The optional FP32 input: a client that preprocesses itself (the handler's own resize, crop
    and normalisation) gets the same top-5 as for the JPEG; both forms in one request are refused."""
    from mariner.handlers.resnet_image import preprocess

    pixels = preprocess([jpeg]).numpy()
    url = f"{server.http}/v2/models/resnet18_torchscript/infer"
    body = {"inputs": [{"name": "pixels", "datatype": "FP32", "shape": list(pixels.shape),
                        "data": pixels.ravel().tolist()}]}  # fmt: skip
    answer = requests.post(url, json=body, timeout=TIMEOUT_S)
    assert answer.status_code == 200, answer.text
    got = {o["name"]: o for o in answer.json()["outputs"]}
    with GrpcClient(server.grpc_target, timeout_s=TIMEOUT_S) as client:
        from_bytes = client.infer("resnet18_torchscript", {"image": np.array([jpeg], dtype=object)})
    assert got["indices"]["data"] == from_bytes["indices"][0].tolist()
    image = {"name": "image", "datatype": "BYTES", "shape": [1], "data": ["x"]}
    both = {"inputs": [body["inputs"][0], image]}
    refused = requests.post(url, json=both, timeout=TIMEOUT_S)
    assert refused.status_code == 400
    none = requests.post(url, json={"inputs": []}, timeout=TIMEOUT_S)
    assert none.status_code == 400
