"""A child that arms itself with `parent_death` is SIGKILLed with its parent, one whose parent died
before it could arm exits at once instead of living on as an orphan, and nothing the child starts
inherits the parent's pid."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from mariner.server.common import parent_death

SHOW = (
    "import os; from mariner.server.common import parent_death; parent_death.arm_from_env(); "
    f"print(parent_death.armed_signal(), os.environ.get({parent_death.PARENT_ENV!r}))"
)


def test_a_child_started_with_the_parent_in_its_env_arms_itself_with_sigkill() -> None:
    done = subprocess.run(
        [sys.executable, "-c", SHOW],
        env=parent_death.env_for_this_parent(os.environ),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [str(int(signal.SIGKILL)), "None"]  # armed; the pid not passed on
    env = {k: v for k, v in os.environ.items() if k != parent_death.PARENT_ENV}
    unarmed = subprocess.run(
        [sys.executable, "-c", SHOW], env=env, capture_output=True, text=True, timeout=60
    )
    assert unarmed.stdout.split() == ["0", "None"]  # the check above can tell the difference


def test_a_child_whose_parent_is_already_gone_exits_before_running() -> None:
    # A pid that is not the parent stands for "the parent died before the child armed": the child
    # is then init's (or a subreaper's), and must not run its program.
    done = subprocess.run(
        [sys.executable, "-c", "from mariner.server.common import parent_death; "
         "parent_death.arm_from_env(); print('ran')"],
        env={**os.environ, parent_death.PARENT_ENV: "1"},
        capture_output=True,
        text=True,
        timeout=60,
    )  # fmt: skip
    assert done.returncode == parent_death.EXIT_PARENT_GONE
    assert "ran" not in done.stdout
