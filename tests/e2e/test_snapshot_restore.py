"""TorchServe's config snapshots from `mariner serve` started as TorchServe is (flags only, no
config file): a startup snapshot, one after each management change, a shutdown one at SIGTERM,
all under `$LOG_LOCATION/config` (0700, files 0600); the next start without a config file
restores the newest one (its models and their workers, in place of `--models`), and `--ncs`
starts without it."""

from __future__ import annotations

import json
import os
import signal
import stat
from pathlib import Path
from typing import Any

import pytest
import requests

from mariner.server.compat.torchserve.java_properties import read_properties
from tests.e2e.serve_process import ServeProcess

pytestmark = pytest.mark.e2e

BODY = json.dumps([4.0] * 64)
HDR = {"Content-Type": "application/json"}


def _snapshots(config_dir: Path, kind: str) -> list[Path]:
    return sorted(config_dir.glob(f"*-{kind}.cfg"))


def _models(snapshot: Path) -> dict[str, Any]:
    return json.loads(read_properties(snapshot.read_text())["model_snapshot"])["models"]


def _stop(srv: ServeProcess) -> None:
    """SIGTERM (a clean stop, which writes the shutdown snapshot) and wait for the exit."""
    os.kill(srv.proc.pid, signal.SIGTERM)
    assert srv.proc.wait(120) == 0
    srv.kill()


def _workers(srv: ServeProcess, model: str) -> int:
    r = requests.get(f"{srv.url('mgmt')}/models/{model}", timeout=30)
    assert r.status_code == 200, r.text
    return len(r.json()[0]["workers"])


def test_snapshots_are_written_and_the_newest_is_restored(model_store: Path, tmp_path: Path) -> None:
    store = tmp_path / "store"
    store.mkdir()
    for name in ("digits_onnx.mar", "digits_torchscript.mar"):
        os.link(model_store / name, store / name)
    config_dir = tmp_path / "logs" / "config"  # ServeProcess's LOG_LOCATION is beside its log
    first = ServeProcess(store, "digits_onnx.mar", tmp_path / "first.log", ["--enable-model-management"])
    try:
        first.wait_ready()
        (startup,) = _snapshots(config_dir, "startup")
        assert stat.S_IMODE(startup.stat().st_mode) == 0o600
        assert stat.S_IMODE(config_dir.stat().st_mode) == 0o700
        assert _models(startup)["digits_onnx"]["1.0"]["minWorkers"] == 1
        mgmt = f"{first.url('mgmt')}/models"
        scaled = requests.put(f"{mgmt}/digits_onnx?min_worker=2&synchronous=true", timeout=180)
        assert scaled.status_code == 200, scaled.text
        # Written before the call answers, as TorchServe's own tests expect (they look at once).
        assert len(_snapshots(config_dir, "snapshot")) == 1
        added = requests.post(
            mgmt,
            params={"url": "digits_torchscript.mar", "model_name": "ts", "initial_workers": "1"},
            timeout=180,
        )
        assert added.status_code == 200, added.text
        assert len(_snapshots(config_dir, "snapshot")) == 2
    finally:
        _stop(first)
    assert len(_snapshots(config_dir, "snapshot")) == 2  # one per change
    (shutdown,) = _snapshots(config_dir, "shutdown")
    models = _models(shutdown)
    assert (models["digits_onnx"]["1.0"]["minWorkers"], models["ts"]["1.0"]["minWorkers"]) == (2, 1)
    assert models["ts"]["1.0"]["marName"] == "digits_torchscript.mar"

    # No config file: the newest snapshot is restored, --models ignored (TorchServe's rule).
    second = ServeProcess(store, "digits_torchscript.mar", tmp_path / "second.log")
    try:
        second.wait_ready()
        assert "restoring config snapshot" in second.log_path.read_text()
        assert (_workers(second, "digits_onnx"), _workers(second, "ts")) == (2, 1)
        answer = requests.post(f"{second.url()}/predictions/ts", data=BODY, headers=HDR, timeout=60)
        assert answer.status_code == 200, answer.text
        assert requests.get(f"{second.url('mgmt')}/models/digits_torchscript", timeout=30).status_code == 404
    finally:
        _stop(second)

    # --ncs: neither restored nor written.
    before = sorted(p.name for p in config_dir.iterdir())
    third = ServeProcess(store, "digits_torchscript.mar", tmp_path / "third.log", ["--ncs"])
    try:
        third.wait_ready()
        served = requests.get(f"{third.url('mgmt')}/models", timeout=30).json()["models"]
        assert [m["modelName"] for m in served] == ["digits_torchscript"]
    finally:
        _stop(third)
    assert sorted(p.name for p in config_dir.iterdir()) == before
