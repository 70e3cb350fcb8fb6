"""Stopping a worker slot, leaving no process behind, whatever the slot is doing.

A slot's task is not cancelled while it creates a process (a fork the zygote made after the
caller went away would be an orphan): `stop_slot` runs once the slot is retired, kills the
process as soon as it exists, and waits (bounded) until the slot's task has ended. A ready
worker is drained first when asked (`drain`): once the frontends follow a table without it they
close their connections to it after the batch they run (counted in /proc/net/unix,
`unix_connections`), and only then is it sent SIGTERM.

Apart from `worker_pool`, which keeps slots running: this is the other end of a slot's life,
with its own clock (grace, drain polling, the bounded reaping).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from mariner.server.supervisor.children import mark_dead
from mariner.server.supervisor.versions import Instance
from mariner.server.supervisor.worker_failures import stopped_error

log = logging.getLogger("mariner.supervisor")

DRAIN_POLL_S = 0.02  # how often a draining worker's connections are counted
DRAIN_FALLBACK_S = 0.5  # the wait when they cannot be counted (no /proc/net/unix)
MIN_STOP_GRACE_S = 1.0  # SIGTERM to SIGKILL, at least, after a drain that took the whole grace
KILL_WAIT_S = 10.0  # for a SIGKILLed process to be reaped
STOP_SLACK_S = 10.0  # past the grace, for a slot's task to end before it is cancelled


def unix_connections(socket_path: str, table: str = "/proc/net/unix") -> int | None:
    """How many connections a worker's listening socket has accepted and still holds (the
    frontends', the supervisor's describe): lines of /proc/net/unix on that path that are not
    the listening socket itself. None when the table cannot be read."""
    try:
        with open(table, "rb") as f:
            text = f.read().decode(errors="replace")
    except OSError:
        return None
    count = 0
    for line in text.splitlines()[1:]:
        parts = line.split()
        if len(parts) < 8 or parts[7] != socket_path:
            continue
        try:
            listening = int(parts[3], 16) & 0x10000  # __SO_ACCEPTCON
        except ValueError:
            continue
        if not listening:
            count += 1
    return count


def _alive(proc: object) -> bool:
    return proc is not None and proc.pid is not None and proc.returncode is None  # type: ignore[attr-defined]


async def stop_slot(inst: Instance, grace: float, drain: bool, why: str | None) -> None:
    """Stop one retired slot (`WorkerPool.stop` says how): drained first when asked, its first
    start failed with `why`, its process killed or stopped until the slot's task has ended."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + grace
    proc = inst.process
    if drain and inst.status == "READY" and _alive(proc):
        await _wait_drained(proc, deadline)
    if inst.first is not None and not inst.first.done():
        inst.first.set_exception(stopped_error(inst, why))
    while True:
        proc = inst.process
        if _alive(proc):
            if inst.status == "READY":
                await proc.stop(max(MIN_STOP_GRACE_S, deadline - loop.time()))
            else:
                await kill_worker(proc)
        task = inst.task
        if task is None or task.done() or task is asyncio.current_task():
            break
        await asyncio.wait([task], timeout=DRAIN_POLL_S)
        if loop.time() > deadline + STOP_SLACK_S and not task.done():
            log.error("worker slot %d did not end %.0f s after it was stopped; cancelling it", inst.index,
                      grace + STOP_SLACK_S)  # fmt: skip
            task.cancel()
            await asyncio.wait([task], timeout=KILL_WAIT_S)
            await kill_worker(inst.process)
            break
    if inst.process is not None:
        mark_dead(inst.process.pid)
    inst.status = "STOPPED"


async def _wait_drained(proc: object, deadline: float) -> None:
    """Until no connection to the worker's socket is left (or its process is gone, or the
    deadline passes)."""
    loop = asyncio.get_running_loop()
    path = proc.spec.socket_path  # type: ignore[attr-defined]
    while _alive(proc):
        left = deadline - loop.time()
        held = unix_connections(path)
        if held is None:
            await asyncio.sleep(max(0.0, min(DRAIN_FALLBACK_S, left)))
            return
        if held == 0:
            return
        if left <= 0:
            log.warning("worker %s still had %d connection(s) when its drain ended; stopping it",
                        proc.spec.id, held)  # type: ignore[attr-defined]  # fmt: skip
            return
        await asyncio.sleep(min(DRAIN_POLL_S, left))


async def kill_worker(proc: object) -> None:
    """SIGKILL a worker process (and its group) if it runs, and reap it (bounded)."""
    if not _alive(proc):
        return
    proc.kill()  # type: ignore[attr-defined]
    with contextlib.suppress(TimeoutError, Exception):
        await asyncio.wait_for(proc.wait(), KILL_WAIT_S)  # type: ignore[attr-defined]
