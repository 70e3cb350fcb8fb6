"""The worker budget and the model lifecycle races, replayed against a real `mariner serve`.

- A worker count over the budget is refused with a 400 naming the cap and the numbers, on every
  path: register (REST and gRPC), scale, an archive's model-config at start-up (that model is
  FAILED with the reason, the others serve), and one the machine's memory cannot hold. A refused
  register leaves nothing behind; the server keeps serving.
- Unregister while a worker is starting leaves no worker process (the register answers that the
  model was unregistered); registers, scales and unregisters of one model interleaved all answer
  within a bound and leave exactly the workers described.
- Scaling 2 -> 1 -> 2 under load answers every request.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import psutil
import pytest
import requests

from tests.integration.fault_archive import build_fault_archive, write_handler_archive
from tests.mariner_serve import MarinerServe

pytestmark = pytest.mark.integration

WORKER_MODULE = "mariner.server.worker.main"
ANSWER_BOUND_S = 30.0  # every management call answers within this, whatever it raced with
SLOW_INIT_S = 2.0
SLOW_HANDLER = f"""
import time


class SlowHandler:
    def initialize(self, context):
        time.sleep({SLOW_INIT_S})  # "starting" for long enough to be interrupted

    def handle(self, data, context):
        return [{{"ok": True}} for _ in data]
