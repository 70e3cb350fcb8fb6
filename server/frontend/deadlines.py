"""One timer per batcher for the deadlines of every request it holds, instead of one per request.

A request's deadline (its client's, or its model's responseTimeout) must end its wait when it
passes, whether the request is still queued or its batch is running: the caller is answered
DEADLINE_EXCEEDED at that moment, and a queued one never reaches the device. An
`asyncio.timeout_at` around each request did that at the cost of a timer armed and cancelled
per request on the frontend's event loop, one of the larger pieces of Mariner's own per-call
work (`python -m mariner.loadtest.experiments.percall`). Deadlines almost never pass, so one timer set for
the earliest deadline the batcher holds does the same: noting a later deadline is a comparison;
when the timer fires, the batcher fails what has expired and the timer moves to the earliest
deadline left.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable


class DeadlineWatch:
    """Calls `expire(now)` when the earliest watched deadline passes; `expire` fails what has
    expired and returns the earliest deadline still held (or None)."""

    def __init__(self, clock: Callable[[], float], expire: Callable[[float], float | None]) -> None:
        self._clock = clock
        self._expire = expire
        self._at: float | None = None  # the deadline the timer is set for
        self._handle: asyncio.TimerHandle | None = None

    def watch(self, deadline: float) -> None:
        """A request with `deadline` is now held (`deadline` on the watch's clock)."""
        if self._at is None or deadline < self._at:
            self._arm(deadline)

    def _arm(self, deadline: float) -> None:
        if self._handle is not None:
            self._handle.cancel()
        loop = asyncio.get_running_loop()
        self._at = deadline
        self._handle = loop.call_at(loop.time() + max(0.0, deadline - self._clock()), self._fire)

    def _fire(self) -> None:
        self._handle, self._at = None, None
        earliest = self._expire(self._clock())
        if earliest is not None:
            self._arm(earliest)

    def close(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
        self._handle, self._at = None, None
