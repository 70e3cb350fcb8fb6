"""The worker budget: static caps, the machine-aware memory and task caps (read from fake cgroup
and /proc trees), and a worker pool that survives any failure to start a worker and never
leaves one behind when a slot is stopped while its process is being created."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from mariner.server.common.archive import ModelArchive
from mariner.server.common.config_loading import load_config
from mariner.server.common.model_settings import ModelSettings
from mariner.server.contracts.errors import Code, ServingError
from mariner.server.supervisor import worker_stop
from mariner.server.supervisor.machine import MIB, Room, memory_room, task_room
from mariner.server.supervisor.versions import Version
from mariner.server.supervisor.worker_budget import Ask, Limits, VersionUse, WorkerBudget
from mariner.server.supervisor.worker_pool import WorkerPool
from mariner.server.supervisor.worker_stop import unix_connections

GIB = 1 << 30


def budget(memory: Room | None = None, tasks: Room | None = None, **limits: Any) -> WorkerBudget:
    return WorkerBudget(
        Limits(**limits),
        memory=lambda: memory,
        tasks=lambda: tasks,
        measure=lambda pid: 310 * MIB,
        count_tasks=lambda pid: 12,
    )


def refusal(b: WorkerBudget, ask: Ask, uses: list[VersionUse] | None = None) -> str:
    with pytest.raises(ServingError) as info:
        b.check(ask, uses or [])
    assert info.value.code is Code.INVALID_ARGUMENT
    return info.value.message


def test_a_count_over_the_per_model_cap_is_refused_naming_the_cap_and_where_it_came_from() -> None:
    ask = Ask("m", "1", 1000, what="initial_workers", source="the register call")
    assert refusal(budget(), ask) == (
        "initial_workers 1000 exceeds the per-model cap of 64 workers (from the register call)"
    )
    budget().check(Ask("m", "1", 64), [])  # the cap itself is allowed
    assert "cap of 8 workers" in refusal(budget(per_model=8), Ask("m", "1", 9))


def test_the_server_wide_cap_counts_every_other_version() -> None:
    others = [VersionUse(("a", "1"), slots=60), VersionUse(("b", "1"), slots=60)]
    message = refusal(budget(total=128), Ask("m", "1", 10, what="min_worker"), others)
    assert message == (
        "min_worker 10 would bring the server to 130 workers, over its cap of 128 workers "
        "(120 run or start for other models)"
    )
    budget(total=128).check(Ask("m", "1", 8), others)
    # The version's own slots are not "others": scaling 60 -> 61 of "a" is within 128.
    budget(total=128).check(Ask("a", "1", 61, current=60), others)


def test_memory_measured_per_worker_times_the_new_workers_must_fit() -> None:
    room = Room(available=int(1.5 * GIB), limit=4 * GIB, source="cgroup memory.max")
    b = budget(memory=room)
    b.note_ready(("m", "1"), 123)  # measured: 310 MiB
    message = refusal(b, Ask("m", "1", 12, what="initial_workers"))
    assert message.startswith("initial_workers 12: 12 workers of ~310 MiB each need 3.6 GiB, ")
    # 1.5 GiB free less a headroom of 10% of 4 GiB.
    assert "1.1 GiB is available (cgroup memory.max, keeping 410 MiB free)" in message
    b.check(Ask("m", "1", 3), [])  # 930 MiB fit
    # Scaling up counts only the new workers.
    b.check(Ask("m", "1", 5, current=2), [])
    assert "6 more workers" in refusal(b, Ask("m", "1", 8, current=2))
    # Scaling down never needs memory.
    budget(memory=Room(0, 4 * GIB, "cgroup memory.max")).check(Ask("m", "1", 1, current=2), [])


def test_a_version_never_measured_costs_the_largest_measured_worker_or_its_archive_estimate() -> None:
    room = Room(available=4 * GIB, limit=16 * GIB, source="MemAvailable")
    b = budget(memory=room)
    assert b.worker_bytes(("new", "1"), 100 * MIB) == (100 * MIB, False)
    b.note_ready(("old", "1"), 1)
    assert b.worker_bytes(("new", "1"), 100 * MIB) == (310 * MIB, False)
    assert b.worker_bytes(("new", "1"), 900 * MIB) == (900 * MIB, False)
    message = refusal(b, Ask("new", "1", 10, estimate=900 * MIB))
    assert "workers of ~900 MiB each (estimated: none of its workers has loaded yet)" in message


def test_workers_still_loading_are_promised_what_they_will_take() -> None:
    room = Room(available=3584 * MIB, limit=8 * GIB, source="cgroup memory.max")
    b = budget(memory=room)
    b.measure = lambda pid: 10 * MIB  # type: ignore[method-assign]  # loading: little so far
    loading = [VersionUse(("a", "1"), slots=4, loading=(None, None, 7, 8), estimate=500 * MIB)]
    # 3584 MiB - 819 MiB headroom - 1980 MiB promised to "a" = 785 MiB: two workers of 300 MiB.
    b.check(Ask("m", "1", 2, estimate=300 * MIB), loading)
    message = refusal(b, Ask("m", "1", 3, estimate=300 * MIB), loading)
    assert "785 MiB is available" in message
    assert "1.9 GiB promised to workers still loading" in message
    assert "1 worker of" in refusal(b, Ask("m", "1", 1, estimate=900 * MIB), loading)


def test_fit_lowers_a_default_count_to_what_every_cap_allows() -> None:
    # 2 GiB free less 819 MiB headroom: 1229 MiB, twelve workers of 100 MiB.
    b = budget(memory=Room(available=2 * GIB, limit=8 * GIB, source="MemAvailable"), per_model=64)
    assert b.fit(Ask("m", "1", 4, estimate=100 * MIB), []) == (4, None)
    n, why = b.fit(Ask("m", "1", 128, estimate=10 * MIB), [])
    assert n == 64
    assert why == "minWorkers 128 exceeds the per-model cap of 64 workers"
    n, why = b.fit(Ask("m", "1", 32, estimate=100 * MIB), [])
    assert n == 12
    assert why is not None
    assert why.startswith("minWorkers 32: 32 workers of ~100 MiB")
    # On a large host the headroom stops at 1 GiB: 2 GiB free of 256 GiB still take ten of them.
    large = budget(memory=Room(available=2 * GIB, limit=256 * GIB, source="MemAvailable"))
    assert large.fit(Ask("m", "1", 32, estimate=100 * MIB), [])[0] == 10
    n, why = b.fit(Ask("m", "1", 64, estimate=2 * GIB), [])
    assert n == 0
    assert why is not None
    assert "is available (MemAvailable" in why


def test_threads_are_a_budget_too_where_something_bounds_them() -> None:
    b = budget(tasks=Room(available=500, limit=1000, source="cgroup pids.max"))
    b.note_ready(("m", "1"), 1)  # 12 threads
    b.check(Ask("m", "1", 30), [])
    message = refusal(b, Ask("m", "1", 40))
    assert message == (
        "minWorkers 40: 40 workers of ~12 threads each need 480 threads, 400 can still be created "
        "(cgroup pids.max, keeping 100 free)"
    )


def test_the_caps_come_from_the_flags_and_the_environment() -> None:
    assert Limits.from_config(load_config([], env={})) == Limits(64, 256, True)
    cfg = load_config(
        ["--max-workers-per-model", "8"],
        env={"MARINER_MAX_TOTAL_WORKERS": "32", "MARINER_WORKER_MEMORY_CHECK": "false"},
    )
    assert Limits.from_config(cfg) == Limits(8, 32, False)
    with pytest.raises(ValueError, match="max_workers_per_model must be positive, got 0"):
        load_config([], env={"MARINER_MAX_WORKERS_PER_MODEL": "0"})


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


MEMINFO = "MemTotal:       16777216 kB\nMemFree:  1000 kB\nMemAvailable:    8388608 kB\n"


def test_memory_room_reads_cgroup_v2_up_the_tree_less_reclaimable_cache(tmp_path: Path) -> None:
    _write(
        tmp_path,
        {
            "proc/self/cgroup": "0::/pod/app\n",
            "proc/meminfo": MEMINFO,
            "sys/fs/cgroup/pod/memory.max": f"{4 * GIB}\n",
            "sys/fs/cgroup/pod/memory.current": f"{3 * GIB}\n",
            "sys/fs/cgroup/pod/memory.stat": f"anon 1\ninactive_file {GIB}\n",
            "sys/fs/cgroup/pod/app/memory.max": "max\n",
            "sys/fs/cgroup/pod/app/memory.current": f"{GIB}\n",
        },
    )
    assert memory_room(tmp_path) == Room(2 * GIB, 4 * GIB, "cgroup memory.max")


def test_memory_room_reads_cgroup_v1_or_falls_back_to_mem_available(tmp_path: Path) -> None:
    _write(
        tmp_path,
        {
            "proc/self/cgroup": "4:memory:/job\n3:pids:/job\n",
            "proc/meminfo": MEMINFO,
            "sys/fs/cgroup/memory/job/memory.limit_in_bytes": f"{2 * GIB}\n",
            "sys/fs/cgroup/memory/job/memory.usage_in_bytes": f"{GIB}\n",
            "sys/fs/cgroup/memory/job/memory.stat": "total_inactive_file 0\n",
            "sys/fs/cgroup/pids/job/pids.max": "300\n",
            "sys/fs/cgroup/pids/job/pids.current": "120\n",
        },
    )
    assert memory_room(tmp_path) == Room(GIB, 2 * GIB, "cgroup memory.limit_in_bytes")
    assert task_room(tmp_path) == Room(180, 300, "cgroup pids.max")
    (tmp_path / "sys/fs/cgroup/memory/job/memory.limit_in_bytes").write_text("9223372036854771712\n")
    assert memory_room(tmp_path) == Room(8 * GIB, 16 * GIB, "MemAvailable")


def test_unix_connections_counts_accepted_sockets_not_the_listener(tmp_path: Path) -> None:
    table = tmp_path / "unix"
    table.write_text(
        "Num       RefCount Protocol Flags    Type St Inode Path\n"
        "0000000026f22a26: 00000002 00000000 00010000 0001 01 653797 /s/a.sock\n"
        "00000000838caa53: 00000003 00000000 00000000 0001 03 653798 /s/a.sock\n"
        "00000000838caa54: 00000003 00000000 00000000 0001 03 653799 /s/a.sock\n"
        "00000000191bffbc: 00000003 00000000 00000000 0001 03 653247 /s/b.sock\n"
        "0000000017b08be0: 00000003 00000000 00000000 0001 03 653796\n"
    )
    assert unix_connections("/s/a.sock", str(table)) == 2
    assert unix_connections("/s/c.sock", str(table)) == 0
    assert unix_connections("/s/a.sock", str(tmp_path / "missing")) is None


# -- the worker pool ----------------------------------------------------------------------------
class _Metrics:
    def __getattr__(self, name: str) -> Any:
        return self

    def labels(self, *args: Any) -> _Metrics:
        return self

    def set(self, value: Any) -> None:
        pass

    def inc(self, value: Any = 1) -> None:
        pass


def _version(tmp_path: Path, name: str = "m") -> Version:
    archive = ModelArchive(
        name=name, version="1", path=tmp_path / "m.mar", sha256="0" * 64, model_dir=tmp_path,
        manifest={}, model_config={},
    )  # fmt: skip
    return Version(archive, None, ModelSettings(device_type="cpu", startup_timeout_s=30), None)  # type: ignore[arg-type]


def _pool(tmp_path: Path) -> WorkerPool:
    async def changed() -> None:
        pass

    return WorkerPool(1, tmp_path, _Metrics(), changed, lambda: 1, lambda: False)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("exc", "code"),
    [
        (RuntimeError("can't start new thread"), Code.RESOURCE_EXHAUSTED),
        (MemoryError(), Code.RESOURCE_EXHAUSTED),
        (BlockingIOError(11, "Resource temporarily unavailable"), Code.RESOURCE_EXHAUSTED),
        (ValueError("a bug"), Code.INTERNAL),
    ],
)
def test_a_worker_that_cannot_be_started_fails_its_start_and_the_slot_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, exc: BaseException, code: Code
) -> None:
    starts = []

    class Failing:
        def __init__(self, spec: Any, **_: Any) -> None:  # output=: who reads its stdout/stderr
            self.spec, self.pid, self.returncode = spec, None, None

        async def start(self, timeout: float) -> Any:
            starts.append(1)
            raise exc

    monkeypatch.setattr("mariner.server.supervisor.worker_process.WorkerProcess", Failing)

    async def scenario() -> None:
        v, pool = _version(tmp_path), _pool(tmp_path)
        (inst,) = pool.add(v, 1)
        assert inst.first is not None
        with pytest.raises(ServingError) as info:
            await asyncio.wait_for(inst.first, 5)
        assert info.value.code is code
        assert type(exc).__name__ in info.value.message
        assert inst.status == "FAILED"
        assert inst.error == info.value.message
        await asyncio.sleep(0.5)  # the backoff's 0.2 s: the slot tried again
        assert len(starts) >= 2
        assert inst.task is not None
        assert not inst.task.done()
        await asyncio.wait_for(pool.stop([inst], 1.0), 5)
        assert inst.task.done()
        assert inst.status == "STOPPED"

    asyncio.run(scenario())


def test_a_slot_stopped_while_its_process_is_being_created_leaves_no_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The zygote forks the worker after stop() was called: it is killed as soon as it exists,
    and the first start's waiter hears why instead of waiting forever."""
    forked = asyncio.Event
    killed: list[int] = []

    class Slow:
        def __init__(self, spec: Any, **_: Any) -> None:  # output=: who reads its stdout/stderr
            self.spec, self.pid, self.returncode = spec, None, None
            self._dead: asyncio.Event = forked()

        async def start(self, timeout: float) -> Any:
            await asyncio.sleep(0.3)  # the fork: no pid yet
            self.pid = 4242
            await self._dead.wait()  # loading until killed
            raise ServingError(Code.INTERNAL, "exited before it was ready")

        def kill(self) -> None:
            killed.append(self.pid)
            self.returncode = -9
            self._dead.set()

        async def wait(self) -> int:
            await self._dead.wait()
            return -9

    monkeypatch.setattr("mariner.server.supervisor.worker_process.WorkerProcess", Slow)

    async def scenario() -> None:
        v, pool = _version(tmp_path), _pool(tmp_path)
        (inst,) = pool.add(v, 1)
        await asyncio.sleep(0.05)
        await asyncio.wait_for(pool.stop([inst], 30.0, why="model m version 1 was unregistered"), 5)
        assert killed == [4242]
        assert inst.task is not None
        assert inst.task.done()
        assert not inst.task.cancelled()
        assert inst.first is not None
        with pytest.raises(ServingError, match="model m version 1 was unregistered while its worker"):
            inst.first.result()

    asyncio.run(scenario())
    assert worker_stop.KILL_WAIT_S > 0


