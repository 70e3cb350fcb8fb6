"""A fork server for model workers: one fresh interpreter that imports torch, numpy and the
worker's modules once, then forks each worker on request.

Why: every worker used to be a fresh interpreter importing torch (1.5-3 s of CPU each), so seven
workers on two cores took 12-24 s to be ready. A fork of a process that already imported torch
starts in milliseconds and shares those pages copy-on-write.

Why this is safe with CUDA: the zygote is itself a fresh interpreter (`python -m
mariner.server.worker.zygote FD`, never a fork of the supervisor) and never initialises CUDA (it
checks, and refuses to serve if an import did): each forked worker initialises its own device, as
a fresh one would. The zygote holds no fd but its control socket (a Unix SOCK_SEQPACKET socketpair
with the supervisor), runs no asyncio loop and no thread of its own.

The control socket carries JSON messages:
  supervisor → zygote  {"op": "fork", "req": n, "spec": ..., "env": {...}, "cwd": ...} with three
                       fds (SCM_RIGHTS): the write ends of the ready-line pipe and of the pipes
                       (or the stderr) the worker's stdout and stderr are
  zygote → supervisor  {"hello": pid, "cuda_initialized": false} once imported;
                       {"req": n, "pid": p} or {"req": n, "error"};
                       {"exited": p, "code": c} when a worker ends (negative: killed by signal c)
The zygote is the workers' parent: it reaps them and reports each exit status, so a segfault is
still seen as -SIGSEGV. The supervisor going away (EOF) makes the zygote SIGKILL its workers and
exit; the zygote going away makes the supervisor SIGKILL them and report -SIGKILL (a worker also
notices its parent changing and exits by itself). A forked child becomes what a fresh worker is:
its own session, signal handlers at their defaults, fds 0-3 only (0 /dev/null, 1 and 2 its
stdout and stderr, 3 the ready pipe), the requested environment and cwd, `sys.path` of the library paths
plus (set by the worker) its archive's directory, reseeded RNGs, and the command line
`python -m mariner.server.worker.main`, which is how operators and tests recognise workers.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Mapping
from concurrent.futures import Future
from typing import Any

from mariner.server.common.child_process import kill_group, to_stderr, wait_gone
from mariner.server.contracts.zygote_wire import (
    MAX_MESSAGE,
)


class ZygoteUnavailable(Exception):
    """The zygote could not fork this worker (it is gone or failed to start): spawn it instead."""


# --------------------------------------------------------------------------- supervisor side


def _settle(fut: asyncio.Future[int], code: int) -> None:
    """Resolve a waiter on its own loop (call_soon_threadsafe), unless it was cancelled."""
    if not fut.done():
        fut.set_result(code)


class ZygoteChild:
    """A worker forked by the zygote: its pid, and its exit status as the zygote reports it."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self._code: int | None = None
        self._lock = threading.Lock()
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[int]]] = []

    @property
    def returncode(self) -> int | None:
        return self._code

    def _set_exit(self, code: int) -> None:
        """Called from the client's reader thread."""
        with self._lock:
            if self._code is not None:
                return
            self._code = code
            waiters, self._waiters = self._waiters, []
        for loop, fut in waiters:
            with contextlib.suppress(RuntimeError):  # that loop is closed: nobody waits there
                loop.call_soon_threadsafe(_settle, fut, code)

    async def wait(self) -> int:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[int] = loop.create_future()
        with self._lock:
            if self._code is not None:
                return self._code
            self._waiters.append((loop, fut))
        return await fut


