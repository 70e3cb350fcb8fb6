"""A child armed by `parent_death` is SIGKILLed with its parent, and one whose parent died
before it could arm exits at once instead of living on as an orphan."""

from __future__ import annotations

import signal
import subprocess
import sys

from mariner.server.workers import parent_death

SHOW = "from mariner.server.workers import parent_death; print(parent_death.armed_signal())"


def test_a_child_started_with_the_hook_is_armed_with_sigkill() -> None:
    done = subprocess.run(
        [sys.executable, "-c", SHOW],
        preexec_fn=parent_death.preexec_for_this_parent(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert int(done.stdout) == signal.SIGKILL
    unarmed = subprocess.run([sys.executable, "-c", SHOW], capture_output=True, text=True, timeout=60)
    assert int(unarmed.stdout) == 0  # the check above can tell the difference


def test_a_child_whose_parent_is_already_gone_exits_before_running() -> None:
    # Arming against a pid that is not the parent stands for "the parent died before the prctl":
    # the child is then init's (or a subreaper's), and must not run its program.
    done = subprocess.run(
        [sys.executable, "-c", "print('ran')"],
        preexec_fn=lambda: parent_death.arm(expected_parent=1),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == parent_death.EXIT_PARENT_GONE
    assert "ran" not in done.stdout