def test_a_start_up_count_someone_set_is_refused_and_the_built_in_one_lowered(tmp_path: Path) -> None:
    """At start-up: an archive's minWorkers or default_workers_per_model over the cap refuses that
    model (the registry keeps it FAILED with this reason); the built-in one-per-core count on a
    large machine is lowered to the cap instead."""
    from mariner.server.common.model_settings import SettingsOverrides
    from mariner.server.common.settings_layers import LayerSource, ServerLayers, worker_count_origin
    from mariner.server.supervisor.worker_slots import admit

    v = _version(tmp_path)
    b = budget()
    settings = ModelSettings(min_workers=100, max_workers=100)
    layers = ServerLayers(defaults=SettingsOverrides(min_workers=100, max_workers=100), startup_workers=100)
    origin = worker_count_origin(layers.named_for_model("m", "1", "m.mar"))
    assert origin == LayerSource("default_workers_per_model", "the server's config")
    with pytest.raises(ServingError) as info:
        admit(b, [], v.archive, settings, origin, 64 * MIB, True)
    assert info.value.message == (
        "default_workers_per_model 100 exceeds the per-model cap of 64 workers (from the server's config)"
    )
    lowered = admit(b, [], v.archive, settings, None, 64 * MIB, True)
    assert (lowered.min_workers, lowered.max_workers) == (64, 64)
    # Other versions' slots count, their minWorkers too before their workers are added.
    other = _version(tmp_path, "other")
    other.settings = ModelSettings(min_workers=250, max_workers=250)
    with pytest.raises(ServingError, match="would bring the server to 260 workers"):
        admit(b, [other], v.archive, ModelSettings(min_workers=10, max_workers=10), origin, 64 * MIB, True)


def test_scaling_down_drains_a_ready_worker_before_its_sigterm(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """stop(drain=True): SIGTERM only once no frontend holds a connection to the worker."""
    events: list[str] = []
    held = iter([2, 1, 1, 0])

    def connections(path: str, table: str = "") -> int:
        n = next(held, 0)
        events.append(f"held {n}")
        return n

    class Ready:
        pid, returncode = 4343, None

        def __init__(self) -> None:
            self.spec = type("Spec", (), {"socket_path": "/s/w.sock", "id": "m-1-0"})()

        async def stop(self, grace: float) -> None:
            events.append("sigterm")
            self.returncode = 0

    monkeypatch.setattr(worker_stop, "unix_connections", connections)

    async def scenario() -> None:
        from mariner.server.supervisor.versions import Instance

        inst = Instance(0, status="READY", process=Ready())
        await asyncio.wait_for(_pool(tmp_path).stop([inst], 5.0, drain=True), 5)
        assert inst.status == "STOPPED"

    asyncio.run(scenario())
    assert events == ["held 2", "held 1", "held 1", "held 0", "sigterm"]
