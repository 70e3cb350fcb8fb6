"""Bad archives and the model lifecycle on `mariner serve` (supervisor, frontend, worker processes).

A store with one good archive beside broken ones (a manifest that is not JSON, a model-config
with `batchSize: lots`, a handler path that leaves the archive) serves the good one and reports
the others as FAILED with their reason; a register whose handler fails to initialise leaves
nothing behind and can be retried; a model from a renamed archive unregisters by its name. The
supervisor's side of the same is in tests/e2e/test_bad_store.py.
"""

from __future__ import annotations

import concurrent.futures
import json
import time
import zipfile
from pathlib import Path

import grpc
import pytest
import requests
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.integration.fault_archive import HANDLER, build_fault_archive
from tests.integration.test_versions_and_management import grpc_management
from tests.mariner_serve import MarinerServe

pytestmark = pytest.mark.integration

HDR = {"Content-Type": "application/json"}
OK = json.dumps({"op": "ok", "value": 7})


def write_mar(path: Path, model: dict, files: dict[str, str]) -> Path:
    """An archive with `model` as its manifest's model object (or raw manifest text under
    "MAR-INF/MANIFEST.json" in `files`)."""
    with zipfile.ZipFile(path, "w") as zf:
        if "MAR-INF/MANIFEST.json" not in files:
            zf.writestr("MAR-INF/MANIFEST.json", json.dumps({"model": model}))
        for name, text in files.items():
            zf.writestr(name, text)
    return path


def init_fault_handler(fault: Path) -> str:
    """The fault handler, whose initialize raises while `fault` exists."""
    return HANDLER.replace(
        "        self.initialized = True",
        f"        if os.path.exists({str(fault)!r}):\n"
        "            raise RuntimeError('injected init failure')\n"
        "        self.initialized = True",
    )


def init_gate_handler(gate: Path) -> str:
    """The fault handler, whose initialize creates gate/started and waits for gate/release."""
    return HANDLER.replace(
        "        self.initialized = True",
        f"        open(os.path.join({str(gate)!r}, 'started'), 'w').close()\n"
        f"        wait_for_path(os.path.join({str(gate)!r}, 'release'))\n"
        "        self.initialized = True",
    )


# The review's model-config: nine levels of nine aliases (~1 KB; 9**9 strings once expanded).
ALIAS_BOMB = 'a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]\n' + "".join(
    f"{n}: &{n} [{','.join([f'*{p}'] * 9)}]\n" for p, n in zip("abcdefgh", "bcdefghi", strict=True)
)


def bad_store(root: Path) -> tuple[Path, Path]:
    """good.mar and broken archives; returns (store, the marker the escaping handler would
    write if it ever ran)."""
    store = root / "store"
    build_fault_archive(store, name="good")
    write_mar(store / "badjson.mar", {}, {"MAR-INF/MANIFEST.json": "{not json", "h.py": HANDLER})
    write_mar(
        store / "badcfg.mar",
        {"modelName": "badcfg", "modelVersion": "1.0", "handler": "h.py", "configFile": "c.yaml"},
        {"h.py": HANDLER, "c.yaml": "batchSize: lots\n"},
    )
    for name, config in (
        ("bomb", ALIAS_BOMB),
        ("devids", "deviceIds: [-1]\n"),
        ("batchbytes", "maxBatchBytes: -5\n"),
    ):
        write_mar(
            store / f"{name}.mar",
            {"modelName": name, "modelVersion": "1.0", "handler": "h.py", "configFile": "c.yaml"},
            {"h.py": HANDLER, "c.yaml": config},
        )
    marker = root / "outside-ran"
    outside = root / "outside_handler.py"
    outside.write_text(
        f"open({str(marker)!r}, 'w').close()\n"
        "def handle(data, context):\n    return [1 for _ in data or ()]\n"
    )
    escaping = "../" * 40 + str(outside).lstrip("/")
    write_mar(store / "escape.mar", {"modelName": "escape", "modelVersion": "1.0", "handler": escaping}, {})
    return store, marker


def _served(tmp_path: Path, store: Path, models: str) -> MarinerServe:
    return MarinerServe(store, models, enable_model_management=True, work_dir=tmp_path / "work").start(
        require_ready=False
    )


def _describe(srv: MarinerServe, model: str) -> dict:
    r = requests.get(f"{srv.management}/models/{model}", timeout=30)
    assert r.status_code == 200, r.text
    (entry,) = r.json()
    return entry


