"""The one worker budget: how many model worker processes the server may start, checked on every
path that asks for them (start-up: the archive's model-config, config.properties `models=` and
`default_workers_per_model`, the server's flags; a management register call; a scale call).

Each worker is a process holding its own copy of the model, so a count nobody bounded (an
`initial_workers=1000`, an archive with `minWorkers: 500`) exhausts the machine: threads and
processes cannot be created any more (the supervisor itself then fails) or the kernel's
out-of-memory killer picks a victim, often another model's worker. The budget refuses such a
count before any process starts, naming the cap and the numbers:

- a static cap per model version (`DEFAULT_MAX_WORKERS_PER_MODEL`, 64) and one for the whole
  server (`DEFAULT_MAX_TOTAL_WORKERS`), configurable (`Limits.from_config`);
- a machine-aware cap: memory. A worker's cost is measured once it is ready (its unique set
  size, /proc/<pid>/smaps_rollup: what one more worker adds, pages a zygote-forked worker shares
  with the zygote are not counted again; its resident size where smaps cannot be read), and
  the requested new workers x that cost must fit in what the host or its cgroup still allows
  (cgroup v2 memory.max - memory.current, v1 memory.limit_in_bytes - memory.usage_in_bytes, both
  less the reclaimable inactive page cache; /proc/meminfo MemAvailable), less a headroom and
  what workers still loading are expected to take yet. Before any worker of a version was
  measured, the largest cost measured of any worker stands in, or an estimate from the
  archive's unpacked size, whichever is larger;
- the same for tasks (threads), where the cgroup (pids.max), the kernel (threads-max) or
  RLIMIT_NPROC bounds them: a pthread_create that fails is how an over-committed server dies.

A refused count is a ServingError(INVALID_ARGUMENT), the management API's 400. The registry
calls `check` (explicit counts) or `fit` (the built-in default count, one per GPU or core, which
is lowered to what fits rather than refused) with the registry's view of every version's
slots (`VersionUse`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from mariner.server.common.config import ServerConfig
from mariner.server.contracts.errors import Code, ServingError
from mariner.server.supervisor.machine import (
    FORKED_WORKER_BASE,
    MIB,
    Room,
    memory_room,
    process_memory,
    process_tasks,
    task_room,
)

log = logging.getLogger("mariner.supervisor")

DEFAULT_MAX_WORKERS_PER_MODEL = 64  # per model version: each worker holds a copy of the model
DEFAULT_MAX_TOTAL_WORKERS = 256  # every version together
GIB = 1 << 30
# Memory left free whatever is asked: the supervisor, the frontends and the workers' own growth
# (activations, allocator caches) live there too.
# 10% of the limit, within 256 MiB and 1 GiB (on a large host a tenth could exceed what is free).
MIN_MEMORY_HEADROOM = 256 * MIB
MAX_MEMORY_HEADROOM = 1 << 30
MEMORY_HEADROOM_FRACTION = 0.10
# Tasks (threads) left free, and a worker's until one is measured (its main thread, which runs
# the event loop and the handler, torch's intra-op pool once it runs, the handler's own threads).
MIN_TASK_HEADROOM = 64
TASK_HEADROOM_FRACTION = 0.10
MIN_WORKER_TASKS = 8


@dataclass(frozen=True)
class Limits:
    """The static caps, and whether the machine-aware checks run."""

    per_model: int = DEFAULT_MAX_WORKERS_PER_MODEL
    total: int = DEFAULT_MAX_TOTAL_WORKERS
    machine_checks: bool = True

    def __post_init__(self) -> None:
        if self.per_model < 1 or self.total < 1:
            raise ValueError(f"worker caps must be positive, got {self}")

    @classmethod
    def from_config(cls, cfg: ServerConfig) -> Limits:
        """The caps the server was configured with (`--max-workers-per-model`,
        `--max-total-workers`, `--worker-memory-check`, or their MARINER_* variables)."""
        return cls(
            per_model=cfg.max_workers_per_model,
            total=cfg.max_total_workers,
            machine_checks=cfg.worker_memory_check,
        )


# -- the budget -----------------------------------------------------------------------------------
Key = tuple[str, str]  # (model, version)


@dataclass(frozen=True)
class VersionUse:
    """One version as the registry holds it: the worker slots it holds or is about to start
    (`slots`), the pids of its ready workers, the pids of its slots still loading (None: no
    process yet, or not added yet), and the estimated cost of one of its workers."""

    key: Key
    slots: int
    ready: tuple[int, ...] = ()
    loading: tuple[int | None, ...] = ()
    estimate: int = FORKED_WORKER_BASE


@dataclass(frozen=True)
class Ask:
    """A count asked for: the version would have `total` workers, it has `current`.

    `what` is the parameter the caller used (initial_workers, minWorkers, min_worker...) and
    `source` where the number came from (None: the caller's own call), both for the message."""

    model: str
    version: str
    total: int
    current: int = 0
    what: str = "minWorkers"
    source: str | None = None
    estimate: int = FORKED_WORKER_BASE

    @property
    def key(self) -> Key:
        return (self.model, self.version)


def _workers(n: int) -> str:
    return "worker" if n == 1 else "workers"


def fmt_bytes(n: float) -> str:
    if abs(n) >= GIB:
        return f"{n / GIB:.1f} GiB"
    return f"{max(0.0, n) / MIB:.0f} MiB"


@dataclass
class _Cap:
    allowed: int  # the largest total the version may have under this cap
    reason: Callable[[int], str]  # the refusal, given the total asked for


@dataclass
class WorkerBudget:
    """The caps and what has been measured of every worker (see the module docstring)."""

    limits: Limits = field(default_factory=Limits)
    memory: Callable[[], Room | None] = memory_room
    tasks: Callable[[], Room | None] = task_room
    measure: Callable[[int], int | None] = process_memory
    count_tasks: Callable[[int], int | None] = process_tasks
    _bytes: dict[Key, int] = field(default_factory=dict)  # per version: the largest cost measured
    _tasks: dict[Key, int] = field(default_factory=dict)

    # -- measuring ------------------------------------------------------------------------------
    def note_ready(self, key: Key, pid: int | None) -> None:
        """A worker of `key` is ready: measure what it costs (its memory and threads)."""
        if pid is None:
            return
        cost = self.measure(pid)
        if cost:
            self._bytes[key] = max(self._bytes.get(key, 0), cost)
        tasks = self.count_tasks(pid)
        if tasks:
            self._tasks[key] = max(self._tasks.get(key, 0), tasks)

    def forget(self, key: Key) -> None:
        self._bytes.pop(key, None)
        self._tasks.pop(key, None)

    def _remeasure(self, uses: Iterable[VersionUse]) -> None:
        for use in uses:
            for pid in use.ready:
                self.note_ready(use.key, pid)

    def worker_bytes(self, key: Key, estimate: int) -> tuple[int, bool]:
        """One worker's cost for `key` and whether it was measured (else: the largest measured
        cost of any worker, or `estimate`, whichever is larger)."""
        if key in self._bytes:
            return self._bytes[key], True
        return max([estimate, *self._bytes.values()]), False

    def worker_tasks(self, key: Key) -> int:
        if key in self._tasks:
            return max(self._tasks[key], MIN_WORKER_TASKS)
        return max([MIN_WORKER_TASKS, *self._tasks.values()])

    # -- deciding -------------------------------------------------------------------------------
    def check(self, ask: Ask, uses: Sequence[VersionUse]) -> None:
        """Raise ServingError(INVALID_ARGUMENT) naming the cap and the numbers when the version
        may not have `ask.total` workers."""
        for cap in self._caps(ask, uses):
            if ask.total > cap.allowed:
                raise ServingError(Code.INVALID_ARGUMENT, self._say(ask, cap.reason(ask.total)))

    def fit(self, ask: Ask, uses: Sequence[VersionUse]) -> tuple[int, str | None]:
        """The largest count up to `ask.total` every cap allows (at least `ask.current`), and
        the refusal of the cap that lowered it (None when `ask.total` fits)."""
        n, why = ask.total, None
        for cap in self._caps(ask, uses):
            if cap.allowed < n:
                n, why = max(ask.current, cap.allowed), self._say(ask, cap.reason(ask.total))
        return n, why

    @staticmethod
    def _say(ask: Ask, reason: str) -> str:
        return f"{reason} (from {ask.source})" if ask.source else reason

    def _caps(self, ask: Ask, uses: Sequence[VersionUse]) -> list[_Cap]:
        per, total = self.limits.per_model, self.limits.total
        others = sum(u.slots for u in uses if u.key != ask.key)
        caps = [
            _Cap(per, lambda n: f"{ask.what} {n} exceeds the per-model cap of {per} workers"),
            _Cap(
                total - others,
                lambda n: (
                    f"{ask.what} {n} would bring the server to {others + n} workers, over its "
                    f"cap of {total} workers ({others} run or start for other models)"
                ),
            ),
        ]
        if self.limits.machine_checks and ask.total > ask.current:
            self._remeasure(uses)
            caps += self._machine_caps(ask, uses)
        return caps

    def _machine_caps(self, ask: Ask, uses: Sequence[VersionUse]) -> list[_Cap]:
        caps = []
        more = "more " if ask.current else ""
        room = self.memory()
        if room is not None:
            per, measured = self.worker_bytes(ask.key, ask.estimate)
            # Workers still loading have not taken all they will: what they are expected to take
            # yet is not free (the version asking included: its own loading slots are `current`).
            pending = 0
            for u in uses:
                expected, _ = self.worker_bytes(u.key, u.estimate)
                for pid in u.loading:
                    now = (self.measure(pid) or 0) if pid is not None else 0
                    pending += max(0, expected - now)
            headroom = min(
                MAX_MEMORY_HEADROOM, max(MIN_MEMORY_HEADROOM, int(MEMORY_HEADROOM_FRACTION * room.limit))
            )
            free = room.available - headroom - pending
            allowed = ask.current + max(0, free) // max(1, per)
            about = "" if measured else " (estimated: none of its workers has loaded yet)"
            detail = f"{room.source}, keeping {fmt_bytes(headroom)} free"
            if pending:
                detail += f", {fmt_bytes(pending)} promised to workers still loading"

            def says(
                n: int, per: int = per, free: int = free, about: str = about, detail: str = detail
            ) -> str:
                new = n - ask.current
                return (
                    f"{ask.what} {n}: {new} {more}{_workers(new)} of ~{fmt_bytes(per)} each{about} need "
                    f"{fmt_bytes(new * per)}, {fmt_bytes(max(0, free))} is available ({detail})"
                )

            caps.append(_Cap(allowed, says))
        threads = self.tasks()
        if threads is not None:
            per_t = self.worker_tasks(ask.key)
            headroom_t = max(MIN_TASK_HEADROOM, int(TASK_HEADROOM_FRACTION * threads.limit))
            pending_t = sum(len(u.loading) for u in uses) * MIN_WORKER_TASKS
            free_t = threads.available - headroom_t - pending_t

            def says_t(n: int, per_t: int = per_t, free_t: int = free_t, source: str = threads.source) -> str:
                new = n - ask.current
                return (
                    f"{ask.what} {n}: {new} {more}{_workers(new)} of ~{per_t} threads each need "
                    f"{new * per_t} threads, {max(0, free_t)} can still be created ({source}, "
                    f"keeping {headroom_t} free)"
                )

            caps.append(_Cap(ask.current + max(0, free_t) // per_t, says_t))
        return caps
