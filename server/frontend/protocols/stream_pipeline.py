"""Pipelined bidirectional streams: many requests of one stream in flight, answered as they finish.

Protocol-neutral: the OIP `ModelStreamInfer` and TorchServe `StreamPredictions2` servicers give
it their request iterator and a function that answers one request (never raising for a failed
request: that is answered in-stream), and yield what `StreamPipeline.responses()` yields.

- Concurrency: each request read becomes a task running the ordinary call path, so requests of
  one stream meet in the dynamic batcher and run as one batch.
- Completion order: an answer is written as soon as its request is done; the client matches
  answers by the id the protocol echoes (OIP `id`, TorchServe `sequence_id`).
- Sequences: requests with the same `key` (TorchServe's sequence id) run one after another in
  arrival order; different keys run concurrently.
- Flow control: at most `window` requests of a stream are between "read" and "answer written".
  When the window is full the reader stops reading the request iterator, so gRPC/HTTP2 flow
  control pushes back on the client; nothing is buffered beyond the window. A client that
  never reads its answers therefore stops the server reading after `window` requests.
- Bytes held: with a frontend's budget (`held`, see `held_bytes`) and a `size` for each request,
  a request's bytes are held from its read until its answer is written; the reader also stops
  while the stream holds `stream_limit` bytes or more, or while the frontend's streams together
  hold their share of the budget, and goes on as answers written release bytes. After a large
  message the next read waits for the frontend's turn (`HeldBytes.in_turn`), so the large
  messages of many streams are read one at a time with other clients' work in between.
- One writer: answers leave through the one generator the servicer yields from (grpc.aio
  allows one writer per call).
- Intermediate answers: a request's answer function may `emit` extra messages ahead of its own
  answer (a handler's intermediate answers); they are written in turn, do not count against
  the window, and at most `frontend.streams.MAX_HELD_BYTES` of them wait unwritten per stream
  (`emit` refuses more, and the request then fails in-stream).
- Half-close: every request in flight is answered, then the stream ends (`Ending.DONE`).
- Cancellation (the client went away, or grpc stopped the call): the reader and every
  in-flight task are cancelled and awaited before the generator finishes, so no task is left.
- Broken request iterator (a read raised): the requests already in flight are answered first,
  then the stream ends with that error (`Ending.BROKEN`, `failure` holds it).
- Drain: once the server drains (`Admission.draining`), the reader stops reading; the requests
  already read are answered (each was admitted when read, so the DataPlane serves it while
  draining) and the stream ends with `Ending.DRAINED`, which the servicers answer UNAVAILABLE
  (the client's unread requests were not run; it retries them elsewhere). A stream idle in a
  read is stopped by its watcher within `DRAIN_POLL_S`, so it cannot hold the drain for the
  grace period.
"""

from __future__ import annotations

import asyncio
import enum
import functools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar, runtime_checkable

from mariner.server.common.held_bytes import LARGE_MESSAGE_BYTES, HeldBytes
from mariner.server.frontend.streams import MAX_HELD_BYTES

log = logging.getLogger("mariner.stream")

WINDOW = 64
# How often a stream waiting for its next request checks whether the server began draining.
DRAIN_POLL_S = 0.2

Req = TypeVar("Req")
Resp = TypeVar("Resp")


@runtime_checkable
class Admission(Protocol):
    """The DataPlane's admission (`draining`, `admit`): fakes in unit tests may lack it."""

    draining: bool

    def admit(self) -> bool: ...


class Ending(enum.Enum):
    """How a stream's answers ended (read `StreamPipeline.ending` once `responses()` is done)."""

    DONE = "done"  # the client half-closed and every request was answered
    DRAINED = "drained"  # the server began draining: reading stopped, everything read was answered
    BROKEN = "broken"  # reading the next request raised (`failure`); everything read was answered


@dataclass
class StreamStats:
    """Requests read and not yet answered, over all of one servicer's streams (tests read it)."""

    in_flight: int = 0
    peak: int = 0
    streams: int = 0

    def add(self, n: int) -> None:
        self.in_flight += n
        self.peak = max(self.peak, self.in_flight)


@dataclass(frozen=True)
class _Answer(Generic[Resp]):
    """A request's own answer and the request bytes written with it."""

    response: Resp
    size: int


@dataclass(frozen=True)
class _Extra(Generic[Resp]):
    """An emitted message (not a request's own answer) and the bytes it holds."""

    response: Resp
    size: int


@dataclass
class _State:
    in_flight: int = 0
    reading: bool = True
    room: asyncio.Event = field(default_factory=asyncio.Event)