def test_a_store_with_bad_archives_serves_the_good_one_and_reports_the_rest(tmp_path: Path) -> None:
    store, marker = bad_store(tmp_path)
    srv = _served(tmp_path, store, "all")
    try:
        r = requests.post(f"{srv.http}/predictions/good", data=OK, headers=HDR, timeout=30)
        assert r.status_code == 200, r.text
        assert r.json()["echo"] == 7
        listed = [
            m["modelName"] for m in requests.get(f"{srv.management}/models", timeout=30).json()["models"]
        ]
        assert listed == ["badcfg", "badjson", "batchbytes", "bomb", "devids", "escape", "good"]
        reasons = {
            "badjson": "MANIFEST.json is not valid JSON",
            "badcfg": "batchSize must be a positive integer, got 'lots'",
            "bomb": "holds an alias (*name) at line 2",
            "devids": "deviceIds must be a list of at most 1024 GPU ids",
            "batchbytes": "maxBatchBytes must be a positive integer, got -5",
            "escape": "model.handler",
        }
        for model, says in reasons.items():
            entry = _describe(srv, model)
            assert entry["mariner"]["state"] == "FAILED"
            assert says in entry["mariner"]["error"]
            assert entry["workers"] == []
            ready = requests.get(f"{srv.http}/v2/models/{model}/ready", timeout=30)
            assert ready.status_code == 503
            assert ready.json()["ready"] is False
            call = requests.post(f"{srv.http}/predictions/{model}", data=OK, headers=HDR, timeout=30)
            assert call.status_code == 503
        assert "outside the archive" in _describe(srv, "escape")["mariner"]["error"]
        assert not marker.exists(), "a handler outside its archive must never run"
        assert _describe(srv, "good")["mariner"]["state"] == "READY"
        # A requested model is missing, so the server is not ready (docs/architecture.md).
        assert requests.get(f"{srv.http}/readyz", timeout=30).status_code == 503
        # Unregistering the failed ones (or registering fixed archives) makes it ready.
        for model in reasons:
            assert requests.delete(f"{srv.management}/models/{model}", timeout=30).status_code == 200
        assert requests.get(f"{srv.http}/readyz", timeout=30).status_code == 200
        assert srv.served_models() == ["good"]
    finally:
        srv.stop()
    assert not marker.exists()


def _health(srv: MarinerServe) -> int:
    with grpc.insecure_channel(srv.grpc_target) as ch:
        return (
            health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=30).status
        )


def _leftovers(work: Path, stem: str) -> list[str]:
    return sorted(p.name for p in work.iterdir() if p.name.startswith(f"{stem}-"))


def test_a_failed_register_leaves_nothing_and_a_retry_after_the_fix_works(tmp_path: Path) -> None:
    store = tmp_path / "store"
    build_fault_archive(store, name="good")
    fault = tmp_path / "fault-on"
    fault.write_text("")
    model = {"modelName": "initfail", "modelVersion": "1.0", "handler": "fault_handler.py"}
    write_mar(store / "initfail.mar", model, {"fault_handler.py": init_fault_handler(fault)})
    srv = _served(tmp_path, store, "good.mar")
    work = tmp_path / "work"
    try:
        assert requests.get(f"{srv.http}/readyz", timeout=30).status_code == 200
        for attempt in ("rest", "grpc"):
            # TorchServe's answer to workers that do not start: 500 "Failed to start workers", here
            # with the worker's own reason.
            if attempt == "rest":
                r = requests.post(f"{srv.management}/models?url=initfail.mar&initial_workers=1", timeout=120)
                assert (r.status_code, r.json()["type"]) == (500, "InternalServerException"), r.text
                message = r.json()["message"]
            else:
                with pytest.raises(grpc.RpcError) as info:
                    grpc_management(srv, "RegisterModel", url="initfail.mar", initial_workers=1)
                assert info.value.code() is grpc.StatusCode.INTERNAL
                message = info.value.details()
            assert message.startswith("Failed to start workers for model initfail version: 1.0")
            assert "initfail version 1.0 failed to load: RuntimeError: injected init failure" in message
            assert srv.served_models() == ["good"], attempt
            assert _leftovers(work, "initfail") == [], "a failed register leaves no unpacked dir"
            assert requests.get(f"{srv.http}/readyz", timeout=30).status_code == 200
            assert _health(srv) == health_pb2.HealthCheckResponse.SERVING
        fault.unlink()
        r = requests.post(f"{srv.management}/models?url=initfail.mar&initial_workers=1", timeout=120)
        assert r.status_code == 200, r.text
        call = requests.post(f"{srv.http}/predictions/initfail", data=OK, headers=HDR, timeout=30)
        assert call.status_code == 200, call.text
        assert requests.get(f"{srv.http}/readyz", timeout=30).status_code == 200
    finally:
        srv.stop()


