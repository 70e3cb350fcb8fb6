"""Children die with their parent: `PR_SET_PDEATHSIG` = SIGKILL, set in the child at its start.

Why: a supervisor killed with SIGKILL cannot stop its children. An orphaned frontend kept the
inference ports and answered 503 for its whole drain, so a server restarted on the same ports
lost connections to it; an orphaned worker held its device and a socket. With PDEATHSIG the
kernel SIGKILLs the child the moment its parent goes, which closes its listeners at once.

Two cautions. PDEATHSIG fires when the *thread* that forked the child ends, not the process, so
children must be started from a thread that lives as long as the parent (the supervisor's event
loop thread; the zygote's only thread), never from a worker thread (`asyncio.to_thread`). And a
parent that died between the fork and the prctl is missed, so after arming the child checks
that its parent is still the one expected and exits if not. Backstops stay: a frontend sees its
control channel's EOF, the zygote its control socket's, a worker its parent pid changing.

A fresh interpreter arms itself after exec (`arm_from_env`, first thing in its entry point), told its
parent by `env_for_this_parent`; PDEATHSIG survives exec, so this is the same as arming before it.
It is never armed from a `preexec_fn`, which runs Python in the forked child of the threaded
supervisor and now and then killed it before exec (`mariner.server.common.child_process` says how).
"""

from __future__ import annotations

import ctypes
import functools
import os
import signal
from collections.abc import Mapping
from typing import Any

PR_SET_PDEATHSIG = 1
PR_GET_PDEATHSIG = 2
EXIT_PARENT_GONE = 1
# The parent's pid, for a fresh interpreter to arm itself against; removed from its environment once
# read, so nothing it starts inherits it.
PARENT_ENV = "MARINER_PARENT_PID"


@functools.cache
def _prctl() -> Any:
    """libc's prctl, resolved once."""
    fn = ctypes.CDLL(None, use_errno=True).prctl
    fn.restype = ctypes.c_int
    return fn


def arm(expected_parent: int, sig: int = signal.SIGKILL) -> None:
    """In the child: be sent `sig` when the parent dies; exit now if it already has."""
    _prctl()(PR_SET_PDEATHSIG, sig, 0, 0, 0)
    if os.getppid() != expected_parent:
        os._exit(EXIT_PARENT_GONE)


def env_for_this_parent(env: Mapping[str, str]) -> dict[str, str]:
    """`env` for a child that arms itself against the calling process (`arm_from_env`). Start the
    child from the thread that called this (see the module docstring)."""
    return {**env, PARENT_ENV: str(os.getpid())}


def arm_from_env(sig: int = signal.SIGKILL) -> None:
    """In a fresh interpreter, first thing: arm against the parent `env_for_this_parent` named, and
    exit now if it is already gone. Nothing named (started by hand): nothing to do."""
    parent = os.environ.pop(PARENT_ENV, None)
    if parent is not None:
        arm(int(parent), sig)


def armed_signal() -> int:
    """The signal this process gets when its parent dies (0: none); for tests and diagnostics."""
    value = ctypes.c_int(0)
    _prctl()(PR_GET_PDEATHSIG, ctypes.byref(value), 0, 0, 0)
    return value.value
