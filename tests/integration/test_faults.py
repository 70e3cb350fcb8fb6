"""Reliability with a fault-injecting handler on a real server: failures stay contained.

A handler that raises for one item fails that item only; one that raises for a batch fails
that batch only; one that hangs past responseTimeout gets DEADLINE_EXCEEDED and its instance is
replaced; one that ends its instance is restarted; running out of memory splits the batch.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import pytest
import requests

from mariner.server import protogen
from tests.integration.fault_archive import build_fault_archive
from tests.mariner_serve import MarinerServe

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MarinerServe]:
    store = tmp_path_factory.mktemp("store")
    # The timeout bounds how long a blocked first batch may wait for the test: far more than the
    # test needs to queue a few requests, on any machine; the hang test waits it out once.
    build_fault_archive(store, response_timeout_s=6)
    srv = MarinerServe(store, "faulty.mar").start()
    try:
        yield srv
    finally:
        srv.stop()


def post(srv: MarinerServe, op: str, value: Any = None, timeout: float = 30) -> requests.Response:
    return requests.post(f"{srv.http}/predictions/faulty", json={"op": op, "value": value}, timeout=timeout)


def counter(srv: MarinerServe, name: str, **labels: str) -> float:
    text = requests.get(f"{srv.metrics}/metrics", timeout=10).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def wait_for(condition: Callable[[], bool], what: str, cap_s: float = 120.0) -> None:
    """Poll for an event; the cap only turns a lost event into a failure instead of a hang."""
    deadline = time.monotonic() + cap_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def behind_a_busy_instance(
    srv: MarinerServe, gate: Path, ops: list[tuple[str, Any]]
) -> list[requests.Response]:
    """Occupy the single instance, queue `ops` meanwhile, so they run together as one batch.

    Events, not sleeps: the blocker says when it holds the instance, /metrics says when every op
    waits in the queue, and only then is the blocker released.
    """
    gate.mkdir()
    with ThreadPoolExecutor(len(ops) + 1) as pool:
        blocker = pool.submit(post, srv, "block", str(gate))
        wait_for(lambda: (gate / "started").exists() or blocker.done(), "the blocker never ran")
        futures = [pool.submit(post, srv, op, value) for op, value in ops]
        wait_for(
            lambda: counter(srv, "mariner_queue_depth", model="faulty") == len(ops) or blocker.done(),
            "the ops never queued behind the blocker",
        )
        (gate / "release").touch()
        assert blocker.result().status_code == 200
        return [f.result() for f in futures]


def wait_until_ok(srv: MarinerServe, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        r = post(srv, "ok", "again")
        if r.status_code == 200:
            return
        assert r.status_code == 503, r.text  # only "restarting" is acceptable meanwhile
        time.sleep(0.1)
    raise AssertionError("the model did not come back")


def test_bad_item_fails_alone(server: MarinerServe, tmp_path: Path) -> None:
    out = behind_a_busy_instance(server, tmp_path / "gate", [("ok", 1), ("bad_item", 2), ("ok", 3)])
    assert [r.status_code for r in out] == [200, 400, 200]
    assert [r.json()["batch"] for r in (out[0], out[2])] == [3, 3], "the three requests share one batch"
    assert out[1].json() == {"error": "injected bad item"}, "the handler's own answer for that item"


def test_a_batch_failure_fails_only_that_batch_with_a_sanitized_error(
    server: MarinerServe, tmp_path: Path
) -> None:
    out = behind_a_busy_instance(server, tmp_path / "gate", [("ok", 1), ("raise_batch", 2)])
    # TorchServe's answer to a handler that raised, for the whole batch (its worker's, too).
    failed = {"code": 503, "type": "InternalServerException", "message": "Prediction failed"}
    assert [(r.status_code, r.json()) for r in out] == [(503, failed)] * 2
    assert "secret" not in out[1].text
    assert "Traceback" not in out[1].text
    assert post(server, "ok", 4).status_code == 200


def test_wrong_result_count_is_an_internal_error(server: MarinerServe) -> None:
    r = post(server, "wrong_count")
    assert (r.status_code, r.json()["message"]) == (503, "number of batch response mismatched")
    kserve = {"instances": [{"data": {"op": "wrong_count"}}]}
    r = requests.post(f"{server.http}/v1/models/faulty:predict", json=kserve, timeout=30)
    assert r.status_code == 500  # KServe's convention, in our words
    assert "returned 0 results for a batch of 1" in r.json()["error"]
    assert post(server, "ok").status_code == 200


def test_out_of_memory_splits_the_batch_and_answers_everyone(server: MarinerServe, tmp_path: Path) -> None:
    before = counter(server, "mariner_oom_batch_splits_total")
    out = behind_a_busy_instance(server, tmp_path / "gate", [("oom_batched", i) for i in range(4)])
    assert [r.status_code for r in out] == [200] * 4
    assert [r.json()["echo"] for r in out] == [0, 1, 2, 3]
    assert counter(server, "mariner_oom_batch_splits_total") - before >= 1
    r = post(server, "oom_always")
    # TorchServe's answer on its endpoint; KServe's in our words, with our code's status.
    assert (r.status_code, r.json()["message"]) == (507, "Out of resources")
    kserve = {"instances": [{"data": {"op": "oom_always"}}]}
    r = requests.post(f"{server.http}/v1/models/faulty:predict", json=kserve, timeout=30)
    assert r.status_code == 503  # RESOURCE_EXHAUSTED
    assert "out of memory on this request alone" in r.json()["error"]


def test_a_hung_handler_times_out_and_its_instance_is_replaced(server: MarinerServe, tmp_path: Path) -> None:
    before = counter(server, "mariner_instance_restarts_total", reason="hung")
    release = tmp_path / "release"
    r = post(server, "hang", str(release))  # the handler runs until `release` exists
    release.touch()  # only now may the hung handler end: the answer did not wait for it
    # TorchServe's answer to a response timeout on its endpoint (OIP/KServe keep 504).
    assert (r.status_code, r.json()["message"]) == (500, "Worker died.")
    wait_until_ok(server)
    assert counter(server, "mariner_instance_restarts_total", reason="hung") - before == 1


def test_a_torchserve_request_may_wait_longer_than_its_response_timeout_in_the_queue(
    server: MarinerServe, tmp_path: Path
) -> None:
    """responseTimeout bounds a batch's run from its start, as on TorchServe, not a request's wait
    before it: requests queued behind a busy instance for longer than that are answered, over
    REST and gRPC, and no worker is replaced."""
    protogen.generate()
    from mariner.server._proto.torchserve import inference_pb2, inference_pb2_grpc

    before = counter(server, "mariner_instance_restarts_total", reason="hung")
    gate = tmp_path / "gate"
    gate.mkdir()
    with grpc.insecure_channel(server.grpc_target) as ch, ThreadPoolExecutor(4) as pool:
        stub = inference_pb2_grpc.InferenceAPIsServiceStub(ch)
        grpc_request = inference_pb2.PredictionsRequest(
            model_name="faulty", input={"data": json.dumps({"op": "ok", "value": "grpc"}).encode()}
        )
        blocker = pool.submit(post, server, "block", str(gate))
        wait_for(lambda: (gate / "started").exists() or blocker.done(), "the blocker never ran")
        queued_at = time.monotonic()
        slow = pool.submit(post, server, "sleep", 4.5)  # its batch runs 4.5 s of the 6 allowed
        rest = pool.submit(post, server, "ok", "rest")
        over_grpc = pool.submit(stub.Predictions, grpc_request)  # no client deadline, as TorchServe's
        wait_for(
            lambda: counter(server, "mariner_queue_depth", model="faulty") == 3 or blocker.done(),
            "the requests never queued behind the blocker",
        )
        time.sleep(2.0)  # held in the queue: with the batch's 4.5 s, longer than responseTimeout
        (gate / "release").touch()
        answers = [blocker.result(), slow.result(), rest.result()]
        grpc_answer = over_grpc.result()
        waited = time.monotonic() - queued_at
    assert waited > 6, "the case under test: queued and run for longer than responseTimeout"
    assert [r.status_code for r in answers] == [200, 200, 200], [r.text for r in answers]
    assert answers[2].json()["echo"] == "rest"
    assert json.loads(grpc_answer.prediction)["echo"] == "grpc"
    assert counter(server, "mariner_instance_restarts_total", reason="hung") == before


def test_an_instance_that_ends_is_restarted_and_health_recovers(server: MarinerServe) -> None:
    protogen.generate()
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from mariner.server._proto.torchserve import inference_pb2, inference_pb2_grpc

    before = counter(server, "mariner_instance_restarts_total", reason="failed")
    with grpc.insecure_channel(server.grpc_target) as ch:
        stub = inference_pb2_grpc.InferenceAPIsServiceStub(ch)
        with pytest.raises(grpc.RpcError) as info:
            stub.Predictions(
                inference_pb2.PredictionsRequest(
                    model_name="faulty", input={"data": json.dumps({"op": "exit"}).encode()}
                )
            )
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        wait_until_ok(server)
        health = health_pb2_grpc.HealthStub(ch)
        deadline = time.monotonic() + 120  # a cap on waiting for the event, not a speed verdict
        while (
            health.Check(health_pb2.HealthCheckRequest(service="faulty")).status
            != health_pb2.HealthCheckResponse.SERVING
        ):
            assert time.monotonic() < deadline, "health did not return to SERVING"
            time.sleep(0.1)
    assert counter(server, "mariner_instance_restarts_total", reason="failed") - before == 1
    describe = requests.get(f"{server.management}/models/faulty", timeout=10).json()
    assert re.search(r"faulty-1\.0-0\.\d+", json.dumps(describe)), describe


def test_overload_rejects_at_once_and_answers_every_accepted_request(tmp_path: Path) -> None:
    build_fault_archive(tmp_path, name="faulty", response_timeout_s=60)
    srv = MarinerServe(tmp_path, "faulty.mar", max_queue=4).start()
    gate = tmp_path / "gate"
    gate.mkdir()
    try:
        rejected: list[requests.Response] = []
        lock = threading.Lock()

        def one(i: int) -> requests.Response:
            r = post(srv, "ok", i)
            if r.status_code == 503:
                with lock:
                    rejected.append(r)
            return r

        with ThreadPoolExecutor(16) as pool:
            blocker = pool.submit(post, srv, "block", str(gate))
            wait_for(lambda: (gate / "started").exists() or blocker.done(), "the blocker never ran")
            futures = [pool.submit(one, i) for i in range(1, 16)]
            # While the instance is held, 15 arrivals meet a queue of 4: the rest are refused at once.
            wait_for(lambda: len(rejected) == 11 or blocker.done(), "the overflow was not refused at once")
            assert counter(srv, "mariner_queue_depth", model="faulty") == 4
            (gate / "release").touch()
            assert blocker.result().status_code == 200
            answers = [f.result() for f in futures]
        codes = [r.status_code for r in answers]
        assert sorted(codes) == [200] * 4 + [503] * 11
        for r in rejected:
            assert r.headers.get("Retry-After") == "1"
            assert "overloaded" in r.json()["message"]
        assert sorted(r.json()["echo"] for r in answers if r.status_code == 200) == sorted(
            i for i, c in zip(range(1, 16), codes, strict=True) if c == 200
        )
    finally:
        srv.stop()
