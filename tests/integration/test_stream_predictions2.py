"""TorchServe's StreamPredictions2 against a real `mariner serve`, in TorchServe's own messages.

The messages come from the `inference.proto` (and google/rpc protos) that the installed
torchserve wheel carries in its model-server.jar, compiled at test time: the client is
TorchServe's wire, not our stubs. The server runs with an inference token, so every call here
also proves a stream is authenticated like a unary call.

- pipelining: 64 digits requests written before any answer is read come back with their
  sequence ids and the same bytes as unary Predictions; they share batches (a blocked probe
  instance makes that deterministic, and the digits batch count is printed);
- sequences: steps of one sequence id reach a stateful handler in order, with TorchServe's
  sequence headers; different ids run concurrently;
- completion order: a request held by a blocked handler is answered after a later one;
- per-item errors in-stream, the stream going on; metrics count streamed requests as calls;
- stock TorchServe answers the same sequence with the same bytes and the same error status.
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import requests

from tests.integration.fault_archive import build_fault_archive, write_handler_archive
from tests.integration.ts_examples.calls import message
from tests.mariner_serve import MarinerServe

pytestmark = pytest.mark.integration

DIGITS = "digits_torchscript"
TOKEN = "stream-token-1"
AUTH = (("authorization", f"Bearer {TOKEN}"),)
METHOD = "/org.pytorch.serve.grpc.inference.InferenceAPIsService/StreamPredictions2"
UNARY = "/org.pytorch.serve.grpc.inference.InferenceAPIsService/Predictions"
CAP_S = 120.0  # only so a broken server cannot hang the run

# A stateful handler: counts each sequence's steps, reports its batch size and the sequence
# headers it saw; a request with a "gate" directory holds the instance until `release` exists.
PROBE = """
import json
import os
import time


class Probe:
    def initialize(self, context):
        self.steps = {}

    def handle(self, data, context):
        out = []
        for i, row in enumerate(data):
            body = row.get("data") if row.get("data") is not None else row.get("body")
            body = json.loads(body)
            gate = body.get("gate")
            if gate:
                open(os.path.join(gate, "started"), "w").close()
                end = time.monotonic() + 300
                while not os.path.exists(os.path.join(gate, "release")) and time.monotonic() < end:
                    time.sleep(0.005)
            seq = context.get_request_header(i, "ts_request_sequence_id")
            self.steps[seq] = self.steps.get(seq, 0) + 1
            out.append(json.dumps({
                "seq": seq,
                "step": self.steps[seq],
                "value": body.get("value"),
                "batch": len(data),
                "start": context.get_request_header(i, "ts_request_sequence_start"),
                "end": context.get_request_header(i, "ts_request_sequence_end"),
            }))
        return out
"""
PROBE_CONFIG = "minWorkers: 1\nmaxWorkers: 1\nbatchSize: 32\nmaxBatchDelay: 0\nresponseTimeout: 120\n"


# -- TorchServe's messages (compiled from its jar, `ts_examples.calls`) ---------------------------
msg = message


def request(model: str, body: Any, seq: str | None = None, **extra: bytes) -> Any:
    cls = msg("org.pytorch.serve.grpc.inference.PredictionsRequest")
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = cls(model_name=model, input={"data": data, **extra})
    if seq is not None:
        r.sequence_id = seq
    return r


def status_of(answer: Any) -> tuple[int, str, str]:
    """An answer's in-stream status as (code, message, ErrorInfo reason); (0, "", "") when unset."""
    status = answer.status
    return status.code, status.message, reason_of(status) if answer.HasField("status") else ""


def reason_of(status: Any) -> str:
    info = msg("google.rpc.ErrorInfo")()
    (detail,) = status.details
    assert detail.Unpack(info)
    return info.reason


def stream(target: str, reqs: list[Any], metadata: Any = AUTH) -> list[Any]:
    """Write every request before reading any answer, then half-close and read them all."""
    response_cls = msg("org.pytorch.serve.grpc.inference.PredictionResponse")

    async def main() -> list[Any]:
        async with grpc.aio.insecure_channel(target) as channel:
            call = channel.stream_stream(
                METHOD,
                request_serializer=lambda m: m.SerializeToString(),
                response_deserializer=response_cls.FromString,
            )(metadata=metadata, timeout=CAP_S)
            for r in reqs:
                await call.write(r)
            await call.done_writing()
            return [a async for a in call]

    return asyncio.run(main())


