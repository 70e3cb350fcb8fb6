"""One budget of request bytes a frontend process holds, over every connection and protocol.

Each connection and stream had limits of its own (message size, a window of 64 requests per
stream) but nothing bounded their sum: twelve gRPC streams sending 7 MiB messages grew a frontend
from 142 MiB to 5 GB in 25 s, and every other client's latency with it. So a frontend counts the
request bytes it holds, from the moment a request is read until its answer is written (or the
call ends), and keeps the total under `limit`:

- A unary call (HTTP, gRPC) takes its bytes before it runs: a gRPC message by its size on the
  wire; an HTTP body as it arrives, after its Content-Length was checked against the room left
  before a byte of it is read (`http_limits`). When they do not fit, it is refused at once,
  503 / RESOURCE_EXHAUSTED with Retry-After, so the client backs off or goes to another replica;
  nothing waits for room.
- A stream may wait, so streams give way first: a stream reads its next message only while the
  frontend holds under `limit * STREAM_SHARE` and the stream itself holds under `stream_limit`.
  Otherwise it stops reading, and HTTP/2 flow control pushes back on its client, until answers
  written release bytes. The rest of the budget stays for unary calls, so streams alone never
  make them fail.

When the bytes held fall back after a burst, the process's allocator is asked to give the freed
memory back to the system (glibc's `malloc_trim`, in a thread, a second after the fall): glibc
otherwise keeps the heap it grew for large messages, and a frontend stayed at 776 MiB after the
attack above ended. (Making glibc map each large buffer on its own, MALLOC_MMAP_THRESHOLD_, did
return it, but cost 3.6x the CPU per large message in page faults.)

A message is counted once it is read, so the total can pass a threshold by the messages read at
the same moment (each at most the largest message the server accepts); the budget bounds what
accumulates, not one read. One event loop per frontend: nothing here is thread-safe.

Large stream messages are also read in turn (`in_turn`). A 7 MiB message costs the frontend's one
event loop about 10 ms in one step (grpc's receive, the protobuf parse and the copies into Python
bytes), and a stream reads its next message as soon as its last one is counted: twelve streams
sending such messages finished their reads together, and another client's next step waited
behind all twelve. So a stream whose last message was large (`LARGE_MESSAGE_BYTES`) takes the
frontend's one turn for its next read and, once it has read, lets whatever waited run before
the next stream's read: another client's step waits for about one large read, not twelve. A read
whose message has not come within `TURN_S` (its client is slow to send) gives the turn up and
goes on waiting without it, so an idle stream never holds the others back.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TypeVar

from mariner.server.contracts.errors import Code, ServingError

log = logging.getLogger("mariner.frontend")

# The share of the budget streams may fill before they stop reading (module docstring).
STREAM_SHARE = 0.5
MIB = 1 << 20
# A burst past this many bytes held is trimmed once the bytes held fall under a quarter of it.
TRIM_AFTER_BYTES = 64 * MIB
TRIM_DELAY_S = 1.0
# A stream whose last message was at least this large reads its next one in turn (docstring).
LARGE_MESSAGE_BYTES = 1 * MIB
# How long a read may hold the turn while its message has not come.
TURN_S = 0.05

T = TypeVar("T")


def _libc_trim() -> Callable[[], object] | None:
    """glibc's malloc_trim(0), or None where there is none (musl, macOS)."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        trim = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    return lambda: trim(0)


_TRIM = _libc_trim()


def _trimmed(done: asyncio.Future[object]) -> None:
    if done.exception() is not None:
        log.warning("malloc_trim failed: %s", done.exception())


@dataclass(frozen=True)
class HeldLimits:
    """A frontend's budget: bytes in all (`limit`) and per stream (`stream_limit`)."""

    limit: int = 512 * MIB
    stream_limit: int = 16 * MIB

    def __post_init__(self) -> None:
        if not 0 < self.stream_limit <= self.limit:
            raise ValueError(
                f"the per-stream budget ({self.stream_limit} bytes) must be above 0 and at most the "
                f"frontend's ({self.limit} bytes)"
            )


class HeldBytes:
    """The request bytes one frontend holds now (module docstring)."""

    def __init__(self, limits: HeldLimits | None = None) -> None:
        self.limits = limits or HeldLimits()
        self.held = 0
        self.peak = 0
        self.refused = 0  # unary calls refused for want of room (tests and logs read it)
        self._stream_room = asyncio.Event()
        self._stream_room.set()
        self._stream_mark = int(self.limits.limit * STREAM_SHARE)
        self._burst = 0  # the most held since the last trim
        self._trim_pending = False
        self.trims = 0
        self._turn = asyncio.Lock()
        self.turns = 0  # reads taken in turn (tests read it)

    def fits(self, n: int) -> bool:
        """Whether `n` more bytes of a unary call fit (always when nothing is held, so the largest
        request the server accepts can run alone)."""
        return not self.held or self.held + n <= self.limits.limit

    def take(self, n: int) -> bool:
        """Hold `n` bytes of a unary call if they fit; False, holding nothing, if not."""
        if not self.fits(n):
            self.refused += 1
            return False
        self.add(n)
        return True

    def add(self, n: int) -> None:
        """Hold `n` bytes already read (a stream's message)."""
        self.held += n
        self.peak = max(self.peak, self.held)
        self._burst = max(self._burst, self.held)
        if self.held >= self._stream_mark:
            self._stream_room.clear()

    def release(self, n: int) -> None:
        self.held -= n
        if self.held < self._stream_mark:
            self._stream_room.set()
        if self._burst >= TRIM_AFTER_BYTES and self.held < TRIM_AFTER_BYTES // 4 and not self._trim_pending:
            self._trim_pending = True
            asyncio.get_running_loop().call_later(TRIM_DELAY_S, self._trim)

    def _trim(self) -> None:
        """Give the heap freed since the burst back to the system, off the loop (module docstring)."""
        self._trim_pending = False
        self._burst = self.held
        if _TRIM is None:
            return
        self.trims += 1
        asyncio.get_running_loop().run_in_executor(None, _TRIM).add_done_callback(_trimmed)

    def streams_may_read(self) -> bool:
        return self.held < self._stream_mark

    async def stream_room(self) -> None:
        """Return once streams may read again."""
        while not self.streams_may_read():
            await self._stream_room.wait()

    async def in_turn(self, requests: AsyncIterator[T]) -> T:
        """The next message of `requests`, read in the frontend's turn (module docstring); raises
        what reading raises (StopAsyncIteration at the end of the stream)."""
        await self._turn.acquire()
        holding = True

        def give_up() -> None:  # the client is slow to send: the others read meanwhile
            nonlocal holding
            holding = False
            self._turn.release()

        timer = asyncio.get_running_loop().call_later(TURN_S, give_up)
        try:
            message = await anext(requests)
            timer.cancel()
            self.turns += 1
            if holding:
                await asyncio.sleep(0)  # what waited behind this read runs before the next one
            return message
        finally:
            timer.cancel()
            if holding:
                self._turn.release()

    def refusal(self, n: int) -> ServingError:
        """What a unary call that did not fit is told (RESOURCE_EXHAUSTED: 503 and Retry-After)."""
        return ServingError(
            Code.RESOURCE_EXHAUSTED,
            f"the server holds {self.held >> 20} MiB of requests, and this one's {n} bytes do not fit "
            f"its budget of {self.limits.limit >> 20} MiB (frontend_max_held_mb); retry shortly",
        )
