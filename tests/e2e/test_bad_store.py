"""`mariner serve --models all` (the supervisor) over a store with broken archives beside a good
one: it starts and serves the good model, reports each broken archive as FAILED with its reason
in one log line (no traceback), never runs a handler that lies outside its archive, and keeps
register and unregister all-or-nothing. The single-process server's side is in
tests/integration/test_bad_archives.py (whose store builder this reuses)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import requests

from mariner.loadtest.servers import ServerError, wait_http_ok
from tests.e2e.serve_process import ServeProcess
from tests.integration.fault_archive import build_fault_archive
from tests.integration.test_bad_archives import bad_store, init_fault_handler, write_mar

pytestmark = pytest.mark.e2e

HDR = {"Content-Type": "application/json"}
OK = json.dumps({"op": "ok", "value": 7})


def _wait_ok(srv: ServeProcess, url: str) -> None:
    try:
        wait_http_ok(url, srv.proc, 120.0)
    except ServerError as exc:
        raise AssertionError(f"{exc}:\n{srv.log_path.read_text()[-3000:]}") from None


def _describe(srv: ServeProcess, model: str) -> dict:
    r = requests.get(f"{srv.url('mgmt')}/models/{model}", timeout=30)
    assert r.status_code == 200, r.text
    (entry,) = r.json()
    return entry


def test_a_bad_store_serves_the_good_model_and_reports_the_rest(tmp_path: Path) -> None:
    store, marker = bad_store(tmp_path)
    fault = tmp_path / "fault-on"
    fault.write_text("")
    model = {"modelName": "initfail", "modelVersion": "1.0", "handler": "fault_handler.py"}
    write_mar(tmp_path / "initfail.mar", model, {"fault_handler.py": init_fault_handler(fault)})
    build_fault_archive(tmp_path / "later", name="renamedmodel")
    work = tmp_path / "work"
    srv = ServeProcess(
        store, "all", tmp_path / "serve.log", ["--enable-model-management", "--work-dir", str(work)]
    )
    try:
        _wait_ok(srv, f"{srv.url()}/v2/models/good/ready")
        r = requests.post(f"{srv.url()}/predictions/good", data=OK, headers=HDR, timeout=30)
        assert r.status_code == 200, r.text
        reasons = {
            "badjson": "MANIFEST.json is not valid JSON",
            "badcfg": "batchSize must be a positive integer, got 'lots'",
            "escape": "points outside the archive",
            "bomb": "holds an alias (*name)",
            "devids": "deviceIds must be a list",
            "batchbytes": "maxBatchBytes must be a positive integer",
        }
        for name, says in reasons.items():
            entry = _describe(srv, name)
            assert (entry["mariner"]["state"], entry["workers"]) == ("FAILED", [])
            assert says in entry["mariner"]["error"]
            ready = requests.get(f"{srv.url()}/v2/models/{name}/ready", timeout=30)
            assert (ready.status_code, ready.json()["ready"]) == (503, False)
        assert not marker.exists(), "a handler outside its archive must never run"
        # A model it was asked to serve is missing: not ready, on every port.
        assert requests.get(f"{srv.url('mgmt')}/ping", timeout=30).status_code == 500
        assert requests.get(f"{srv.url()}/readyz", timeout=30).status_code == 503
        log = srv.log_path.read_text()
        assert "Traceback" not in log
        assert sum("refusing archive" in line for line in log.splitlines()) == len(reasons)

        # A register whose handler fails to initialise leaves nothing; the retry after the fix works.
        (store / "initfail.mar").write_bytes((tmp_path / "initfail.mar").read_bytes())
        for _ in range(2):
            r = requests.post(f"{srv.url('mgmt')}/models?url=initfail.mar&initial_workers=1", timeout=120)
            assert (r.status_code, r.json()["type"]) == (500, "InternalServerException"), (
                r.text
            )  # TorchServe's
            assert "injected init failure" in r.json()["message"]
            assert requests.get(f"{srv.url('mgmt')}/models/initfail", timeout=30).status_code == 404
            assert not [p for p in work.iterdir() if p.name.startswith("initfail-")]
        fault.unlink()
        added = requests.post(f"{srv.url('mgmt')}/models?url=initfail.mar&initial_workers=1", timeout=120)
        assert added.status_code == 200, added.text
        r = requests.post(f"{srv.url()}/predictions/initfail", data=OK, headers=HDR, timeout=30)
        assert r.status_code == 200, r.text

        # Unregistering the failed ones makes the server ready; a renamed archive unregisters by name.
        for name in reasons:
            assert requests.delete(f"{srv.url('mgmt')}/models/{name}", timeout=60).status_code == 200
        _wait_ok(srv, f"{srv.url('mgmt')}/ping")
        _wait_ok(srv, f"{srv.url()}/readyz")
        (store / "some-other-file.mar").write_bytes((tmp_path / "later" / "renamedmodel.mar").read_bytes())
        assert (
            requests.post(f"{srv.url('mgmt')}/models?url=some-other-file.mar", timeout=120).status_code == 200
        )
        assert requests.delete(f"{srv.url('mgmt')}/models/renamedmodel", timeout=60).status_code == 200
        assert requests.get(f"{srv.url('mgmt')}/ping", timeout=30).status_code == 200
        assert requests.get(f"{srv.url()}/readyz", timeout=30).status_code == 200
        listed = requests.get(f"{srv.url('mgmt')}/models", timeout=30).json()["models"]
        assert [m["modelName"] for m in listed] == ["good", "initfail"]
    finally:
        srv.kill()
    assert not marker.exists()


def test_a_gpu_bound_model_without_a_gpu_is_failed_with_its_reason_under_the_supervisor(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker that cannot start (deviceType gpu, no GPU visible) leaves its version FAILED with
    the worker's reason in describe, and a call to it says it failed to load (not LOADING), while
    the CPU model next to it answers."""
    from tests.integration.test_worker_faults import _with_config

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # inherited by `mariner serve` and its workers
    store = tmp_path / "store"
    _with_config(build_fault_archive(store, name="gpu_bound", response_timeout_s=5), "deviceType: gpu\n")
    build_fault_archive(store, name="cpu_model", response_timeout_s=5)
    srv = ServeProcess(store, "all", tmp_path / "serve.log")
    try:
        _wait_ok(srv, f"{srv.url()}/v2/models/cpu_model/ready")
        r = requests.post(f"{srv.url()}/predictions/cpu_model", data=OK, headers=HDR, timeout=30)
        assert r.status_code == 200, r.text
        entry = _describe(srv, "gpu_bound")
        deadline = 60
        while entry["mariner"]["state"] != "FAILED" and deadline:  # its first start may still run
            deadline -= 1
            __import__("time").sleep(1)
            entry = _describe(srv, "gpu_bound")
        assert entry["mariner"]["state"] == "FAILED", entry
        assert "requires a GPU" in entry["mariner"]["error"]
        assert all(w["status"] == "FAILED" for w in entry["workers"])
        r = requests.post(f"{srv.url()}/predictions/gpu_bound", data=OK, headers=HDR, timeout=30)
        assert r.status_code == 503, r.text
        assert "failed to load" in r.json()["message"]
        assert requests.get(f"{srv.url()}/readyz", timeout=30).status_code == 503
    finally:
        srv.kill()