def unary(target: str, r: Any) -> bytes:
    response_cls = msg("org.pytorch.serve.grpc.inference.PredictionResponse")
    with grpc.insecure_channel(target) as channel:
        call = channel.unary_unary(
            UNARY,
            request_serializer=lambda m: m.SerializeToString(),
            response_deserializer=response_cls.FromString,
        )
        return bytes(call(r, metadata=AUTH, timeout=CAP_S).prediction)


def same_prediction(got: bytes, want: bytes) -> None:
    g, w = json.loads(got), json.loads(want)
    assert g["label"] == w["label"]
    assert [t["label"] for t in g["topk"]] == [t["label"] for t in w["topk"]]
    for a, b in zip(g["topk"], w["topk"], strict=True):
        assert a["probability"] == pytest.approx(b["probability"], abs=1e-4)


def pixels(n: int, seed: int = 0) -> list[list[float]]:
    return np.random.default_rng(seed).integers(0, 17, size=(n, 64)).astype(float).tolist()


# -- the server -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(model_store: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[MarinerServe]:
    store = tmp_path_factory.mktemp("store")
    shutil.copy2(model_store / f"{DIGITS}.mar", store)
    write_handler_archive(
        store / "probe.mar", "probe", "probe.py", {"probe.py": PROBE, "model-config.yaml": PROBE_CONFIG}
    )
    build_fault_archive(store, response_timeout_s=60)
    srv = MarinerServe(store, f"{DIGITS}.mar,probe.mar,faulty.mar", inference_token=TOKEN).start()
    try:
        yield srv
    finally:
        srv.stop()


def metric(srv: MarinerServe, name: str, **labels: str) -> float:
    total = 0.0
    for line in requests.get(f"{srv.metrics}/metrics", timeout=30).text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        got = dict(re.findall(r'(\w+)="([^"]*)"', line.split("}")[0]))
        if all(got.get(k) == v for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def wait_for(condition: Any, what: str) -> None:
    end = time.monotonic() + CAP_S
    while not condition():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.01)


# -- tests ----------------------------------------------------------------------------------------
def test_64_pipelined_requests_answer_as_unary_predictions_do(server: MarinerServe) -> None:
    rows = pixels(64)
    reqs = [request(DIGITS, row, f"s{i}") for i, row in enumerate(rows)]
    expected = {f"s{i}": unary(server.grpc_target, r) for i, r in enumerate(reqs)}
    batches = metric(server, "mariner_batch_size_count", model=DIGITS)
    ok = metric(server, "mariner_requests_total", model=DIGITS, protocol="torchserve-grpc", code="200")
    answers = stream(server.grpc_target, reqs)
    assert sorted(a.sequence_id for a in answers) == sorted(expected)
    assert all(not a.HasField("status") for a in answers)
    for a in answers:  # batched kernels round the 6th decimal differently: labels exact, probs close
        same_prediction(bytes(a.prediction), expected[a.sequence_id])
    ran_in = metric(server, "mariner_batch_size_count", model=DIGITS) - batches
    print(f"\n64 pipelined StreamPredictions2 requests ran in {ran_in:.0f} batches")
    # every streamed request is one call in the same counters as unary Predictions
    after = metric(server, "mariner_requests_total", model=DIGITS, protocol="torchserve-grpc", code="200")
    assert after - ok == 64


