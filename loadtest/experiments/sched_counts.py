"""What the kernel does to each server process under load: context switches, migrations, user and
system CPU per request by process role; and what pinning a role to one CPU, giving it SCHED_BATCH
or another time slice changes, measured on one server in the same minutes.

    python -m mariner.loadtest.experiments.sched_counts                         # 64 clients, 4 x 4 s
    python -m mariner.loadtest.experiments.sched_counts --pin frontend=0,worker=1
    python -m mariner.loadtest.experiments.sched_counts --batch frontend --clients 8
    python -m mariner.loadtest.experiments.sched_counts --slice frontend=200

Why a tool of its own: the frontend's CPU per prediction live (~95-125 µs at 64 clients on the
2-core machine) is about twice what `percall` measures in-process (~50), and the interpreter is
not all of the difference. Per answered request this prints, for each role (frontend, worker,
supervisor): CPU (and its system part), voluntary and involuntary context switches (from
/proc/PID/task/TID/status) and migrations between CPUs (`se.nr_migrations` in .../sched, where the
kernel shows it). With `--pin`, `--batch` or `--slice` (EEVDF's time slice, in µs: the runtime
`sched_setattr` takes for a fair task since Linux 6.12; x86-64 only) each round serves one level
as started and one with the setting applied to the role's threads (undone after), in alternating
order, so the variant and the baseline share the server, its warm caches and the minute. Threads
a process starts while a setting is applied keep the process's own affinity, policy and slice.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import statistics
import struct
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import psutil

from mariner.loadtest.experiments.ab_live import check_live, drive, live_parser, role
from mariner.loadtest.payloads import test_digit_bodies
from mariner.loadtest.servers.mariner import MarinerProcess

REPORTED_ROLES = ("frontend", "worker", "supervisor")  # the zygote only forks workers


@dataclass(frozen=True)
class Counters:
    """What the kernel counted for a process (or a role's processes), summed over its threads."""

    cpu_s: float = 0.0
    system_s: float = 0.0
    voluntary: int = 0
    involuntary: int = 0
    migrations: int | None = 0  # None where the kernel does not show them

    def __add__(self, other: Counters) -> Counters:
        return self._combine(other, 1)

    def __sub__(self, other: Counters) -> Counters:
        return self._combine(other, -1)

    def _combine(self, other: Counters, sign: int) -> Counters:
        mig = (
            None
            if self.migrations is None or other.migrations is None
            else self.migrations + sign * other.migrations
        )
        return Counters(
            self.cpu_s + sign * other.cpu_s,
            self.system_s + sign * other.system_s,
            self.voluntary + sign * other.voluntary,
            self.involuntary + sign * other.involuntary,
            mig,
        )


def _thread_switches(pid: int, tid: int) -> tuple[int, int, int | None]:
    voluntary = involuntary = 0
    migrations: int | None = None
    with open(f"/proc/{pid}/task/{tid}/status") as status:
        for line in status:
            name, _, value = line.partition(":")
            if name == "voluntary_ctxt_switches":
                voluntary = int(value)
            elif name == "nonvoluntary_ctxt_switches":
                involuntary = int(value)
    with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{tid}/sched") as sched:
        for line in sched:
            if line.startswith("se.nr_migrations"):
                migrations = int(line.partition(":")[2])
    return voluntary, involuntary, migrations


def read_counters(pid: int) -> Counters:
    """The counters of process `pid` now (a thread that ended meanwhile is left out)."""
    process = psutil.Process(pid)
    total = Counters()
    for thread in process.threads():
        with contextlib.suppress(OSError):
            voluntary, involuntary, migrations = _thread_switches(pid, thread.id)
            total += Counters(0.0, 0.0, voluntary, involuntary, migrations)
    times = process.cpu_times()
    return Counters(times.user + times.system, times.system) + total


def pids_by_role(root: int) -> dict[str, list[int]]:
    """The server's processes (the supervisor `root` and its descendants) by role."""
    out: dict[str, list[int]] = {}
    top = psutil.Process(root)
    for p in [top, *top.children(recursive=True)]:
        with contextlib.suppress(psutil.Error):
            out.setdefault(role(p.cmdline()), []).append(p.pid)
    return out


def counters_by_role(roles: dict[str, list[int]]) -> dict[str, Counters]:
    out: dict[str, Counters] = {}
    for name, pids in roles.items():
        for pid in pids:
            with contextlib.suppress(psutil.Error):
                out[name] = out.get(name, Counters()) + read_counters(pid)
    return out


@dataclass(frozen=True)
class Setting:
    """What a variant changes: roles pinned to one CPU each, roles given SCHED_BATCH, roles given
    a time slice (µs)."""

    pin: dict[str, int] = field(default_factory=dict)
    batch: frozenset[str] = frozenset()
    slice_us: dict[str, int] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.pin or self.batch or self.slice_us)

    def label(self) -> str:
        parts = [f"{r} on CPU {c}" for r, c in sorted(self.pin.items())]
        parts += [f"{r} SCHED_BATCH" for r in sorted(self.batch)]
        parts += [f"{r} slice {us} µs" for r, us in sorted(self.slice_us.items())]
        return ", ".join(parts) or "as started"


