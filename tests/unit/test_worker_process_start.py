"""Starting a worker process: a zygote fork that outlives the startupTimeout ends the start
with WorkerStartTimeout, without starting a fresh interpreter the spent deadline would kill."""

from __future__ import annotations

import asyncio
import os
import threading
from pathlib import Path
from typing import Any

import pytest

from mariner.server.contracts.worker_api import WorkerSpec
from mariner.server.supervisor import worker_process as process
from mariner.server.supervisor import zygote_client as zygote
from mariner.server.supervisor.worker_process import WorkerProcess, WorkerStartTimeout

pytestmark = pytest.mark.unit


class SlowZygote:
    """A zygote that never answers a fork; it said hello, so its failure is not counted."""

    def __init__(self) -> None:
        self.hello = threading.Event()
        self.hello.set()
        self.asked = 0

    async def fork(self, spec_json: str, fds: tuple[int, int, int], **_: Any) -> Any:
        self.asked += 1
        await asyncio.Event().wait()


def spec(tmp_path: Path) -> WorkerSpec:
    return WorkerSpec(
        model="m", version="1", instance=0, generation=0, model_dir=str(tmp_path),
        archive_file="m.mar", sha256="", manifest={}, model_config={}, batch_size=1,
        gpu_id=None, torch_threads=None, socket_path=str(tmp_path / "w.sock"),
    )  # fmt: skip


def open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


@pytest.mark.parametrize("timeout", [0.0, 0.2])
@pytest.mark.parametrize("with_output", [False, True])
def test_a_fork_past_the_startup_timeout_ends_the_start_without_a_spawn(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, timeout: float, with_output: bool
) -> None:
    slow = SlowZygote()
    spawned: list[int] = []
    attached: list[str] = []
    monkeypatch.setattr(zygote, "client_for", lambda env: slow)

    def spawn(self: WorkerProcess) -> int:
        spawned.append(1)
        raise AssertionError("a fresh interpreter was started")

    monkeypatch.setattr(WorkerProcess, "_spawn", spawn)

    class Output:
        def attach(self, worker: str, stdout_fd: int, stderr_fd: int) -> None:
            attached.append(worker)

    worker = WorkerProcess(spec(tmp_path), env={}, output=Output() if with_output else None)
    assert process.start_method(worker.spec, {}) == "zygote"

    async def body() -> None:
        before = open_fds()
        with pytest.raises(WorkerStartTimeout) as info:
            await worker.start(timeout)
        assert open_fds() == before  # _fork closed its ready pipe and the output pipes
        assert info.value.message == (
            f"model m version 1: its worker was not ready within its startupTimeout ({timeout:g} s) "
            "and was killed"
        )

    asyncio.run(body())
    assert slow.asked == 1
    assert spawned == []  # no fresh interpreter for a deadline already spent
    assert attached == []
    assert worker.pid is None
    assert not worker.forked
