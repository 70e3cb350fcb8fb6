"""The pipelining helper behind ModelStreamInfer and StreamPredictions2, driven in pure asyncio
(event-gated, no sleeps that decide a verdict), then over a real grpc.aio server on port 0 for
flow control against a client that never reads, and cancellation."""

from __future__ import annotations

import asyncio
import importlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import grpc
import pytest

from mariner.server import protogen
from mariner.server.common.held_bytes import LARGE_MESSAGE_BYTES, HeldBytes, HeldLimits
from mariner.server.contracts.types import InferRequest, InferResult
from mariner.server.frontend.protocols.stream_pipeline import WINDOW, Ending, StreamPipeline, StreamStats
from tests.unit.test_grpc_adapters import FakePlane

pytestmark = pytest.mark.unit

CAP_S = 60.0  # only so a broken test cannot hang the run; verdicts never depend on it


async def until(condition: Any, what: str) -> None:
    """Wait for `condition()` by yielding to the loop (event-driven, capped)."""
    loop = asyncio.get_running_loop()
    end = loop.time() + CAP_S
    while not condition():
        if loop.time() > end:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.001)


@dataclass
class Source:
    """A request iterator that counts what was read; optionally blocks or breaks."""

    items: list[str]
    read: int = 0
    hold: asyncio.Event | None = None  # after the items: wait on this (never set: an idle client)
    broken: bool = False

    async def __aiter__(self) -> AsyncIterator[str]:
        for item in self.items:
            self.read += 1
            yield item
        if self.broken:
            raise ConnectionError("the request stream broke")
        if self.hold is not None:
            await self.hold.wait()


@dataclass
class Gates:
    """`answer` waits on the gate of its request's name (if any) and records start order."""

    gates: dict[str, asyncio.Event] = field(default_factory=dict)
    started: list[str] = field(default_factory=list)
    cancelled: int = 0

    async def answer(self, request: str) -> str:
        self.started.append(request)
        gate = self.gates.get(request)
        try:
            if gate is not None:
                await gate.wait()
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        if request.startswith("crash"):
            raise RuntimeError("unexpected")
        return f"answer:{request}"


def pipe_of(source: Any, gates: Gates, **kw: Any) -> StreamPipeline[str, str]:
    return StreamPipeline(source.__aiter__(), gates.answer, on_crash=lambda r: f"crashed:{r}", **kw)


def test_answers_come_in_completion_order_and_a_crash_is_answered_in_stream() -> None:
    async def main() -> None:
        gates = Gates(gates={"slow": asyncio.Event()})
        pipe = pipe_of(Source(["slow", "fast", "crash-1", "after"]), gates)
        got: list[str] = []
        async for resp in pipe.responses():
            got.append(resp)
            if len(got) == 3:
                gates.gates["slow"].set()  # released only once the later requests were answered
        assert got[:3] == ["answer:fast", "crashed:crash-1", "answer:after"]
        assert got[3] == "answer:slow"
        assert pipe.ending is Ending.DONE

    asyncio.run(main())


def test_steps_of_one_sequence_run_in_arrival_order_others_concurrently() -> None:
    async def main() -> None:
        gates = Gates(gates={"a1": asyncio.Event()})
        stats = StreamStats()
        pipe = StreamPipeline(
            Source(["a1", "b1", "a2", "b2", "a3"]).__aiter__(),
            gates.answer,
            on_crash=str,
            key=lambda r: r[0],
            stats=stats,
        )
        got: list[str] = []
        async for resp in pipe.responses():
            got.append(resp)
            if len(got) == 2:  # b1, b2 done while a1 holds sequence a: a2, a3 have not started
                assert "a2" not in gates.started
                assert "a3" not in gates.started
                gates.gates["a1"].set()
        assert got == ["answer:b1", "answer:b2", "answer:a1", "answer:a2", "answer:a3"]
        assert [s for s in gates.started if s[0] == "a"] == ["a1", "a2", "a3"]
        assert stats.in_flight == 0

    asyncio.run(main())