@contextlib.contextmanager
def applied(setting: Setting, roles: dict[str, list[int]]) -> Iterator[None]:
    """`setting` on every thread of the roles it names, each thread's own affinity and policy
    restored afterwards."""
    undo: list[Callable[[], None]] = []
    try:
        for name in set(setting.pin) | setting.batch | set(setting.slice_us):
            for pid in roles.get(name, []):
                for tid in (t.id for t in psutil.Process(pid).threads()):
                    undo.append(_set(tid, setting.pin.get(name), name in setting.batch))
                    if name in setting.slice_us:
                        undo.append(_set_slice(tid, setting.slice_us[name] * 1000))
        yield
    finally:
        for step in reversed(undo):
            with contextlib.suppress(OSError):
                step()


def _set(tid: int, cpu: int | None, batch: bool) -> Callable[[], None]:
    cpus, policy, param = os.sched_getaffinity(tid), os.sched_getscheduler(tid), os.sched_getparam(tid)
    if cpu is not None:
        os.sched_setaffinity(tid, {cpu})
    if batch:
        os.sched_setscheduler(tid, os.SCHED_BATCH, os.sched_param(0))

    def restore() -> None:
        os.sched_setaffinity(tid, cpus)
        os.sched_setscheduler(tid, policy, param)

    return restore


# sched_attr (include/uapi/linux/sched/types.h): size, policy, flags, nice, priority, runtime,
# deadline, period, util_min, util_max; x86-64's syscall numbers.
_SCHED_ATTR = struct.Struct("=IIQiIQQQII")
_SETATTR, _GETATTR = 314, 315


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _syscall(number: int, *args: object) -> None:
    if _libc().syscall(number, *args) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def _sched_attr(tid: int) -> tuple[int, ...]:
    """Thread `tid`'s sched_attr fields (`_SCHED_ATTR`), as `sched_getattr` reads them."""
    buf = ctypes.create_string_buffer(_SCHED_ATTR.size)
    _syscall(_GETATTR, tid, buf, _SCHED_ATTR.size, 0)
    return _SCHED_ATTR.unpack(buf.raw)


def slice_ns(tid: int) -> int:
    """Thread `tid`'s time slice (the runtime `sched_getattr` reports for a fair task)."""
    return int(_sched_attr(tid)[5])


def _set_slice(tid: int, ns: int) -> Callable[[], None]:
    _size, policy, _flags, nice, priority, old, *_ = _sched_attr(tid)

    def put(runtime: int) -> None:
        attr = _SCHED_ATTR.pack(_SCHED_ATTR.size, policy, 0, nice, priority, runtime, 0, 0, 0, 0)
        _syscall(_SETATTR, tid, ctypes.create_string_buffer(attr, _SCHED_ATTR.size), 0)

    put(ns)
    return lambda: put(old)


@dataclass(frozen=True)
class Level:
    """One level served under one setting: throughput, p50 and each role's counters per request."""

    rps: float
    p50_ms: float
    per_request: dict[str, Counters]
    requests: int


