"""The supervisor's one writer of TorchServe's log files and console.

Every record (its own, its frontends' over their record pipes, its workers' output lines) is
put in a bounded buffer; one thread formats and writes them, so no event loop waits on a disk or
a slow terminal. Where each kind goes, as TorchServe's log4j2.xml sends it (every logger there
also reaches the root's console and ts_log.log):

| kind | file | also |
|---|---|---|
| TorchServe's sentences | ts_log.log | console |
| Mariner's own records | ts_log.log | (on stderr as JSON already) |
| a worker's output line | model_log.log | ts_log.log, console (or, console off, the JSON log) |
| access line | access_log.log | ts_log.log, console |
| frontend / system metric | ts_metrics.log | ts_log.log, console |
| handler metric | model_metrics.log | ts_log.log, console |

With the console off (`--no-ts-console`), nothing is printed on stdout and a worker's output
goes to the JSON log on stderr instead, so every line reaches a collector once either way.

`async_logging` (TorchServe's key): false flushes the files after every batch the writer takes
(a line is on disk within milliseconds); true flushes at most once a second.
"""

from __future__ import annotations

import json
import logging
import os
import select
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from mariner.server.common.scheduling import batch_class
from mariner.server.compat.torchserve.logdirs import log_dir, metrics_dir, usable_dir
from mariner.server.compat.torchserve.logs.files import RotatingFile
from mariner.server.compat.torchserve.logs.lines import Clock, pattern_line, plain_line
from mariner.server.compat.torchserve.logs.records import Kind, Record

log = logging.getLogger("mariner.logs")

MAX_BUFFERED = 50_000  # records waiting for the writer; more are dropped and counted
ASYNC_FLUSH_S = 1.0
DEFAULT_MAX_BYTES = 100 * 1024 * 1024  # log4j's SizeBasedTriggeringPolicy in TorchServe's config
DEFAULT_BACKUPS = 5  # its DefaultRolloverStrategy max
LOG_FILES = ("ts_log", "model_log", "access_log")
METRICS_FILES = ("ts_metrics", "model_metrics")
_PLAIN = {Kind.ACCESS: "access_log", Kind.TS_METRICS: "ts_metrics", Kind.MODEL_METRICS: "model_metrics"}


@dataclass(frozen=True)
class LogSettings:
    """Where and how TorchServe's logs are written."""

    log_dir: Path
    metrics_dir: Path
    max_bytes: int = DEFAULT_MAX_BYTES
    backups: int = DEFAULT_BACKUPS
    console: bool = True
    async_logging: bool = False
    files: bool = True  # False: no file at all (the console and the JSON log only)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **settings: object) -> LogSettings:
        """The directories from LOG_LOCATION / METRICS_LOCATION (`ts_logdirs`), the rest given."""
        return cls(log_dir(env), metrics_dir(env), **settings)  # type: ignore[arg-type]


