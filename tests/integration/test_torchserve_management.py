"""TorchServe's management semantics on a real `mariner serve` started as TorchServe's harness
starts it: no `--models` (so no model), no `default_workers_per_model`, a model store of
symlinks (marsgen's layout and a Kubernetes ConfigMap volume's), model management on.

* No model at start is no model, and the server is ready (TorchServe's /ping).
* A register without a worker count registers the model with none and answers 200 at once,
  `synchronous=false` too; calls to it get TorchServe's 503; scale adds and removes workers, to 0
  and back; a negative count is TorchServe's 500 and changes nothing.
* `handler=` replaces the manifest's: one that does not load registers (no worker) and fails
  the workers a scale or `initial_workers` asks for with TorchServe's 500.
* `startup_timeout=0` gives workers no time to start; values TorchServe ignores are ignored.
* Paths may end in a slash; symlinked store entries are served under their own names.
One server for the module: the tests only send requests (each cleans up what it registers).
"""

from __future__ import annotations

import json
import os
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
import yaml

from tests.integration.test_versions_and_management import grpc_management
from tests.mariner_serve import MarinerServe

pytestmark = pytest.mark.integration

BODY = json.dumps([4.0] * 64)
HDR = {"Content-Type": "application/json"}
NO_WORKER_YET = "registered with 0 initial workers. Use scale workers API to add workers for the model."


def without_worker_counts(src: Path, dst: Path) -> Path:
    """A copy of an archive whose model-config names no worker count (as TorchServe's examples'
    archives), so the server's and the register call's counts decide."""
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w") as zout:
        for item in zin.infolist():
            data = zin.read(item)
            if item.filename == "model-config.yaml":
                config = {
                    k: v for k, v in yaml.safe_load(data).items() if k not in ("minWorkers", "maxWorkers")
                }
                data = yaml.safe_dump(config).encode()
            zout.writestr(item, data)
    return dst