def test_a_full_window_stops_the_reading_until_answers_are_taken() -> None:
    async def main() -> None:
        source = Source([f"r{i}" for i in range(1000)])
        gates = Gates()
        stats = StreamStats()
        pipe = pipe_of(source, gates, window=8, stats=stats)
        answers = pipe.responses()
        first = await anext(answers)  # then the consumer stops taking answers
        await until(lambda: source.read == 9, "the window to fill")
        for _ in range(50):  # let every task and the reader run as far as they can
            await asyncio.sleep(0)
        assert source.read == 9  # 1 answered + 8 in flight: reading stopped
        assert stats.peak == 8
        rest = [r async for r in answers]
        assert [first, *rest] == [f"answer:r{i}" for i in range(1000)]
        assert stats.peak == 8
        assert stats.in_flight == 0

    asyncio.run(main())


def _sized(name: str) -> int:
    """Test requests are named "<anything>:<bytes>"."""
    return int(name.rsplit(":", 1)[1])


def sized_stream(held: HeldBytes, count: int, size: int, **source: Any) -> tuple[Source, Gates, Any]:
    """`count` gated requests of `size` bytes each, on a pipeline counting them in `held`; the
    answers' iterator is the third item (its first answer is awaited by the caller)."""
    names = [f"r{i}:{size}" for i in range(count)]
    feed = Source(names, **source)
    gates = Gates(gates={name: asyncio.Event() for name in names})
    pipe = pipe_of(feed, gates, held=held, size=_sized)
    return feed, gates, pipe.responses()


def test_a_stream_stops_reading_at_its_own_byte_budget_and_goes_on_as_answers_are_written() -> None:
    async def main() -> None:
        held = HeldBytes(HeldLimits(limit=1000, stream_limit=100))
        source, gates, answers = sized_stream(held, 50, 30)
        first = asyncio.ensure_future(anext(answers))
        await until(lambda: source.read == 4, "the stream to hold its budget")
        await asyncio.sleep(0.05)  # time enough to read more, were it allowed
        assert source.read == 4, "stopped at 120 bytes held, the first read past 100"
        assert held.held == 120
        gates.gates["r0:30"].set()
        assert await first == "answer:r0:30"
        await until(lambda: source.read == 5, "one more read once 30 bytes were released")
        assert held.held == 120
        for gate in gates.gates.values():
            gate.set()
        rest = [a async for a in answers]
        assert len(rest) == 49
        assert held.held == 0, "every request's bytes released as its answer was written"
        assert held.peak <= 130

    asyncio.run(main())


def test_streams_stop_reading_at_their_share_of_the_frontends_budget() -> None:
    async def main() -> None:
        held = HeldBytes(HeldLimits(limit=200, stream_limit=200))  # streams together: 100
        held.add(90)  # a unary call's bytes
        source, gates, answers = sized_stream(held, 10, 20)
        first = asyncio.ensure_future(anext(answers))
        await until(lambda: source.read == 1, "one read")
        await asyncio.sleep(0.05)
        assert source.read == 1, "90 + 20 held: past the streams' share, no more reads"
        assert held.take(50), "a unary call still fits: streams never take its part"
        assert not held.take(50), "and past the whole budget it is refused"
        held.release(50 + 90)  # the unary calls end: streams may read again
        await until(lambda: source.read == 5, "reading resumes to the share again")
        for gate in gates.gates.values():
            gate.set()
        assert (await first).startswith("answer:")
        assert len([a async for a in answers]) == 9
        assert held.held == 0

    asyncio.run(main())


@dataclass
class SlowReads:
    """A request iterator whose every read takes a few turns of the loop, counting how many reads
    of all such iterators are under way at once (after each one's first)."""

    items: list[str]
    shared: dict[str, int]
    hold: asyncio.Event | None = None  # after the items: wait on this (never set: an idle client)

    async def __aiter__(self) -> AsyncIterator[str]:
        for n, item in enumerate(self.items):
            if n:
                self.shared["now"] += 1
                self.shared["most"] = max(self.shared["most"], self.shared["now"])
            for _ in range(3):
                await asyncio.sleep(0)
            if n:
                self.shared["now"] -= 1
            yield item
        if self.hold is not None:
            await self.hold.wait()


async def collect(pipe: StreamPipeline[str, str]) -> list[str]:
    return [r async for r in pipe.responses()]


