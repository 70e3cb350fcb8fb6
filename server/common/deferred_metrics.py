"""Prometheus writes of one event-loop turn, made once at the end of the turn.

In prometheus_client's multiprocess mode every `inc`, `set` and `observe` is a locked write
into a memory-mapped file (a histogram observation is two: its sum and its bucket), and a
frontend records several per request: the call's count and duration, its queue wait, the
queue depth on arrival. Measured on the call path (`python -m mariner.loadtest.experiments.percall`),
those writes were the largest single piece of Mariner's own per-call work. A batch's requests
all finish in the same loop turn, so the writes of a turn are summed here and written once per
child when the turn ends: a counter gets one `inc` of the sum, a histogram one write per bucket
touched plus one for its sum, a gauge its last value. Nothing is lost or reordered that a
scrape could see: a scrape of this process flushes first (`Metrics.exposition`), and the
supervisor's merge of the files sees at most one loop turn's delay. Without a running loop
(start-up, tests calling directly) every write is made at once.

The histogram fold uses prometheus_client's `_sum`, `_buckets` and `_upper_bounds`, private
but unchanged for years; the version is pinned and a test compares the fold with `observe`.
"""

from __future__ import annotations

import asyncio
import threading
from bisect import bisect_left
from collections.abc import Iterator
from typing import Any


class DeferredWrites:
    """The writes of the current loop turn; `flush` makes them."""

    def __init__(self) -> None:
        self._incs: dict[Any, float] = {}
        self._sets: dict[Any, float] = {}
        self._observations: dict[Any, list[float]] = {}  # child -> [sum, count in bucket 0, 1, ...]
        self._scheduled = False
        # A scrape or a test may collect from another thread while the loop records.
        self._lock = threading.Lock()

    def inc(self, child: Any, amount: float = 1.0) -> None:
        with self._lock:
            self._incs[child] = self._incs.get(child, 0.0) + amount
        self._schedule()

    def set(self, child: Any, value: float) -> None:
        with self._lock:
            self._sets[child] = value
        self._schedule()

    def observe(self, child: Any, amount: float) -> None:
        bounds = child._upper_bounds
        with self._lock:
            acc = self._observations.get(child)
            if acc is None:
                acc = self._observations[child] = [0.0] * (len(bounds) + 1)
            acc[0] += amount
            acc[bisect_left(bounds, amount) + 1] += 1  # the first bound >= amount, as observe picks
        self._schedule()

    def _schedule(self) -> None:
        if self._scheduled:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self.flush()
            return
        self._scheduled = True
        loop.call_soon(self.flush)

    def flush(self) -> None:
        """Write everything summed since the last flush."""
        with self._lock:
            self._scheduled = False
            incs, self._incs = self._incs, {}
            sets, self._sets = self._sets, {}
            observations, self._observations = self._observations, {}
        for child, amount in incs.items():
            child.inc(amount)
        for child, value in sets.items():
            child.set(value)
        for child, acc in observations.items():
            child._sum.inc(acc[0])
            buckets = child._buckets
            for i, count in enumerate(acc[1:]):
                if count:
                    buckets[i].inc(count)


class FlushOnCollect:
    """Registered first on a registry: collecting it (a scrape, `get_sample_value`) flushes
    the pending writes before the metrics after it are read."""

    def collect(self) -> Iterator[Any]:
        WRITES.flush()
        return iter(())

    def describe(self) -> list[Any]:
        return []


# One per process: every metric of the process flushes in the same turn.
WRITES = DeferredWrites()


class DeferredCounter:
    """A counter child whose increments are summed per loop turn."""

    __slots__ = ("_child",)

    def __init__(self, child: Any) -> None:
        self._child = child

    def inc(self, amount: float = 1.0) -> None:
        WRITES.inc(self._child, amount)


class DeferredGauge:
    """A gauge child of which only the last value set in a loop turn is written."""

    __slots__ = ("_child",)

    def __init__(self, child: Any) -> None:
        self._child = child

    def set(self, value: float) -> None:
        WRITES.set(self._child, value)


class DeferredHistogram:
    """A histogram child whose observations are folded per loop turn."""

    __slots__ = ("_child",)

    def __init__(self, child: Any) -> None:
        self._child = child

    def observe(self, amount: float) -> None:
        WRITES.observe(self._child, amount)