@pytest.fixture(scope="module")
def store(model_store: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("linked")
    store = root / "store"
    (store / "..2026_01_01_00_00_00.1").mkdir(parents=True)
    # marsgen's layout: an entry that is a symlink to the archive built elsewhere
    (store / "digits.mar").symlink_to(
        without_worker_counts(model_store / "digits_onnx.mar", root / "built.mar")
    )
    # a ConfigMap volume's layout: entry -> ..data/entry, ..data -> the timestamped directory
    os.link(model_store / "digits_torchscript.mar", store / "..2026_01_01_00_00_00.1" / "cm.mar")
    (store / "..data").symlink_to("..2026_01_01_00_00_00.1")
    (store / "cm.mar").symlink_to("..data/cm.mar")
    return store


@pytest.fixture(scope="module")
def server(store: Path) -> Iterator[MarinerServe]:
    srv = MarinerServe(store, "", enable_model_management=True, default_workers_per_model=None).start()
    try:
        yield srv
    finally:
        srv.stop()


def _register(srv: MarinerServe, **params: str) -> requests.Response:
    return requests.post(f"{srv.management}/models", params=params, timeout=180)


def _described(srv: MarinerServe, model: str) -> dict[str, Any]:
    (entry,) = requests.get(f"{srv.management}/models/{model}", timeout=30).json()
    return entry


def _predict(srv: MarinerServe, model: str) -> requests.Response:
    return requests.post(f"{srv.http}/predictions/{model}", data=BODY, headers=HDR, timeout=60)


def _ping(srv: MarinerServe) -> tuple[int, int]:
    return (
        requests.get(f"{srv.management}/ping", timeout=30).status_code,
        requests.get(f"{srv.http}/ping", timeout=30).status_code,
    )


def test_no_models_means_none_loaded_and_a_ready_server(server: MarinerServe) -> None:
    assert requests.get(f"{server.management}/models", timeout=30).json() == {"models": []}
    assert _ping(server) == (200, 200)


def test_a_register_without_workers_answers_at_once_and_scales_to_zero_and_back(server: MarinerServe) -> None:
    mgmt = f"{server.management}/models"
    r = _register(server, url="digits.mar", model_name="lazy", synchronous="false")
    try:
        assert (r.status_code, r.json()) == (200, {"status": f'Model "lazy" Version: 1.0 {NO_WORKER_YET}'})
        entry = _described(server, "lazy")
        assert (entry["minWorkers"], entry["workers"], entry["modelUrl"]) == (0, [], "digits.mar")
        assert entry["mariner"]["state"] == "NO_WORKERS"
        answer = _predict(server, "lazy")
        assert (answer.status_code, answer.json()["type"]) == (503, "ServiceUnavailableException")
        assert "has no worker" in answer.json()["message"]
        assert _ping(server) == (200, 200), "a model asked for with no worker leaves the server ready"

        up = requests.put(f"{mgmt}/lazy?min_worker=1&synchronous=true", timeout=180)
        assert (up.status_code, up.json()) == (200, {"status": "Workers scaled to 1 for model: lazy"})
        assert _predict(server, "lazy").status_code == 200
        negative = requests.put(f"{mgmt}/lazy?min_worker=-1", timeout=30)
        assert (negative.status_code, negative.json()["type"]) == (500, "InternalServerException")
        assert len(_described(server, "lazy")["workers"]) == 1, "a refused scale changes nothing"

        down = requests.put(f"{mgmt}/lazy?min_worker=0&synchronous=true", timeout=180)
        assert (down.status_code, down.json()) == (200, {"status": "Workers scaled to 0 for model: lazy"})
        assert _described(server, "lazy")["workers"] == []
        assert _predict(server, "lazy").status_code == 503
        assert _ping(server) == (200, 200)
    finally:
        gone = requests.delete(f"{mgmt}/lazy/?synchronous=true&timeout=true", timeout=60)  # a trailing '/'
        assert gone.status_code == 200, gone.text


def test_grpc_register_without_workers_registers_none(server: MarinerServe) -> None:
    try:
        answer = grpc_management(server, "RegisterModel", url="digits.mar", model_name="lazy_grpc")
        assert answer == f'Model "lazy_grpc" Version: 1.0 {NO_WORKER_YET}'
        assert _described(server, "lazy_grpc")["workers"] == []
    finally:
        requests.delete(f"{server.management}/models/lazy_grpc", timeout=60)


def test_a_configmap_style_symlinked_entry_is_served_under_its_own_name(server: MarinerServe) -> None:
    r = _register(server, url="cm.mar", initial_workers="1")
    try:
        assert r.status_code == 200, r.text
        assert r.json() == {
            "status": 'Model "digits_torchscript" Version: 1.0 registered with 1 initial workers'
        }
        assert _described(server, "digits_torchscript")["modelUrl"] == "cm.mar"
        assert _predict(server, "digits_torchscript").status_code == 200
    finally:
        requests.delete(f"{server.management}/models/digits_torchscript", timeout=60)


def test_a_handler_that_does_not_load_registers_and_fails_its_workers(server: MarinerServe) -> None:
    mgmt = f"{server.management}/models"
    r = _register(server, url="digits.mar", model_name="nh", handler="nehandler")
    try:
        assert r.status_code == 200, r.text
        assert _described(server, "nh")["mariner"]["handler"] == "nehandler"
        scale = requests.put(f"{mgmt}/nh?min_worker=1&synchronous=true", timeout=180)
        assert (scale.status_code, scale.json()["type"]) == (500, "InternalServerException"), scale.text
        assert scale.json()["message"].startswith("Failed to start workers for model nh version: 1.0")
    finally:
        assert requests.delete(f"{mgmt}/nh", timeout=60).status_code == 200
    started = _register(server, url="digits.mar", model_name="nh", handler="nehandler", initial_workers="1")
    assert (started.status_code, started.json()["type"]) == (500, "InternalServerException"), started.text
    assert requests.get(f"{mgmt}/nh", timeout=30).status_code == 404, "nothing of it is left"
    outside = _register(server, url="digits.mar", model_name="nh", handler="../../evil.py")
    assert outside.status_code == 400, outside.text  # the manifest's own rule: never out of the archive


def test_startup_timeout_zero_gives_workers_no_time(server: MarinerServe) -> None:
    mgmt = f"{server.management}/models"
    r = _register(server, url="digits.mar", model_name="st", startup_timeout="0", initial_workers="1")
    assert (r.status_code, r.json()["type"]) == (500, "InternalServerException"), r.text
    assert requests.get(f"{mgmt}/st", timeout=30).status_code == 404
    r = _register(server, url="digits.mar", model_name="st", startup_timeout="0")
    try:
        assert r.status_code == 200, r.text
        assert _described(server, "st")["startupTimeout"] == 0
    finally:
        requests.delete(f"{mgmt}/st", timeout=60)


def test_values_torchserve_ignores_register_the_model(server: MarinerServe) -> None:
    r = _register(
        server,
        url="digits.mar",
        model_name="odd",
        batch_size="dd",
        max_batch_delay="junk",
        initial_workers="-1",
    )
    try:
        assert (r.status_code, r.json()) == (200, {"status": f'Model "odd" Version: 1.0 {NO_WORKER_YET}'})
        entry = _described(server, "odd")
        assert (entry["batchSize"], entry["maxBatchDelay"], entry["workers"]) == (32, 5, [])  # the archive's
        for said in ("batch_size='dd'", "max_batch_delay='junk'", "initial_workers='-1'"):
            assert sum(said in line for line in server.log_text().splitlines()) == 1, said
    finally:
        requests.delete(f"{server.management}/models/odd", timeout=60)
