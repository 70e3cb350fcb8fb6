"""The one entry every producer of TorchServe's log lines calls, in whatever process it runs.

The supervisor points it at its log writer (`sink.LogSink.put_fields`), a frontend at its record
pipe (`records.RecordPipe.put_fields`); a process that set neither (a test driving one
component, a worker) drops the records. A target takes the record's fields (no object built per
record: a frontend writes several per call), and producers that format much ask `enabled()`
first, so a server without TorchServe's logs pays one call per event.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from mariner.server.compat.torchserve.logs.records import Kind, Record

# (kind, time, level, thread, logger, message) -> None
Target = Callable[[int, float, str, str, str, str], None]
_target: Target | None = None


def set_target(target: Target | None) -> None:
    """Where this process's records go from now on (None: nowhere)."""
    global _target
    _target = target


def to_records(consume: Callable[[Record], None]) -> Target:
    """A target handing each record to `consume` as a `Record` (tests, tools)."""

    def target(kind: int, t: float, level: str, thread: str, logger: str, message: str) -> None:
        consume(Record(kind, t, level, thread, logger, message))

    return target


def enabled() -> bool:
    return _target is not None


def current() -> Target | None:
    """The target now (None: records are dropped), for a producer writing several at once."""
    return _target


def emit(kind: Kind, level: str, thread: str, logger: str, message: str, t: float | None = None) -> None:
    target = _target
    if target is not None:
        target(kind, time.time() if t is None else t, level, thread, logger, message)


class ServerRecords(logging.Handler):
    """Mariner's own log records, also into ts_log.log in TorchServe's pattern (the JSON log on
    stderr has them already, so they are not printed again on the console). `thread` names the
    process (`supervisor`, `frontend-0`), where TorchServe's pattern has a Java thread name."""

    def __init__(self, thread: str, level: int = logging.NOTSET) -> None:
        super().__init__(level)
        self.thread = thread

    def emit(self, record: logging.LogRecord) -> None:
        target = _target
        if target is None:
            return
        try:
            from mariner.server.compat.torchserve.logs.lines import level_name

            message = record.getMessage()
            if record.exc_info:
                message = f"{message}\n{logging.Formatter().formatException(record.exc_info)}"
            target(Kind.SERVER, record.created, level_name(record.levelno), self.thread, record.name, message)
        except Exception:  # noqa: BLE001 - a log record never fails its caller
            self.handleError(record)
