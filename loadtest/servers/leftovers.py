"""No stock TorchServe process outlives its owner: a watchdog for the owner's death, a sweep for
orphans, and the check tests make after stop().
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import psutil

# Run by a watchdog process in its own session, reading a pipe only the owner holds. EOF means
# the owner called stop() or died in a way no cleanup code survives (SIGKILL, OOM): either way
# the TorchServe process group is terminated and the temp dir removed, so Java never outlives us.
GUARD_SOURCE = """
import os, shutil, signal, sys, time
pgid, workdir = int(sys.argv[1]), sys.argv[2]
sys.stdin.buffer.read()
for sig, grace in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 0.0)):
    deadline = time.monotonic() + grace
    try:
        os.killpg(pgid, sig)
        while time.monotonic() < deadline:
            time.sleep(0.2)
            os.killpg(pgid, 0)
    except ProcessLookupError:
        break
shutil.rmtree(workdir, ignore_errors=True)
"""


def processes_mentioning(path: Path) -> list[psutil.Process]:
    """TorchServe processes (launcher, Java frontend, workers) whose command line names path.

    Matching on the private workdir finds an instance's processes even after they were orphaned;
    requiring a TorchServe marker too keeps, say, a `tail -f` of its log out of it.
    """
    needle = str(path)
    found = []
    for p in psutil.process_iter(["cmdline", "status"]):
        with contextlib.suppress(psutil.Error):
            cmdline = " ".join(p.info["cmdline"] or [])
            if (
                p.pid != os.getpid()
                and p.info["status"] != psutil.STATUS_ZOMBIE
                and needle in cmdline
                and any(marker in cmdline for marker in TORCHSERVE_MARKERS)
            ):
                found.append(p)
    return found


TORCHSERVE_MARKERS = ("ts.model_server", "org.pytorch.serve.ModelServer", "model_service_worker")


def leftover_processes(path: Path) -> list[int]:
    """Pids of TorchServe processes whose command line names path (an instance's workdir or the
    temp_root it was made in) that are still running; empty after stop()."""
    return [p.pid for p in processes_mentioning(path)]
