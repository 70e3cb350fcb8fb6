"""The supervisor's reader of its children's output: each worker's stdout and stderr, each
frontend's record pipe.

One thread waits on every pipe (a selector) and splits what arrives into lines; each pipe's
lines go to its own callback. Nothing from a child is trusted to be small or slow: a line is cut
at `max_line` bytes (the rest of it up to the newline is dropped, the cut is marked), and a pipe
that writes more than `rate` lines a second (after a burst of `burst`) has its excess dropped and
counted, the count reported once the pipe calms down. A child that prints without end costs this
thread its reads, never the supervisor's event loop, and never blocks the child on a full pipe.
"""

from __future__ import annotations

import contextlib
import logging
import os
import selectors
import threading
import time
from collections.abc import Callable

from mariner.server.common.scheduling import batch_class

log = logging.getLogger("mariner.logs")

READ_CHUNK = 1 << 16
DEFAULT_MAX_LINE = 16 * 1024
DEFAULT_RATE = 2000.0  # lines per second per pipe, sustained
DEFAULT_BURST = 20_000.0


class LineReader:
    """Splits one pipe's bytes into bounded lines for `on_line`; counts what it drops over the
    rate and reports it through `on_dropped(count)` once lines flow again."""

    def __init__(
        self,
        on_line: Callable[[str], None],
        *,
        on_dropped: Callable[[int], None] | None = None,
        on_eof: Callable[[], None] | None = None,
        max_line: int = DEFAULT_MAX_LINE,
        rate: float | None = DEFAULT_RATE,
        burst: float = DEFAULT_BURST,
    ) -> None:
        self._on_line = on_line
        self._on_dropped = on_dropped
        self._on_eof = on_eof
        self._max_line = max_line
        self._rate = rate
        self._burst = burst
        self._tokens = burst
        self._last = time.monotonic()
        self._partial = bytearray()
        self._skipping = False  # inside a line already cut: drop up to its newline
        self.dropped = 0  # lines dropped over the rate, not yet reported

    def feed(self, data: bytes) -> None:
        start = 0
        while True:
            end = data.find(b"\n", start)
            if end < 0:
                self._keep(data[start:])
                return
            if self._skipping:
                self._skipping = False
            elif self._partial:
                self._partial += data[start:end]
                line = bytes(self._partial)
                self._partial.clear()
                self._line(line)
            else:
                self._line(data[start:end])
            start = end + 1

    def _keep(self, tail: bytes) -> None:
        if self._skipping or not tail:
            return
        self._partial += tail
        if len(self._partial) > self._max_line:
            line = bytes(self._partial[: self._max_line])
            self._partial.clear()
            self._skipping = True
            self._line(line, cut=True)

    def _line(self, raw: bytes, cut: bool = False) -> None:
        if len(raw) > self._max_line:
            raw, cut = raw[: self._max_line], True
        if not self._admit():
            return
        text = raw.decode("utf-8", "replace").rstrip("\r")
        if cut:
            text += f" [line cut at {self._max_line} bytes]"
        self._on_line(text)

    def _admit(self) -> bool:
        if self._rate is None:
            return True
        now = time.monotonic()
        self._tokens = min(self._burst, self._tokens + (now - self._last) * self._rate)
        self._last = now
        if self._tokens < 1:
            self.dropped += 1
            return False
        self._tokens -= 1
        if self.dropped and self._on_dropped is not None:
            count, self.dropped = self.dropped, 0
            self._on_dropped(count)
        return True

    def eof(self) -> None:
        if self._partial and not self._skipping:
            line = bytes(self._partial)
            self._partial.clear()
            self._line(line)
        if self.dropped and self._on_dropped is not None:
            count, self.dropped = self.dropped, 0
            self._on_dropped(count)
        if self._on_eof is not None:
            self._on_eof()


class OutputPump:
    """One thread reading many pipes. `add(fd, reader)` hands a pipe's read end over (it is
    closed at EOF or `close`); callbacks run on the pump's thread."""

    def __init__(self) -> None:
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        self._lock = threading.Lock()
        self._adding: list[tuple[int, LineReader]] = []
        self._closing = False
        self._stopped = False  # the thread has ended: the wake pipe is closed, nothing is read
        self._thread = threading.Thread(target=self._run, name="child-output", daemon=True)
        self._thread.start()

    def add(self, fd: int, reader: LineReader) -> None:
        os.set_blocking(fd, False)
        with self._lock:
            if self._closing:
                os.close(fd)
                return
            self._adding.append((fd, reader))
        self._poke()

    def _poke(self) -> None:
        with self._lock:  # never write to the wake pipe's number once it is closed (and reused)
            if self._stopped:
                return
            with contextlib.suppress(BlockingIOError, OSError):
                os.write(self._wake_w, b"x")

    def close(self, timeout: float = 5.0) -> None:
        """Read what the pipes still hold (bounded by `timeout`), then close them all."""
        with self._lock:
            self._closing = True
        self._poke()
        self._thread.join(timeout)

    def _run(self) -> None:
        try:
            batch_class()  # woken by a frontend's lines, it lets the frontend run first
            while True:
                with self._lock:
                    adding, self._adding = self._adding, []
                    closing = self._closing
                for fd, reader in adding:
                    self._selector.register(fd, selectors.EVENT_READ, reader)
                if closing:
                    self._drain_all()
                    return
                for key, _ in self._selector.select():
                    if key.data is None:
                        with contextlib.suppress(BlockingIOError, OSError):
                            while os.read(self._wake_r, 512):
                                pass
                        continue
                    self._read(key.fd, key.data)
        except Exception:  # noqa: BLE001 - report, then stop reading (children write to a full pipe)
            log.exception("the child output reader failed")
        finally:
            # Once this thread ends, nothing reads a pipe: one handed over later is closed at once
            # (its child gets EPIPE) rather than left to fill and block the child.
            with self._lock:
                self._closing = self._stopped = True
                orphans, self._adding = self._adding, []
                os.close(self._wake_w)
            for fd, _ in orphans:
                with contextlib.suppress(OSError):
                    os.close(fd)
            for key in list(self._selector.get_map().values()):
                self._selector.unregister(key.fd)
                with contextlib.suppress(OSError):
                    os.close(key.fd)
            self._selector.close()

    def _read(self, fd: int, reader: LineReader) -> bool:
        """Read one chunk into `reader`; False when there was nothing to read now or the pipe
        ended (it is then closed and the reader told)."""
        try:
            data = os.read(fd, READ_CHUNK)
        except BlockingIOError:
            return False
        except OSError:
            data = b""
        if not data:
            self._selector.unregister(fd)
            os.close(fd)
            try:
                reader.eof()
            except Exception:  # noqa: BLE001 - one reader's failure ends only its pipe
                log.exception("reading a child's output failed at its end")
            return False
        try:
            reader.feed(data)
        except Exception:  # noqa: BLE001
            log.exception("reading a child's output failed; dropping that chunk")
        return True

    def _drain_all(self) -> None:
        """At close: what every pipe still holds, for at most a second in all."""
        deadline = time.monotonic() + 1.0
        for key in list(self._selector.get_map().values()):
            if key.data is None:
                continue
            while time.monotonic() < deadline and self._read(key.fd, key.data):
                pass
