"""Model code that kills its own process fails only its batch; the server and other models go on.

Every model instance is a worker process. A handler that segfaults, aborts, calls os._exit,
spins forever or runs out of memory under an rlimit fails the batch it held with a clear error,
its worker is replaced, the model answers correctly again, and another model served at the same
time keeps answering throughout (its p50/p99 before and during each fault are printed, not
judged: no verdict here depends on the machine's speed). A spinning worker is SIGKILLed: no
process is left burning a core. Archives never share `sys.path`. Stopping the server leaves no
worker process behind.
"""

from __future__ import annotations

import json
import os
import statistics
import threading
import time
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import requests

from tests.integration.fault_archive import build_fault_archive
from tests.mariner_serve import MarinerServe

pytestmark = pytest.mark.integration

WORKER_MODULE = "mariner.server.worker.main"


def _workers() -> list[psutil.Process]:
    """This test process's worker processes still alive."""
    out = []
    for child in psutil.Process().children(recursive=True):
        try:
            if WORKER_MODULE in " ".join(child.cmdline()) and child.status() != psutil.STATUS_ZOMBIE:
                out.append(child)
        except psutil.NoSuchProcess:
            continue
    return out


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MarinerServe]:
    store = tmp_path_factory.mktemp("store")
    build_fault_archive(store, name="faulty", response_timeout_s=5, helper="faulty's helper")
    build_fault_archive(store, name="steady", response_timeout_s=30, helper="steady's helper")
    srv = MarinerServe(store, "faulty.mar,steady.mar").start()
    try:
        yield srv
    finally:
        srv.stop()


def post(srv: MarinerServe, model: str, op: str, value: Any = None) -> requests.Response:
    return requests.post(f"{srv.http}/predictions/{model}", json={"op": op, "value": value}, timeout=60)


def gone(pid: int) -> bool:
    """The process no longer runs (a zombie runs nothing: it only waits to be reaped)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def wait_for(condition: Callable[[], bool], what: str, cap_s: float = 120.0) -> None:
    """Poll for an event; the cap only turns a lost event into a failure instead of a hang."""
    deadline = time.monotonic() + cap_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def worker_pid(srv: MarinerServe, model: str) -> int:
    return int(post(srv, model, "pid").json()["pid"])


class Steady:
    """Sends requests to the other model without pause and keeps each answer and its latency."""

    def __init__(self, srv: MarinerServe) -> None:
        self.srv = srv
        self.samples: list[tuple[float, float, bool]] = []  # (sent at, seconds, correct)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        i = 0
        with requests.Session() as s:
            while not self._stop.is_set():
                i += 1
                t0 = time.monotonic()
                r = s.post(f"{self.srv.http}/predictions/steady", json={"op": "ok", "value": i}, timeout=60)
                ok = r.status_code == 200 and r.json()["echo"] == i
                self.samples.append((t0, time.monotonic() - t0, ok))

    def __enter__(self) -> Steady:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(60)

    def count(self) -> int:
        return len(self.samples)

    def report(self, label: str, since: float, until: float) -> list[tuple[float, float, bool]]:
        window = [s for s in self.samples if since <= s[0] < until]
        lat = sorted(s[1] * 1e3 for s in window)
        if lat:
            p99 = lat[min(len(lat) - 1, int(len(lat) * 0.99))]
            print(f"steady {label}: n={len(lat)} p50={statistics.median(lat):.2f} ms p99={p99:.2f} ms")
        return window


def wait_until_ok(srv: MarinerServe) -> None:
    def ok() -> bool:
        r = post(srv, "faulty", "ok", "again")
        assert r.status_code in (200, 503), r.text  # 503 only while restarting
        return r.status_code == 200 and r.json()["echo"] == "again"

    wait_for(ok, "the faulty model did not come back")


@pytest.mark.parametrize(
    ("op", "status", "words"),
    [
        ("segfault", 500, "worker process"),
        ("abort", 500, "worker process"),
        ("os_exit", 500, "worker process"),
        ("memory_hog", 507, "Out of resources"),  # TorchServe's answer on its endpoint
    ],
)
def test_a_fault_fails_only_its_batch_and_the_other_model_keeps_answering(
    server: MarinerServe, op: str, status: int, words: str
) -> None:
    pid_before = worker_pid(server, "faulty")
    with Steady(server) as steady:
        wait_for(lambda: steady.count() >= 50, "the other model never answered")
        t_fault = time.monotonic()
        r = post(server, "faulty", op, 64)
        assert r.status_code == status, r.text
        assert words in r.json()["message"], r.json()
        if status == 500:
            assert f"pid {pid_before}" in r.json()["message"]
            assert "died" in r.json()["message"]
        wait_until_ok(server)
        n = steady.count()
        wait_for(lambda: steady.count() >= n + 20, "the other model stopped answering")
        t_end = time.monotonic()
    before = steady.report(f"before {op}", 0, t_fault)
    during = steady.report(f"during {op}", t_fault, t_end)
    assert during, "the other model answered while the fault happened"
    assert all(ok for _, _, ok in before + during), "every answer of the other model was right"
    pid_after = worker_pid(server, "faulty")
    if status == 500:
        assert pid_after != pid_before, "the dead worker was replaced by a new process"
        assert (
            not psutil.pid_exists(pid_before) or psutil.Process(pid_before).status() == psutil.STATUS_ZOMBIE
        )
    else:
        assert pid_after == pid_before, "running out of memory is answered, not fatal"
    assert requests.get(f"{server.http}/ping", timeout=10).status_code == 200


def test_an_endless_loop_is_killed_and_leaves_no_process_burning(
    server: MarinerServe, tmp_path: Path
) -> None:
    pid_file = tmp_path / "spinner.pid"
    with Steady(server) as steady:
        wait_for(lambda: steady.count() >= 50, "the other model never answered")
        t_fault = time.monotonic()
        r = post(server, "faulty", "spin", str(pid_file))
        # TorchServe's answer to a response timeout on its endpoint (OIP/KServe keep 504).
        assert r.status_code == 500, r.text
        assert r.json() == {"code": 500, "type": "InternalServerException", "message": "Worker died."}
        spinner = int(pid_file.read_text())
        wait_for(
            lambda: (
                not psutil.pid_exists(spinner) or psutil.Process(spinner).status() == psutil.STATUS_ZOMBIE
            ),
            "the spinning worker is still alive",
        )
        wait_until_ok(server)
        n = steady.count()
        wait_for(lambda: steady.count() >= n + 20, "the other model stopped answering")
        t_end = time.monotonic()
    steady.report("before spin", 0, t_fault)
    during = steady.report("during spin", t_fault, t_end)
    assert during
    assert all(ok for _, _, ok in steady.samples)
    assert worker_pid(server, "faulty") != spinner


def test_a_fatal_cuda_error_ends_the_worker_and_a_new_one_serves(server: MarinerServe) -> None:
    """A sticky CUDA error (illegal address, device-side assert...) leaves the device unusable in
    that process: the batch is answered 503, the worker exits on its own (it is not killed for
    dying) and the pool's replacement, a new process, answers the next requests."""
    pid_before = worker_pid(server, "faulty")
    r = post(server, "faulty", "cuda_fatal")
    assert r.status_code == 503, r.text
    assert "restarting" in r.json()["message"]
    assert "illegal" not in r.json()["message"]  # the device's words stay in the log
    wait_for(lambda: gone(pid_before), "the worker with the broken device is still running")
    wait_until_ok(server)
    assert worker_pid(server, "faulty") != pid_before
    assert post(server, "steady", "ok", 1).json()["echo"] == 1


