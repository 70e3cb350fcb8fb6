"""`percall`'s protocol pieces drive the inference listener's real protocol both ways, and its
prediction work on a bare protocol: every call must be answered (the driver waits for each
answer's last byte), so a broken way hangs or fails here rather than printing a figure for calls
that never completed."""

from __future__ import annotations

from typing import Any

import pytest

from mariner.loadtest.experiments import percall
from mariner.server.compat.torchserve.logs import emit
from mariner.server.compat.torchserve.logs.records import RecordPipe


def test_both_ways_through_the_protocol_answer_and_are_timed(
    tmp_path: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    pieces = percall.protocol_pieces(calls=percall.CONCURRENCY * 20, rounds=1)
    assert [p.name.rsplit(": ", 1)[1] for p in pieces] == [
        "the ASGI app",
        "the fast path",
        "the fast path's work",
    ]
    assert all(p.us_per_request > 0 for p in pieces)


def test_the_bookkeeping_pieces_measure_real_work_and_leave_the_log_target_as_it_was(
    tmp_path: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The access line's figure is of lines really handed to a record pipe, one per timed call."""
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    lines: list[str] = []
    real_put = RecordPipe.put_fields

    def counting(self: RecordPipe, *fields: Any) -> None:
        lines.append(str(fields[-1]))
        real_put(self, *fields)

    monkeypatch.setattr(RecordPipe, "put_fields", counting)
    before = emit.current()
    pieces = percall.bookkeeping_pieces(calls=percall.BATCH * 4, rounds=1)
    assert [p.name for p in pieces][0] == "request id"
    assert all(p.us_per_request > 0 for p in pieces)
    assert len(lines) == percall.BATCH * 4, "every timed call wrote its access line"
    assert '"POST /predictions/digits HTTP/1.1" 200' in lines[0]
    assert emit.current() is before
