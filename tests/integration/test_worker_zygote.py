"""Workers forked by the zygote are what a freshly spawned worker is, and the zygote never touches
CUDA.

Each worker here loads a handler whose `initialize` writes a report of the process it runs in
(parent, session, fds, sys.path, signal handlers, environment, RNG draw, CUDA state) to a file
named by its pid; the tests compare forked workers with a spawned one and check what a fork
must not inherit. A worker that segfaults while loading is reported as SIGSEGV, the zygote dying
takes its workers with it (reported as killed) and the next worker gets a new zygote, and the
plain spawn start is still there when asked for or when no zygote can fork.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from mariner.server.contracts.errors import ServingError
from mariner.server.contracts.worker_api import WorkerSpec
from mariner.server.supervisor import zygote_client as zygote
from mariner.server.supervisor.worker_process import WorkerProcess

pytestmark = pytest.mark.integration

HANDLER = """
import json
import os
import signal
import sys


def initialize(context):
    import numpy
    import torch

    if os.environ.get("ZYGOTE_TEST_CRASH") == "segfault":
        import ctypes

        ctypes.string_at(0)
    fds = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            fds[fd] = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            pass  # the directory listing's own fd
    names = ("SIGINT", "SIGTERM", "SIGCHLD", "SIGHUP", "SIGPIPE", "SIGUSR1")
    report = {
        "pid": os.getpid(),
        "ppid": os.getppid(),
        "sid": os.getsid(0),
        "pgid": os.getpgid(0),
        "cuda_initialized": torch.cuda.is_initialized(),
        "torch_threads": torch.get_num_threads(),
        "fds": fds,
        "sys_path": sys.path,
        "cwd": os.getcwd(),
        "marker": os.environ.get("ZYGOTE_TEST_MARKER"),
        "signals": {n: repr(signal.getsignal(getattr(signal, n))) for n in names},
        "numpy_draw": int(numpy.random.randint(0, 2**31 - 1)),
        "secrets": sorted(k for k in os.environ if k.endswith("_TOKEN") or "secret-value" in os.environ[k]),
    }
    path = os.path.join(os.environ["ZYGOTE_TEST_REPORTS"], str(os.getpid()))
    with open(path + ".tmp", "w") as f:
        json.dump(report, f)
    os.replace(path + ".tmp", path)


def handle(data, context):
    if data is None:  # TorchServe initialises a function handler with handle(None, context)
        return initialize(context)
    return [{"ok": True} for _ in data]
