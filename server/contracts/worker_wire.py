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
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import pickle
import struct
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from multiprocessing import resource_tracker, shared_memory
from typing import Any

from mariner.server.contracts import safe_pickle
from mariner.server.contracts.errors import Code, ServingError
from mariner.server.contracts.peer import PeerRefused, check_peer
from mariner.server.contracts.types import InferRequest, InferResult, WireProtocol

# Buffers this large or larger travel through shared memory instead of the socket.
SHM_THRESHOLD = 256 * 1024
# Segments adding up to this many bytes are filled in a thread, off the event loop (`write_message`).
THREAD_FILL_BYTES = 1024 * 1024
# The largest frame either side accepts (header + body; shared-memory buffers do not count).
MAX_FRAME = 64 * 1024 * 1024
SHM_PREFIX = "mrnr"

_LEN = struct.Struct(">II")
log = logging.getLogger("mariner.worker")

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


@dataclass(frozen=True)
class ShmRef:
    name: str
    size: int


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


def _untrack(name: str) -> None:  # `name` as SharedMemory keeps it: with its leading "/"
    # The creator hands the segment to the peer, which unlinks it: this process's resource
    # tracker must not unlink it (or warn about it) when this process exits.
    with contextlib.suppress(Exception):
        resource_tracker.unregister(name, "shared_memory")


def _view(shm: shared_memory.SharedMemory) -> memoryview:
    """The segment's bytes (typeshed types `buf` Optional: it is None only after close())."""
    buf = shm.buf
    if buf is None:
        raise RuntimeError(f"shared memory {shm.name} is already closed")
    return buf


def _fill(name: str, view: memoryview) -> None:
    """Create segment `name` holding `view`. Written with pwrite, which copies in the kernel with
    the GIL released, so a thread can fill segments while the event loop goes on (`write_message`)."""
    shm = shared_memory.SharedMemory(name=name, create=True, size=max(1, view.nbytes))
    try:
        _untrack(shm._name)  # type: ignore[attr-defined]  # private: the name with its leading "/"
        fd: int = shm._fd  # type: ignore[attr-defined]  # private: the segment's descriptor
        done = 0
        while done < view.nbytes:
            done += os.pwrite(fd, view[done:], done)
    finally:
        shm.close()


def _fill_all(fills: Sequence[tuple[str, memoryview]]) -> None:
    for name, view in fills:
        _fill(name, view)


def _from_shm(ref: ShmRef) -> bytearray:
    shm = shared_memory.SharedMemory(name=ref.name)
    try:
        return bytearray(_view(shm)[: ref.size])
    finally:
        shm.close()
        shm.unlink()  # also drops the tracker registration the attach made


def unlink_segments(names: Iterable[str]) -> int:
    """Unlink segments this process sent but the peer may never read; returns how many existed."""
    gone = 0
    for name in names:
        try:
            shm = shared_memory.SharedMemory(name=name)
        except FileNotFoundError:
            continue
        shm.close()
        shm.unlink()
        gone += 1
    return gone


def _encode_unfilled(msg: Any) -> tuple[bytes, list[ShmRef], list[tuple[str, memoryview]]]:
    """One frame for `msg`, the segments it names, and what each must hold: the frame may be
    sent only once every segment is filled (`_fill`)."""
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
        _fill_all(fills)
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
            buffers.append(_from_shm(ref))
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


class SentSegments:
    """The shared-memory segments one side sent on one connection and the peer may not have read
    yet. Pruned as the peer unlinks them; what is left when the connection ends is unlinked."""

    def __init__(self) -> None:
        self._names: set[str] = set()

    def add(self, refs: Sequence[ShmRef]) -> None:
        if not refs:
            return
        self._names.update(r.name for r in refs)
        if len(self._names) > 64:
            self._names = {n for n in self._names if os.path.exists(f"/dev/shm/{n}")}

    def discard(self, refs: Sequence[ShmRef]) -> None:
        self._names.difference_update(r.name for r in refs)

    def release(self) -> int:
        names, self._names = self._names, set()
        return unlink_segments(names)


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
            await _fill_off_loop(fills)
        else:
            _fill_all(fills)
        writer.write(frame)
        await writer.drain()
    except BaseException:
        if sent is None:
            unlink_segments(r.name for r in refs)
        raise
    return refs


