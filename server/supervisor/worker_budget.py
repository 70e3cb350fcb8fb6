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
import os
import resource
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mariner.server.core.errors import Code, ServingError

log = logging.getLogger("mariner.supervisor")

DEFAULT_MAX_WORKERS_PER_MODEL = 64  # per model version: each worker holds a copy of the model
DEFAULT_MAX_TOTAL_WORKERS = 256  # every version together
# Until the server has config fields for them (ServerConfig.max_workers_per_model,
# .max_total_workers, .worker_memory_check), these environment variables set them.
ENV_PER_MODEL = "MARINER_MAX_WORKERS_PER_MODEL"
ENV_TOTAL = "MARINER_MAX_TOTAL_WORKERS"
ENV_MEMORY_CHECK = "MARINER_WORKER_MEMORY_CHECK"  # "0"/"false": no machine-aware check

MIB = 1 << 20
GIB = 1 << 30
# Memory left free whatever is asked: the supervisor, the frontends and the workers' own growth
# (activations, allocator caches) live there too.
MIN_MEMORY_HEADROOM = 256 * MIB
MEMORY_HEADROOM_FRACTION = 0.10
# A worker not measured yet: a fork of the zygote shares torch with it; a fresh interpreter
# (GPU workers, MARINER_WORKER_START=spawn) imports torch on its own.
FORKED_WORKER_BASE = 64 * MIB
SPAWNED_WORKER_BASE = 384 * MIB
ARCHIVE_FACTOR = 2  # the unpacked files, loaded into memory and converted once
# Tasks (threads) left free, and a worker's until one is measured (its handler thread, the
# event loop, torch's intra-op pool once it runs).
MIN_TASK_HEADROOM = 64
TASK_HEADROOM_FRACTION = 0.10
MIN_WORKER_TASKS = 8
_UNLIMITED = 1 << 60  # cgroup v1 writes "no limit" as a page-rounded 2**63 - 1


def _env_int(env: Mapping[str, str], key: str) -> int | None:
    value = env.get(key)
    if value is None or not value.strip():
        return None
    try:
        number = int(value)
    except ValueError:
        raise ServingError(
            Code.INVALID_ARGUMENT, f"{key} must be a positive integer, got {value!r}"
        ) from None
    if number < 1:
        raise ServingError(Code.INVALID_ARGUMENT, f"{key} must be a positive integer, got {value!r}")
    return number


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
    def from_config(cls, cfg: Any, env: Mapping[str, str] | None = None) -> Limits:
        """The caps from the server's config (`max_workers_per_model`, `max_total_workers`,
        `worker_memory_check`, where it has those fields), else the environment, else defaults."""
        env = os.environ if env is None else env
        per_model = getattr(cfg, "max_workers_per_model", None) or _env_int(env, ENV_PER_MODEL)
        total = getattr(cfg, "max_total_workers", None) or _env_int(env, ENV_TOTAL)
        check = getattr(cfg, "worker_memory_check", None)
        if check is None:
            check = env.get(ENV_MEMORY_CHECK, "1").strip().lower() not in ("0", "false", "no", "off")
        return cls(
            per_model=per_model or DEFAULT_MAX_WORKERS_PER_MODEL,
            total=total or DEFAULT_MAX_TOTAL_WORKERS,
            machine_checks=bool(check),
        )


# -- what the machine allows --------------------------------------------------------------------
@dataclass(frozen=True)
class Room:
    """What is still free of one resource: `available` now (units: bytes or tasks), `limit`
    the bound it is measured against (for the headroom), `source` the file that said so."""

    available: int
    limit: int
    source: str


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except (OSError, UnicodeDecodeError):
        return None


def _read_int(path: Path) -> int | None:
    text = _read(path)
    if text is None:
        return None
    text = text.strip()
    if text == "max":
        return _UNLIMITED
    try:
        return int(text.split()[0])
    except (ValueError, IndexError):
        return None


def _stat_value(path: Path, key: str) -> int:
    text = _read(path) or ""
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name == key:
            try:
                return int(value)
            except ValueError:
                return 0
    return 0


def _cgroup_dirs(root: Path) -> dict[str, list[Path]]:
    """Per cgroup hierarchy ("v2", "memory", "pids"): this process's cgroup directory and its
    ancestors up to the mount (a limit anywhere up the tree applies)."""
    text = _read(root / "proc/self/cgroup") or ""
    found: dict[str, list[Path]] = {}
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy, controllers, rel = parts
        if hierarchy == "0" and controllers == "":
            keys, base = ["v2"], root / "sys/fs/cgroup"
        else:
            names = controllers.split(",")
            keys = [n for n in ("memory", "pids") if n in names]
            if not keys:
                continue
            base = root / "sys/fs/cgroup" / keys[0]
        own = base / rel.lstrip("/")
        if not own.is_dir():  # a cgroup namespace: the mount is this process's own cgroup
            own = base
        chain = []
        node = own
        while True:
            chain.append(node)
            if node == base or base not in node.parents:
                break
            node = node.parent
        for key in keys:
            found[key] = chain
    return found