def test_a_model_from_a_renamed_archive_unregisters_by_its_name(tmp_path: Path) -> None:
    store = tmp_path / "store"
    build_fault_archive(store, name="good")
    build_fault_archive(store, name="renamedmodel").rename(store / "some-other-file.mar")
    srv = _served(tmp_path, store, "good.mar")
    try:
        for _ in range(2):
            r = requests.post(f"{srv.management}/models?url=some-other-file.mar", timeout=120)
            assert r.status_code == 200, r.text
            assert requests.get(f"{srv.http}/readyz", timeout=30).status_code == 200
            r = requests.delete(f"{srv.management}/models/renamedmodel", timeout=60)
            assert r.status_code == 200, r.text
            assert srv.served_models() == ["good"]
            assert requests.get(f"{srv.http}/readyz", timeout=30).status_code == 200
        assert _leftovers(tmp_path / "work", "some-other-file") == []
    finally:
        srv.stop()


def test_a_register_in_progress_keeps_the_server_ready(tmp_path: Path) -> None:
    store = tmp_path / "store"
    build_fault_archive(store, name="good")
    gate = tmp_path / "gate"
    gate.mkdir()
    model = {"modelName": "slow", "modelVersion": "1.0", "handler": "fault_handler.py"}
    write_mar(store / "slow.mar", model, {"fault_handler.py": init_gate_handler(gate)})
    srv = _served(tmp_path, store, "good.mar")
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            register = pool.submit(requests.post, f"{srv.management}/models?url=slow.mar", timeout=300)
            while not (gate / "started").exists() and not register.done():
                time.sleep(0.01)
            assert (gate / "started").exists(), register.result().text
            assert requests.get(f"{srv.http}/readyz", timeout=30).status_code == 200
            assert _health(srv) == health_pb2.HealthCheckResponse.SERVING
            (gate / "release").write_text("")
            assert register.result().status_code == 200
        assert requests.get(f"{srv.http}/readyz", timeout=30).status_code == 200
    finally:
        (gate / "release").write_text("")
        srv.stop()


@pytest.mark.serial  # a latency bound: measured with no other test's servers beside it
def test_an_alias_bomb_registered_is_refused_while_the_server_keeps_answering(tmp_path: Path) -> None:
    """The review's attack: a ~1 KB model-config of nested aliases, registered. It is refused with
    400 naming the alias, and health, management and metrics answer throughout (they stopped, and
    the supervisor grew to 7 GB, when the YAML was expanded on its loop)."""
    store, _ = bad_store(tmp_path)
    srv = _served(tmp_path, store, "good.mar")
    stop = time.monotonic() + 20
    slowest: list[float] = []

    def poll() -> None:
        while time.monotonic() < stop:
            for url in (f"{srv.http}/ping", f"{srv.management}/models", f"{srv.metrics}/metrics"):
                t0 = time.monotonic()
                assert requests.get(url, timeout=5).status_code == 200, url
                slowest.append(time.monotonic() - t0)

    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            poller = pool.submit(poll)
            for _ in range(3):
                r = requests.post(
                    f"{srv.management}/models",
                    params={"url": "bomb.mar", "initial_workers": "1", "synchronous": "true"},
                    timeout=30,
                )
                assert r.status_code == 400, r.text
                assert "holds an alias (*name) at line 2" in r.json()["message"]
            stop = time.monotonic()  # the poller ends its round
            poller.result()
        assert slowest, "the poller ran"
        assert max(slowest) < 2.0, f"a health/management/metrics call took {max(slowest):.2f} s"
        assert srv.served_models() == ["good"]
        assert (
            requests.post(f"{srv.http}/predictions/good", data=OK, headers=HDR, timeout=30).status_code == 200
        )
    finally:
        srv.stop()