async def _fill_off_loop(fills: Sequence[tuple[str, memoryview]]) -> None:
    filled = asyncio.get_running_loop().run_in_executor(None, _fill_all, fills)
    try:
        await asyncio.shield(filled)
    except asyncio.CancelledError:
        # The thread goes on creating segments; unlink them once it is done, as nobody reads them.
        filled.add_done_callback(functools.partial(_unlink_filled, fills))
        raise


def _unlink_filled(fills: Sequence[tuple[str, memoryview]], filled: asyncio.Future[None]) -> None:
    if not filled.cancelled() and filled.exception() is not None:
        log.debug("filling shared memory failed after its call was cancelled: %s", filled.exception())
    unlink_segments(name for name, _ in fills)


async def ask_describe(
    socket_path: str, request: InferRequest, timeout_s: float, *, expected_pid: int | None = None
) -> InferResult:
    """Send one `Describe` on a connection of its own to the worker at `socket_path` and return
    the handler's result; bounded by `timeout_s` (DEADLINE_EXCEEDED beyond it). The listener must
    run as our uid (and be `expected_pid`, the worker's pid, when given). A failure the worker
    reports comes back as the ServingError it names."""

    try:
        async with asyncio.timeout(timeout_s):
            reader, writer = await asyncio.open_unix_connection(socket_path)
            try:
                check_peer(
                    writer.get_extra_info("socket"),
                    what=f"worker socket {socket_path}",
                    expected_pid=expected_pid,
                )
                await write_message(writer, Describe(0, request))
                answer = await read_message(reader)
            finally:
                writer.close()
    except TimeoutError:
        raise ServingError(
            Code.DEADLINE_EXCEEDED, f"the handler did not describe the model within {timeout_s:g} s"
        ) from None
    except (OSError, asyncio.IncompleteReadError, FrameError, PeerRefused) as exc:
        raise ServingError(Code.UNAVAILABLE, f"the model's worker could not be asked: {exc}") from None
    if not isinstance(answer, Result) or answer.id != 0:
        raise ServingError(Code.INTERNAL, "the model's worker answered a describe call with something else")
    if answer.error is not None:
        codes = {c.value: c for c in Code}
        raise ServingError(codes.get(answer.error.code, Code.INTERNAL), answer.error.message)
    if len(answer.results) != 1:
        raise ServingError(Code.INTERNAL, "the handler's describe call did not return exactly one result")
    return answer.results[0]


def describe_request(
    model: str, version: str, headers: Mapping[str, str], protocol: WireProtocol
) -> InferRequest:
    """The request a describe call hands the handler, as TorchServe builds it: no data, the
    caller's headers (credentials left out, as for inference) and `describe: True`, which
    TorchServe's BaseHandler checks to call `describe_handle`."""
    from mariner.server.contracts.worker_wire import CREDENTIAL_HEADERS

    kept = {k.lower(): v for k, v in headers.items() if k.lower() not in CREDENTIAL_HEADERS}
    return InferRequest(
        model=model,
        version=version,
        data={},
        protocol=protocol,
        request_id=uuid.uuid4().hex,
        headers={**kept, "describe": "True"},
    )


# Request headers that carry credentials: checked here, never handed to handler code (archives
# are third-party code; a token they can read is a token they can leak). Lower-case, as HTTP
# header names reach us from uvicorn and gRPC metadata keys are.
CREDENTIAL_HEADERS = frozenset({"authorization", "proxy-authorization"})
