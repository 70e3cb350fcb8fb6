"""The default MiniLM archives of model_store/ (as `make models` built and verified them), linked
into a store of their own and served by Mariner on port 0: TorchServe HTTP (text/plain, JSON
list, a bad request), the Open Inference Protocol over REST and gRPC with BYTES tensors, and its
metadata from the archive's signature.

What is checked is what users get: unit-length 384-d vectors equal (within float rounding) to
the vectors the pipeline's verified eager handler computes, whichever variant answers.
"""

from __future__ import annotations

import json
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import requests
import yaml

from mariner.client.grpc_client import GrpcClient
from mariner.training.minilm import pipeline
from mariner.training.minilm.verify import load_handler
from mariner.training.text_data import sentences
from tests.conftest import FamilyStore, family_store
from tests.mariner_serve import MarinerServe

pytestmark = pytest.mark.integration

TIMEOUT = 120
DIM = 384


@pytest.fixture(scope="module")
def built(model_store: Path, tmp_path_factory: pytest.TempPathFactory) -> FamilyStore:
    return family_store(model_store, "minilm_", "minilm", tmp_path_factory.mktemp("minilm") / "store")


@pytest.fixture(scope="module")
def server(built: FamilyStore) -> Iterator[MarinerServe]:
    srv = MarinerServe(built.store, ",".join(f"minilm_{v}.mar" for v in pipeline.DEFAULT_VARIANTS)).start()
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def reference(built: FamilyStore, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The eager handler on its unpacked archive: the vectors the build verified."""
    unpacked = tmp_path_factory.mktemp("minilm_eager")
    with zipfile.ZipFile(built.store / "minilm_eager.mar") as mar:
        mar.extractall(unpacked)
    manifest = json.loads((unpacked / "MAR-INF" / "MANIFEST.json").read_text())
    config = yaml.safe_load((unpacked / "model-config.yaml").read_text())
    return load_handler(unpacked, manifest, config)


def test_the_store_holds_every_default_variant_verified(built: FamilyStore) -> None:
    by_model = {e["model"]: e for e in built.entries}
    assert {f"minilm_{v}" for v in pipeline.DEFAULT_VARIANTS} <= set(by_model)
    for entry in built.entries:
        assert (built.store / entry["file"]).stat().st_size == entry["bytes"]
        assert entry["verification"]["passed"] is True
        assert entry["version"] == "1.0"
    assert by_model["minilm_eager"]["verification"]["oracle_max_abs_diff"] <= 1e-5
    assert "| eager |" in built.report


@pytest.mark.parametrize("variant", pipeline.DEFAULT_VARIANTS)
def test_torchserve_http_answers_text_and_json_lists(
    server: MarinerServe, reference: Any, variant: str
) -> None:
    a, b = sentences("heldout")[:2]
    expect = reference.embed([a, b])
    tol = 0.05 if variant.startswith("int8") else 1e-4
    url = f"{server.http}/predictions/minilm_{variant}"
    one = requests.post(url, data=a.encode(), headers={"Content-Type": "text/plain"}, timeout=TIMEOUT)
    assert one.status_code == 200, one.text
    vec = np.asarray(one.json()["embedding"], dtype=np.float32)
    assert vec.shape == (DIM,)
    np.testing.assert_allclose(vec, expect[0], atol=tol)
    many = requests.post(url, json=[a, b], timeout=TIMEOUT)
    assert many.status_code == 200, many.text
    np.testing.assert_allclose(np.asarray(many.json()["embeddings"]), expect, atol=tol)


def test_bad_request_is_400_with_a_message(server: MarinerServe) -> None:
    url = f"{server.http}/predictions/minilm_eager"
    bad = requests.post(url, json=["fine", 7], timeout=TIMEOUT)
    assert bad.status_code == 400
    assert "text 1 must be a string" in bad.text
    empty = requests.post(url, data=b"  ", headers={"Content-Type": "text/plain"}, timeout=TIMEOUT)
    assert empty.status_code == 400
    assert "empty" in empty.text


def test_oip_rest_bytes_tensor_and_metadata(server: MarinerServe, reference: Any) -> None:
    texts = sentences("heldout")[2:5]
    meta = requests.get(f"{server.http}/v2/models/minilm_onnx", timeout=TIMEOUT).json()
    assert meta["inputs"] == [{"name": "text", "datatype": "BYTES", "shape": [-1]}]
    assert meta["outputs"] == [{"name": "embedding", "datatype": "FP32", "shape": [-1, DIM]}]
    body = {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [len(texts)], "data": texts}]}
    r = requests.post(f"{server.http}/v2/models/minilm_onnx/infer", data=json.dumps(body), timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    (out,) = r.json()["outputs"]
    assert out["name"] == "embedding"
    assert out["datatype"] == "FP32"
    assert out["shape"] == [len(texts), DIM]
    got = np.asarray(out["data"], dtype=np.float32).reshape(len(texts), DIM)
    np.testing.assert_allclose(got, reference.embed(texts), atol=1e-4)


def test_oip_grpc_bytes_tensor(server: MarinerServe, reference: Any) -> None:
    texts = sentences("heldout")[5:9]
    arr = np.array([t.encode() for t in texts], dtype=object)
    with GrpcClient(server.grpc_target, timeout_s=TIMEOUT) as client:
        out = client.infer("minilm_eager", {"text": arr})
    assert out["embedding"].shape == (len(texts), DIM)
    np.testing.assert_allclose(out["embedding"], reference.embed(texts), atol=1e-5)
