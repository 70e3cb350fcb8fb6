"""The wire between a frontend and a model worker: framed pickle-5 messages on a Unix socket.

A frame is `u32 length | u32 header length | header | body`, big-endian lengths. The body is
a pickle (protocol 5) of one message dataclass. Buffers of at least `SHM_THRESHOLD` bytes
(numpy tensors, large request or response bodies) do not travel in the body: each goes into its
own `multiprocessing.shared_memory` segment, and the header (a pickle of `ShmRef`s, empty when
there are none) names them in order. The receiver copies each segment out and unlinks it, so a
segment lives only between send and receive; a sender unlinks what it sent on a connection that
closed (the peer will never read it), so no segment outlives a dead connection.

Both ends are processes of the same server, on a socket in a private directory; each end also
checks its peer's credentials (`peer.py`) before reading a frame. Frames are still loaded with
`safe_pickle`, which builds only the protocol's value types: a peer that is not ours, or a
handler's result that names a callable, fails that message instead of running code.

The segments' own life (create, fill, take, unlink, what a connection still owns) is
`shm_segments.py`; a describe call over this wire, `worker_describe.py`.
"""

from __future__ import annotations

import asyncio
import os
import pickle
import struct
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from mariner.server.contracts import safe_pickle
from mariner.server.contracts.shm_segments import (
    SentSegments,
    ShmRef,
    fill_segments,
    fill_segments_off_loop,
    take_segment,
    unlink_segments,
)
from mariner.server.contracts.types import InferRequest, InferResult

# Buffers this large or larger travel through shared memory instead of the socket.
SHM_THRESHOLD = 256 * 1024
# Segments adding up to this many bytes are filled in a thread, off the event loop (`write_message`).
THREAD_FILL_BYTES = 1024 * 1024
# The largest frame either side accepts (header + body; shared-memory buffers do not count).
MAX_FRAME = 64 * 1024 * 1024
SHM_PREFIX = "mrnr"

_LEN = struct.Struct(">II")

INSTANCE_FAILED = "instance_failed"


@dataclass(frozen=True)
class Batch:
    """A batch a frontend sends; `id` is unique among the batches in flight on one connection."""

    id: int
    requests: tuple[InferRequest, ...]


@dataclass(frozen=True)
class Describe:
    """Ask the handler for its customized metadata (TorchServe's DESCRIBE command): the worker
    runs `request` (headers carry `describe: True`) as a handler call of its own, never merged
    with inference batches, and answers `Result(id)` with its one result."""

    id: int
    request: InferRequest


@dataclass(frozen=True)
class BatchError:
    """A whole-batch failure: `code` is a `Code` value, or INSTANCE_FAILED when the handler ended
    the worker (it exits after sending this)."""

    code: str
    message: str
    # (status, type, message) as TorchServe's endpoints answer it, where that differs from `code`.
    torchserve: tuple[int, str, str] | None = None


@dataclass(frozen=True)
class Result:
    """A worker's answer to `Batch(id)`: one result per request, or a whole-batch error.

    `oom_splits` counts the out-of-memory splits it took, so the frontend counts them.
    """

    id: int
    results: tuple[InferResult, ...] = ()
    error: BatchError | None = None
    oom_splits: int = 0


@dataclass(frozen=True)
class Partial:
    """An intermediate answer to request `index` of `Batch(id)`, sent by the worker while the
    handler still runs (TorchServe's `send_intermediate_predict_response`), before the batch's
    `Result`. Parts of one request arrive in the order the handler sent them."""

    id: int
    index: int
    result: InferResult


class FrameError(Exception):
    """The peer sent something that is not a frame of this protocol (or one too large)."""


class _Big:
    """Marks a large bytes value so it leaves the pickle as an out-of-band buffer (pickle cannot
    take a plain `bytes` out of band); it loads back as plain bytes."""

    __slots__ = ("data",)

    def __init__(self, data: bytes) -> None:
        self.data = data

    def __reduce_ex__(self, protocol: Any) -> Any:
        return bytes, (pickle.PickleBuffer(self.data),)


def _mark_big(values: Any) -> Any:
    if not isinstance(values, dict):
        return values
    if not any(isinstance(v, bytes) and len(v) >= SHM_THRESHOLD for v in values.values()):
        return values
    return {k: _Big(v) if isinstance(v, bytes) and len(v) >= SHM_THRESHOLD else v for k, v in values.items()}


def _prepare(msg: Any) -> Any:
    """Wrap the large bytes a message carries (request data fields, result bodies) in `_Big`."""
    if isinstance(msg, Batch):
        reqs = tuple(
            replace(r, data=marked) if (marked := _mark_big(r.data)) is not r.data else r
            for r in msg.requests
        )
        return replace(msg, requests=reqs)
    if isinstance(msg, Partial) and len(msg.result.body) >= SHM_THRESHOLD:
        return replace(msg, result=replace(msg.result, body=_Big(msg.result.body)))  # type: ignore[arg-type]
    if isinstance(msg, Result) and any(len(r.body) >= SHM_THRESHOLD for r in msg.results):
        return replace(
            msg,
            results=tuple(
                # _Big stands in for the bytes while pickling only; it loads back as bytes.
                replace(r, body=_Big(r.body)) if len(r.body) >= SHM_THRESHOLD else r  # type: ignore[arg-type]
                for r in msg.results
            ),
        )
    return msg


