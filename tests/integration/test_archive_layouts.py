"""A no-archive directory and a .tar.gz, as the real torch-model-archiver writes them, are served
like the .mar they were made from: at start-up, by register, and (the .tar.gz and the
directory) as stock TorchServe serves them."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from mariner.loadtest.servers import StockTorchServe
from tests.integration.rearchive import rearchive
from tests.mariner_serve import MarinerServe

pytestmark = pytest.mark.integration

BODIES = [json.dumps([float((i * 7 + k) % 17) for k in range(64)]) for i in range(3)]
HDR = {"Content-Type": "application/json"}


@pytest.fixture(scope="module")
def store(model_store: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("layouts")
    mar = model_store / "digits_torchscript.mar"
    shutil.copy(mar, d / "digits_torchscript.mar")
    rearchive(mar, d, "digits_dir", "no-archive")
    rearchive(mar, d, "digits_tgz", "tgz")
    assert (d / "digits_dir" / "MAR-INF" / "MANIFEST.json").is_file()
    return d


@pytest.fixture(scope="module")
def server(store: Path) -> Iterator[MarinerServe]:
    srv = MarinerServe(
        store,
        "mar=digits_torchscript.mar,dir=digits_dir,tgz=digits_tgz.tar.gz",
        enable_model_management=True,
    ).start()
    try:
        yield srv
    finally:
        srv.stop()


def predict(base: str, model: str, body: str) -> requests.Response:
    return requests.post(f"{base}/predictions/{model}", data=body, headers=HDR, timeout=60)


def answers(base: str, model: str) -> list[object]:
    out = []
    for body in BODIES:
        r = predict(base, model, body)
        assert r.status_code == 200, r.text
        out.append(r.json())
    return out


def test_directory_and_tgz_serve_at_start_up_as_the_mar(server: MarinerServe) -> None:
    assert server.all_ready, server.log_tail()
    expected = answers(server.http, "mar")
    assert answers(server.http, "dir") == expected
    assert answers(server.http, "tgz") == expected
    for model, archive in (("dir", "digits_dir"), ("tgz", "digits_tgz.tar.gz")):
        (desc,) = server.describe(model)
        assert desc["modelUrl"] == archive


def test_directory_and_tgz_register_over_rest(server: MarinerServe) -> None:
    expected = answers(server.http, "mar")
    for url, name in (("digits_dir", "dir_reg"), ("digits_tgz.tar.gz", "tgz_reg")):
        r = requests.post(
            f"{server.management}/models",
            params={"url": url, "model_name": name, "initial_workers": 1, "synchronous": "true"},
            timeout=300,
        )
        assert r.status_code == 200, r.text
        assert answers(server.http, name) == expected
    missing = requests.post(f"{server.management}/models", params={"url": "no_such_dir"}, timeout=30)
    assert missing.status_code == 404, missing.text


def test_a_directory_is_served_from_a_copy_not_the_store(server: MarinerServe, store: Path) -> None:
    """Editing the store's directory changes nothing served: a new worker loads the checked copy."""
    handler = store / "digits_dir" / "digits_handler.py"
    original = handler.read_bytes()
    handler.write_text("raise RuntimeError('edited in the store after it was loaded')\n")
    try:
        r = requests.put(
            f"{server.management}/models/dir", params={"min_worker": 2, "synchronous": "true"}, timeout=300
        )
        assert r.status_code == 200, r.text
        assert len(server.describe("dir")[0]["workers"]) == 2
        assert answers(server.http, "dir") == answers(server.http, "mar")
    finally:
        handler.write_bytes(original)


def test_stock_torchserve_answers_the_same_for_the_tgz_and_the_directory(
    server: MarinerServe, store: Path
) -> None:
    if shutil.which("java") is None:
        pytest.fail("stock TorchServe needs Java 17 on PATH: run `make java`")
    ours = {m: answers(server.http, m) for m in ("tgz", "dir")}
    with StockTorchServe(store, ["digits_torchscript"], batch_size=1) as ts:
        for url, name in (("digits_tgz.tar.gz", "tgz"), ("digits_dir", "dir")):
            r = requests.post(
                f"{ts.management_url}/models",
                params={"url": url, "model_name": name, "initial_workers": 1, "synchronous": "true"},
                timeout=300,
            )
            assert r.status_code == 200, r.text
            assert answers(ts.http_url, name) == ours[name]