def test_large_messages_of_many_streams_are_read_one_at_a_time() -> None:
    """Twelve streams of 7 MiB messages finished their reads together and another client's next
    step waited behind all of them; after a large message a stream reads in the frontend's turn."""

    async def main() -> None:
        held = HeldBytes(HeldLimits(limit=1 << 40, stream_limit=1 << 40))
        shared = {"now": 0, "most": 0}
        big = LARGE_MESSAGE_BYTES
        pipes = [
            pipe_of(SlowReads([f"s{k}-{i}:{big}" for i in range(5)], shared), Gates(), held=held, size=_sized)
            for k in range(4)
        ]
        answers = await asyncio.gather(*(collect(p) for p in pipes))
        assert [len(a) for a in answers] == [5, 5, 5, 5]
        assert shared["most"] == 1, "two large reads were under way at once"
        assert held.turns == 4 * 4, "every read after a large message took the turn"
        assert held.held == 0

        small = HeldBytes(HeldLimits(limit=1 << 40, stream_limit=1 << 40))
        shared.update(now=0, most=0)
        pipes = [
            pipe_of(SlowReads([f"s{k}-{i}:100" for i in range(5)], shared), Gates(), held=small, size=_sized)
            for k in range(4)
        ]
        await asyncio.gather(*(collect(p) for p in pipes))
        assert small.turns == 0, "small messages are read without waiting for a turn"
        assert shared["most"] > 1

    asyncio.run(main())


def test_a_stream_slow_to_send_gives_the_turn_up() -> None:
    async def main() -> None:
        held = HeldBytes(HeldLimits(limit=1 << 40, stream_limit=1 << 40))
        shared = {"now": 0, "most": 0}
        big = LARGE_MESSAGE_BYTES
        idle = SlowReads([f"idle:{big}"], shared, hold=asyncio.Event())  # then sends nothing
        busy = SlowReads([f"b{i}:{big}" for i in range(5)], shared)
        idle_answers = pipe_of(idle, Gates(), held=held, size=_sized).responses()
        assert await anext(idle_answers) == f"answer:idle:{big}"  # its reader now waits its turn
        got = [r async for r in pipe_of(busy, Gates(), held=held, size=_sized).responses()]
        assert len(got) == 5, "the busy stream was answered in full while the idle one waited"
        await idle_answers.aclose()
        assert held.held == 0

    asyncio.run(asyncio.wait_for(main(), CAP_S))


def test_a_cancelled_stream_releases_the_bytes_it_held() -> None:
    async def main() -> None:
        held = HeldBytes(HeldLimits(limit=1000, stream_limit=100))
        _, _, answers = sized_stream(held, 5, 40, hold=asyncio.Event())

        async def consume() -> None:
            async for _ in answers:
                pass

        task = asyncio.ensure_future(consume())
        await until(lambda: held.held == 120, "three requests held")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert held.held == 0

    asyncio.run(main())


def test_a_broken_request_stream_ends_after_the_answers_in_flight() -> None:
    async def main() -> None:
        pipe = pipe_of(Source(["x", "y"], broken=True), Gates())
        got = [r async for r in pipe.responses()]
        assert sorted(got) == ["answer:x", "answer:y"]
        assert pipe.ending is Ending.BROKEN
        assert isinstance(pipe.failure, ConnectionError)

    asyncio.run(main())


@dataclass
class Plane:
    draining: bool = False
    admitted: int = 0

    def admit(self) -> bool:
        self.admitted += 1
        return not self.draining


def test_a_drain_stops_an_idle_stream_after_answering_what_was_read() -> None:
    async def main() -> None:
        plane = Plane()
        gates = Gates(gates={"held": asyncio.Event()})
        source = Source(["held", "quick"], hold=asyncio.Event())  # then idle forever
        pipe = pipe_of(source, gates, admission=plane)
        answers = pipe.responses()
        assert await anext(answers) == "answer:quick"
        plane.draining = True
        gates.gates["held"].set()
        assert [r async for r in answers] == ["answer:held"]
        assert pipe.ending is Ending.DRAINED
        assert plane.admitted == 2  # each request read was admitted before the drain

    asyncio.run(main())