class ZygoteClient:
    """The supervisor's end of one zygote: starts it, forks workers through it, and keeps every
    forked worker's exit status (a reader thread, so it serves any event loop)."""

    def __init__(self, env: Mapping[str, str]) -> None:
        from mariner.server.common import parent_death
        from mariner.server.common.child_env import child_env
        from mariner.server.common.child_process import start_child

        self.env = child_env(env)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._sock = ours
        try:
            self.proc = start_child(
                [sys.executable, "-m", "mariner.server.worker.zygote", str(theirs.fileno())],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=None,
                env=parent_death.env_for_this_parent(self.env),  # dies with the supervisor
                pass_fds=(theirs.fileno(),),
                start_new_session=True,  # a Ctrl-C to the supervisor's group does not reach it
                close_fds=True,
            )
        finally:
            theirs.close()
        self.hello = threading.Event()
        self.cuda_initialized: bool | None = None  # as the zygote reported it once it had preloaded
        self.alive = True
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()
        self._next_req = 0
        self._pending: dict[int, Future[ZygoteChild]] = {}
        self._children: dict[int, ZygoteChild] = {}
        self._reader = threading.Thread(target=self._read, name=f"zygote-{self.proc.pid}", daemon=True)
        self._reader.start()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def live_children(self) -> int:
        with self._lock:
            return sum(1 for c in self._children.values() if c.returncode is None)

    async def fork(
        self, spec_json: str, fds: tuple[int, int, int], *, env: Mapping[str, str], cwd: str
    ) -> ZygoteChild:
        """Ask for a worker; `fds` (the ready pipe's, its stdout's and its stderr's write ends)
        become its fds 3, 1 and 2 (the caller closes its own copies)."""
        fut: Future[ZygoteChild] = Future()
        with self._lock:
            if not self.alive:
                raise ZygoteUnavailable(f"zygote {self.pid} is gone")
            req = self._next_req = self._next_req + 1
            self._pending[req] = fut
        from mariner.server.common.child_env import child_env

        msg = json.dumps({"op": "fork", "req": req, "spec": spec_json, "env": child_env(env), "cwd": cwd})
        try:
            with self._send_lock:
                socket.send_fds(self._sock, [msg.encode()], list(fds))
        except OSError as exc:
            with self._lock:
                self._pending.pop(req, None)
            raise ZygoteUnavailable(f"zygote {self.pid}: {exc}") from exc
        return await asyncio.wrap_future(fut)

    def close(self) -> None:
        """Tell the zygote to go (it SIGKILLs the workers it still has, then exits)."""
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)

    def _read(self) -> None:
        try:
            while True:
                data = self._sock.recv(MAX_MESSAGE)
                if not data:
                    break
                self._handle(json.loads(data))
        except (OSError, ValueError) as exc:
            to_stderr(f"zygote {self.pid}: control socket failed: {exc!r}")
        finally:
            self._gone()

    def _handle(self, msg: dict[str, Any]) -> None:
        if "hello" in msg:
            self.cuda_initialized = bool(msg.get("cuda_initialized"))
            self.hello.set()
        elif "exited" in msg:
            with self._lock:
                child = self._children.pop(int(msg["exited"]), None)
            if child is not None:
                child._set_exit(int(msg["code"]))
        elif "req" in msg:
            with self._lock:
                fut = self._pending.pop(int(msg["req"]), None)
                child = None
                if "pid" in msg:
                    child = self._children[int(msg["pid"])] = ZygoteChild(int(msg["pid"]))
            if fut is None or not fut.set_running_or_notify_cancel():
                if child is not None:  # nobody waits for it any more (the start timed out)
                    kill_group(child.pid)
                return
            if child is not None:
                fut.set_result(child)
            else:
                fut.set_exception(ZygoteUnavailable(f"zygote {self.pid}: {msg.get('error')}"))

    def _gone(self) -> None:
        """The zygote exited (or closed its end): nobody reaps its workers now. Kill them and
        report each as killed once it is gone; pending forks fall back to spawning."""
        with self._lock:
            self.alive = False
            pending, self._pending = list(self._pending.values()), {}
            children, self._children = list(self._children.values()), {}
        for fut in pending:
            if fut.set_running_or_notify_cancel():
                fut.set_exception(ZygoteUnavailable(f"zygote {self.pid} exited"))
        for child in children:
            kill_group(child.pid)
        for child in children:
            wait_gone(child.pid)
            child._set_exit(-signal.SIGKILL)
        self._sock.close()
        self.proc.wait()
        if children:
            to_stderr(
                f"zygote {self.pid} exited with {self.proc.returncode}; killed its {len(children)} workers"
            )


_clients: dict[frozenset[tuple[str, str]], ZygoteClient] = {}
_clients_lock = threading.Lock()
_failures = 0
MAX_FAILURES = 3  # zygotes that died before serving in a row: stop trying, spawn every worker


def client_for(env: Mapping[str, str]) -> ZygoteClient:
    """The live zygote started with exactly `env` (environment variables read at import time,
    e.g. OMP_NUM_THREADS or PROMETHEUS_MULTIPROC_DIR, must be the worker's), starting one if
    there is none or it died. Zygotes of other environments with no live worker are closed."""
    key = frozenset(env.items())
    with _clients_lock:
        if _failures >= MAX_FAILURES:
            raise ZygoteUnavailable(f"{_failures} zygotes failed in a row")
        client = _clients.get(key)
        if client is not None and client.alive:
            return client
        for other_key, other in list(_clients.items()):
            if other_key != key and other.alive and other.live_children() == 0:
                other.close()
                del _clients[other_key]
        client = _clients[key] = ZygoteClient(env)
        return client


def note_result(client: ZygoteClient, ok: bool) -> None:
    """Count zygotes that died without ever serving, so a broken one is not restarted forever."""
    global _failures
    with _clients_lock:
        if ok:
            _failures = 0
        elif not client.hello.is_set():
            _failures += 1


def shutdown() -> None:
    """Close every zygote (their workers are SIGKILLed): for tests and interpreter exit."""
    with _clients_lock:
        clients = list(_clients.values())
        _clients.clear()
    for client in clients:
        client.close()
    for client in clients:
        with contextlib.suppress(subprocess.TimeoutExpired):
            client.proc.wait(10)
