"""What the tests of TorchServe's logs share: the records a process emits, and what a pipe holds."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from mariner.server.compat.torchserve.logs import emit
from mariner.server.compat.torchserve.logs.records import Record


@pytest.fixture
def captured() -> Iterator[list[Record]]:
    """Every TorchServe log record this process emits while the test runs."""
    records: list[Record] = []
    emit.set_target(emit.to_records(records.append))
    yield records
    emit.set_target(None)


def read_available(fd: int) -> bytes:
    """What the pipe `fd` holds now (non-blocking), to its end or until it is empty."""
    os.set_blocking(fd, False)
    out = b""
    while True:
        try:
            chunk = os.read(fd, 1 << 20)
        except BlockingIOError:
            return out
        if not chunk:
            return out
        out += chunk
