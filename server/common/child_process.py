"""Child processes started from a multi-threaded server without running anything between fork and
exec, and awaited on the event loop without a thread.

Why not asyncio's own subprocesses: under uvloop, `create_subprocess_exec` forks with libuv and runs
Python's after-fork hooks in the child before exec, as CPython's `preexec_fn` does. In the supervisor,
whose other threads are busy in gRPC, a child like that also ran gRPC's fork handlers on inherited
state ("Kick failed: eventfd_write: Bad file descriptor") and now and then died of SIGABRT before
exec: 1 child in 300 under load, none in 300 started as here. A worker that died so was reported as
"exited with signal SIGABRT before it was ready" instead of its reason. `subprocess.Popen` without a
`preexec_fn` execs straight from a vfork()ed child: no Python and no fork handlers run there.

A child that must die with its parent arms itself after exec (`common.parent_death`).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import select
import signal
import subprocess
import sys
import threading
from collections.abc import Sequence
from typing import IO, Any


def start_child(argv: Sequence[str], **popen_kwargs: Any) -> subprocess.Popen[bytes]:
    """`subprocess.Popen(argv, **popen_kwargs)`; a `preexec_fn` is refused (see the module
    docstring). Call it from a thread that lives as long as the child's parent should (the event
    loop's): PR_SET_PDEATHSIG follows the thread that forked."""
    if popen_kwargs.get("preexec_fn") is not None:
        raise ValueError("no preexec_fn: it runs Python in the forked child of a threaded process")
    return subprocess.Popen(list(argv), **popen_kwargs)


class ChildProcess:
    """A started child: its pid, its exit status once known, signals, and an awaitable exit."""

    def __init__(self, popen: subprocess.Popen[bytes]) -> None:
        self.popen = popen

    @classmethod
    def start(cls, argv: Sequence[str], **popen_kwargs: Any) -> ChildProcess:
        """`start_child(argv, **popen_kwargs)`, awaitable on the loop."""
        return cls(start_child(argv, **popen_kwargs))

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def returncode(self) -> int | None:
        """The exit status (negative: the signal that killed it), None while it runs."""
        return self.popen.poll()

    def send_signal(self, sig: int) -> None:
        self.popen.send_signal(sig)  # a no-op once it is reaped, so never another process

    def kill(self) -> None:
        self.popen.kill()

    async def wait(self) -> int:
        return await wait_exit(self.popen)


async def wait_exit(popen: subprocess.Popen[Any]) -> int:
    """Wait on the loop for `popen` to exit; its status (negative: killed by that signal). A pidfd
    turns readable at the exit; without one (an old kernel) it polls every 20 ms."""
    if popen.poll() is not None:
        return popen.returncode
    try:
        fd = os.pidfd_open(popen.pid)
    except (OSError, AttributeError):
        fd = None
    if fd is not None:
        loop = asyncio.get_running_loop()
        done = loop.create_future()

        def readable() -> None:
            if not done.done():
                done.set_result(None)

        loop.add_reader(fd, readable)
        try:
            if popen.poll() is None:
                await done
        finally:
            loop.remove_reader(fd)
            os.close(fd)
    while popen.poll() is None:  # no pidfd (or a race with its readiness): poll
        await asyncio.sleep(0.02)
    return popen.returncode


async def stream_reader(pipe: IO[bytes]) -> asyncio.StreamReader:
    """An asyncio reader over a child's pipe (`stdout=subprocess.PIPE`); owns the pipe from here."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), pipe)
    return reader


def kill_worker(pid: int) -> None:
    """SIGKILL a worker and whatever it started (it leads its own session and process group)."""
    for kill in (os.killpg, os.kill):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            kill(pid, signal.SIGKILL)


def kill_group(pid: int) -> None:
    for kill in (os.killpg, os.kill):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            kill(pid, signal.SIGKILL)


def wait_gone(pid: int) -> None:
    """Block until `pid` no longer runs (not our child: pidfd, else poll)."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    except OSError:
        fd = None
    if fd is not None:
        try:
            select.select([fd], [], [], 30.0)
        finally:
            os.close(fd)
        return
    for _ in range(1500):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        threading.Event().wait(0.02)


def to_stderr(text: str) -> None:
    with contextlib.suppress(OSError, ValueError):
        sys.stderr.write(f"mariner zygote: {text}\n")
        sys.stderr.flush()
