"""One log file, size-bounded: TorchServe's log4j `SizeBasedTriggeringPolicy` (100 MB) with a
`DefaultRolloverStrategy` (5 old files), so no log fills the disk.

When a write would take the file past `max_bytes`, it is renamed `<name>.1` (an older `.1`
becomes `.2`, and so on; the one past `backups` is deleted) and a fresh file is started. With
`backups=0` the file is simply started again. Rotated files are not compressed (log4j gzips
them): compressing on the writer thread would stall every log for the time it takes.

A file that cannot be opened or written (a read-only or full disk) costs one warning and is
retried at the next write after a pause; the server never stops for its logs.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from pathlib import Path
from typing import BinaryIO

log = logging.getLogger("mariner.logs")

RETRY_AFTER_S = 30.0  # after a failed open or write, before the file is tried again


class RotatingFile:
    """Appends bytes to `path`, rotating by size. Not thread-safe: the one writer owns it."""

    def __init__(self, path: Path, max_bytes: int, backups: int) -> None:
        if max_bytes <= 0:
            raise ValueError(f"max_bytes must be positive, got {max_bytes}")
        if backups < 0:
            raise ValueError(f"backups must be zero or more, got {backups}")
        self.path = path
        self.max_bytes = max_bytes
        self.backups = backups
        self._file: BinaryIO | None = None
        self._size = 0
        self._failed_at: float | None = None
        self.rotations = 0

    def open(self) -> bool:
        """Create (or reopen for appending) the file now, as log4j does at start-up: operators
        and tests see it before anything is written. False when it cannot be opened."""
        if self._file is not None:
            return True
        if self._failed_at is not None and time.monotonic() - self._failed_at < RETRY_AFTER_S:
            return False
        try:
            self._file = open(self.path, "ab")  # noqa: SIM115 - held open until close()
            self._size = self._file.tell()
        except OSError as exc:
            self._fail("open", exc)
            return False
        self._failed_at = None
        return True

    def write(self, data: bytes) -> None:
        """Append `data` (whole lines), rotating first when it would pass the size bound."""
        if not data or not self.open():
            return
        if self._size > 0 and self._size + len(data) > self.max_bytes:
            self._rotate()
            if not self.open():
                return
        assert self._file is not None
        try:
            self._file.write(data)
            self._size += len(data)
        except OSError as exc:
            self._fail("write", exc)
            self._close_quietly()

    def flush(self) -> None:
        if self._file is None:
            return
        try:
            self._file.flush()
        except OSError as exc:
            self._fail("write", exc)
            self._close_quietly()

    def close(self) -> None:
        self.flush()
        self._close_quietly()

    def _close_quietly(self) -> None:
        if self._file is not None:
            with contextlib.suppress(OSError):
                self._file.close()
            self._file = None

    def _rotate(self) -> None:
        self.flush()
        self._close_quietly()
        try:
            if self.backups == 0:
                os.unlink(self.path)
            else:
                oldest = self._numbered(self.backups)
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(oldest)
                for n in range(self.backups - 1, 0, -1):
                    with contextlib.suppress(FileNotFoundError):
                        os.rename(self._numbered(n), self._numbered(n + 1))
                os.rename(self.path, self._numbered(1))
        except FileNotFoundError:
            pass  # someone removed it: a fresh file is what rotation makes anyway
        except OSError as exc:
            self._fail("rotate", exc)
        self._size = 0
        self.rotations += 1

    def _numbered(self, n: int) -> Path:
        return self.path.with_name(f"{self.path.name}.{n}")

    def _fail(self, what: str, exc: OSError) -> None:
        if self._failed_at is None:
            log.warning("cannot %s log file %s: %s; retrying in %g s", what, self.path, exc.strerror or exc,
                        RETRY_AFTER_S)  # fmt: skip
        self._failed_at = time.monotonic()
