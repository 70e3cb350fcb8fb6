"""What a log record is, and how a frontend hands its records to the supervisor.

The supervisor is the one writer of TorchServe's log files and console (`sink`). A frontend's
records (its access lines, its metric lines, TorchServe's lifecycle sentences it knows first,
its own log records for ts_log.log) travel over a pipe the supervisor reads (`pump`), one line
each: `kind \\x1f milliseconds \\x1f level \\x1f thread \\x1f logger \\x1f message`, newlines of the
message as `\\x1e`. The frontend's side (`RecordPipe`) buffers records and writes them once per
event-loop turn without ever blocking: a full pipe (a supervisor that fell behind) keeps a
bounded backlog, and past it records are dropped and counted, never the event loop stalled.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import fcntl
import os
import threading
import time
from typing import NamedTuple


class Kind(enum.IntEnum):
    """Where a record goes (the sink's routing)."""

    TS = 0  # TorchServe's own sentences: ts_log.log and the console
    SERVER = 1  # Mariner's own log records: ts_log.log (the JSON log on stderr already has them)
    MODEL_LOG = 2  # a worker's output line: model_log.log, ts_log.log, the console
    ACCESS = 3  # access_log.log, ts_log.log, the console
    TS_METRICS = 4  # ts_metrics.log, ts_log.log, the console
    MODEL_METRICS = 5  # model_metrics.log, ts_log.log, the console
    CONSOLE = 6  # a bare console line (TorchServe's "Model server started.")


class Record(NamedTuple):
    kind: int
    time: float
    level: str  # log4j's name: DEBUG, INFO, WARN, ERROR
    thread: str  # log4j's %t
    logger: str  # log4j's %c
    message: str


_FIELD = "\x1f"
_NEWLINE = "\x1e"
MAX_RECORD_LINE = 1 << 16  # what the supervisor reads of one encoded record


def encode(record: Record) -> str:
    return encode_fields(*record)


def encode_fields(kind: int, t: float, level: str, thread: str, logger: str, message: str) -> str:
    """One record's line (`decode` reads it back); a message is escaped only when it needs it,
    as most do not (the frontend's hot path)."""
    if "\n" in message or _FIELD in message:
        message = message.replace(_FIELD, " ").replace("\n", _NEWLINE)
    return f"{kind}{_FIELD}{int(t * 1000)}{_FIELD}{level}{_FIELD}{thread}{_FIELD}{logger}{_FIELD}{message}\n"


def decode(line: str) -> Record | None:
    """A record from one line a frontend wrote, or None when it is not one."""
    parts = line.split(_FIELD, 5)
    if len(parts) != 6:
        return None
    try:
        kind = Kind(int(parts[0]))
        t = int(parts[1]) / 1000  # milliseconds on the wire
    except ValueError:
        return None
    return Record(kind, t, parts[2], parts[3], parts[4], parts[5].replace(_NEWLINE, "\n"))


def widen_pipe(fd: int, size: int = 1 << 20) -> None:
    """Ask for a larger pipe buffer (Linux F_SETPIPE_SZ; up to the system's limit), so a burst
    of records waits in the kernel rather than in the writer's backlog."""
    with contextlib.suppress(OSError, AttributeError):
        fcntl.fcntl(fd, getattr(fcntl, "F_SETPIPE_SZ", 1031), size)


class RecordPipe:
    """A frontend's end of its record pipe: `put` buffers, the event loop writes.

    `put` is cheap and thread-safe (a lock and a list append); the buffer is written once per
    loop turn (a `call_soon` scheduled by the first record of the turn), or at once when no loop
    runs. Writes are non-blocking: what the pipe does not take waits (bounded by `max_backlog`
    bytes) for the pipe to drain; beyond that, records are dropped and counted, and the count is
    reported as one record once the pipe takes records again.
    """

    def __init__(self, fd: int, *, max_backlog: int = 8 << 20) -> None:
        self._fd = fd
        os.set_blocking(fd, False)
        self._lock = threading.Lock()
        self._parts: list[str] = []
        self._size = 0
        self._backlog = bytearray()
        self._max_backlog = max_backlog
        self._scheduled = False
        self._waiting_writable = False
        self._dropped = 0
        self._closed = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: int | None = None

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """Write from `loop` from now on (call on that loop's thread)."""
        self._loop = loop
        self._loop_thread = threading.get_ident()

    def put(self, record: Record) -> None:
        self.put_fields(*record)

    def put_fields(self, kind: int, t: float, level: str, thread: str, logger: str, message: str) -> None:
        """`put` without a Record: the frontend's hot path (`emit`'s target)."""
        text = encode_fields(kind, t, level, thread, logger, message)
        with self._lock:
            if self._closed or self._size + len(self._backlog) > self._max_backlog:
                self._dropped += 1
                return
            self._parts.append(text)
            self._size += len(text)
            if self._scheduled:
                return
            self._scheduled = True
        loop = self._loop
        if loop is None or loop.is_closed():
            self.flush()
        elif threading.get_ident() == self._loop_thread:
            loop.call_soon(self.flush)
        else:
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: nothing to write to
                loop.call_soon_threadsafe(self.flush)

    def flush(self) -> None:
        """Write what is buffered (never blocks)."""
        with self._lock:
            self._scheduled = False
            parts, self._parts, self._size = self._parts, [], 0
            dropped, self._dropped = self._dropped, 0
            if dropped:
                why = f"{dropped} log records dropped: the record pipe to the supervisor was full"
                note = Record(Kind.SERVER, time.time(), "WARN", "frontend", "mariner.logs", why)
                parts.append(encode(note))
            if parts:
                self._backlog += "".join(parts).encode("utf-8", "replace")
            if self._closed or not self._backlog:
                return
            try:
                written = os.write(self._fd, self._backlog)
            except BlockingIOError:
                written = 0
            except OSError:  # the supervisor is gone: nothing more can be written
                self._closed = True
                self._backlog.clear()
                return
            del self._backlog[:written]
            pending = bool(self._backlog)
        if pending:
            self._wait_writable()

    def _wait_writable(self) -> None:
        loop = self._loop
        if loop is None or self._waiting_writable or threading.get_ident() != self._loop_thread:
            return
        self._waiting_writable = True

        def writable() -> None:
            loop.remove_writer(self._fd)
            self._waiting_writable = False
            self.flush()

        try:
            loop.add_writer(self._fd, writable)
        except (RuntimeError, ValueError, OSError):
            self._waiting_writable = False

    def close(self) -> None:
        """Write what is left (best effort, non-blocking) and close the pipe."""
        self.flush()
        with self._lock:
            self._closed = True
        if self._waiting_writable and self._loop is not None:
            with contextlib.suppress(Exception):
                self._loop.remove_writer(self._fd)
        with contextlib.suppress(OSError):
            os.close(self._fd)