def test_sequences_run_in_order_with_torchserve_headers_and_share_batches(
    server: MarinerServe, tmp_path: Path
) -> None:
    """A gate holds the probe's instance while 2 sequences of 6 steps and 20 one-off requests
    (empty id, start=true) queue; released, the one-offs run together and each sequence's steps
    reach the handler in arrival order."""
    reqs = [request("probe", {"gate": str(tmp_path), "value": "gate"}, "gate")]
    for step in range(1, 7):
        reqs += [request("probe", {"value": step}, "A"), request("probe", {"value": step}, "B")]
    reqs += [request("probe", {"value": f"o{i}"}, None, ts_request_sequence_start=b"true") for i in range(20)]

    async def main() -> list[Any]:
        response_cls = msg("org.pytorch.serve.grpc.inference.PredictionResponse")
        async with grpc.aio.insecure_channel(server.grpc_target) as channel:
            call = channel.stream_stream(
                METHOD,
                request_serializer=lambda m: m.SerializeToString(),
                response_deserializer=response_cls.FromString,
            )(metadata=AUTH, timeout=CAP_S)
            await call.write(reqs[0])
            await asyncio.to_thread(wait_for, (tmp_path / "started").exists, "the gate to hold the instance")
            for r in reqs[1:]:
                await call.write(r)
            await call.done_writing()
            # 20 one-offs + the first step of A and of B wait in the queue (the others wait their turn)
            await asyncio.to_thread(
                wait_for,
                lambda: metric(server, "mariner_queue_depth", model="probe") >= 22,
                "the queue to fill",
            )
            (tmp_path / "release").touch()
            return [a async for a in call]

    answers = asyncio.run(main())
    assert len(answers) == len(reqs)
    assert all(not a.HasField("status") for a in answers)
    seen = [json.loads(a.prediction) for a in answers]
    for seq in ("A", "B"):
        steps = [s for s in seen if s["seq"] == seq]
        assert [(s["step"], s["value"]) for s in steps] == [(k, k) for k in range(1, 7)]
        assert all(s["end"] == "true" and s["start"] is None for s in steps)
    oneoffs = [s for s in seen if str(s["value"]).startswith("o")]
    assert len(oneoffs) == 20
    assert all(s["seq"].startswith("ts-seq-") and s["start"] == "true" for s in oneoffs)
    assert len({s["seq"] for s in oneoffs}) == 20
    by_value = {json.loads(a.prediction)["value"]: a.sequence_id for a in answers}
    assert all(by_value[s["value"]] == s["seq"] for s in oneoffs)  # the generated id is echoed
    assert max(s["batch"] for s in oneoffs) > 1  # queued together, run together


def test_a_later_request_is_answered_before_a_held_one(server: MarinerServe, tmp_path: Path) -> None:
    response_cls = msg("org.pytorch.serve.grpc.inference.PredictionResponse")

    async def main() -> list[str]:
        async with grpc.aio.insecure_channel(server.grpc_target) as channel:
            call = channel.stream_stream(
                METHOD,
                request_serializer=lambda m: m.SerializeToString(),
                response_deserializer=response_cls.FromString,
            )(metadata=AUTH, timeout=CAP_S)
            await call.write(request("probe", {"gate": str(tmp_path), "value": "slow"}, "slow"))
            await asyncio.to_thread(wait_for, (tmp_path / "started").exists, "the slow request to start")
            await call.write(request("faulty", {"op": "ok", "value": "fast"}, "fast"))
            first = await call.read()
            (tmp_path / "release").touch()
            await call.done_writing()
            second = await call.read()
            return [first.sequence_id, second.sequence_id]

    assert asyncio.run(main()) == ["fast", "slow"]


def test_failures_are_answered_in_stream_and_the_stream_goes_on(server: MarinerServe) -> None:
    good = pixels(2, seed=3)
    reqs = [
        request(DIGITS, good[0], "g1"),
        request(DIGITS, good[0], None),  # no sequence id, no start: TorchServe's BadRequestException
        request("", good[0], "no-model"),
        request("nope", good[0], "unknown"),
        request(DIGITS, [1.0] * 3, "bad-input"),  # the handler's own 400
        request("faulty", {"op": "raise_batch"}, "raised"),
        request(DIGITS, good[1], "g2"),
    ]
    answers = stream(server.grpc_target, reqs)
    assert len(answers) == len(reqs)
    by = {a.sequence_id: a for a in answers}
    assert {"g1", "g2"} <= set(by)
    same_prediction(bytes(by["g1"].prediction), unary(server.grpc_target, reqs[0]))
    same_prediction(bytes(by["g2"].prediction), unary(server.grpc_target, reqs[-1]))
    internal = "org.pytorch.serve.http.InternalServerException"
    assert status_of(by[""]) == (13, "Parameter sequenceId is required.", "BadRequestException.()")
    assert status_of(by["no-model"]) == (13, "Parameter model_name is required.", "BadRequestException.()")
    assert status_of(by["unknown"]) == (
        13,
        "Model not found: nope",
        "org.pytorch.serve.archive.model.ModelNotFoundException",
    )
    code, _, reason = status_of(by["bad-input"])
    assert (code, reason) == (grpc.StatusCode.INVALID_ARGUMENT.value[0], internal)
    assert status_of(by["raised"]) == (grpc.StatusCode.UNAVAILABLE.value[0], "Prediction failed", internal)


