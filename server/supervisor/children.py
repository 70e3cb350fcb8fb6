"""What every child process of the supervisor shares: how long to wait before restarting one,
and dropping a dead one's live gauges from the merged metrics."""

from __future__ import annotations

import asyncio
import contextlib
import os

FIRST_BACKOFF_S = 0.2
MAX_BACKOFF_S = 30.0
STABLE_AFTER_S = 30.0  # a child that ran this long starts its next restart at the first backoff


class Backoff:
    """Restart delays of one child: 0.2 s doubling up to 30 s, back to 0.2 s once a run lasted
    30 s (a child that crashes at once is not restarted in a tight loop; one that crashed
    after a good run comes back fast)."""

    def __init__(self) -> None:
        self.delay = FIRST_BACKOFF_S

    def after_run(self, ran_s: float) -> float:
        """The delay before the next start, given how long the last run lasted."""
        if ran_s > STABLE_AFTER_S:
            self.delay = FIRST_BACKOFF_S
        return self.delay

    async def wait(self) -> None:
        """Sleep the current delay, then double it (bounded)."""
        await asyncio.sleep(self.delay)
        self.delay = min(self.delay * 2, MAX_BACKOFF_S)


def mark_dead(pid: int | None) -> None:
    """Drop a dead process's live gauges from the merged metrics (multiprocess mode only)."""
    if pid is None or not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        return
    from prometheus_client import multiprocess

    with contextlib.suppress(OSError):
        multiprocess.mark_process_dead(pid)