class LogSink:
    """Writes every record to its files and the console from one thread (see the module)."""

    def __init__(self, settings: LogSettings, *, stdout_fd: int = 1, stderr_fd: int = 2) -> None:
        self.settings = settings
        self._stdout_fd = stdout_fd
        self._stderr_fd = stderr_fd
        self._files: dict[str, RotatingFile] = {}
        self._lock = threading.Lock()
        self._buffer: list[Record] = []
        self._dropped = 0
        self._wake = threading.Event()
        self._closing = False
        self._thread: threading.Thread | None = None
        self._clock = Clock()
        self._console_ok = settings.console
        self.written = 0  # records written, for tests and the close line

    def start(self) -> None:
        """Create the files now (TorchServe's log4j creates them at start-up) and start writing.
        A location that cannot be written costs one warning; its files are left out."""
        s = self.settings
        locations = ((s.log_dir, LOG_FILES), (s.metrics_dir, METRICS_FILES)) if s.files else ()
        for directory, names in locations:
            usable = usable_dir(directory)
            if usable is None:
                log.warning("log location %s cannot be written: %s are not written", directory,
                            ", ".join(f"{n}.log" for n in names))  # fmt: skip
                continue
            for name in names:
                f = RotatingFile(usable / f"{name}.log", s.max_bytes, s.backups)
                f.open()
                self._files[name] = f
        self._thread = threading.Thread(target=self._run, name="ts-log-writer", daemon=True)
        self._thread.start()

    @property
    def files(self) -> dict[str, Path]:
        return {name: f.path for name, f in self._files.items()}

    def put_fields(self, kind: int, t: float, level: str, thread: str, logger: str, message: str) -> None:
        """`put` from its fields (`emit`'s target)."""
        self.put(Record(kind, t, level, thread, logger, message))

    def put(self, record: Record) -> None:
        """Queue one record (any thread; never blocks)."""
        with self._lock:
            if len(self._buffer) >= MAX_BUFFERED or self._closing:
                self._dropped += 1
                return
            self._buffer.append(record)
        if not self._wake.is_set():
            self._wake.set()

    def close(self, timeout: float = 10.0) -> None:
        """Write what is queued, flush and close the files."""
        with self._lock:
            self._closing = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
        for f in self._files.values():
            f.close()

    # -- the writer thread --------------------------------------------------------------------
    def _run(self) -> None:
        last_flush = time.monotonic()
        batch_class()  # woken by a frontend's lines, it lets the frontend run first
        while True:
            self._wake.wait(ASYNC_FLUSH_S if self.settings.async_logging else None)
            self._wake.clear()
            with self._lock:
                batch, self._buffer = self._buffer, []
                dropped, self._dropped = self._dropped, 0
                closing = self._closing
            if dropped:
                why = f"{dropped} log records dropped: the log writer fell behind"
                batch.append(Record(Kind.SERVER, time.time(), "WARN", "ts-log-writer", "mariner.logs", why))
            try:
                self._write(batch)
            except Exception:  # noqa: BLE001 - the writer must outlive any one bad batch
                log.exception("writing a batch of %d log records failed", len(batch))
            now = time.monotonic()
            if closing or not self.settings.async_logging or now - last_flush >= ASYNC_FLUSH_S:
                for f in self._files.values():
                    f.flush()
                last_flush = now
            if closing:
                with self._lock:
                    if not self._buffer:
                        return

    def _write(self, batch: list[Record]) -> None:
        out: dict[str, list[str]] = {}
        console: list[str] = []
        stderr: list[str] = []
        stamp = self._clock.stamp
        for r in batch:
            kind = r.kind
            when = stamp(r.time)
            if kind == Kind.CONSOLE:
                console.append(r.message + "\n")
                continue
            line = pattern_line(when, r.level, r.thread, r.logger, r.message)
            out.setdefault("ts_log", []).append(line)
            if kind == Kind.SERVER:
                continue
            if kind == Kind.MODEL_LOG:
                out.setdefault("model_log", []).append(line)
                if self.settings.console:
                    console.append(line)
                else:
                    stderr.append(_json_line(r))
                continue
            plain = _PLAIN.get(kind)  # type: ignore[call-overload]
            if plain is not None:
                out.setdefault(plain, []).append(plain_line(when, r.message))
            console.append(line)
        for name, lines in out.items():
            f = self._files.get(name)
            if f is not None:
                f.write("".join(lines).encode("utf-8", "replace"))
        if console and self._console_ok and self.settings.console:
            self._console_ok = _write_all(self._stdout_fd, "".join(console))
        if stderr:
            _write_all(self._stderr_fd, "".join(stderr))
        self.written += len(batch)


def _json_line(r: Record) -> str:
    """A worker's output line for the JSON log on stderr (the console being off), in the shape
    of Mariner's own records (`server/common/logs.py`)."""
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(r.time)) + f".{int(r.time * 1000) % 1000:03d}Z"
    level = "WARNING" if r.level == "WARN" else r.level
    return json.dumps({"ts": stamp, "level": level, "logger": r.logger, "worker": r.thread, "msg": r.message},
                      ensure_ascii=False) + "\n"  # fmt: skip


def _write_all(fd: int, text: str) -> bool:
    """Write all of `text` to `fd` (blocking: this is the writer thread). False once the reader
    is gone (a closed pipe): the console is then left alone."""
    data = text.encode("utf-8", "replace")
    view = memoryview(data)
    while view:
        try:
            written = os.write(fd, view)
        except InterruptedError:
            continue
        except BlockingIOError:  # a non-blocking stdout that is full: wait for room
            select.select([], [fd], [], 1.0)
            continue
        except OSError:
            return False
        view = view[written:]
    return True
