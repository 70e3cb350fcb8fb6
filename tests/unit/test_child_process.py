"""Children started without Python between fork and exec, awaited on the loop."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from mariner.server.common.child_process import ChildProcess, stream_reader


def test_a_preexec_fn_is_refused_before_anything_starts() -> None:
    with pytest.raises(ValueError, match="preexec_fn"):
        ChildProcess.start([sys.executable, "-c", "pass"], preexec_fn=lambda: None)


def test_no_python_runs_in_the_child_before_exec(tmp_path: Path) -> None:
    """An after-fork hook of the parent fires in a child exactly when Python runs there."""
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import os, sys\n"
        "from mariner.server.common.child_process import ChildProcess\n"
        "os.register_at_fork(after_in_child=lambda: os.write(2, b'PYTHON-IN-CHILD\\n'))\n"
        "ChildProcess.start([sys.executable, '-c', 'pass']).popen.wait()\n"
        "import subprocess\n"
        "subprocess.run([sys.executable, '-c', 'pass'], preexec_fn=lambda: None)\n"
    )
    done = subprocess.run([sys.executable, str(probe)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stderr.count("PYTHON-IN-CHILD") == 1  # the preexec_fn start only: the probe works


def test_wait_gives_the_exit_status_and_the_signal() -> None:
    async def run() -> tuple[int, int, int | None]:
        ok = ChildProcess.start([sys.executable, "-c", "raise SystemExit(7)"])
        slow = ChildProcess.start([sys.executable, "-c", "import time; time.sleep(60)"])
        running = slow.returncode
        slow.send_signal(signal.SIGTERM)
        return await ok.wait(), await asyncio.wait_for(slow.wait(), 30), running

    code, killed, running = asyncio.run(run())
    assert (code, killed, running) == (7, -signal.SIGTERM, None)


def test_stream_reader_reads_the_childs_pipe_to_eof() -> None:
    async def run() -> bytes:
        child = ChildProcess.start(
            [sys.executable, "-c", "import sys; sys.stdout.write('x' * 200000)"], stdout=subprocess.PIPE
        )
        assert child.popen.stdout is not None
        reader = await stream_reader(child.popen.stdout)
        data = await reader.read()
        assert await child.wait() == 0
        return data

    assert asyncio.run(run()) == b"x" * 200000