def test_cancelling_the_stream_cancels_every_task_in_flight() -> None:
    async def main() -> None:
        gates = Gates(gates={f"r{i}": asyncio.Event() for i in range(10)})
        stats = StreamStats()
        pipe = pipe_of(Source([f"r{i}" for i in range(10)], hold=asyncio.Event()), gates, stats=stats)

        async def consume() -> None:
            async for _ in pipe.responses():
                pass

        before = asyncio.all_tasks()
        consumer = asyncio.create_task(consume())
        await until(lambda: len(gates.started) == 10, "every request to start")
        consumer.cancel()
        with pytest.raises(asyncio.CancelledError):
            await consumer
        assert gates.cancelled == 10
        assert asyncio.all_tasks() == before  # no reader, no request task left
        assert stats.in_flight == 0
        assert stats.streams == 0

    asyncio.run(main())


def test_emitted_messages_come_ahead_of_their_requests_answer_within_a_byte_budget(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from mariner.server.frontend.protocols import stream_pipeline

    monkeypatch.setattr(stream_pipeline, "MAX_HELD_BYTES", 10)

    async def main() -> None:
        accepted: list[bool] = []
        written = asyncio.Event()

        async def answer(request: str) -> str:
            if request == "talker":
                accepted.append(pipe.emit("part0", 4))
                accepted.append(pipe.emit("part1", 4))
                accepted.append(pipe.emit("refused", 8))  # 8 bytes unwritten already: over 10
                await written.wait()
                accepted.append(pipe.emit("part2", 8))  # the first two were written meanwhile
            return f"answer:{request}"

        pipe = StreamPipeline(Source(["talker", "other"]).__aiter__(), answer, on_crash=str, window=1)
        got: list[str] = []
        async for resp in pipe.responses():
            got.append(resp)
            if resp == "part1":
                written.set()
        assert accepted == [True, True, False, True]
        # The window (1) counts requests: "other" is read once "talker" has its own answer.
        assert got == ["part0", "part1", "part2", "answer:talker", "answer:other"]

    asyncio.run(main())


# -- over grpc.aio --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ts() -> Any:
    protogen.generate()
    pb = importlib.import_module("mariner.server._proto.torchserve.inference_pb2")
    pb_grpc = importlib.import_module("mariner.server._proto.torchserve.inference_pb2_grpc")
    servicer_module = importlib.import_module("mariner.server.frontend.protocols.torchserve.grpc")
    return pb, pb_grpc, servicer_module


@dataclass
class BlockingPlane(FakePlane):
    """Echo model whose inferences wait for `release` (counting the ones running, and cancelled)."""

    release: asyncio.Event = field(default_factory=asyncio.Event)
    running: int = 0
    cancelled: int = 0

    async def infer(self, req: InferRequest) -> InferResult:
        self.running += 1
        try:
            await self.release.wait()
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        finally:
            self.running -= 1
        return await super().infer(req)


async def _serve(ts: Any, plane: Any) -> tuple[grpc.aio.Server, Any, int]:
    _, _, module = ts
    server = grpc.aio.server()
    servicer = module.add_to_server(plane, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, servicer, port


def test_a_client_that_never_reads_holds_at_most_a_window_in_flight(ts: Any) -> None:
    """1,000 requests of 64 KiB answers written by a client that reads nothing: the server stops
    reading at WINDOW requests in flight; once the client reads, every answer comes."""
    pb, pb_grpc, _ = ts
    payload = b"x" * 65536

    async def main() -> None:
        plane = BlockingPlane()
        plane.release.set()
        server, servicer, port = await _serve(ts, plane)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                call = pb_grpc.InferenceAPIsServiceStub(channel).StreamPredictions2()

                async def write() -> None:
                    for i in range(1000):
                        await call.write(
                            pb.PredictionsRequest(
                                model_name="echo", sequence_id=f"s{i}", input={"data": payload}
                            )
                        )
                    await call.done_writing()

                writer = asyncio.create_task(write())
                stats = servicer.stream_stats
                await until(lambda: stats.in_flight == WINDOW, "the window to fill")
                # Answers already written still drain into the transport's buffers until HTTP/2
                # flow control blocks them, each freeing a slot; then reading stops for good.
                seen, quiet = len(plane.seen), 0
                while quiet < 20:  # unchanged for 20 looks 10 ms apart: the server stopped reading
                    await asyncio.sleep(0.01)
                    quiet = quiet + 1 if len(plane.seen) == seen else 0
                    seen = len(plane.seen)
                assert stats.in_flight == WINDOW
                assert seen < 1000 // 2  # far from all: it stopped reading the stream
                answers = [r async for r in call]  # now the client reads: everything drains
                await writer
                assert sorted(a.sequence_id for a in answers) == sorted(f"s{i}" for i in range(1000))
                assert all(a.prediction == b"echo:" + payload for a in answers)
                assert stats.peak == WINDOW
                assert stats.in_flight == 0
        finally:
            await server.stop(0)

    asyncio.run(main())


def test_a_cancelled_stream_leaves_no_request_running(ts: Any) -> None:
    pb, pb_grpc, _ = ts

    async def main() -> None:
        plane = BlockingPlane()
        server, servicer, port = await _serve(ts, plane)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                call = pb_grpc.InferenceAPIsServiceStub(channel).StreamPredictions2()
                for i in range(10):
                    await call.write(pb.PredictionsRequest(model_name="echo", sequence_id=f"s{i}"))
                await until(lambda: plane.running == 10, "every request to reach the plane")
                call.cancel()
                stats = servicer.stream_stats
                await until(lambda: stats.streams == 0 and stats.in_flight == 0, "the stream to end")
                await until(lambda: plane.running == 0, "the inferences to end")
                assert plane.cancelled == 10
                cancelled = sum(
                    sample.value
                    for metric in plane.metrics.registry.collect()
                    for sample in metric.samples
                    if sample.name == "mariner_requests_total" and sample.labels.get("code") == "499"
                )
                assert cancelled == 10  # each counted once, as a cancelled unary call is
        finally:
            await server.stop(0)

    asyncio.run(main())


# -- StreamPredictions2's in-stream statuses (the one mapping) -------------------------------------
def test_in_stream_statuses_follow_torchserve() -> None:
    protogen.generate()
    from mariner.server.common.models import resolve_version
    from mariner.server.contracts.errors import Code, ServingError
    from mariner.server.frontend.protocols.torchserve import stream2
    from mariner.server.worker.handler_errors import handler_failed, prediction_exception

    def seen(error: ServingError, answer: InferResult | None = None) -> tuple[int, str, bytes]:
        status = stream2.in_stream_status(error, answer)
        (detail,) = status.details
        assert detail.type_url == "type.googleapis.com/google.rpc.ErrorInfo"
        return status.code, status.message, detail.value

    def reason(text: str) -> bytes:  # ErrorInfo{reason}: field 1, length-delimited
        return b"\x0a" + bytes([len(text)]) + text.encode()

    handler = reason("org.pytorch.serve.http.InternalServerException")
    with pytest.raises(stream2.BadStreamRequest) as refused:
        stream2.sequence_of("", "digits", {})
    assert seen(refused.value) == (13, "Parameter sequenceId is required.", reason("BadRequestException.()"))
    with pytest.raises(ServingError) as unknown:
        resolve_version({}, {}, "nope", None)
    assert seen(unknown.value) == (
        13,
        "Model not found: nope",
        reason("org.pytorch.serve.archive.model.ModelNotFoundException"),
    )
    assert seen(handler_failed("ValueError")) == (14, "Prediction failed", handler)

    class PredictionException(Exception):
        def __init__(self, message: str, error_code: int) -> None:
            super().__init__(message)
            self.message, self.error_code = message, error_code

    raised = prediction_exception(PredictionException("too dark", 404))
    assert raised is not None
    assert seen(raised) == (5, "too dark", handler)
    own = InferResult(body=b'{"error": "bad pixels"}', status=400)
    assert seen(ServingError(Code.INVALID_ARGUMENT, "x"), own) == (3, '{"error": "bad pixels"}', handler)
    overload = ServingError(Code.RESOURCE_EXHAUSTED, "queue full")  # ours: TorchServe has no such answer
    assert seen(overload) == (8, "queue full", reason("org.pytorch.serve.http.ServiceUnavailableException"))
    started = stream2.sequence_of("", "digits", {stream2.SEQUENCE_START: b"TRUE"})
    assert started.key is None
    assert started.sequence_id.startswith("ts-seq-")
    assert dict(started.headers) == {
        stream2.SEQUENCE_START: "true",
        stream2.SEQUENCE_ID: started.sequence_id,
        stream2.SEQUENCE_END: "true",
    }
