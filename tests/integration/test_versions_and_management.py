"""Several versions of one model, a default version, and model management (off by default)."""

from __future__ import annotations

import json
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import requests

from tests.mariner_serve import MarinerServe

pytestmark = pytest.mark.integration

BODY = json.dumps([4.0] * 64)
HDR = {"Content-Type": "application/json"}


def with_version(src: Path, dst: Path, version: str) -> Path:
    """A copy of an archive whose manifest says `version`."""
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w") as zout:
        for item in zin.infolist():
            data = zin.read(item)
            if item.filename == "MAR-INF/MANIFEST.json":
                manifest = json.loads(data)
                manifest["model"]["modelVersion"] = version
                data = json.dumps(manifest).encode()
            zout.writestr(item, data)
    return dst


@pytest.fixture(scope="module")
def store(model_store: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("versions")
    with_version(model_store / "digits_onnx.mar", d / "digits_v1.mar", "1.0")
    with_version(model_store / "digits_onnx.mar", d / "digits_v2.mar", "2.0")
    with_version(model_store / "digits_torchscript.mar", d / "extra.mar", "1.0")
    return d


@pytest.fixture(scope="module")
def server(store: Path) -> Iterator[MarinerServe]:
    srv = MarinerServe(
        store,
        "digits=digits_v1.mar,digits=digits_v2.mar",
        enable_model_management=True,
        job_queue_size=None,  # the server's own default: TorchServe's 100
    ).start()
    try:
        yield srv
    finally:
        srv.stop()


def test_versions_are_addressable_and_the_first_is_the_default(server: MarinerServe) -> None:
    base = f"{server.http}/predictions/digits"
    default = requests.post(base, data=BODY, headers=HDR, timeout=30)
    v1 = requests.post(f"{base}/1.0", data=BODY, headers=HDR, timeout=30)
    v2 = requests.post(f"{base}/2.0", data=BODY, headers=HDR, timeout=30)
    assert default.status_code == v1.status_code == v2.status_code == 200
    assert default.content == v1.content == v2.content  # same weights, three routes
    missing = requests.post(f"{base}/3.0", data=BODY, headers=HDR, timeout=30)
    assert (missing.status_code, missing.json()) == (  # stock TorchServe's answer on its endpoint
        404,
        {
            "code": 404,
            "type": "ModelVersionNotFoundException",
            "message": "Model version: 3.0 does not exist for model: digits",
        },
    )
    oip = requests.get(f"{server.http}/v2/models/digits/versions/3.0", timeout=30)
    assert oip.status_code == 404
    assert "1.0, 2.0" in oip.json()["error"]  # ours, elsewhere: it names what is served
    described = requests.get(f"{server.management}/models/digits/all", timeout=30).json()
    assert sorted(d["modelVersion"] for d in described) == ["1.0", "2.0"]


def test_management_takes_archives_from_the_store_only(server: MarinerServe) -> None:
    mgmt = f"{server.management}/models"
    # TorchServe's answers: a URL no allowed_urls pattern matches, and '..' in url, are 404
    # ModelNotFoundException; Mariner allows no URL and never reads outside the store.
    refused = requests.post(mgmt, params={"url": "https://example.com/evil.mar"}, timeout=30)
    assert (refused.status_code, refused.json()["type"]) == (404, "ModelNotFoundException")
    assert (
        refused.json()["message"]
        == "Given URL https://example.com/evil.mar does not match any allowed URL(s)"
    )
    outside = requests.post(mgmt, params={"url": "../digits_v1.mar"}, timeout=30)
    assert outside.status_code == 404
    assert outside.json()["message"] == "Relative path is not allowed in url: ../digits_v1.mar"
    empty = requests.post(mgmt, params={"url": ""}, timeout=30)
    assert (empty.status_code, empty.json()["message"]) == (404, "empty url")
    added = requests.post(mgmt, params={"url": "extra.mar", "model_name": "extra"}, timeout=120)
    assert added.status_code == 200, added.text
    assert (
        requests.post(f"{server.http}/predictions/extra", data=BODY, headers=HDR, timeout=30).status_code
        == 200
    )
    removed = requests.delete(f"{mgmt}/extra", timeout=60)
    assert removed.status_code == 200, removed.text
    assert (
        requests.post(f"{server.http}/predictions/extra", data=BODY, headers=HDR, timeout=30).status_code
        == 404
    )


def test_management_is_refused_when_not_enabled(store: Path) -> None:
    """TorchServe's answer while its model API is off: 405 for register and unregister."""
    srv = MarinerServe(store, "digits_v1.mar").start()
    try:
        r = requests.post(f"{srv.management}/models", params={"url": "extra.mar"}, timeout=30)
        assert r.status_code == 405
        assert r.json()["type"] == "MethodNotAllowedException"
        assert "--enable-model-management" in srv.log_text()
        (served,) = requests.get(f"{srv.management}/models", timeout=30).json()["models"]
        gone = requests.delete(f"{srv.management}/models/{served['modelName']}", timeout=30)
        assert gone.status_code == 405
        url = f"{srv.http}/predictions/{served['modelName']}"
        assert requests.post(url, data=BODY, headers=HDR, timeout=30).status_code == 200  # still served
    finally:
        srv.stop()


def grpc_management(server: MarinerServe, call: str, **fields: Any) -> Any:
    """One TorchServe gRPC management call; returns its `msg`, parsed when it is JSON."""
    from mariner.server._proto.torchserve import management_pb2, management_pb2_grpc

    request = getattr(management_pb2, f"{call}Request")(**fields)
    with grpc.insecure_channel(server.grpc_management_target) as channel:
        stub = management_pb2_grpc.ManagementAPIsServiceStub(channel)
        msg = getattr(stub, call)(request, timeout=120).msg
    try:
        return json.loads(msg)
    except json.JSONDecodeError:
        return msg


def without_memory(doc: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The document less each worker's memoryUsage (the process's RSS moves between two calls),
    after checking it is a real, positive byte count and the pid is a worker process of this
    (in-process) server."""
    import psutil

    workers = {
        child.pid
        for child in psutil.Process().children(recursive=True)
        if "mariner.server.worker.main" in " ".join(child.cmdline())
    }
    for entry in doc:
        for worker in entry["workers"]:
            memory = worker.pop("memoryUsage")
            assert isinstance(memory, int)
            assert memory > 0
            assert worker["pid"] in workers
    return doc


def test_rest_and_grpc_describe_and_list_the_same(server: MarinerServe) -> None:
    rest = requests.get(f"{server.management}/models/digits/all", timeout=30).json()
    over_grpc = grpc_management(server, "DescribeModel", model_name="digits", model_version="all")
    assert without_memory(rest) == without_memory(over_grpc)
    assert [(e["modelVersion"], e["loadedAtStartup"]) for e in rest] == [("1.0", True), ("2.0", True)]
    entry = rest[0]
    # The archive's model-config (batchSize 32, maxBatchDelay 5, responseTimeout 30) is what serves.
    assert (entry["batchSize"], entry["maxBatchDelay"], entry["responseTimeout"]) == (32, 5, 30)
    assert entry["jobQueueStatus"] == {"remainingCapacity": 100, "pendingRequests": 0}  # job_queue_size
    assert entry["workers"][0]["status"] == "READY"
    assert "startTime" in entry["workers"][0]
    listed = requests.get(f"{server.management}/models", timeout=30).json()
    assert listed == grpc_management(server, "ListModels")
    assert listed == {"models": [{"modelName": "digits", "modelUrl": "digits_v1.mar"}]}


def test_a_model_registered_over_grpc_is_described_as_registered_with_its_settings(
    server: MarinerServe,
) -> None:
    answer = grpc_management(
        server, "RegisterModel", url="extra.mar", model_name="late", batch_size=4, response_timeout=9
    )
    assert answer == 'Model "late" Version: 1.0 registered with 1 initial workers'
    try:
        rest = requests.get(f"{server.management}/models/late", timeout=30).json()
        assert without_memory(rest) == without_memory(
            grpc_management(server, "DescribeModel", model_name="late")
        )
        (entry,) = rest
        assert entry["loadedAtStartup"] is False
        # the call's values over the archive's (batchSize 32, responseTimeout 30); the rest from it
        assert (entry["batchSize"], entry["responseTimeout"], entry["maxBatchDelay"]) == (4, 9, 5)
    finally:
        requests.delete(f"{server.management}/models/late", timeout=60)


def test_a_register_value_torchserve_ignores_is_ignored_with_one_warning(server: MarinerServe) -> None:
    """TorchServe registers `batch_size=lots` (a value that is no number is "not given"): so does
    Mariner, with the archive's batchSize, and says once in its log what it ignored."""
    mgmt = f"{server.management}/models"
    odd = requests.post(
        mgmt,
        params={"url": "extra.mar", "model_name": "extra", "batch_size": "lots", "initial_workers": "1"},
        timeout=120,
    )
    try:
        assert odd.status_code == 200, odd.text
        (entry,) = requests.get(f"{mgmt}/extra", timeout=30).json()
        assert entry["batchSize"] == 32  # the archive's (its model-config says 32)
        warned = [line for line in server.log_text().splitlines() if "batch_size='lots'" in line]
        assert len(warned) == 1, warned
        assert "batchSize" in warned[0]
    finally:
        requests.delete(f"{mgmt}/extra", timeout=60)
