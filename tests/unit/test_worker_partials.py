"""A frontend's worker connection and a handler's intermediate answers, against a fake worker.

The fake worker is a Unix socket served in this process (so the peer check sees our own pid): it
answers each batch with scripted `Partial` frames, then the batch's `Result`. Parts of a
TorchServe request go to the sink its adapter opened, as they arrive; a request without one
(or of a protocol whose ids clients choose) gets them joined in front of its final body.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from mariner.server.contracts import worker_wire as protocol
from mariner.server.contracts.types import InferRequest, InferResult, WireProtocol
from mariner.server.contracts.worker_api import WorkerEndpoint
from mariner.server.frontend import worker_client as connection_mod
from mariner.server.frontend.streams import STREAMS
from mariner.server.frontend.worker_client import WorkerConnection

pytestmark = pytest.mark.unit

Script = Callable[[protocol.Batch], list[object]]


def part(body: bytes, status: int = 200, **kw: object) -> InferResult:
    return InferResult(body=body, status=status, **kw)  # type: ignore[arg-type]


def ts(rid: str, protocol_: WireProtocol = WireProtocol.TS_HTTP) -> InferRequest:
    return InferRequest("m", "1", {"body": rid}, protocol_, rid)


async def with_worker(
    tmp_path: Path, script: Script, test: Callable[[WorkerConnection], Awaitable[None]]
) -> None:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            try:
                batch = await protocol.read_message(reader)
            except (asyncio.IncompleteReadError, asyncio.CancelledError):  # the test is over
                return
            for msg in script(batch):
                await protocol.write_message(writer, msg)

    path = str(tmp_path / "w.sock")
    server = await asyncio.start_unix_server(serve, path=path)
    conn = WorkerConnection(WorkerEndpoint("m-1-0", 0, 0, path, os.getpid(), "cpu", "READY"), batch_size=4)
    await conn.start()
    try:
        await test(conn)
    finally:
        conn.close()
        server.close()


class Sink:
    def __init__(self) -> None:
        self.parts: list[bytes] = []

    def partial(self, p: InferResult) -> None:
        self.parts.append(p.body)


def test_parts_go_to_their_requests_sink_and_the_batch_mate_is_untouched(tmp_path: Path) -> None:
    def script(batch: protocol.Batch) -> list[object]:
        return [
            protocol.Partial(batch.id, 0, part(b"p0")),
            protocol.Partial(batch.id, 0, part(b"p1")),
            protocol.Result(batch.id, (part(b"end"), part(b"mate"))),
        ]

    async def test(conn: WorkerConnection) -> None:
        sink = Sink()
        STREAMS["s1"] = sink
        try:
            results = await conn.run([ts("s1"), ts("plain")])
        finally:
            STREAMS.pop("s1", None)
        assert sink.parts == [b"p0", b"p1"]
        assert [r.body for r in results] == [b"end", b"mate"]

    asyncio.run(with_worker(tmp_path, script, test))


def test_without_a_sink_parts_are_joined_in_front_of_the_final_body(tmp_path: Path) -> None:
    def script(batch: protocol.Batch) -> list[object]:
        return [
            protocol.Partial(batch.id, 1, part(b"a", content_type="text/plain", headers={"x": "1"})),
            protocol.Partial(batch.id, 1, part(b"b")),
            protocol.Result(batch.id, (part(b"first"), part(b"end", status=201))),
        ]

    async def test(conn: WorkerConnection) -> None:
        results = await conn.run([ts("x0", WireProtocol.TS_GRPC), ts("x1", WireProtocol.TS_GRPC)])
        assert results[0] == part(b"first")
        joined = results[1]
        # What an HTTP client reading the whole streamed answer gets: the first part opened it.
        assert (joined.body, joined.status, joined.content_type) == (b"abend", 200, "text/plain")
        assert joined.headers == {"x": "1"}

    asyncio.run(with_worker(tmp_path, script, test))


def test_a_client_chosen_id_never_reaches_another_requests_sink(tmp_path: Path) -> None:
    def script(batch: protocol.Batch) -> list[object]:
        return [protocol.Partial(batch.id, 0, part(b"leak")), protocol.Result(batch.id, (part(b"end"),))]

    async def test(conn: WorkerConnection) -> None:
        victim = Sink()
        STREAMS["same-id"] = victim  # a TorchServe request in flight under this id
        try:
            (answer,) = await conn.run([ts("same-id", WireProtocol.OIP_HTTP)])  # an OIP id says the same
        finally:
            STREAMS.pop("same-id", None)
        assert victim.parts == []
        assert answer.body == b"leakend"

    asyncio.run(with_worker(tmp_path, script, test))


def test_an_error_part_is_the_answer_and_too_many_bytes_fail_the_request(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(connection_mod, "MAX_HELD_BYTES", 10)

    def script(batch: protocol.Batch) -> list[object]:
        return [
            protocol.Partial(batch.id, 0, part(b"no", status=503)),
            protocol.Partial(batch.id, 0, part(b"after")),
            protocol.Partial(batch.id, 1, part(b"123456")),
            protocol.Partial(batch.id, 1, part(b"789012")),
            protocol.Result(batch.id, (part(b"end"), part(b"end"))),
        ]

    async def test(conn: WorkerConnection) -> None:
        failed, too_big = await conn.run([ts("e0", WireProtocol.TS_GRPC), ts("e1", WireProtocol.TS_GRPC)])
        assert (failed.status, failed.body) == (503, b"no")
        assert too_big.status == 500
        assert "slower than the model wrote it" in too_big.phrase

    asyncio.run(with_worker(tmp_path, script, test))


def test_each_part_restarts_its_batchs_response_timeout(tmp_path: Path) -> None:
    from mariner.server.frontend.streams import BATCH_PROGRESS

    def script(batch: protocol.Batch) -> list[object]:
        return [
            protocol.Partial(batch.id, 0, part(b"p0")),
            protocol.Partial(batch.id, 0, part(b"p1")),
            protocol.Result(batch.id, (part(b"end"),)),
        ]

    async def test(conn: WorkerConnection) -> None:
        ticks: list[int] = []
        BATCH_PROGRESS.set(lambda: ticks.append(1))  # what the batcher sets in the batch's task
        await conn.run([ts("r", WireProtocol.TS_GRPC)])
        assert len(ticks) == 2

    asyncio.run(with_worker(tmp_path, script, test))


def test_a_tensor_answer_is_kept_whole(tmp_path: Path) -> None:
    import numpy as np

    tensors = {"y": np.arange(3, dtype=np.float32)}

    def script(batch: protocol.Batch) -> list[object]:
        return [
            protocol.Partial(batch.id, 0, part(b"progress")),
            protocol.Result(batch.id, (InferResult(body=b"", tensors=tensors),)),
        ]

    async def test(conn: WorkerConnection) -> None:
        (answer,) = await conn.run([ts("t", WireProtocol.OIP_HTTP)])
        assert answer.tensors is not None
        assert answer.tensors["y"].tolist() == [0.0, 1.0, 2.0]

    asyncio.run(with_worker(tmp_path, script, test))


def test_parts_of_a_batch_already_answered_are_dropped(tmp_path: Path) -> None:
    def script(batch: protocol.Batch) -> list[object]:
        return [protocol.Result(batch.id, (part(b"end"),)), protocol.Partial(batch.id, 0, part(b"late"))]

    async def test(conn: WorkerConnection) -> None:
        sink = Sink()
        STREAMS["r"] = sink
        try:
            assert [r.body for r in await conn.run([ts("r")])] == [b"end"]
            assert [r.body for r in await conn.run([ts("r")])] == [b"end"]  # the connection goes on
        finally:
            STREAMS.pop("r", None)
        assert sink.parts == []

    asyncio.run(with_worker(tmp_path, script, test))


# -- the worker's side: HandlerCall routes each part to its request's frontend --------------------
class FakeLink:
    def __init__(self, room: bool = True) -> None:
        self.open = True
        self.room = room  # send_now finds the transport empty
        self.now: list[protocol.Partial] = []
        self.queued: list[protocol.Partial] = []

    def send_now(self, frame: bytes, refs: list[protocol.ShmRef]) -> bool:
        if self.room:
            self.now.append(_decoded(frame))
        return self.room

    def send(self, frame: bytes, refs: list[protocol.ShmRef]) -> None:
        self.queued.append(_decoded(frame))


def _decoded(frame: bytes) -> protocol.Partial:
    (msg,) = protocol.FrameSplitter().feed(frame)
    assert isinstance(msg, protocol.Partial)
    return msg


class Job:
    def __init__(self, conn: FakeLink, batch_id: int, ids: list[str]) -> None:
        self.conn = conn
        self.batch = protocol.Batch(batch_id, tuple(ts(i) for i in ids))


def test_each_part_goes_to_the_batch_and_position_of_its_request() -> None:
    from mariner.server.worker.handler_call import HandlerCall

    one, two = FakeLink(), FakeLink(room=False)  # two's transport still holds earlier frames
    call = HandlerCall(
        [Job(one, 7, ["a", "b"]), Job(two, 3, ["c"])],
        what="test",
        loop=None,
        loop_thread=__import__("threading").get_ident(),
        loop_blocked=True,
    )
    call.deliver("b", part(b"to b"))
    call.deliver("c", part(b"to c"))
    call.deliver("nobody", part(b"dropped"))
    call.done = True
    call.deliver("a", part(b"too late"))
    assert [(m.id, m.index, m.result.body) for m in one.now] == [(7, 1, b"to b")]
    assert one.queued == []
    # Behind the frames the transport holds: queued there, in order.
    assert [(m.id, m.index, m.result.body) for m in two.queued] == [(3, 0, b"to c")]


class RecordingLink:
    """A frontend whose transport still holds earlier frames (`send_now` writes nothing): what
    the loop would put on the wire, Partial and Result alike, in the order it was given."""

    def __init__(self) -> None:
        self.open = True
        self.wire: list[object] = []
        self._lock = __import__("threading").Lock()

    def send_now(self, frame: bytes, refs: list[protocol.ShmRef]) -> bool:
        return False

    def send(self, frame: bytes, refs: list[protocol.ShmRef]) -> None:
        with self._lock:
            self.wire.extend(protocol.FrameSplitter().feed(frame))

    def bodies(self) -> list[tuple[str, bytes]]:
        out: list[tuple[str, bytes]] = []
        for m in self.wire:
            if isinstance(m, protocol.Partial):
                out.append(("part", m.result.body))
            elif isinstance(m, protocol.Result):
                out.extend(("result", r.body) for r in m.results)
        return out


def in_thread(fn: Callable[[], None]) -> None:
    import threading

    t = threading.Thread(target=fn)
    t.start()
    t.join()


def test_a_plain_handlers_parts_from_its_threads_are_held_and_written_in_order_by_finish() -> None:
    import threading

    from mariner.server.worker.handler_call import HandlerCall

    link = RecordingLink()
    call = HandlerCall(
        [Job(link, 5, ["a"])],  # type: ignore[arg-type]
        what="test",
        loop=None,
        loop_thread=threading.get_ident(),
        loop_blocked=True,
    )
    call.deliver("a", part(b"1"))  # the loop's thread: behind the transport's frames
    in_thread(lambda: call.deliver("a", part(b"2")))  # another thread: held
    in_thread(lambda: call.deliver("a", part(b"3")))
    assert link.bodies() == [("part", b"1")]
    call.deliver("a", part(b"4"))  # the loop's thread again: the held parts go first
    in_thread(lambda: call.deliver("a", part(b"5")))
    call.finish()
    call.finish()  # nothing is written twice
    in_thread(lambda: call.deliver("a", part(b"late")))  # after the call returned: dropped
    assert link.bodies() == [("part", b) for b in (b"1", b"2", b"3", b"4", b"5")]


def test_a_coroutine_handlers_parts_from_its_threads_are_written_once_by_loop_or_finish() -> None:
    import threading

    from mariner.server.worker.handler_call import HandlerCall

    async def body() -> None:
        link = RecordingLink()
        call = HandlerCall(
            [Job(link, 5, ["a"])],  # type: ignore[arg-type]
            what="test",
            loop=asyncio.get_running_loop(),
            loop_thread=threading.get_ident(),
            loop_blocked=False,
        )
        in_thread(lambda: call.deliver("a", part(b"1")))
        await asyncio.sleep(0)  # the loop's callback writes it
        assert link.bodies() == [("part", b"1")]
        in_thread(lambda: call.deliver("a", part(b"2")))
        in_thread(lambda: call.deliver("a", part(b"3")))
        call.finish()  # before the callback runs: finish writes them
        await asyncio.sleep(0)
        await asyncio.sleep(0)  # the callback finds nothing left
        assert link.bodies() == [("part", b"1"), ("part", b"2"), ("part", b"3")]

    asyncio.run(body())


def test_a_plain_handlers_parts_from_another_thread_reach_the_frontend_before_its_result() -> None:
    """The loop is hidden while a plain handler runs: a part its thread leaves for the loop is
    written when the call returns, ahead of the Result (after it, the frontend drops it)."""
    import threading
    from types import SimpleNamespace

    from mariner.server.contracts.worker_api import WorkerSpec
    from mariner.server.worker.batch_server import Worker, _Job

    spec = WorkerSpec(
        model="m", version="1", instance=0, generation=0, model_dir="/nonexistent",
        archive_file="m.mar", sha256="", manifest={}, model_config={}, batch_size=4,
        gpu_id=None, torch_threads=None, socket_path="/nonexistent/s",
    )  # fmt: skip
    worker: Worker

    def run_batch(requests: list[InferRequest], deliver: Callable[[str, InferResult], None]) -> object:
        for body in (b"p1", b"p2"):
            in_thread(lambda body=body: deliver(requests[0].request_id, part(body)))  # type: ignore[misc]
        worker.stop()  # one batch, then the dispatch loop ends
        return [part(b"final")]

    host = SimpleNamespace(placement=SimpleNamespace(gpu_id=None, device="cpu"), is_async=False,
                           run_batch=run_batch)  # fmt: skip
    worker = Worker(spec, host)
    link = RecordingLink()

    async def body() -> None:
        worker._loop = asyncio.get_running_loop()
        worker._thread = threading.get_ident()
        worker._jobs.append(_Job(link, protocol.Batch(9, (ts("r"),)), 1))  # type: ignore[arg-type]
        await worker._dispatch()
        await asyncio.sleep(0)
        await asyncio.sleep(0)  # whatever the loop was asked to write is written now

    asyncio.run(body())
    assert link.bodies() == [("part", b"p1"), ("part", b"p2"), ("result", b"final")]