def memory_room(root: Path = Path("/")) -> Room | None:
    """The memory still free for new workers: the tightest of the cgroup limits (every level up
    the tree) and the host's MemAvailable; None when nothing can be read."""
    rooms: list[Room] = []
    dirs = _cgroup_dirs(root)
    for d in dirs.get("v2", []):
        limit = _read_int(d / "memory.max")
        current = _read_int(d / "memory.current")
        if limit is None or limit >= _UNLIMITED or current is None:
            continue
        used = max(0, current - _stat_value(d / "memory.stat", "inactive_file"))
        rooms.append(Room(limit - used, limit, "cgroup memory.max"))
    for d in dirs.get("memory", []):
        limit = _read_int(d / "memory.limit_in_bytes")
        usage = _read_int(d / "memory.usage_in_bytes")
        if limit is None or limit >= _UNLIMITED or usage is None:
            continue
        used = max(0, usage - _stat_value(d / "memory.stat", "total_inactive_file"))
        rooms.append(Room(limit - used, limit, "cgroup memory.limit_in_bytes"))
    meminfo = _read(root / "proc/meminfo")
    if meminfo:
        values = {}
        for line in meminfo.splitlines():
            name, _, rest = line.partition(":")
            try:
                values[name] = int(rest.split()[0]) * 1024
            except (ValueError, IndexError):
                continue
        available = values.get("MemAvailable")
        if available is None and "MemFree" in values:
            available = values["MemFree"] + values.get("Cached", 0)
        if available is not None:
            rooms.append(Room(available, values.get("MemTotal", available), "MemAvailable"))
    return min(rooms, key=lambda r: r.available, default=None)


def _tasks_of_uid(root: Path, uid: int) -> int:
    total = 0
    proc = root / "proc"
    try:
        entries = list(os.scandir(proc))
    except OSError:
        return 0
    for entry in entries:
        if not entry.name.isdigit():
            continue
        try:
            if entry.stat().st_uid != uid:
                continue
            stat = (proc / entry.name / "stat").read_text()
            total += int(stat.rsplit(")", 1)[1].split()[17])
        except (OSError, ValueError, IndexError):
            continue
    return total


def task_room(root: Path = Path("/")) -> Room | None:
    """The tasks (threads) still free: the tightest of the cgroup's pids.max (every level up),
    the kernel's threads-max and, for a non-root user, RLIMIT_NPROC; None when none bounds."""
    rooms: list[Room] = []
    dirs = _cgroup_dirs(root)
    for key in ("v2", "pids"):
        for d in dirs.get(key, []):
            limit = _read_int(d / "pids.max")
            current = _read_int(d / "pids.current")
            if limit is None or limit >= _UNLIMITED or current is None:
                continue
            rooms.append(Room(limit - current, limit, "cgroup pids.max"))
    threads_max = _read_int(root / "proc/sys/kernel/threads-max")
    loadavg = _read(root / "proc/loadavg")
    if threads_max and loadavg:
        try:
            running = int(loadavg.split()[3].split("/")[1])
            rooms.append(Room(threads_max - running, threads_max, "kernel threads-max"))
        except (ValueError, IndexError):
            pass
    if root == Path("/") and os.geteuid() != 0:
        soft, _ = resource.getrlimit(resource.RLIMIT_NPROC)
        if soft != resource.RLIM_INFINITY and soft > 0:
            rooms.append(Room(soft - _tasks_of_uid(root, os.geteuid()), soft, "RLIMIT_NPROC"))
    return min(rooms, key=lambda r: r.available, default=None)


def process_memory(pid: int) -> int | None:
    """What one worker process costs: its unique set size (private pages, resident or swapped
    out) from smaps_rollup, else its resident set size from statm; None when it is gone."""
    text = _read(Path(f"/proc/{pid}/smaps_rollup"))
    if text:
        total = 0
        seen = False
        for line in text.splitlines():
            name, _, rest = line.partition(":")
            if name in ("Private_Clean", "Private_Dirty", "Swap"):
                try:
                    total += int(rest.split()[0]) * 1024
                    seen = True
                except (ValueError, IndexError):
                    continue
        if seen:
            return total
    text = _read(Path(f"/proc/{pid}/statm"))
    try:
        return int(text.split()[1]) * os.sysconf("SC_PAGE_SIZE") if text else None
    except (ValueError, IndexError):
        return None


def process_tasks(pid: int) -> int | None:
    text = _read(Path(f"/proc/{pid}/status"))
    for line in (text or "").splitlines():
        if line.startswith("Threads:"):
            try:
                return int(line.split()[1])
            except (ValueError, IndexError):
                return None
    return None


def archive_estimate(model_dir: Path, *, spawned: bool) -> int:
    """A conservative cost of one worker of an archive nobody measured yet: the interpreter's
    own (a zygote fork shares torch; a fresh interpreter does not) plus twice the unpacked
    files (read into memory, then converted or copied once)."""
    size = 0
    for dirpath, _, files in os.walk(model_dir):
        for name in files:
            try:
                size += os.lstat(os.path.join(dirpath, name)).st_size
            except OSError:
                continue
    return (SPAWNED_WORKER_BASE if spawned else FORKED_WORKER_BASE) + ARCHIVE_FACTOR * size


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
            headroom = max(MIN_MEMORY_HEADROOM, int(MEMORY_HEADROOM_FRACTION * room.limit))
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