"""


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    d = tmp_path / "model"
    d.mkdir()
    (d / "reporter.py").write_text(HANDLER)
    return d


@pytest.fixture
def reports(tmp_path: Path) -> Path:
    d = tmp_path / "reports"
    d.mkdir()
    return d


@pytest.fixture(autouse=True)
def _close_zygotes() -> Iterator[None]:
    yield
    zygote.shutdown()


def spec(model_dir: Path, instance: int = 0) -> WorkerSpec:
    return WorkerSpec(
        model="reporter",
        version="1.0",
        instance=instance,
        generation=0,
        model_dir=str(model_dir),
        archive_file=str(model_dir.parent / "reporter.mar"),
        sha256="0" * 64,
        manifest={"model": {"modelName": "reporter", "handler": "reporter.py", "modelVersion": "1.0"}},
        model_config={},
        batch_size=1,
        gpu_id=None,
        torch_threads=1,
        socket_path=str(model_dir.parent / f"w{instance}.sock"),
    )


def env_for(reports: Path, **extra: str) -> dict[str, str]:
    return {**os.environ, "ZYGOTE_TEST_REPORTS": str(reports), "ZYGOTE_TEST_MARKER": "mine", **extra}


def report(reports: Path, pid: int) -> dict[str, Any]:
    return json.loads((reports / str(pid)).read_text())


def fd_targets(pid: int) -> set[str]:
    out = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            out.add(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except OSError:
            continue
    return out


def shared_kernel_objects(worker: dict[str, Any], others: set[str]) -> set[str]:
    """Sockets and pipes the worker holds beyond fds 0-2 (its ready pipe, the log) that appear
    in `others`."""
    held = {t for fd, t in worker["fds"].items() if int(fd) > 2 and t.startswith(("socket:", "pipe:"))}
    return held & others


def test_workers_are_forked_from_a_zygote_that_never_initialised_cuda(model_dir: Path, reports: Path) -> None:
    env = env_for(reports)

    async def scenario() -> None:
        workers = [WorkerProcess(spec(model_dir, i), env=env) for i in range(2)]
        held_by_us = socket.socketpair()  # something the test process holds while workers start
        try:
            await asyncio.gather(*(w.start(120) for w in workers))
            client = zygote.client_for(env)
            assert client.cuda_initialized is False
            ours = fd_targets(os.getpid()) | {f"socket:[{os.fstat(s.fileno()).st_ino}]" for s in held_by_us}
            theirs = fd_targets(client.pid)
            for w in workers:
                assert w.forked
                assert w.pid is not None
                got = report(reports, w.pid)
                assert got["ppid"] == client.pid != os.getpid()
                assert got["sid"] == got["pgid"] == w.pid  # its own session and group
                assert got["cuda_initialized"] is False
                assert got["marker"] == "mine"
                assert got["cwd"] == os.getcwd()
                assert got["torch_threads"] == 1
                assert got["sys_path"][0] == str(model_dir)
                assert os.getcwd() not in got["sys_path"]
                assert "" not in got["sys_path"]
                assert shared_kernel_objects(got, ours) == set()
                assert shared_kernel_objects(got, theirs) == set()
                assert "mariner.server.worker.main" in " ".join(psutil.Process(w.pid).cmdline())
            assert "mariner.server.worker.zygote" in " ".join(psutil.Process(client.pid).cmdline())
            # The zygote holds nothing of the supervisor's but its end of the control socket.
            zygote_sockets = {t for t in theirs if t.startswith("socket:")}
            assert len(zygote_sockets) == 1
            draws = {report(reports, w.pid)["numpy_draw"] for w in workers}
            assert len(draws) == 2  # each fork reseeded numpy's RNG
        finally:
            for s in held_by_us:
                s.close()
            await asyncio.gather(*(w.stop(10) for w in workers))
        assert [w.returncode for w in workers] == [0, 0]

    asyncio.run(scenario())


def test_a_forked_worker_looks_like_a_spawned_one(model_dir: Path, reports: Path) -> None:
    """Neither gets a token from the environment it was started with."""
    tokens = {"MARINER_INFERENCE_TOKEN": "secret-value-1", "MARINER_MANAGEMENT_TOKEN": "secret-value-2"}

    async def scenario() -> tuple[dict[str, Any], dict[str, Any]]:
        forked = WorkerProcess(spec(model_dir, 0), env=env_for(reports, **tokens))
        spawned = WorkerProcess(
            spec(model_dir, 1), env=env_for(reports, MARINER_WORKER_START="spawn", **tokens)
        )
        try:
            await asyncio.gather(forked.start(120), spawned.start(120))
            assert forked.forked
            assert not spawned.forked
            assert forked.pid is not None
            assert spawned.pid is not None
            return report(reports, forked.pid), report(reports, spawned.pid)
        finally:
            await asyncio.gather(forked.stop(10), spawned.stop(10))

    forked, spawned = asyncio.run(scenario())
    assert spawned["ppid"] == os.getpid()
    assert forked["sys_path"] == spawned["sys_path"]
    assert forked["signals"] == spawned["signals"]
    assert len(forked["fds"]) <= len(spawned["fds"])
    assert forked["cuda_initialized"] is spawned["cuda_initialized"] is False
    assert forked["secrets"] == spawned["secrets"] == []


def test_a_forked_worker_that_segfaults_is_reported_as_sigsegv(model_dir: Path, reports: Path) -> None:
    async def scenario() -> None:
        worker = WorkerProcess(spec(model_dir), env=env_for(reports, ZYGOTE_TEST_CRASH="segfault"))
        with pytest.raises(ServingError, match="SIGSEGV"):
            await worker.start(120)
        assert worker.forked
        assert await worker.wait() == -signal.SIGSEGV
        assert worker.returncode == -signal.SIGSEGV

    asyncio.run(scenario())


def test_a_dead_zygote_takes_its_workers_and_the_next_worker_gets_a_new_one(
    model_dir: Path, reports: Path
) -> None:
    env = env_for(reports)

    async def scenario() -> None:
        first = WorkerProcess(spec(model_dir, 0), env=env)
        await first.start(120)
        old = zygote.client_for(env)
        assert first.forked
        assert report(reports, first.pid or 0)["ppid"] == old.pid
        os.kill(old.pid, signal.SIGKILL)
        assert await first.wait() == -signal.SIGKILL
        assert first.pid is not None
        assert not psutil.pid_exists(first.pid) or psutil.Process(first.pid).status() == psutil.STATUS_ZOMBIE
        second = WorkerProcess(spec(model_dir, 1), env=env)
        try:
            await second.start(120)
            assert second.forked
            new = zygote.client_for(env)
            assert new.pid != old.pid
            assert report(reports, second.pid or 0)["ppid"] == new.pid
        finally:
            await second.stop(10)

    asyncio.run(scenario())


def test_spawn_when_asked_or_when_no_zygote_can_fork(
    model_dir: Path, reports: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def unavailable(env: object) -> zygote.ZygoteClient:
        raise zygote.ZygoteUnavailable("no zygote in this test")

    async def start_one(instance: int, env: dict[str, str]) -> dict[str, Any]:
        worker = WorkerProcess(spec(model_dir, instance), env=env)
        try:
            await worker.start(120)
            assert not worker.forked
            assert worker.pid is not None
            return report(reports, worker.pid)
        finally:
            await worker.stop(10)

    asked = asyncio.run(start_one(0, env_for(reports, MARINER_WORKER_START="spawn")))
    assert asked["ppid"] == os.getpid()
    monkeypatch.setattr(zygote, "client_for", unavailable)
    fallback = asyncio.run(start_one(1, env_for(reports)))
    assert fallback["ppid"] == os.getpid()
    assert fallback["sys_path"][0] == str(model_dir)


SUPERVISOR = """
import asyncio, json, os, sys
from pathlib import Path
from mariner.server.supervisor import zygote_client as zygote
from mariner.server.supervisor.worker_process import WorkerProcess
from tests.integration.test_worker_zygote import env_for, spec


