"""`mariner serve --frontends 2`: the supervisor, two frontends and model worker processes.

One server, one test (start-up is the slow part): traffic over HTTP and gRPC is answered
correctly; /metrics on the supervisor counts every frontend's requests; a frontend killed with
SIGKILL is restarted while the other keeps answering; describe shows the workers' real pids;
ScaleWorker starts and stops worker processes while the model keeps answering; SIGTERM exits
0 and leaves no process behind. Every wait is for an event, with a generous cap that only turns
a stall into a failure; nothing here judges speed. Start-up to ready is printed (-s).
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import psutil
import pytest
import requests

from mariner.server import protogen
from tests.e2e.serve_process import ServeProcess, drain_totals

pytestmark = pytest.mark.e2e

MODEL = "digits_torchscript"
PIXELS = json.dumps([4.0] * 64).encode()
CAP_S = 300.0  # the most any one event may take before the test fails instead of hanging


def wait_for(what: str, check: Callable[[], bool], cap: float = CAP_S) -> None:
    deadline = time.monotonic() + cap
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def children(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)  # workers are the zygote's children
    except psutil.NoSuchProcess:
        return []


def _running(pid: int, module: str) -> set[int]:
    """Live descendants of `pid` running `python -m module` (a zombie not yet reaped is not live)."""
    found = set()
    for p in children(pid):
        try:
            if p.status() != psutil.STATUS_ZOMBIE and module in " ".join(p.cmdline()):
                found.add(p.pid)
        except psutil.Error:
            continue  # it exited meanwhile
    return found


def frontend_pids(pid: int) -> set[int]:
    return _running(pid, "mariner.server.frontend.main")


def worker_pids(pid: int) -> set[int]:
    return _running(pid, "mariner.server.worker.main")


def requests_total(metrics_url: str) -> float:
    text = requests.get(f"{metrics_url}/metrics", timeout=10).text
    return sum(
        float(m.group(1))
        for m in re.finditer(r'^mariner_requests_total\{[^}]*code="200"[^}]*\} (\S+)$', text, re.M)
    )


def test_two_frontends_share_traffic_survive_a_kill_scale_and_drain(
    model_store: Path, tmp_path: Path
) -> None:
    protogen.generate()
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from mariner.server._proto.torchserve import (
        inference_pb2,
        inference_pb2_grpc,
        management_pb2,
        management_pb2_grpc,
    )

    srv = ServeProcess(
        model_store, f"{MODEL}.mar", tmp_path / "serve.log", ["--frontends", "2", "--enable-model-management"]
    )
    session = requests.Session()
    url = srv.url()

    def predict_http() -> dict:
        r = session.post(
            f"{url}/predictions/{MODEL}",
            data=PIXELS,
            headers={"Content-Type": "application/json"},
            timeout=60,
        )
        assert r.status_code == 200, r.text
        return r.json()

    try:
        took = srv.wait_ready()
        print(f"\nstart-up to ready (supervisor /ping, then /readyz): {took:.2f} s")
        wait_for("two frontends", lambda: len(frontend_pids(srv.proc.pid)) == 2)
        assert len(worker_pids(srv.proc.pid)) == 1

        # Traffic over both protocols, answered correctly (the same answer over both).
        expected = predict_http()
        assert 0 <= expected["label"] <= 9
        with grpc.insecure_channel(srv.target()) as ch:
            stub = inference_pb2_grpc.InferenceAPIsServiceStub(ch)
            reply = stub.Predictions(
                inference_pb2.PredictionsRequest(model_name=MODEL, input={"data": PIXELS}), timeout=60
            )
        assert json.loads(reply.prediction) == expected

        # /metrics on the supervisor counts every frontend: K requests on K fresh connections
        # (each lands on either frontend), exactly K more counted.
        metrics = srv.url("metrics")
        before = requests_total(metrics)
        k = 40
        for _ in range(k):
            r = requests.post(f"{url}/predictions/{MODEL}", data=PIXELS, timeout=60)  # new connection each
            assert r.status_code == 200
        assert requests_total(metrics) == before + k

        # Describe shows the worker process with its real pid.
        described = session.get(f"{srv.url('mgmt')}/models/{MODEL}", timeout=30).json()
        workers = described[0]["workers"]
        assert {w["pid"] for w in workers} == worker_pids(srv.proc.pid)
        assert all(w["status"] == "READY" for w in workers)
        # gRPC management (7071) is the supervisor too: the same document, and its health.
        with grpc.insecure_channel(srv.target("grpc_mgmt")) as ch:
            doc = management_pb2_grpc.ManagementAPIsServiceStub(ch).DescribeModel(
                management_pb2.DescribeModelRequest(model_name=MODEL), timeout=30
            )
            status = health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=30
            )
        assert [w["pid"] for w in json.loads(doc.msg)[0]["workers"]] == [w["pid"] for w in workers]
        assert status.status == health_pb2.HealthCheckResponse.SERVING

        # Kill one frontend: it is restarted (a new pid); the other answers meanwhile.
        old = frontend_pids(srv.proc.pid)
        victim = min(old)
        os.kill(victim, signal.SIGKILL)
        answered_meanwhile = 0
        health_seen: set[int] = set()  # the supervisor's /ping while the frontend is replaced
        deadline = time.monotonic() + CAP_S
        while time.monotonic() < deadline:
            now = frontend_pids(srv.proc.pid)
            health = session.get(f"{srv.url('mgmt')}/ping", timeout=30).status_code
            health_seen.add(health)
            if len(now) == 2 and victim not in now and health == 200:
                break
            try:
                r = requests.post(f"{url}/predictions/{MODEL}", data=PIXELS, timeout=60)
            except requests.ConnectionError:
                continue  # a connection the kernel had queued on the killed frontend
            assert r.status_code == 200, r.text
            answered_meanwhile += 1
        new = frontend_pids(srv.proc.pid)
        assert len(new) == 2, (old, new)
        assert victim not in new, (old, new)
        print(f"answered while frontend {victim} was down and restarting: {answered_meanwhile}")
        # A new interpreter has to start and import the listeners: far longer than one request.
        assert answered_meanwhile >= 1
        assert 500 in health_seen, "the supervisor said healthy while a frontend was being restarted"
        srv.wait_ready()
        assert f"(pid {victim}) exited with" in srv.log_path.read_text()
        assert predict_http() == expected

        # ScaleWorker: up to 2 worker processes, then down to 1; the model answers throughout.
        mgmt = srv.url("mgmt")
        r = session.put(f"{mgmt}/models/{MODEL}?min_worker=2&synchronous=true", timeout=CAP_S)
        assert r.status_code == 200, r.text
        wait_for("2 workers", lambda: len(worker_pids(srv.proc.pid)) == 2)
        described = session.get(f"{mgmt}/models/{MODEL}", timeout=30).json()[0]
        assert described["minWorkers"] == 2
        assert {w["pid"] for w in described["workers"]} == worker_pids(srv.proc.pid)
        for _ in range(10):
            assert predict_http() == expected
        r = session.put(f"{mgmt}/models/{MODEL}?min_worker=1&synchronous=true", timeout=CAP_S)
        assert r.status_code == 200, r.text
        wait_for("1 worker", lambda: len(worker_pids(srv.proc.pid)) == 1)
        for _ in range(10):
            assert predict_http() == expected

        # SIGTERM: exit 0, every frontend drained (accepted == answered), no process left.
        everyone = [psutil.Process(srv.proc.pid), *children(srv.proc.pid)]
        srv.proc.send_signal(signal.SIGTERM)
        assert srv.proc.wait(CAP_S) == 0
        gone, alive = psutil.wait_procs(everyone, timeout=30)
        assert not alive, alive
        accepted, answered, ok, frontends = drain_totals(srv.log_path.read_text())
        assert frontends == 2
        assert accepted == answered
    finally:
        session.close()
        srv.kill()


def test_whole_store_starts_its_workers_in_parallel(model_store: Path, tmp_path: Path) -> None:
    """Every archive of the digits store: one worker each, all loading at once. Prints the
    start-up time (no verdict on it: the machine's load decides it)."""
    archives = sorted(p.name for p in model_store.glob("*.mar"))
    srv = ServeProcess(model_store, "all", tmp_path / "serve.log")
    try:
        took = srv.wait_ready()
        print(f"\nstart-up to ready, {len(archives)} archives, one worker each: {took:.2f} s")
        models = requests.get(f"{srv.url('mgmt')}/models", timeout=30).json()["models"]
        assert len(models) == len(archives)
        assert len(worker_pids(srv.proc.pid)) == len(archives)
        srv.proc.send_signal(signal.SIGTERM)
        assert srv.proc.wait(CAP_S) == 0
    finally:
        srv.kill()


def test_a_port_in_use_fails_start_up_with_its_address_and_leaves_nothing(
    model_store: Path, tmp_path: Path
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        address = f"127.0.0.1:{taken.getsockname()[1]}"
        srv = ServeProcess(
            model_store, f"{MODEL}.mar", tmp_path / "serve.log", ["--management-address", address]
        )
        try:
            assert srv.proc.wait(CAP_S) == 2
            log = srv.log_path.read_text()
            assert f"cannot start: cannot listen on '{address}'" in log, log[-2000:]
            assert "started (pid" not in log, "the ports are checked before any child starts"
        finally:
            srv.kill()
