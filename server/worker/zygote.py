"""The zygote process's side of the fork server (`zygote.py` is the supervisor's side and the
protocol): preload, say hello, fork a worker on request, reap workers and report their exits.

`python -m mariner.server.worker.zygote FD` runs `serve` here; a forked child becomes a worker
(`_become_worker`) exactly as a fresh `python -m mariner.server.worker.main` would be.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import signal
import socket
import sys
from typing import Any

from mariner.server.common.child_process import kill_group, to_stderr
from mariner.server.contracts.zygote_wire import (
    FDS_PER_FORK,
    MAX_MESSAGE,
    PRELOAD,
    READY_FD,
    WORKER_CMDLINE_MODULE,
)

# The signals a forked worker resets, and which of them this process was started ignoring (a
# spawned worker inherits an ignored signal across exec, e.g. SIGHUP under nohup): read before
# the zygote installs handlers of its own.
_RESET = (signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1)
_INHERITED_IGNORED = {sig: signal.getsignal(sig) == signal.SIG_IGN for sig in _RESET}


def serve(fd: int) -> int:
    """The zygote's main loop: preload, say hello, fork on request, reap and report exits."""
    import importlib
    import selectors

    sock = socket.socket(fileno=fd)
    from mariner.server.contracts.peer import PeerRefused, check_peer

    try:  # a socketpair's peer is the process that made it: our parent, the supervisor
        check_peer(sock, what="zygote control socket", expected_pid=os.getppid())
    except PeerRefused as exc:
        to_stderr(str(exc))
        return 1
    # `-m` put the supervisor's cwd first on sys.path: workers must not import from it.
    if sys.path and sys.path[0] in ("", ".", os.getcwd()):
        del sys.path[0]
    for name in PRELOAD:
        importlib.import_module(name)
    torch = sys.modules["torch"]
    if torch.cuda.is_initialized():  # a fork would inherit an unusable CUDA context
        to_stderr("CUDA was initialised while preloading; refusing to fork workers")
        return 1
    # Freeze what the imports left: a child's garbage collections then walk only its own new
    # objects instead of touching (and so copying) the shared torch heap pages.
    gc.collect()
    gc.freeze()
    wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # the wakeup fd does the work
    children: set[int] = set()
    sel = selectors.DefaultSelector()
    sel.register(sock, selectors.EVENT_READ, "sock")
    sel.register(wake_r, selectors.EVENT_READ, "wake")
    sock.send(json.dumps({"hello": os.getpid(), "cuda_initialized": torch.cuda.is_initialized()}).encode())
    try:
        while True:
            for key, _ in sel.select():
                if key.data == "wake":
                    with contextlib.suppress(BlockingIOError):
                        while os.read(wake_r, 512):
                            pass
                    _reap(sock, children)
                    continue
                msg, fds, _, _ = socket.recv_fds(sock, MAX_MESSAGE, FDS_PER_FORK)
                if not msg:
                    return 0  # the supervisor is gone
                request = json.loads(msg)
                if len(fds) != FDS_PER_FORK:
                    for received in fds:
                        os.close(received)
                    error = f"expected {FDS_PER_FORK} fds"
                    sock.send(json.dumps({"req": request.get("req"), "error": error}).encode())
                    continue
                sys.stdout.flush()
                sys.stderr.flush()
                zygote_pid = os.getpid()
                try:
                    pid = os.fork()
                except OSError as exc:
                    for received in fds:
                        os.close(received)
                    sock.send(json.dumps({"req": request["req"], "error": f"fork: {exc}"}).encode())
                    continue
                if pid == 0:
                    sel.close()
                    sock.detach()  # its fd is closed below with the rest; never close it twice
                    _become_worker(request, fds, zygote_pid)  # never returns
                for received in fds:
                    os.close(received)
                children.add(pid)
                sock.send(json.dumps({"req": request["req"], "pid": pid}).encode())
    except (BrokenPipeError, ConnectionResetError):
        return 0
    finally:
        for pid in children:
            kill_group(pid)


def _reap(sock: socket.socket, children: set[int]) -> None:
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        children.discard(pid)
        sock.send(json.dumps({"exited": pid, "code": os.waitstatus_to_exitcode(status)}).encode())


def _become_worker(request: dict[str, Any], fds: list[int], zygote_pid: int) -> None:
    """In the forked child: turn into what a freshly spawned worker is, run it, exit."""
    code = 1
    try:
        from mariner.server.common import parent_death

        parent_death.arm(zygote_pid)  # the zygote (single-threaded) going means the server went
        os.setsid()  # its own group: kill() SIGKILLs the worker and whatever it started
        signal.set_wakeup_fd(-1)
        for sig in _RESET:  # as exec leaves them: ignored stays ignored (nohup), else default
            signal.signal(sig, signal.SIG_IGN if _INHERITED_IGNORED.get(sig) else signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        ready_w, out, err = fds
        devnull = os.open(os.devnull, os.O_RDWR)
        # Out of the way of 0-3 first: a received fd may have any of those numbers.
        ready_w, out, err = (os.dup(fd) for fd in (ready_w, out, err))
        os.dup2(devnull, 0)
        os.dup2(out, 1)
        os.dup2(err, 2)
        os.dup2(ready_w, READY_FD)
        os.closerange(READY_FD + 1, os.sysconf("SC_OPEN_MAX"))  # the control socket, the pipes, the rest
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        main = sys.modules[WORKER_CMDLINE_MODULE]
        sys.argv[:] = [str(main.__file__)]
        _set_cmdline([sys.executable, "-m", WORKER_CMDLINE_MODULE])
        _reseed()
        code = main.run_worker(main.spec_from_json(request["spec"]), READY_FD)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:  # noqa: BLE001 - whatever happens, the child must never return to the loop
        import traceback

        traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def _reseed() -> None:
    """A fork copies the parent's RNG state; fresh interpreters each seed from the OS."""
    np = sys.modules.get("numpy")
    if np is not None:
        np.random.seed()  # `random` reseeds itself after a fork


def _set_cmdline(argv: list[str]) -> None:
    """Rewrite /proc/self/cmdline (the original argv memory, found via /proc/self/stat) so the
    worker shows as `python -m mariner.server.worker.main`; skipped if it does not fit."""
    import ctypes

    with contextlib.suppress(OSError, ValueError, IndexError):
        with open("/proc/self/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        arg_start, arg_end = int(fields[45]), int(fields[46])  # fields 48 and 49 of proc(5)
        new = b"\0".join(a.encode() for a in argv) + b"\0"
        size = arg_end - arg_start
        if 0 < len(new) <= size:
            ctypes.memmove(arg_start, new.ljust(size, b"\0"), size)


if __name__ == "__main__":
    from mariner.server.common import parent_death

    parent_death.arm_from_env()

    if len(sys.argv) != 2:
        sys.exit("usage: python -m mariner.server.worker.zygote FD (started by the supervisor)")
    sys.exit(serve(int(sys.argv[1])))
