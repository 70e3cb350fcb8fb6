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


FORK_PROBE = "MARINER-FORK-PROBE: Python ran in a forked child of the supervisor"
# Imported first by the supervisor's interpreter (PYTHONPATH): an after-fork hook that writes the probe
# line, then drops the variable that asked for it, so the children it starts do not register it.
SITECUSTOMIZE = f"""
import os
if os.environ.pop("MARINER_FORK_PROBE", None):
    os.register_at_fork(after_in_child=lambda: os.write(2, b"{FORK_PROBE}\\n"))
"""


def test_the_supervisor_starts_every_child_without_running_python_between_fork_and_exec(
    tmp_path: Path,
) -> None:
    """Frontends, the zygote and spawned workers arm themselves after exec. A `preexec_fn` would run
    Python in the forked child of the multi-threaded supervisor, where gRPC's fork handlers then ran
    on inherited state and now and then aborted the child (a worker "exited with signal SIGABRT
    before it was ready" instead of saying why it failed). Python's after-fork hooks run in a child
    exactly when Python code runs there before exec, so a hook in the supervisor is the probe."""
    from tests.integration.test_worker_faults import _with_config

    (tmp_path / "probe").mkdir()
    (tmp_path / "probe" / "sitecustomize.py").write_text(SITECUSTOMIZE)
    store = tmp_path / "store"
    build_fault_archive(store, name="cpu_model")  # forked by the zygote, which is spawned
    # A worker that requires a GPU is a fresh interpreter; without one it fails and is retried, so
    # several spawns happen.
    _with_config(build_fault_archive(store, name="gpu_bound"), "deviceType: gpu\n")
    path = os.pathsep.join(p for p in (str(tmp_path / "probe"), os.environ.get("PYTHONPATH")) if p)
    env = {"PYTHONPATH": path, "MARINER_FORK_PROBE": "1", "CUDA_VISIBLE_DEVICES": ""}
    srv = MarinerServe(store, "all", env=env, frontends=2).start(require_ready=False)
    try:
        deadline = time.monotonic() + 60
        state = {}
        while time.monotonic() < deadline:
            state = next(d for d in srv.describe("gpu_bound"))["mariner"]
            if state["state"] == "FAILED":
                break
            time.sleep(0.5)
        assert state["state"] == "FAILED", state
        assert "requires a GPU" in state["error"], state
        r = requests.post(f"{srv.http}/predictions/cpu_model", json={"op": "ok", "value": 1}, timeout=30)
        assert r.status_code == 200, r.text
        children = psutil.Process(srv.supervisor_pid).children()
        commands = [" ".join(c.cmdline()) for c in children]
        assert any("mariner.server.worker.zygote" in c for c in commands), commands
        assert len(srv.frontend_pids()) == 2
        log = srv.log_text()
        assert log.count("requires a GPU") >= 2, srv.log_tail()  # the spawned worker was retried
        assert FORK_PROBE not in log, srv.log_tail()
    finally:
        srv.stop(timeout=10)