async def main():
    model_dir, reports = Path(sys.argv[1]), Path(sys.argv[2])
    env = env_for(reports)
    worker = WorkerProcess(spec(model_dir), env=env)
    await worker.start(120)
    print(json.dumps({"worker": worker.pid, "zygote": zygote.client_for(env).pid}), flush=True)
    await asyncio.sleep(3600)


asyncio.run(main())
"""


def test_workers_and_zygote_end_when_the_supervisor_dies(model_dir: Path, reports: Path) -> None:
    """SIGKILL to the supervisor runs none of its cleanup: the zygote sees its control socket
    close, kills its workers and exits."""
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[2]
    proc = subprocess.Popen(
        [sys.executable, "-c", SUPERVISOR, str(model_dir), str(reports)],
        cwd=repo,
        stdout=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        assert proc.stdout is not None
        pids = json.loads(proc.stdout.readline())
        worker, zyg = psutil.Process(pids["worker"]), psutil.Process(pids["zygote"])
        assert worker.ppid() == zyg.pid
        assert zyg.ppid() == proc.pid
        proc.kill()
        proc.wait()
        gone, alive = psutil.wait_procs([worker, zyg], timeout=120)  # a cap, not a verdict on speed
        assert alive == []
    finally:
        proc.kill()
        proc.wait()


BARE_PARENT = """
import subprocess, sys
from pathlib import Path
from mariner.server.contracts.worker_api import spec_to_json
from tests.integration.test_worker_zygote import spec

# A parent that arms nothing (no PDEATHSIG): only the worker's own watch on its parent is left.
proc = subprocess.Popen(
    [sys.executable, "-m", "mariner.server.worker.main"],
    stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True,
)
proc.stdin.write(spec_to_json(spec(Path(sys.argv[1]))).encode())
proc.stdin.close()
proc.stdout.readline()  # the ready line
print(proc.pid, flush=True)
proc.wait()
"""


def test_a_worker_whose_parent_dies_ends_itself_without_pdeathsig(model_dir: Path, reports: Path) -> None:
    """The backstop behind PDEATHSIG: the worker watches its parent's pidfd and exits with it."""
    import subprocess
    import sys
    import time

    repo = Path(__file__).resolve().parents[2]
    proc = subprocess.Popen(
        [sys.executable, "-c", BARE_PARENT, str(model_dir)],
        cwd=repo,
        stdout=subprocess.PIPE,
        env=env_for(reports),
        start_new_session=True,
    )
    worker: psutil.Process | None = None
    try:
        assert proc.stdout is not None
        worker = psutil.Process(int(proc.stdout.readline()))
        assert worker.ppid() == proc.pid
        t0 = time.monotonic()
        proc.kill()
        proc.wait()

        def running() -> bool:
            assert worker is not None
            try:
                return worker.status() != psutil.STATUS_ZOMBIE  # a zombie waits for init, not us
            except psutil.NoSuchProcess:
                return False

        while running() and time.monotonic() - t0 < 60:  # a cap, not a verdict on speed
            time.sleep(0.01)
        print(f"\nworker gone {time.monotonic() - t0:.3f} s after its parent")
        assert not running()
    finally:
        proc.kill()
        proc.wait()
        if worker is not None:
            with contextlib.suppress(psutil.Error):
                worker.kill()