def _with_config(path: Path, extra: str) -> Path:
    """Rewrite the archive's model-config.yaml with `extra` lines appended."""
    with zipfile.ZipFile(path) as zf:
        files = {n: zf.read(n) for n in zf.namelist()}
    files["model-config.yaml"] += extra.encode()
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in files.items():
            zf.writestr(name, data)
    return path


@pytest.mark.parametrize("how", ["deviceType", "flag"])
def test_a_gpu_bound_model_without_a_gpu_fails_with_the_reason_and_others_are_served(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    """No silent CPU fallback: a model that needs a GPU (its deviceType, or --require-gpu) is not
    served on a CPU-only machine; describe says why, and a CPU model next to it answers. (That
    the supervisor and frontends never ask torch about CUDA is tests/unit/test_devices.py's.)"""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # no GPU visible, whatever this machine has
    store = tmp_path / "store"
    gpu = build_fault_archive(store, name="gpu_bound", response_timeout_s=5)
    cpu = _with_config(
        build_fault_archive(store, name="cpu_model", response_timeout_s=5), "deviceType: cpu\n"
    )
    overrides: dict[str, Any] = {"enable_model_management": True}
    if how == "deviceType":
        _with_config(gpu, "deviceType: gpu\n")
    else:
        overrides["require_gpu"] = True
    srv = MarinerServe(store, f"{gpu.name},{cpu.name}", **overrides)
    try:
        assert not srv.start(require_ready=False).all_ready, "the GPU-bound model must not be ready"
        assert post(srv, "cpu_model", "ok", 1).json()["echo"] == 1
        r = post(srv, "gpu_bound", "ok", 1)
        assert r.status_code == 503, r.text
        described = requests.get(f"{srv.management}/models/gpu_bound", timeout=30)
        text = described.text
        assert "failed to load" in r.json()["message"]
        assert described.json()[0]["mariner"]["state"] == "FAILED"
        assert "requires a GPU" in described.json()[0]["mariner"]["error"], text
        assert "not served on the CPU" in text
        assert all(w["status"] != "READY" for w in described.json()[0]["workers"])
    finally:
        srv.stop()


def test_each_archive_imports_its_own_helper(server: MarinerServe) -> None:
    assert post(server, "faulty", "helper").json() == {"helper": "faulty's helper"}
    assert post(server, "steady", "helper").json() == {"helper": "steady's helper"}


def test_describe_names_each_worker_process(server: MarinerServe) -> None:
    desc = requests.get(f"{server.management}/models/faulty", timeout=10).json()
    pids = {w["pid"] for d in desc for w in d["workers"]}
    assert pids == {worker_pid(server, "faulty")}, json.dumps(desc)


@pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="SCHED_BATCH is Linux's")
def test_workers_run_in_the_batch_scheduling_class_and_the_frontend_does_not(server: MarinerServe) -> None:
    worker = worker_pid(server, "faulty")
    assert os.sched_getscheduler(worker) == os.SCHED_BATCH
    assert server.proc is not None
    tree = psutil.Process(server.proc.pid).children(recursive=True)
    frontends = [p.pid for p in tree if "frontend.main" in " ".join(p.cmdline())]
    assert frontends, "the server runs a frontend process"
    assert {os.sched_getscheduler(pid) for pid in frontends} == {os.SCHED_OTHER}


def test_stopping_the_server_leaves_no_worker_process(tmp_path: Path) -> None:
    build_fault_archive(tmp_path, name="faulty")
    before = {p.pid for p in _workers()}
    srv = MarinerServe(tmp_path, "faulty.mar", min_workers=2).start()
    try:
        ours = {p.pid for p in _workers()} - before
        assert len(ours) == 2, "one process per worker"
        assert post(srv, "faulty", "ok", 1).status_code == 200
    finally:
        srv.stop()
    assert not ({p.pid for p in _workers()} & ours), "a worker outlived the server"
