"""`mariner torchserve ...`: TorchServe's own launcher command line, running Mariner.

Scripts, Makefiles, TorchServe's test harness (`ts.launcher`) and container entrypoints call
`torchserve --start ...` and `torchserve --stop`. TorchServe's launcher (ts/model_server.py)
starts its Java frontend in the background, writes the pid to `$TMPDIR/.model_server.pid` and
returns at once; `--foreground` keeps it attached; `--stop` sends SIGTERM to that pid (waiting up
to 60 s with `--foreground`) and removes `key_file.json` from the working directory. This command
keeps those semantics and messages, with `mariner serve` (which reads the same flags,
server/compat/torchserve/flags.py) as the server. The images install it as `torchserve`.

Two deliberate differences:
- As the first process of a container (pid 1) it runs the server in the foreground: there is no
  background to go to, and TorchServe's images need a `tail -f /dev/null` to keep a backgrounded
  server's container alive (which also hides the server's death from Kubernetes).
- In the foreground the launcher *becomes* the server (exec), so signals reach it directly.

`mariner serve torchserve ARGS` (what a KServe TorchServe ServingRuntime's `args` become under the
images' `mariner serve` entrypoint) runs `torchserve ARGS` in the foreground with the inference API
on 0.0.0.0:8080, where TorchServe's KServe image (`pytorch/torchserve-kfs`) runs the KServe wrapper
that KServe routes to: Mariner answers KServe v1 and v2 there itself (docs/deploy.md, "KServe").
It runs with TorchServe's configuration alone: the images' own config file (MARINER_CONFIG_FILE,
made for the Kubernetes Deployment) is not read.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from mariner.server.compat.torchserve.tokens import write_private_file

PID_FILE_NAME = ".model_server.pid"
# Where KServe routes a TorchServe ServingRuntime's traffic: the port TorchServe's KServe image
# serves its wrapper on (its config.properties moves TorchServe itself to 8085).
KSERVE_WRAPPER_ADDRESS = "0.0.0.0:8080"
# `mariner serve` is started as this module's interpreter running the console script's module,
# so the pid file's process can be recognised as ours (TorchServe checks for its Java class).
SERVER_MODULE = "mariner.server.cli"
STOP_WAIT_S = 60.0
# Flags only the launcher reads; everything else is `mariner serve`'s (which accepts
# torchserve's --start, --foreground, --ncs ... itself).
_LAUNCHER_ONLY = ("--stop", "--version", "-v")


@dataclass(frozen=True)
class Launch:
    """What one `torchserve` command line asks for."""

    action: str  # "start", "stop" or "version"
    foreground: bool
    serve_args: tuple[str, ...]


def parse(argv: Sequence[str], *, pid1: bool = False, kserve: bool = False) -> Launch:
    """Split TorchServe's launcher flags from the server's (`kserve`: the inference API goes to
    the KServe wrapper's address, in the foreground)."""
    args = list(argv)
    if "--version" in args or "-v" in args:
        return Launch("version", False, ())
    foreground = "--foreground" in args or pid1 or kserve
    serve_args = tuple(a for a in args if a not in _LAUNCHER_ONLY)
    if kserve:
        serve_args = (*serve_args, "--inference-address", KSERVE_WRAPPER_ADDRESS, "--kserve-runtime")
    return Launch("stop" if "--stop" in args else "start", foreground, serve_args)


def pid_file() -> Path:
    """TorchServe's pid file: `.model_server.pid` in the temp dir (TMPDIR)."""
    return Path(tempfile.gettempdir()) / PID_FILE_NAME


def running_server(path: Path) -> int | None:
    """The pid in `path` when that process is a running `mariner serve`, else None (the stale
    file is removed, as TorchServe's launcher removes an orphan pid file)."""
    try:
        pid = int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    if _is_server(pid):
        return pid
    print("Removing orphan pid file.")
    with contextlib.suppress(OSError):
        path.unlink()
    return None


def _is_server(pid: int) -> bool:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    if stat.rpartition(")")[2].split()[:1] == ["Z"]:
        return False
    argv = raw.split(b"\0")
    return SERVER_MODULE.encode() in argv and b"serve" in argv


def server_argv(serve_args: Sequence[str]) -> list[str]:
    """`mariner serve` as a child of this interpreter (no PATH lookup, same virtualenv)."""
    return [sys.executable, "-m", SERVER_MODULE, "serve", *serve_args]


def stop(foreground: bool, *, wait_s: float = STOP_WAIT_S, cwd: Path | None = None) -> int:
    """SIGTERM the running server (it drains, see docs/architecture.md "Shutdown")."""
    path = pid_file()
    pid = running_server(path)
    if pid is None:
        print("TorchServe is not currently running.")
        return 0
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        print("TorchServe already stopped.")
    except PermissionError:
        print(f"TorchServe (pid {pid}) runs as another user: it was not stopped.")
        return 1
    else:
        # TorchServe's launcher removes the key file it leaves in the working directory.
        with contextlib.suppress(OSError):
            ((cwd or Path.cwd()) / "key_file.json").unlink()
        if foreground:
            deadline = time.monotonic() + wait_s
            while _is_server(pid) and time.monotonic() < deadline:
                time.sleep(0.1)
            if _is_server(pid):
                print("Stopping TorchServe took too long.")
        else:
            print("TorchServe has stopped.")
    with contextlib.suppress(OSError):
        path.unlink()
    return 0


def start(
    launch: Launch,
    *,
    exec_server: Callable[[list[str]], object] = lambda argv: os.execv(argv[0], argv),
) -> int:
    """Start `mariner serve`: in the background (pid file, return 0) or, in the foreground, by
    becoming it."""
    path = pid_file()
    if running_server(path) is not None:
        print("TorchServe is already running, please use torchserve --stop to stop TorchServe.")
        return 1
    argv = server_argv(launch.serve_args)
    if launch.foreground:
        _write_pid(path, os.getpid())
        sys.stdout.flush()
        sys.stderr.flush()
        exec_server(argv)  # does not return in production
        return 0
    # A session of its own: the server outlives this launcher and its terminal's signals.
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, start_new_session=True)
    _write_pid(path, proc.pid)
    return 0


def _write_pid(path: Path, pid: int) -> None:
    # $TMPDIR is shared: never write through a link someone else planted there.
    write_private_file(path, str(pid))


def main(argv: Sequence[str] | None = None, *, kserve: bool = False) -> int:
    """`torchserve [--start|--stop] [--foreground] [flags]` (the `mariner-torchserve` script)."""
    launch = parse(sys.argv[1:] if argv is None else argv, pid1=os.getpid() == 1, kserve=kserve)
    if launch.action == "version":
        from importlib.metadata import version

        print(f"Mariner {version('mariner')}, serving TorchServe 0.12's command line and APIs")
        return 0
    if launch.action == "stop":
        return stop(launch.foreground)
    if kserve:
        # TorchServe's command line carries TorchServe's configuration (its config.properties):
        # the images' own config file (MARINER_CONFIG_FILE, the Deployment's) is not read over it.
        os.environ.pop("MARINER_CONFIG_FILE", None)
    return start(launch)


if __name__ == "__main__":
    sys.exit(main())
