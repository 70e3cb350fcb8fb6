"""`percall`'s protocol pieces drive the inference listener's real protocol both ways: every
call must be answered (the driver waits for each answer's last byte), so a broken way hangs or
fails here rather than printing a figure for calls that never completed."""

from __future__ import annotations

import pytest

from mariner.loadtest.experiments import percall


def test_both_ways_through_the_protocol_answer_and_are_timed(
    tmp_path: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    pieces = percall.protocol_pieces(calls=percall.CONCURRENCY * 20, rounds=1)
    assert [p.name.rsplit(": ", 1)[1] for p in pieces] == ["the ASGI app", "the fast path"]
    assert all(p.us_per_request > 0 for p in pieces)
