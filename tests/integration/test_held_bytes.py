"""A frontend's budget of held request bytes, against a live `mariner serve` (127.0.0.1, bounded).

Replays the review's attack at a small scale: streams that send large messages to a model that
cannot answer yet (its one worker is held by a gate) used to be read up to their window of 64
each, whatever the bytes; here each stream stops at its own budget and all of them at their share
of the frontend's, so the frontend's memory stays flat. Large unary calls fill the rest, and the
one that does not fit is answered 503 with Retry-After at once; a small call to another model is
served throughout; once the gate opens every streamed request is answered and the budget is free
again.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import psutil
import pytest
import requests

from mariner.server._proto.torchserve import inference_pb2, inference_pb2_grpc
from tests.integration.fault_archive import build_fault_archive
from tests.mariner_serve import MarinerServe

pytestmark = pytest.mark.integration

MIB = 1 << 20
STREAMS = 6
PER_STREAM = 40  # messages of 1 MiB each: 240 MiB offered in all
TIMEOUT = 120


def _body(op: str, value: object, pad: int = 0) -> bytes:
    return json.dumps({"op": op, "value": value, "pad": "x" * pad}).encode()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MarinerServe]:
    store = tmp_path_factory.mktemp("held")
    build_fault_archive(store, name="held", response_timeout_s=120)
    build_fault_archive(store, name="plain")
    srv = MarinerServe(
        store,
        "held.mar,plain.mar",
        max_request_bytes=2 * MIB,
        frontend_max_held_mb=16,  # streams stop at 8 MiB together
        stream_max_held_mb=3,
    ).start()
    try:
        yield srv
    finally:
        srv.stop()


def _stream(srv: MarinerServe, n: int, answers: list[int]) -> None:
    def messages() -> Iterator[inference_pb2.PredictionsRequest]:
        for i in range(PER_STREAM):
            yield inference_pb2.PredictionsRequest(
                model_name="held", sequence_id=f"s{n}-{i}", input={"body": _body("ok", i, MIB)}
            )

    with grpc.insecure_channel(srv.grpc_target) as ch:
        stub = inference_pb2_grpc.InferenceAPIsServiceStub(ch)
        for answer in stub.StreamPredictions2(messages(), timeout=TIMEOUT):
            assert json.loads(answer.prediction)["echo"] is not None
            answers[n] += 1


@pytest.mark.serial  # a latency bound: measured with no other test's servers beside it
def test_streams_and_large_calls_are_held_to_the_budget_and_others_are_served(
    server: MarinerServe, tmp_path: Path
) -> None:
    (frontend,) = server.frontend_pids()
    proc = psutil.Process(frontend)
    rss_before = proc.memory_info().rss
    gate = tmp_path / "gate"
    gate.mkdir()
    url = f"{server.http}/predictions/held"
    answers = [0] * STREAMS
    with ThreadPoolExecutor(STREAMS + 12) as pool:
        blocker = pool.submit(requests.post, url, data=_body("block", str(gate)), timeout=TIMEOUT)
        deadline = time.monotonic() + 60
        while not (gate / "started").exists():
            assert time.monotonic() < deadline, "the gate's request never started"
            time.sleep(0.01)
        streams = [pool.submit(_stream, server, n, answers) for n in range(STREAMS)]
        time.sleep(3.0)  # the streams send what they may; unbounded, they would hold 240 MiB
        rss_streams = proc.memory_info().rss

        # Large unary calls take the rest of the budget; the one past it is refused at once.
        big = [pool.submit(requests.post, url, data=_body("ok", "big", int(1.5 * MIB)), timeout=TIMEOUT)]
        refused = None
        for _ in range(10):
            big.append(
                pool.submit(requests.post, url, data=_body("ok", "big", int(1.5 * MIB)), timeout=TIMEOUT)
            )
            time.sleep(0.2)
            done = [f.result() for f in big if f.done()]
            refused = next((r for r in done if r.status_code == 503), None)
            if refused is not None:
                break
        assert refused is not None, "a large call past the budget is refused"
        assert refused.headers["retry-after"] == "1"
        assert "frontend_max_held_mb" in refused.json()["message"]

        # A small call to another model is served meanwhile, promptly.
        t0 = time.monotonic()
        small = requests.post(f"{server.http}/predictions/plain", data=_body("ok", 7), timeout=30)
        assert small.status_code == 200
        assert small.json()["echo"] == 7
        assert time.monotonic() - t0 < 2.0

        grew = (rss_streams - rss_before) / MIB
        assert grew < 120, f"the frontend grew {grew:.0f} MiB under {STREAMS * PER_STREAM} MiB of streams"

        (gate / "release").touch()
        assert blocker.result().status_code == 200
        for f in streams:
            f.result()
        for f in big:
            assert f.result().status_code in (200, 503)
    assert answers == [PER_STREAM] * STREAMS, "every streamed request was answered in the end"
    # The budget is free again: a large call is served.
    again = requests.post(url, data=_body("ok", "after", int(1.5 * MIB)), timeout=TIMEOUT)
    assert again.status_code == 200, again.text
    print(
        f"\nfrontend RSS: {rss_before / MIB:.0f} MiB before, {rss_streams / MIB:.0f} MiB with "
        f"{STREAMS} streams offering {STREAMS * PER_STREAM} MiB"
    )


def test_a_grpc_unary_call_past_the_budget_is_resource_exhausted(
    server: MarinerServe, tmp_path: Path
) -> None:
    gate = tmp_path / "gate"
    gate.mkdir()
    url = f"{server.http}/predictions/held"
    with ThreadPoolExecutor(16) as pool:
        blocker = pool.submit(requests.post, url, data=_body("block", str(gate)), timeout=TIMEOUT)
        while not (gate / "started").exists():
            time.sleep(0.01)
        calls = []
        codes: list[grpc.StatusCode] = []
        refusals: list[tuple[str, tuple[tuple[str, str], ...]]] = []
        lock = threading.Lock()

        def unary(i: int) -> None:
            with grpc.insecure_channel(server.grpc_target) as ch:
                stub = inference_pb2_grpc.InferenceAPIsServiceStub(ch)
                request = inference_pb2.PredictionsRequest(
                    model_name="held", input={"body": _body("ok", i, int(1.5 * MIB))}
                )
                try:
                    stub.Predictions(request, timeout=TIMEOUT)
                    code = grpc.StatusCode.OK
                except grpc.RpcError as exc:
                    code = exc.code()
                    if code is grpc.StatusCode.RESOURCE_EXHAUSTED:
                        with lock:
                            refusals.append((exc.details(), tuple(exc.trailing_metadata() or ())))
                with lock:
                    codes.append(code)

        for i in range(14):  # 21 MiB offered to a 16 MiB budget
            calls.append(pool.submit(unary, i))
            time.sleep(0.1)
        deadline = time.monotonic() + 30
        while grpc.StatusCode.RESOURCE_EXHAUSTED not in codes:
            assert time.monotonic() < deadline, f"no refusal: {codes}"
            time.sleep(0.05)
        (gate / "release").touch()
        assert blocker.result().status_code == 200
        for f in calls:
            f.result()
    assert set(codes) <= {grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED}
    for details, trailing in refusals:
        assert "frontend_max_held_mb" in details
        assert ("retry-after", "1") in trailing
    assert codes.count(grpc.StatusCode.OK) >= 8, codes