def test_an_undecodable_message_ends_the_stream_after_answering_what_came_before(
    server: MarinerServe,
) -> None:
    """Bytes that are not a PredictionsRequest end the request side INVALID_ARGUMENT, but the
    requests read before them are answered first (an abort at the bad message lost them)."""
    response_cls = msg("org.pytorch.serve.grpc.inference.PredictionResponse")
    good = request(DIGITS, pixels(1, seed=5)[0], "before").SerializeToString()

    async def main() -> tuple[list[Any], grpc.aio.AioRpcError]:
        async with grpc.aio.insecure_channel(server.grpc_target) as channel:
            call = channel.stream_stream(METHOD, request_serializer=None, response_deserializer=None)(
                metadata=AUTH, timeout=CAP_S
            )
            # Nothing is written after the bad message: the server may already have ended the call,
            # and a write racing that end fails in the client's own core (INTERNAL), not here.
            for raw in (good, b"\xff\xff\xff\xff"):
                await call.write(raw)
            await call.done_writing()  # a no-op once the call has ended
            got: list[Any] = []

            async def read_all() -> None:
                async for a in call:
                    got.append(response_cls.FromString(a))

            with pytest.raises(grpc.aio.AioRpcError) as ended:
                await read_all()
            return got, ended.value

    answers, ended = asyncio.run(main())
    assert [a.sequence_id for a in answers] == ["before"]
    assert not answers[0].HasField("status")
    assert ended.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "not a valid protobuf message" in (ended.details() or "")


def test_a_stream_without_the_token_is_refused_like_a_unary_call(server: MarinerServe) -> None:
    response_cls = msg("org.pytorch.serve.grpc.inference.PredictionResponse")

    async def refused(metadata: Any) -> tuple[grpc.StatusCode, str]:
        # No message is ever sent: the server refuses on the metadata alone (a message racing
        # that refusal can fail in the client's own core as INTERNAL instead).
        async def requests() -> Any:
            await asyncio.Event().wait()
            yield request(DIGITS, pixels(1)[0], "s")

        async with grpc.aio.insecure_channel(server.grpc_target) as channel:
            call = channel.stream_stream(
                METHOD,
                request_serializer=lambda m: m.SerializeToString(),
                response_deserializer=response_cls.FromString,
            )(requests(), metadata=metadata, timeout=CAP_S)
            async for _ in call:
                pass
            return await call.code(), await call.details()

    for metadata in ((), (("authorization", "Bearer nope"),)):
        with pytest.raises(grpc.aio.AioRpcError) as info:
            asyncio.run(refused(metadata))
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert info.value.details() == "missing or invalid bearer token"


