"""Multiprocess metric values keep the process id instead of asking the kernel per write, and a
forked child still writes files of its own (`server/common/metric_values.py`)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# Runs in a fresh interpreter with PROMETHEUS_MULTIPROC_DIR set (prometheus_client picks its
# mode at import). Checks which pid function a write asks, then forks and writes in the child.
SCRIPT = """
import os, sys
from prometheus_client import CollectorRegistry, Counter
from prometheus_client import multiprocess
from prometheus_client import values
from mariner.server.common import metrics  # noqa: F401 - swaps the value class

value_class = values.ValueClass  # what the server's metrics are made of
from mariner.server.common.metric_values import current_pid

# The pid check of every write asks current_pid (prometheus_client's default, os.getpid, is bound
# as a default argument, so patching os.getpid could not show which one a write calls).
check = value_class._MmapedValue__check_for_pid_change
asked = [c.cell_contents for c in check.__closure__ if callable(c.cell_contents)]
assert asked == [current_pid], asked
registry = CollectorRegistry()
c = Counter("unit_writes", "writes", registry=registry)
c.inc(100)
assert current_pid() == os.getpid()
child = os.fork()
if child == 0:
    ok = current_pid() == os.getpid()
    c.inc(5)
    os._exit(0 if ok else 3)
_, status = os.waitpid(child, 0)
assert os.waitstatus_to_exitcode(status) == 0, "the child's cached pid was not its own"
files = sorted(p for p in os.listdir(os.environ["PROMETHEUS_MULTIPROC_DIR"]) if p.startswith("counter_"))
assert files == sorted([f"counter_{os.getpid()}.db", f"counter_{child}.db"]), files
merged = CollectorRegistry()
multiprocess.MultiProcessCollector(merged)
print(merged.get_sample_value("unit_writes_total"))
"""


def test_writes_make_no_getpid_call_and_a_forked_child_writes_its_own_file(tmp_path: Path) -> None:
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert float(out.stdout.strip()) == 105.0  # the parent's 100 and the child's 5, merged
