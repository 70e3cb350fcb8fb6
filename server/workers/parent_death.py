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
"""

from __future__ import annotations

import ctypes
import functools
import os
import signal
from collections.abc import Callable
from typing import Any

PR_SET_PDEATHSIG = 1
PR_GET_PDEATHSIG = 2
EXIT_PARENT_GONE = 1


@functools.cache
def _prctl() -> Any:
    """libc's prctl, resolved once in the parent: the preexec hook runs between fork and exec,
    where loading a library is best avoided."""
    fn = ctypes.CDLL(None, use_errno=True).prctl
    fn.restype = ctypes.c_int
    return fn


def arm(expected_parent: int, sig: int = signal.SIGKILL) -> None:
    """In the child: be sent `sig` when the parent dies; exit now if it already has."""
    _prctl()(PR_SET_PDEATHSIG, sig, 0, 0, 0)
    if os.getppid() != expected_parent:
        os._exit(EXIT_PARENT_GONE)


def preexec_for_this_parent() -> Callable[[], None]:
    """A `preexec_fn` for subprocess/asyncio that arms the child against the calling process.
    Call it from the thread that starts the child (see the module docstring)."""
    parent = os.getpid()
    _prctl()

    def preexec() -> None:
        arm(parent)

    return preexec


def armed_signal() -> int:
    """The signal this process gets when its parent dies (0: none); for tests and diagnostics."""
    value = ctypes.c_int(0)
    _prctl()(PR_GET_PDEATHSIG, ctypes.byref(value), 0, 0, 0)
    return value.value