def serve_level(
    server: MarinerProcess,
    roles: dict[str, list[int]],
    *,
    model: str,
    clients: int,
    seconds: float,
    bodies: tuple[bytes, ...],
) -> Level:
    before = counters_by_role(roles)
    level, answered = drive(server, "mariner", model=model, clients=clients, seconds=seconds, bodies=bodies)
    after = counters_by_role(roles)
    per_request = {r: after[r] - before[r] for r in after}
    return Level(level.throughput_rps, level.latency.p50_ms, per_request, answered)


def _cells(level: Level, name: str) -> list[str]:
    c, n = level.per_request.get(name, Counters()), level.requests
    mig = "n/a" if c.migrations is None else f"{c.migrations / n:.3f}"
    return [f"{c.cpu_s / n * 1e6:.1f}", f"{c.system_s / n * 1e6:.1f}", f"{c.voluntary / n:.3f}",
            f"{c.involuntary / n:.3f}", mig]  # fmt: skip


def report(levels: dict[str, list[Level]]) -> str:
    """Per setting, the median round's figures (the round of median throughput) and the median
    of throughput and p50 over the rounds."""
    head = ["setting", "req/s", "p50 ms", "role", "CPU µs/req", "system µs/req", "voluntary/req",
            "involuntary/req", "migrations/req"]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for label, runs in levels.items():
        middle = sorted(runs, key=lambda lv: lv.rps)[(len(runs) - 1) // 2]
        rps, p50 = statistics.median(lv.rps for lv in runs), statistics.median(lv.p50_ms for lv in runs)
        for i, name in enumerate(REPORTED_ROLES):
            first = [label, f"{rps:,.0f}", f"{p50:.2f}"] if i == 0 else ["", "", ""]
            lines.append("| " + " | ".join([*first, name, *_cells(middle, name)]) + " |")
    return "\n".join(lines)


def parse_roles(option: str, what: str, text: str) -> dict[str, int]:
    """`ROLE=N[,ROLE=N]` (`what` names N in the error)."""
    out: dict[str, int] = {}
    for part in filter(None, text.split(",")):
        name, sep, value = part.partition("=")
        if not sep or name not in REPORTED_ROLES or not value.isdigit():
            roles = ", ".join(REPORTED_ROLES)
            raise ValueError(
                f"{option} takes ROLE={what}[,ROLE={what}] with ROLE one of {roles}, not {part!r}"
            )
        out[name] = int(value)
    return out


def main(argv: Sequence[str] | None = None) -> None:
    p = live_parser(__doc__, rounds=4, seconds=4.0)
    p.add_argument("--pin", default="", help="ROLE=CPU[,ROLE=CPU]: the variant pins those roles")
    p.add_argument("--batch", default="", help="ROLE[,ROLE]: the variant gives those roles SCHED_BATCH")
    p.add_argument(
        "--slice", default="", help="ROLE=US[,ROLE=US]: the variant gives those roles that time slice"
    )
    a = p.parse_args(argv)
    check_live(p, a)
    try:
        batch = frozenset(filter(None, a.batch.split(",")))
        if not batch <= set(REPORTED_ROLES):
            raise ValueError(f"--batch takes roles among {REPORTED_ROLES}, not {a.batch!r}")
        slices = parse_roles("--slice", "US", a.slice)
        variant = Setting(parse_roles("--pin", "CPU", a.pin), batch, slices)
    except ValueError as exc:
        p.error(str(exc))
    settings = [Setting(), variant] if variant else [Setting()]
    levels: dict[str, list[Level]] = {s.label(): [] for s in settings}
    with MarinerProcess(a.model_store, a.model, torch_threads=1) as server:
        assert server.pid is not None
        roles = pids_by_role(server.pid)
        bodies = test_digit_bodies()
        print(f"{a.clients} clients, {a.rounds} x {a.seconds:g} s; processes: {roles}", flush=True)
        for r in range(a.rounds):
            for setting in settings if r % 2 == 0 else settings[::-1]:  # each first in half the rounds
                with applied(setting, roles):
                    level = serve_level(
                        server, roles, model=a.model, clients=a.clients, seconds=a.seconds, bodies=bodies
                    )
                levels[setting.label()].append(level)
                print(
                    f"  round {r + 1} {setting.label()}: {level.rps:7.0f} req/s, p50 {level.p50_ms:.2f} ms",
                    flush=True,
                )
        print(report(levels), flush=True)


if __name__ == "__main__":
    main()
