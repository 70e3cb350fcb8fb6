"""The book behind Triton's statistics extension: per version, successes and failures each
counted and timed, the last call's time, unknown models not kept."""

from __future__ import annotations

import time

from mariner.server.common.oip_stats import CallStats, CallTotals


def test_book_counts_and_times_each_outcome_per_version() -> None:
    book = CallStats()
    before = int(time.time() * 1000)
    book.record("digits", "1", True, 0.25)
    book.record("digits", "1", True, 0.5)
    book.record("digits", "1", False, 2.0)
    book.record("digits", "2", False, 1.0)
    book.record("unknown", "unknown", True, 9.0)
    snap = book.snapshot()
    assert set(snap) == {("digits", "1"), ("digits", "2")}
    one = snap[("digits", "1")]
    assert (one.ok, one.ok_s, one.failed, one.failed_s) == (2, 0.75, 1, 2.0)
    assert before <= one.last_ms <= int(time.time() * 1000)
    assert snap[("digits", "2")] == CallTotals(0, 0.0, 1, 1.0, snap[("digits", "2")].last_ms)


def test_a_snapshot_does_not_move_with_later_calls() -> None:
    book = CallStats()
    book.record("m", "1", True, 1.0)
    snap = book.snapshot()
    book.record("m", "1", True, 1.0)
    assert snap[("m", "1")].ok == 1
    assert book.snapshot()[("m", "1")].ok == 2
