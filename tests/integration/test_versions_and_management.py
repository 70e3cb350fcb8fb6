"""Several versions of one model, a default version, and model management (off by default)."""

from __future__ import annotations

import json
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from tests.integration.mariner_inproc import InProcessMariner

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
def server(store: Path) -> Iterator[InProcessMariner]:
    srv = InProcessMariner(
        store, "digits=digits_v1.mar,digits=digits_v2.mar", enable_model_management=True
    ).start()
    try:
        yield srv
    finally:
        srv.stop()


def test_versions_are_addressable_and_the_first_is_the_default(server: InProcessMariner) -> None:
    base = f"{server.http}/predictions/digits"
    default = requests.post(base, data=BODY, headers=HDR, timeout=30)
    v1 = requests.post(f"{base}/1.0", data=BODY, headers=HDR, timeout=30)
    v2 = requests.post(f"{base}/2.0", data=BODY, headers=HDR, timeout=30)
    assert default.status_code == v1.status_code == v2.status_code == 200
    assert default.content == v1.content == v2.content  # same weights, three routes
    missing = requests.post(f"{base}/3.0", data=BODY, headers=HDR, timeout=30)
    assert missing.status_code == 404
    assert "1.0, 2.0" in missing.json()["message"]
    described = requests.get(f"{server.management}/models/digits/all", timeout=30).json()
    assert sorted(d["modelVersion"] for d in described) == ["1.0", "2.0"]


def test_management_takes_archives_from_the_store_only(server: InProcessMariner) -> None:
    mgmt = f"{server.management}/models"
    refused = requests.post(mgmt, params={"url": "https://example.com/evil.mar"}, timeout=30)
    assert refused.status_code == 403
    outside = requests.post(mgmt, params={"url": "../digits_v1.mar"}, timeout=30)
    assert outside.status_code == 403
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
    srv = InProcessMariner(store, "digits_v1.mar").start()
    try:
        r = requests.post(f"{srv.management}/models", params={"url": "extra.mar"}, timeout=30)
        assert r.status_code == 403
        assert "--enable-model-management" in r.json()["message"]
    finally:
        srv.stop()
