"""What the machine still allows new worker processes, and what one worker costs: the
measurements the worker budget (`worker_budget`) decides on.

Memory: the tightest of the cgroup limits up the tree (v2 memory.max - memory.current, v1
memory.limit_in_bytes - memory.usage_in_bytes, both less the reclaimable inactive page cache)
and the host's MemAvailable. Tasks: cgroup pids.max, the kernel's threads-max, RLIMIT_NPROC for a
non-root user. A worker's cost: its unique set size (what one more such process adds; the pages
a zygote-forked worker shares with the zygote are not counted again), else its resident size.
Every reader takes a root directory, so tests give it a fake /proc and /sys.
"""

from __future__ import annotations

import os
import resource
from dataclasses import dataclass
from pathlib import Path

MIB = 1 << 20
# A worker not measured yet: a fork of the zygote shares torch with it; a fresh interpreter
# (GPU workers, MARINER_WORKER_START=spawn) imports torch on its own.
FORKED_WORKER_BASE = 64 * MIB
SPAWNED_WORKER_BASE = 384 * MIB
ARCHIVE_FACTOR = 2  # the unpacked files, loaded into memory and converted once
_UNLIMITED = 1 << 60  # cgroup v1 writes "no limit" as a page-rounded 2**63 - 1


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
    # (hierarchy, limit file, usage file, reclaimable page cache in memory.stat): v2, then v1.
    for hierarchy, limit_file, usage_file, inactive in (
        ("v2", "memory.max", "memory.current", "inactive_file"),
        ("memory", "memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file"),
    ):
        for d in dirs.get(hierarchy, []):
            limit = _read_int(d / limit_file)
            usage = _read_int(d / usage_file)
            if limit is None or limit >= _UNLIMITED or usage is None:
                continue
            used = max(0, usage - _stat_value(d / "memory.stat", inactive))
            rooms.append(Room(limit - used, limit, f"cgroup {limit_file}"))
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
