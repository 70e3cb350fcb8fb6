"""A supervisor killed with SIGKILL takes its whole tree with it at once: the frontends, the
zygote and the workers are gone (PR_SET_PDEATHSIG) and the inference ports are free for a
server started on them next, instead of an orphan answering 503 there for its whole drain."""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import requests

from tests.integration.fault_archive import build_fault_archive
from tests.mariner_serve import MarinerServe

# Only a cap so a regression cannot hang the run; the figure printed is what happened.
GONE_CAP_S = 15.0


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _bindable(port: int) -> bool:
    """Whether a fresh listener (as a restarted server opens it, SO_REUSEADDR and no
    SO_REUSEPORT) can take `port`: not while any process still listens there."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            s.listen()
        except OSError:
            return False
        return True


@pytest.fixture
def server(tmp_path: Path) -> Iterator[MarinerServe]:
    build_fault_archive(tmp_path / "store")
    # A long refusal window after the drain (the harness turns it off; operators behind a load
    # balancer set one): an orphaned frontend would hold the ports answering 503 for all of it.
    srv = MarinerServe(tmp_path / "store", "faulty.mar", refuse_seconds=30.0).start()
    yield srv
    srv.stop(timeout=10)


def test_sigkill_of_the_supervisor_takes_frontends_workers_and_ports_with_it(server: MarinerServe) -> None:
    assert server.supervisor_pid is not None
    assert server.ports is not None
    frontends = server.frontend_pids()
    workers = server.worker_pids("faulty")
    tree = {p.pid for p in psutil.Process(server.supervisor_pid).children(recursive=True)}
    assert frontends
    assert workers
    assert set(frontends) | set(workers) <= tree
    url = f"{server.http}/predictions/faulty"
    answered: list[int] = []
    stop = threading.Event()

    def load() -> None:  # the supervisor dies under load, as in production
        while not stop.is_set():
            try:
                answered.append(requests.post(url, json={"op": "ok", "value": 1}, timeout=5).status_code)
            except requests.RequestException:
                answered.append(0)

    clients = [threading.Thread(target=load, daemon=True) for _ in range(4)]
    for t in clients:
        t.start()
    while len(answered) < 20:
        time.sleep(0.01)
    os.kill(server.supervisor_pid, signal.SIGKILL)
    t0 = time.monotonic()
    while any(_alive(p) for p in tree) and time.monotonic() - t0 < GONE_CAP_S:
        time.sleep(0.01)
    gone_s = time.monotonic() - t0
    stop.set()
    for t in clients:
        t.join(10)
    left = sorted(p for p in tree if _alive(p))
    print(f"\nsupervisor SIGKILLed: its {len(tree)} descendants gone after {gone_s:.3f} s")
    assert not left, f"still running {gone_s:.1f} s after the supervisor died: {left}"
    for port in (server.ports.inference, server.ports.grpc_inference):
        assert _bindable(port), f"port {port} is still held after the supervisor and its tree died"
    assert 200 in answered  # the load really ran before the kill
