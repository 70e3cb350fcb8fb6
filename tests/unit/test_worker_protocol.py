"""The frontend ⇄ worker wire: frames round-trip every value a batch carries, large buffers go
through shared memory and no segment outlives its frame, oversized frames are refused."""

from __future__ import annotations

import asyncio
import os
import threading
from pathlib import Path

import numpy as np
import pytest

from mariner.server.contracts import shm_segments
from mariner.server.contracts import worker_wire as protocol
from mariner.server.contracts.types import InferRequest, InferResult, WireProtocol
from mariner.server.contracts.worker_api import WorkerSpec, spec_from_json, spec_to_json
from mariner.server.worker.main import isolate_sys_path


def _segments() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith(f"{protocol.SHM_PREFIX}{os.getpid()}_")}


def _batch(blob: bytes, tensor: np.ndarray) -> protocol.Batch:
    return protocol.Batch(
        7,
        (
            InferRequest("m", "1", {"body": blob, "n": 3}, WireProtocol.TS_GRPC, "r1", headers={"a": "b"}),
            InferRequest("m", None, {}, WireProtocol.OIP_HTTP, "r2", tensors={"x": tensor}, items=2),
        ),
    )


async def _pipe(msg: object, *, max_frame: int = protocol.MAX_FRAME) -> object:
    """Write `msg` into a real stream and read it back."""
    reader = asyncio.StreamReader()
    frame, refs = protocol.encode(msg)
    reader.feed_data(frame)
    reader.feed_eof()
    try:
        return await protocol.read_message(reader, max_frame=max_frame)
    except BaseException:
        protocol.unlink_segments(r.name for r in refs)
        raise


def test_small_messages_stay_in_the_frame() -> None:
    msg = _batch(b"small", np.arange(6, dtype=np.float32).reshape(2, 3))
    frame, refs = protocol.encode(msg)
    assert refs == []
    out = asyncio.run(_pipe(msg))
    assert isinstance(out, protocol.Batch)
    assert out.id == 7
    assert out.requests[0] == msg.requests[0]
    np.testing.assert_array_equal(out.requests[1].tensors["x"], msg.requests[1].tensors["x"])
    assert out.requests[1].protocol is WireProtocol.OIP_HTTP