def test_a_drain_answers_what_streams_read_and_ends_them_unavailable(
    model_store: Path, tmp_path: Path
) -> None:
    """SIGTERM: an idle stream ends at once with UNAVAILABLE (it does not hold the drain for
    the grace period); a stream with a request in flight gets its answer, then UNAVAILABLE."""
    from mariner.server.frontend.protocols.grpc_drain_gate import DRAINING_MESSAGE

    store = tmp_path / "store"
    write_handler_archive(
        store / "probe.mar", "probe", "probe.py", {"probe.py": PROBE, "model-config.yaml": PROBE_CONFIG}
    )
    build_fault_archive(store, response_timeout_s=60)
    gate = tmp_path / "gate"
    gate.mkdir()
    srv = MarinerServe(store, "probe.mar,faulty.mar").start()
    response_cls = msg("org.pytorch.serve.grpc.inference.PredictionResponse")

    async def end_of(call: Any) -> tuple[list[Any], grpc.StatusCode, str]:
        answers = []
        while (a := await read_or_end(call)) is not None:
            answers.append(a)
        return answers, await call.code(), await call.details()

    async def read_or_end(call: Any) -> Any:
        try:
            a = await call.read()
        except grpc.aio.AioRpcError:
            return None
        return None if a is grpc.aio.EOF else a

    async def main() -> None:
        async with grpc.aio.insecure_channel(srv.grpc_target) as channel:
            method = channel.stream_stream(
                METHOD,
                request_serializer=lambda m: m.SerializeToString(),
                response_deserializer=response_cls.FromString,
            )
            idle, held = method(timeout=CAP_S), method(timeout=CAP_S)
            await idle.write(request("faulty", {"op": "ok", "value": 1}, "idle"))
            assert (await idle.read()).sequence_id == "idle"  # accepted, now idle in its next read
            await held.write(request("probe", {"gate": str(gate), "value": "held"}, "held"))
            await asyncio.to_thread(wait_for, (gate / "started").exists, "the held request to start")
            assert srv.proc is not None
            srv.proc.send_signal(signal.SIGTERM)
            assert await end_of(idle) == ([], grpc.StatusCode.UNAVAILABLE, DRAINING_MESSAGE)
            (gate / "release").touch()  # only now: the idle stream did not wait for this one
            answers, code, details = await end_of(held)
            assert [a.sequence_id for a in answers] == ["held"]
            assert json.loads(answers[0].prediction)["value"] == "held"
            assert (code, details) == (grpc.StatusCode.UNAVAILABLE, DRAINING_MESSAGE)

    try:
        asyncio.run(main())
        assert srv.proc is not None
        assert srv.proc.wait(CAP_S) == 0
    finally:
        srv.stop()


def test_one_stream_with_64_in_flight_against_64_concurrent_unary_calls(server: MarinerServe) -> None:
    """Prints requests/s of one StreamPredictions2 stream holding 64 requests in flight and of
    64 concurrent unary Predictions calls on one channel, on digits: 3 interleaved rounds of
    `N` requests each (A, B, A, B...), medians and their ratio. Asserts only that all answered."""
    n, rounds = 640, 5
    rows = pixels(64, seed=11)
    body = [request(DIGITS, row, f"s{i}") for i, row in enumerate(rows)]
    response_cls = msg("org.pytorch.serve.grpc.inference.PredictionResponse")
    ser = {
        "request_serializer": lambda m: m.SerializeToString(),
        "response_deserializer": response_cls.FromString,
    }

    async def one_stream(channel: grpc.aio.Channel) -> float:
        call = channel.stream_stream(METHOD, **ser)(metadata=AUTH, timeout=CAP_S)
        room = asyncio.Semaphore(64)
        start = time.perf_counter()

        async def write() -> None:
            for i in range(n):
                await room.acquire()
                await call.write(body[i % 64])
            await call.done_writing()

        writer = asyncio.create_task(write())
        got = 0
        async for answer in call:
            assert not answer.HasField("status")
            got += 1
            room.release()
        await writer
        assert got == n
        return n / (time.perf_counter() - start)

    async def unary_calls(channel: grpc.aio.Channel) -> float:
        predict = channel.unary_unary(UNARY, **ser)
        left = list(range(n))
        start = time.perf_counter()

        async def caller() -> None:
            while left:
                i = left.pop()
                answer = await predict(body[i % 64], metadata=AUTH, timeout=CAP_S)
                assert answer.prediction

        await asyncio.gather(*(caller() for _ in range(64)))
        return n / (time.perf_counter() - start)

    async def main() -> tuple[list[float], list[float]]:
        async with grpc.aio.insecure_channel(server.grpc_target) as channel:
            await one_stream(channel)  # warm up both paths
            await unary_calls(channel)
            streamed, unary_ = [], []
            for _ in range(rounds):
                streamed.append(await one_stream(channel))
                unary_.append(await unary_calls(channel))
            return streamed, unary_

    streamed, unary_ = asyncio.run(main())
    s, u = float(np.median(streamed)), float(np.median(unary_))
    print(
        f"\ndigits, {n} requests x {rounds} interleaved rounds: one stream (64 in flight) {s:.0f} req/s, "
        f"64 unary calls {u:.0f} req/s, ratio {s / u:.2f} (rounds: stream {[round(x) for x in streamed]}, "
        f"unary {[round(x) for x in unary_]}, paired ratio median "
        f"{float(np.median([a / b for a, b in zip(streamed, unary_, strict=True)])):.2f})"
    )