class StreamPipeline(Generic[Req, Resp]):
    """One stream's pipeline; iterate `responses()` exactly once."""

    def __init__(
        self,
        requests: AsyncIterator[Req],
        answer: Callable[[Req], Awaitable[Resp]],
        *,
        on_crash: Callable[[Req], Resp],
        key: Callable[[Req], str | None] | None = None,
        admission: object = None,
        window: int = WINDOW,
        stats: StreamStats | None = None,
        held: HeldBytes | None = None,
        size: Callable[[Req], int] | None = None,
    ) -> None:
        if window < 1:
            raise ValueError(f"window must be at least 1, got {window}")
        self._requests = requests
        self._answer = answer
        self._on_crash = on_crash
        self._key = key
        self._admission = admission if isinstance(admission, Admission) else None
        self._window = window
        self._stats = stats if stats is not None else StreamStats()
        self._held = held if size is not None else None
        self._size = size
        self._bytes = 0  # request bytes read and not yet answered (held in `held`)
        self._done: asyncio.Queue[_Answer[Resp] | _Extra[Resp] | None] = asyncio.Queue()
        self._extra_bytes = 0  # emitted and not yet written
        self._tasks: set[asyncio.Task[None]] = set()
        self._tails: dict[str, asyncio.Task[None]] = {}
        self._state = _State()
        self._drain_seen = False
        self.ending: Ending | None = None
        self.failure: BaseException | None = None

    async def responses(self) -> AsyncIterator[Resp]:
        """Answers in completion order; the one place they are written from."""
        self._stats.streams += 1
        reader = asyncio.create_task(self._read(), name="stream-reader")
        tasks = [reader]
        if self._admission is not None:
            tasks.append(asyncio.create_task(self._watch(reader), name="stream-drain-watch"))
        try:
            while (resp := await self._done.get()) is not None:
                if isinstance(resp, _Extra):
                    self._extra_bytes -= resp.size
                    yield resp.response
                    continue
                self._release(1, resp.size)
                yield resp.response
        finally:
            self._stats.streams -= 1
            await self._shutdown(tasks)

    def emit(self, response: Resp, size: int) -> bool:
        """Write `response` (holding `size` bytes) ahead of its request's own answer; False, and
        nothing queued, when the stream already holds too much unwritten (module docstring)."""
        if self._extra_bytes + size > MAX_HELD_BYTES:
            return False
        self._extra_bytes += size
        self._done.put_nowait(_Extra(response, size))
        return True

    # -- reading --------------------------------------------------------------------------------
    async def _read(self) -> None:
        state = self._state
        last = 0  # the size of the last message read: after a large one, the next waits its turn
        try:
            while True:
                while self._full():  # stop reading, let HTTP/2 push back
                    state.room.clear()
                    await state.room.wait()
                if self._held is not None and not self._held.streams_may_read():
                    await self._held.stream_room()
                    continue  # and look again at this stream's own room
                if self._draining():
                    self.ending = Ending.DRAINED
                    return
                try:
                    if self._held is not None and last >= LARGE_MESSAGE_BYTES:
                        request = await self._held.in_turn(self._requests)
                    else:
                        request = await anext(self._requests)
                except StopAsyncIteration:
                    self.ending = Ending.DONE
                    return
                size = 0
                if self._held is not None and self._size is not None:
                    size = self._size(request)
                    self._bytes += size
                    self._held.add(size)
                last = size
                self._start(request, size)
        except asyncio.CancelledError:
            if not self._drain_seen:  # the call itself was cancelled
                raise
            task = asyncio.current_task()
            if task is not None:
                task.uncancel()
            self.ending = Ending.DRAINED  # the watcher stopped a read: the server drains
        except Exception as exc:  # a broken request stream: answer what was read, then fail
            self.failure = exc
            self.ending = Ending.BROKEN
        finally:
            state.reading = False
            self._maybe_end()

    async def _watch(self, reader: asyncio.Task[None]) -> None:
        """Stop a reader waiting for a request once the server drains. A separate task, so a
        read costs nothing extra; it looks every DRAIN_POLL_S seconds while the reader runs."""
        while not reader.done():
            await asyncio.sleep(DRAIN_POLL_S)
            if self._draining() and not reader.done():
                self._drain_seen = True
                reader.cancel()
                return

    def _draining(self) -> bool:
        return self._admission is not None and self._admission.draining

    # -- running ----------------------------------------------------------------------------------
    def _full(self) -> bool:
        if self._state.in_flight >= self._window:
            return True
        return self._held is not None and self._bytes >= self._held.limits.stream_limit

    def _start(self, request: Req, size: int) -> None:
        if self._admission is not None:
            # Read before the drain: admitted in the reader's context, which the task copies,
            # so the DataPlane serves it even if the drain begins before it reaches the batcher.
            self._admission.admit()
        key = self._key(request) if self._key is not None else None
        before = self._tails.get(key) if key is not None else None
        self._state.in_flight += 1
        self._stats.add(1)
        task = asyncio.create_task(self._run(request, before, size))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        if key is not None:
            self._tails[key] = task
            task.add_done_callback(functools.partial(self._forget, key))

    def _forget(self, key: str, task: asyncio.Task[None]) -> None:
        if self._tails.get(key) is task:
            del self._tails[key]

    async def _run(self, request: Req, before: asyncio.Task[None] | None, size: int) -> None:
        if before is not None:  # the previous step of this sequence first, whatever its outcome
            await asyncio.wait({before})
        try:
            resp = await self._answer(request)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("a streamed request's answer failed unexpectedly")
            resp = self._on_crash(request)
        self._done.put_nowait(_Answer(resp, size))

    # -- accounting -------------------------------------------------------------------------------
    def _release(self, n: int, size: int = 0) -> None:
        state = self._state
        state.in_flight -= n
        self._stats.add(-n)
        if size:
            self._bytes -= size
            assert self._held is not None
            self._held.release(size)
        state.room.set()
        self._maybe_end()

    def _maybe_end(self) -> None:
        state = self._state
        if not state.reading and state.in_flight == 0:
            self._done.put_nowait(None)

    async def _shutdown(self, own: list[asyncio.Task[None]]) -> None:
        """Cancel and await the reader, the watcher and every task still running (cancellation,
        or a writer that stopped early): none is left pending when the call ends."""
        left = [*own, *self._tasks]
        for task in left:
            task.cancel()
        await asyncio.gather(*left, return_exceptions=True)
        # Answers done but never written leave the window too.
        unsent = self._state.in_flight
        if unsent:
            self._state.in_flight = 0
            self._stats.add(-unsent)
        if self._bytes and self._held is not None:
            self._held.release(self._bytes)
            self._bytes = 0