"""


def slow_archive(store: Path, name: str, config: str = "minWorkers: 1\nmaxWorkers: 1\n") -> Path:
    files = {"slow_handler.py": SLOW_HANDLER, "model-config.yaml": config}
    return write_handler_archive(store / f"{name}.mar", name, "slow_handler.py", files)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MarinerServe]:
    store = tmp_path_factory.mktemp("races")
    build_fault_archive(store, name="steady", response_timeout_s=10)
    slow_archive(store, "slow")
    slow_archive(store, "big", "minWorkers: 500\nmaxWorkers: 500\n")
    srv = MarinerServe(store, "steady.mar,big.mar", enable_model_management=True)
    srv.start(require_ready=False)  # big is FAILED by design
    try:
        yield srv
    finally:
        srv.stop()


def workers(srv: MarinerServe) -> set[int]:
    """The worker processes under the supervisor, alive (zygote forks and fresh interpreters)."""
    assert srv.supervisor_pid is not None
    found = set()
    for child in psutil.Process(srv.supervisor_pid).children(recursive=True):
        try:
            if WORKER_MODULE in " ".join(child.cmdline()) and child.status() != psutil.STATUS_ZOMBIE:
                found.add(child.pid)
        except psutil.NoSuchProcess:
            continue
    return found


def wait_for(condition: Callable[[], bool], what: str, cap_s: float = 15.0) -> None:
    deadline = time.monotonic() + cap_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def described_pids(srv: MarinerServe, model: str) -> set[int]:
    r = requests.get(f"{srv.management}/models/{model}", timeout=30)
    if r.status_code == 404:
        return set()
    return {int(w["pid"]) for entry in r.json() for w in entry["workers"] if w.get("pid")}


class Call(threading.Thread):
    """One management call on its own thread, timed."""

    def __init__(self, method: str, target: str, **params: Any) -> None:
        super().__init__(daemon=True)
        self.method, self.target, self.params = method, target, params
        self.answer: requests.Response | None = None
        self.seconds = 0.0

    def run(self) -> None:
        t0 = time.monotonic()
        self.answer = requests.request(
            self.method, self.target, params=self.params, timeout=ANSWER_BOUND_S + 30
        )
        self.seconds = time.monotonic() - t0

    def result(self) -> requests.Response:
        self.join(ANSWER_BOUND_S + 35)
        assert self.answer is not None, f"{self.method} {self.target} {self.params} never answered"
        assert self.seconds < ANSWER_BOUND_S, (self.seconds, self.answer.text)
        return self.answer


def unregister_when_known(srv: MarinerServe, model: str) -> requests.Response:
    """DELETE as soon as the register has made the model known (it unpacks first)."""
    deadline = time.monotonic() + ANSWER_BOUND_S
    while True:
        r = requests.delete(f"{srv.management}/models/{model}", timeout=ANSWER_BOUND_S)
        if r.status_code != 404 or time.monotonic() > deadline:
            return r
        time.sleep(0.01)


# -- the budget -----------------------------------------------------------------------------------
def test_counts_over_the_per_model_cap_are_refused_on_every_path_and_leave_nothing(
    server: MarinerServe,
) -> None:
    before = workers(server)
    mgmt = f"{server.management}/models"
    r = requests.post(mgmt, params={"url": "slow.mar", "initial_workers": 1000}, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["message"] == (
        "initial_workers 1000 exceeds the per-model cap of 64 workers (from the register call)"
    )
    assert requests.get(f"{mgmt}/slow", timeout=30).status_code == 404

    from mariner.server._proto.torchserve import management_pb2, management_pb2_grpc

    with grpc.insecure_channel(server.grpc_management_target) as channel:
        stub = management_pb2_grpc.ManagementAPIsServiceStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            stub.RegisterModel(
                management_pb2.RegisterModelRequest(url="slow.mar", initial_workers=1000), timeout=60
            )
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "initial_workers 1000 exceeds the per-model cap of 64 workers" in str(info.value.details())

    r = requests.put(f"{mgmt}/steady", params={"min_worker": 65, "synchronous": "true"}, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["message"] == "min_worker 65 exceeds the per-model cap of 64 workers"
    r = requests.put(f"{mgmt}/steady", params={"min_worker": 1000}, timeout=30)  # asynchronous: refused now
    assert r.status_code == 400, r.text

    # The archive that asked for 500 at start-up is FAILED with the reason; the other serves.
    (big,) = requests.get(f"{mgmt}/big", timeout=30).json()
    assert big["mariner"]["state"] == "FAILED", big
    assert "minWorkers 500 exceeds the per-model cap of 64 workers (from the model-config of big.mar)" in str(
        big
    )
    ok = requests.post(f"{server.http}/predictions/steady", json={"op": "ok", "value": 1}, timeout=30)
    assert ok.status_code == 200, ok.text
    assert workers(server) == before


def test_a_count_the_memory_cannot_hold_is_refused_naming_the_numbers(tmp_path: Path) -> None:
    """Static caps raised out of the way: the machine-aware cap refuses 50,000 workers (more
    memory than any machine has), before one process starts."""
    slow_archive(tmp_path, "slow")
    build_fault_archive(tmp_path, name="steady")
    srv = MarinerServe(
        tmp_path,
        "steady.mar",
        enable_model_management=True,
        max_workers_per_model=1_000_000,
        max_total_workers=1_000_000,
    ).start()
    try:
        before = workers(srv)
        t0 = time.monotonic()
        r = requests.post(
            f"{srv.management}/models", params={"url": "slow.mar", "initial_workers": 50000}, timeout=60
        )
        took = time.monotonic() - t0
        print(f"\nrefused in {took * 1e3:.0f} ms: {r.json()['message']}")
        assert r.status_code == 400, r.text
        message = r.json()["message"]
        assert message.startswith("initial_workers 50000: 50000 workers of ~"), message
        assert "is available (" in message or "can still be created (" in message, message
        assert requests.get(f"{srv.management}/models/slow", timeout=30).status_code == 404
        r = requests.put(
            f"{srv.management}/models/steady", params={"min_worker": 50000, "synchronous": "true"}
        )
        assert r.status_code == 400, r.text
        assert "49999 more workers of ~" in r.json()["message"]
        assert workers(srv) == before
    finally:
        srv.stop()


# -- lifecycle races --------------------------------------------------------------------------------
@pytest.mark.parametrize("delay_s", [0.0, 0.05, 0.3, 1.0])
def test_unregister_while_a_worker_starts_leaves_no_worker_process(
    server: MarinerServe, delay_s: float
) -> None:
    before = workers(server)
    register = Call("POST", f"{server.management}/models", url="slow.mar", synchronous="true")
    register.start()
    time.sleep(delay_s)
    unregister = unregister_when_known(server, "slow")
    assert unregister.status_code == 200, unregister.text
    answer = register.result()
    # Unregistered before its worker was ready (2 s of initialize): the register says so.
    assert answer.status_code == 499, answer.text
    assert "slow version 1.0 was unregistered while its worker was starting" in answer.json()["message"]
    wait_for(lambda: workers(server) == before, f"a worker of slow survived: {workers(server) - before}")
    assert requests.get(f"{server.management}/models/slow", timeout=30).status_code == 404


def test_registers_scales_and_unregisters_of_one_model_interleaved_all_answer(server: MarinerServe) -> None:
    before = workers(server)
    mgmt = f"{server.management}/models"
    register = Call("POST", mgmt, url="slow.mar", initial_workers=2, synchronous="true")
    register.start()
    wait_for(lambda: requests.get(f"{mgmt}/slow", timeout=30).status_code == 200, "slow was never known")
    # Both scales wait for the register (one lifecycle change of a version at a time).
    down = Call("PUT", f"{mgmt}/slow", min_worker=1, synchronous="true")
    up = Call("PUT", f"{mgmt}/slow", min_worker=3, synchronous="true")
    down.start()
    up.start()
    answers = [c.result() for c in (register, down, up)]
    assert [a.status_code for a in answers] == [200, 200, 200], [a.text for a in answers]
    (entry,) = requests.get(f"{mgmt}/slow", timeout=30).json()
    wait_for(
        lambda: workers(server) - before == described_pids(server, "slow"), "workers and describe differ"
    )
    assert len(described_pids(server, "slow")) == entry["minWorkers"]

    # A scale up still starting, then an unregister: both answer, no worker is left.
    scaling = Call("PUT", f"{mgmt}/slow", min_worker=4, synchronous="true")
    scaling.start()
    time.sleep(0.3)
    assert requests.delete(f"{mgmt}/slow", timeout=ANSWER_BOUND_S).status_code == 200
    scaled = scaling.result()
    assert scaled.status_code == 499, scaled.text
    assert "was unregistered while its worker was starting" in scaled.json()["message"]
    wait_for(lambda: workers(server) == before, f"workers of slow survived: {workers(server) - before}")


def test_scaling_down_and_up_under_load_fails_no_request(server: MarinerServe) -> None:
    mgmt = f"{server.management}/models/steady"
    assert requests.put(mgmt, params={"min_worker": 2, "synchronous": "true"}, timeout=60).status_code == 200
    stop = threading.Event()
    outcomes: list[tuple[int, str]] = []

    def client(n: int) -> None:
        with requests.Session() as s:
            i = 0
            while not stop.is_set():
                i += 1
                value = f"{n}-{i}"
                r = s.post(f"{server.http}/predictions/steady", json={"op": "ok", "value": value}, timeout=60)
                ok = r.status_code == 200 and r.json().get("echo") == value
                outcomes.append((r.status_code, "" if ok else r.text[:300]))

    clients = [threading.Thread(target=client, args=(n,), daemon=True) for n in range(8)]
    for c in clients:
        c.start()
    scales = []
    try:
        time.sleep(0.5)
        for count in (1, 2, 1, 2, 1):
            t0 = time.monotonic()
            r = requests.put(mgmt, params={"min_worker": count, "synchronous": "true"}, timeout=60)
            scales.append((count, r.status_code, round(time.monotonic() - t0, 2)))
            time.sleep(0.3)
    finally:
        stop.set()
        for c in clients:
            c.join(60)
    failures = [o for o in outcomes if o[1]]
    print(f"\n{len(outcomes)} requests while scaling {scales}; failures: {len(failures)} {failures[:3]}")
    assert all(code == 200 for _, code, _ in scales), scales
    assert len(outcomes) > 100
    assert failures == [], [line for line in server.log_text().splitlines() if "failed" in line][-5:]
    assert len(described_pids(server, "steady")) == 1
