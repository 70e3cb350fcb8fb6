"""The scheduler counters tool (mariner.loadtest.experiments.sched_counts): the counters it reads
are the kernel's (a thread that sleeps is switched out voluntarily, once per sleep at least), a
variant's pin and policy reach a process's threads and are undone, and a short live run reports
both settings with every role.

Nothing here asserts a speed or a count under load: the figures must exist, not favour a setting.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from mariner.loadtest.experiments import sched_counts
from mariner.loadtest.experiments.sched_counts import Counters, Setting


@pytest.fixture
def sleeper() -> Iterator[subprocess.Popen[bytes]]:
    """A child process with two threads, sleeping."""
    code = "import threading, time; threading.Thread(target=time.sleep, args=(60,)).start(); time.sleep(60)"
    child = subprocess.Popen([sys.executable, "-c", code])
    deadline = time.monotonic() + 10
    while len(os.listdir(f"/proc/{child.pid}/task")) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    yield child
    child.kill()
    child.wait()


def test_sleeping_counts_voluntary_switches_and_spinning_counts_cpu() -> None:
    before = sched_counts.read_counters(os.getpid())
    for _ in range(20):
        time.sleep(0.001)
    end = time.process_time() + 0.05
    while time.process_time() < end:
        pass
    delta = sched_counts.read_counters(os.getpid()) - before
    assert delta.voluntary >= 20
    assert delta.cpu_s >= 0.04
    assert 0 <= delta.system_s <= delta.cpu_s
    assert delta.involuntary >= 0


def test_counters_add_and_subtract_field_by_field_and_unknown_migrations_stay_unknown() -> None:
    a, b = Counters(2.0, 1.0, 10, 4, 3), Counters(0.5, 0.25, 1, 1, None)
    assert a - Counters(1.0, 0.5, 3, 2, 1) == Counters(1.0, 0.5, 7, 2, 2)
    assert (a + b).migrations is None
    assert (a + b).voluntary == 11


def test_a_variant_reaches_every_thread_of_its_role_and_is_undone(sleeper: subprocess.Popen[bytes]) -> None:
    tids = [int(t) for t in os.listdir(f"/proc/{sleeper.pid}/task")]
    assert len(tids) == 2
    before = {tid: (os.sched_getaffinity(tid), os.sched_getscheduler(tid)) for tid in tids}
    cpu = min(os.sched_getaffinity(0))
    setting = Setting({"frontend": cpu}, frozenset({"frontend"}))
    with sched_counts.applied(setting, {"frontend": [sleeper.pid], "worker": [os.getpid()]}):
        for tid in tids:
            assert os.sched_getaffinity(tid) == {cpu}
            assert os.sched_getscheduler(tid) == os.SCHED_BATCH
        assert os.sched_getscheduler(0) == before[tids[0]][1]  # another role: untouched
    assert {tid: (os.sched_getaffinity(tid), os.sched_getscheduler(tid)) for tid in tids} == before


def test_role_options_are_checked() -> None:
    assert sched_counts.parse_roles("--pin", "CPU", "frontend=0,worker=1") == {"frontend": 0, "worker": 1}
    for bad in ("frontend", "client=0", "worker=one"):
        with pytest.raises(ValueError, match="--slice takes ROLE=US"):
            sched_counts.parse_roles("--slice", "US", bad)


def test_a_slice_reaches_every_thread_of_its_role_and_is_undone(sleeper: subprocess.Popen[bytes]) -> None:
    tids = [int(t) for t in os.listdir(f"/proc/{sleeper.pid}/task")]
    before = {tid: sched_counts.slice_ns(tid) for tid in tids}
    with sched_counts.applied(Setting(slice_us={"worker": 300}), {"worker": [sleeper.pid]}):
        assert {tid: sched_counts.slice_ns(tid) for tid in tids} == dict.fromkeys(tids, 300_000)
    assert {tid: sched_counts.slice_ns(tid) for tid in tids} == before


@pytest.mark.integration
@pytest.mark.slow
def test_a_live_run_reports_both_settings_for_every_role(
    model_store: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cpu = min(os.sched_getaffinity(0))
    sched_counts.main(["--rounds", "2", "--seconds", "1", "--clients", "4", "--pin", f"frontend={cpu}",
                       "--batch", "frontend", "--model-store", str(model_store)])  # fmt: skip
    out = capsys.readouterr().out
    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in out.splitlines() if line.startswith("| ")]
    header, body = rows[0], rows[1:]
    assert header[:4] == ["setting", "req/s", "p50 ms", "role"]
    assert [r[3] for r in body] == list(sched_counts.REPORTED_ROLES) * 2
    labels = [r[0] for r in body if r[0]]
    assert labels == ["as started", f"frontend on CPU {cpu}, frontend SCHED_BATCH"]
    for r in body:
        assert float(r[4]) > 0  # each role spent CPU on the requests
    assert out.count(" round ") == 4