def test_large_buffers_travel_through_shared_memory_and_are_unlinked_on_receipt() -> None:
    before = _segments()
    blob = os.urandom(protocol.SHM_THRESHOLD + 1)
    tensor = np.random.default_rng(0).random((2, protocol.SHM_THRESHOLD // 8 + 1))
    msg = _batch(blob, tensor)
    frame, refs = protocol.encode(msg)
    assert len(refs) == 2, "the bytes body and the tensor each went to a segment"
    assert len(frame) < protocol.SHM_THRESHOLD, "and not into the frame"
    assert _segments() - before == {r.name for r in refs}
    out = protocol.decode(*_split(frame))
    assert _segments() == before, "the receiver unlinked every segment it read"
    assert out.requests[0].data["body"] == blob
    assert type(out.requests[0].data["body"]) is bytes
    np.testing.assert_array_equal(out.requests[1].tensors["x"], tensor)


def test_result_bodies_and_errors_round_trip() -> None:
    body = b"r" * (protocol.SHM_THRESHOLD * 2)
    ok = protocol.Result(
        3, (InferResult(body, status=200, content_type="text/plain"), InferResult(b"x")), oom_splits=2
    )
    out = asyncio.run(_pipe(ok))
    assert out == ok
    err = protocol.Result(4, error=protocol.BatchError("internal", "boom"))
    assert asyncio.run(_pipe(err)) == err


def test_segments_a_peer_never_read_are_released_with_the_connection() -> None:
    before = _segments()
    sent = protocol.SentSegments()
    _, refs = protocol.encode(_batch(os.urandom(protocol.SHM_THRESHOLD), np.zeros(1)))
    sent.add(refs)
    assert _segments() - before == {r.name for r in refs}
    assert sent.release() == 1
    assert _segments() == before
    assert sent.release() == 0, "releasing twice finds nothing"


class _Sink:
    """A StreamWriter's write side that keeps what it was given."""

    def __init__(self) -> None:
        self.frames: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.frames.append(data)

    async def drain(self) -> None:
        return None


def _slow_fill(monkeypatch: pytest.MonkeyPatch, started: threading.Event, go: threading.Event) -> list[str]:
    """Make every segment fill wait for `go` (set `started` first); returns the fill threads' names."""
    threads: list[str] = []
    fill = shm_segments._fill

    def slow(name: str, view: memoryview) -> None:
        threads.append(threading.current_thread().name)
        started.set()
        assert go.wait(10), "the test never let the fill go on"
        fill(name, view)

    monkeypatch.setattr(shm_segments, "_fill", slow)
    return threads


def test_a_large_batch_is_copied_to_shared_memory_while_the_event_loop_runs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Twelve 7 MiB requests copied on the loop held a frontend's every other call for 100 ms and
    more; from `THREAD_FILL_BYTES` on they are copied in a thread, and the frame is written only
    once every segment holds its bytes."""
    before = _segments()
    started, go = threading.Event(), threading.Event()
    threads = _slow_fill(monkeypatch, started, go)
    blob = os.urandom(protocol.THREAD_FILL_BYTES)
    sink = _Sink()

    async def main() -> int:
        write = asyncio.create_task(protocol.write_message(sink, _batch(blob, np.zeros(1))))  # type: ignore[arg-type]
        ticks = 0
        while not started.is_set():
            await asyncio.sleep(0.001)
        for _ in range(5):  # the fill is stuck in its thread, yet the loop goes on
            await asyncio.sleep(0)
            ticks += 1
        assert not sink.frames, "the frame left before its segment was filled"
        go.set()
        await write
        return ticks

    assert asyncio.run(main()) == 5
    assert threads
    assert all(t != threading.main_thread().name for t in threads)
    out = protocol.decode(*_split(sink.frames[0]))
    assert out.requests[0].data["body"] == blob
    assert _segments() == before


def test_a_small_batch_is_copied_on_the_loop_without_a_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    started, go = threading.Event(), threading.Event()
    go.set()
    threads = _slow_fill(monkeypatch, started, go)
    sink = _Sink()
    refs = asyncio.run(protocol.write_message(sink, _batch(os.urandom(protocol.SHM_THRESHOLD), np.zeros(1))))  # type: ignore[arg-type]
    assert threads == [threading.main_thread().name]
    protocol.unlink_segments(r.name for r in refs)


def test_a_write_cancelled_while_its_segments_fill_leaves_none_behind(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    before = _segments()
    started, go = threading.Event(), threading.Event()
    _slow_fill(monkeypatch, started, go)
    sink = _Sink()

    async def main() -> None:
        write = asyncio.create_task(
            protocol.write_message(sink, _batch(os.urandom(protocol.THREAD_FILL_BYTES), np.zeros(1)))  # type: ignore[arg-type]
        )
        while not started.is_set():
            await asyncio.sleep(0.001)
        write.cancel()
        with pytest.raises(asyncio.CancelledError):
            await write
        go.set()  # the thread now creates its segment, and it is unlinked once it is done
        for _ in range(200):
            if _segments() == before:
                return
            await asyncio.sleep(0.01)

    asyncio.run(main())
    assert not sink.frames
    assert _segments() == before


def test_an_oversized_frame_is_refused_and_leaks_nothing() -> None:
    before = _segments()
    msg = _batch(b"y" * 1000, np.zeros(1))
    with pytest.raises(protocol.FrameError, match="larger than the limit"):
        asyncio.run(_pipe(msg, max_frame=100))
    assert _segments() == before


def test_a_spec_survives_its_json_trip() -> None:
    spec = WorkerSpec(
        model="m", version="1", instance=0, generation=2, model_dir="/x", archive_file="/m.mar", sha256="0",
        manifest={"model": {"handler": "h.py"}}, model_config={"batchSize": 4}, batch_size=4, gpu_id=None,
        torch_threads=1, socket_path="/tmp/s.sock",
    )  # fmt: skip
    assert spec_from_json(spec_to_json(spec)) == spec
    assert spec.id == "m-1-0.2"


def test_the_archive_dir_is_the_only_model_path(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import sys

    import mariner.server.common.archive  # noqa: F401 - isolate_sys_path imports it; not with this path

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", ["", str(tmp_path), "/usr/lib/python3.11", "/other/archive"])
    isolate_sys_path("/other/archive")
    assert sys.path == ["/other/archive", "/usr/lib/python3.11"]


def _split(frame: bytes) -> tuple[bytes, bytes]:
    size, header = protocol._LEN.unpack(frame[: protocol._LEN.size])
    data = frame[protocol._LEN.size :]
    assert len(data) == size
    return data[:header], data[header:]


def test_the_splitter_decodes_frames_however_the_stream_cuts_them() -> None:
    a = _batch(b"small", np.arange(6, dtype=np.float32).reshape(2, 3))
    b = protocol.Result(3, error=protocol.BatchError("internal", "boom"))
    frame_a, _ = protocol.encode(a)
    frame_b, _ = protocol.encode(b)
    splitter = protocol.FrameSplitter()
    # Byte by byte: nothing until a frame's last byte, then exactly that message.
    got: list[object] = []
    for i in range(len(frame_a)):
        out = splitter.feed(frame_a[i : i + 1])
        assert out == [] or i == len(frame_a) - 1
        got += out
    assert len(got) == 1
    assert isinstance(got[0], protocol.Batch)
    assert got[0].id == 7
    assert splitter.pending == 0
    # Two frames and half of a third in one piece: two messages, the half kept for later.
    out = splitter.feed(frame_b + frame_a + frame_b[:5])
    assert [type(m) for m in out] == [protocol.Result, protocol.Batch]
    assert out[0] == b
    assert splitter.pending == 5
    assert splitter.feed(frame_b[5:]) == [b]
    assert splitter.pending == 0


def test_the_splitter_takes_large_buffers_from_shared_memory_and_refuses_oversized_frames() -> None:
    before = _segments()
    blob = os.urandom(protocol.SHM_THRESHOLD + 1)
    frame, refs = protocol.encode(_batch(blob, np.zeros((2, 2), dtype=np.float32)))
    assert len(refs) == 1
    (msg,) = protocol.FrameSplitter().feed(frame)
    assert msg.requests[0].data["body"] == blob
    assert _segments() == before  # read and unlinked
    small, _ = protocol.encode(protocol.Result(1))
    with pytest.raises(protocol.FrameError, match="larger than the limit of 8"):
        protocol.FrameSplitter(max_frame=8).feed(small)