def _encode_unfilled(msg: Any) -> tuple[bytes, list[ShmRef], list[tuple[str, memoryview]]]:
    """One frame for `msg`, the segments it names, and what each must hold: the frame may be
    sent only once every segment is filled (`fill_segments`)."""
    refs: list[ShmRef] = []
    fills: list[tuple[str, memoryview]] = []

    def out_of_band(buf: pickle.PickleBuffer) -> bool:
        view = buf.raw()
        if view.nbytes < SHM_THRESHOLD:
            return True  # small: stays inside the pickle
        name = f"{SHM_PREFIX}{os.getpid()}_{os.urandom(6).hex()}"
        refs.append(ShmRef(name, view.nbytes))
        fills.append((name, view))
        return False

    body = pickle.dumps(_prepare(msg), protocol=5, buffer_callback=out_of_band)
    header = pickle.dumps(tuple(refs), protocol=5) if refs else b""
    return _LEN.pack(len(header) + len(body), len(header)) + header + body, refs, fills


def encode(msg: Any) -> tuple[bytes, list[ShmRef]]:
    """One frame for `msg`, and the shared-memory segments it created (for cleanup on failure)."""
    frame, refs, fills = _encode_unfilled(msg)
    try:
        fill_segments(fills)
    except BaseException:
        unlink_segments(r.name for r in refs)
        raise
    return frame, refs


def decode(header: bytes, body: bytes) -> Any:
    """The message of one frame; FrameError if it is not one of ours (see `safe_pickle`)."""
    try:
        refs: Sequence[ShmRef] = safe_pickle.loads(header) if header else ()
    except Exception as exc:  # noqa: BLE001 - whatever a bad header raises, the frame is refused
        raise FrameError(f"bad frame header: {exc}") from None
    if not all(isinstance(r, ShmRef) for r in refs):
        raise FrameError("bad frame header: it names something other than shared-memory segments")
    buffers = []
    try:
        for ref in refs:
            buffers.append(take_segment(ref))
    finally:
        # A segment that could not be read must still not outlive this frame.
        unlink_segments(r.name for r in refs[len(buffers) + 1 :])
    try:
        return safe_pickle.loads(body, buffers=buffers)
    except Exception as exc:  # noqa: BLE001 - a refused or broken pickle fails this message only
        raise FrameError(f"bad frame: {exc}") from None


def _check_sizes(sizes: tuple[Any, ...], max_frame: int) -> tuple[int, int]:
    size, header_size = sizes
    if size > max_frame or header_size > size:
        raise FrameError(f"frame of {size} bytes is larger than the limit of {max_frame}")
    return size, header_size


async def read_message(reader: asyncio.StreamReader, *, max_frame: int = MAX_FRAME) -> Any:
    """Read one message. Raises asyncio.IncompleteReadError at EOF, FrameError on a bad frame."""
    size, header_size = _check_sizes(_LEN.unpack(await reader.readexactly(_LEN.size)), max_frame)
    data = await reader.readexactly(size)
    return decode(data[:header_size], data[header_size:])


class FrameSplitter:
    """Frames out of a byte stream fed in pieces (an `asyncio.Protocol`'s `data_received`): the
    messages are decoded as their last byte arrives, in the callback itself, so whoever reads
    them after one turn of the event loop sees every frame the socket held."""

    def __init__(self, *, max_frame: int = MAX_FRAME) -> None:
        self._buf = bytearray()
        self._max_frame = max_frame

    def feed(self, data: bytes) -> list[Any]:
        """The messages `data` completes, in order; FrameError on a bad frame (the stream is then
        unusable: its framing is lost)."""
        buf = self._buf
        buf += data
        out: list[Any] = []
        start = 0
        while len(buf) - start >= _LEN.size:
            size, header_size = _check_sizes(_LEN.unpack_from(buf, start), self._max_frame)
            end = start + _LEN.size + size
            if len(buf) < end:
                break
            body_at = start + _LEN.size + header_size
            with memoryview(buf) as view:  # one copy of each part (released before the del below)
                out.append(decode(bytes(view[start + _LEN.size : body_at]), bytes(view[body_at:end])))
            start = end
        if start:
            del buf[:start]
        return out

    @property
    def pending(self) -> int:
        """Bytes of a frame not yet complete."""
        return len(self._buf)


async def write_message(
    writer: asyncio.StreamWriter, msg: Any, *, sent: SentSegments | None = None
) -> list[ShmRef]:
    """Write one message and drain; returns the segments it created (also recorded in `sent`).

    Segments of `THREAD_FILL_BYTES` or more in all are filled in a thread: copying a batch of
    twelve 7 MiB requests took the frontend's event loop one step of 100 ms and more, and every
    other call on that frontend waited for it."""
    frame, refs, fills = _encode_unfilled(msg)
    if sent is not None:
        sent.add(refs)
    try:
        if sum(view.nbytes for _, view in fills) >= THREAD_FILL_BYTES:
            await fill_segments_off_loop(fills)
        else:
            fill_segments(fills)
        writer.write(frame)
        await writer.drain()
    except BaseException:
        if sent is None:
            unlink_segments(r.name for r in refs)
        raise
    return refs


# Request headers that carry credentials: checked here, never handed to handler code (archives
# are third-party code; a token they can read is a token they can leak). Lower-case, as HTTP
# header names reach us from uvicorn and gRPC metadata keys are.
CREDENTIAL_HEADERS = frozenset({"authorization", "proxy-authorization"})
