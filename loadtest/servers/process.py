"""What every server the load tools and the tests start has in common, whatever it is.

A server runs as a subprocess in its own process group (stop() signals the group, so nothing it
spawned survives), on five 127.0.0.1 ports of its own (`Ports`, TorchServe's five listeners),
with a private work dir that holds its console log and is removed on stop(). start() returns
once the server is ready, or raises ServerError with the tail of its logs, having stopped it
again; stop() is idempotent and also runs at interpreter exit. Subclasses say what to run and
when it counts as ready: `mariner.loadtest.servers.mariner` and `...servers.torchserve`.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import IO, Self

import psutil
import requests

LOCALHOST = "127.0.0.1"
READY_POLL_S = 0.05


class ServerError(RuntimeError):
    """A server could not be started or died; the message carries the tail of its logs."""


@dataclass(frozen=True)
class Ports:
    """The five listeners of a TorchServe-compatible server (Mariner has the same five)."""

    inference: int
    management: int
    metrics: int
    grpc_inference: int
    grpc_management: int

    @classmethod
    def defaults(cls) -> Ports:
        """TorchServe's documented defaults, which Mariner also uses (8080/8081/8082/7070/7071)."""
        return cls(inference=8080, management=8081, metrics=8082, grpc_inference=7070, grpc_management=7071)

    def all(self) -> tuple[int, ...]:
        return (self.inference, self.management, self.metrics, self.grpc_inference, self.grpc_management)


def pick_free_ports(host: str = LOCALHOST) -> Ports:
    """Five distinct ports the kernel calls free right now.

    All five sockets are held open until every port is chosen, so the kernel cannot hand out the
    same port twice. Another process can still grab one before the server binds it; start()
    reports that with the log tail.
    """
    with contextlib.ExitStack() as stack:
        ports: list[int] = []
        for _ in range(5):
            sock = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            sock.bind((host, 0))
            ports.append(int(sock.getsockname()[1]))
    return Ports(*ports)


def port_is_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def port_accepts(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


def wait_http_ok(url: str, proc: subprocess.Popen[bytes], timeout: float) -> float:
    """Poll `url` until it answers 200; seconds it took. Raises ServerError if `proc` exits first.

    A readiness poll, never a fixed sleep: start-up time varies a lot on a shared machine.
    """
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            raise ServerError(f"the server exited with code {proc.returncode} while starting")
        with contextlib.suppress(requests.RequestException):
            if requests.get(url, timeout=1.0).status_code == 200:
                return time.monotonic() - t0
        time.sleep(READY_POLL_S)
    raise ServerError(f"{url} did not answer 200 within {timeout:.0f} s")


def process_tree_cpu_seconds(pid: int | None) -> float:
    """CPU time (user + system) of a process and its live descendants; 0 when it is gone.

    The benchmark samples this before and after a level to say how much CPU a server used.
    """
    if pid is None:
        return 0.0
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0.0
    total = 0.0
    for p in procs:
        with contextlib.suppress(psutil.Error):
            t = p.cpu_times()
            total += t.user + t.system
    return total


class ServerProcess:
    """One server subprocess: its addresses, start() until ready, stop(), its logs.

    Use as a context manager (`with MarinerProcess(...) as server:`) or call start() and stop().
    Subclasses give `command()` and `wait_ready()`, and may add to `environment()`,
    `prepare()`, `launched()`, `terminate()`, `cleanup()` and `log_files()`.
    """

    title = "the server"  # how errors name it
    workdir_prefix = "loadtest-server-"

    def __init__(self, ports: Ports | None = None, *, host: str = LOCALHOST, temp_root: Path | None = None):
        self.host = host
        self.ports = ports if ports is not None else pick_free_ports(host)
        self.temp_root = temp_root
        self.workdir: Path | None = None  # private: console log, config, scratch; removed on stop()
        self.proc: subprocess.Popen[bytes] | None = None
        self.ready_seconds: float | None = None  # from launch to ready
        self._console: IO[bytes] | None = None

    # -- addresses ----------------------------------------------------------------------------
    @property
    def http_url(self) -> str:
        """Inference API, e.g. http://127.0.0.1:8080 (POST /predictions/<model>, GET /ping)."""
        return f"http://{self.host}:{self.ports.inference}"

    @property
    def management_url(self) -> str:
        return f"http://{self.host}:{self.ports.management}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.host}:{self.ports.metrics}"

    @property
    def grpc_target(self) -> str:
        """host:port of the gRPC inference service (org.pytorch.serve.grpc.inference)."""
        return f"{self.host}:{self.ports.grpc_inference}"

    @property
    def grpc_management_target(self) -> str:
        return f"{self.host}:{self.ports.grpc_management}"

    @property
    def pid(self) -> int | None:
        """The server's pid, which is also its process group."""
        return None if self.proc is None else self.proc.pid

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def cpu_seconds(self) -> float:
        """User + system CPU seconds of the server and all its descendants so far."""
        return process_tree_cpu_seconds(self.pid)

    # -- logs ---------------------------------------------------------------------------------
    @property
    def log_path(self) -> Path | None:
        """The server's console (stdout and stderr)."""
        return None if self.workdir is None else self.workdir / "console.log"

    def log_files(self) -> list[Path]:
        return [] if self.log_path is None else [self.log_path]

    def log_tail(self, lines: int = 60) -> str:
        """The last lines of each of the server's logs."""
        parts = []
        for path in self.log_files():
            if path.exists():
                text = path.read_text(errors="replace").splitlines()[-lines:]
                parts.append(f"--- {path.name} (last {len(text)} lines) ---\n" + "\n".join(text))
        return "\n".join(parts) or f"({self.title} wrote no logs)"

    # -- what subclasses say ------------------------------------------------------------------
    def command(self) -> list[str]:
        raise NotImplementedError

    def environment(self) -> dict[str, str] | None:
        """The server's environment; None: this process's."""
        return None

    def cwd(self) -> Path | None:
        return None

    def prepare(self) -> None:
        """Runs once the work dir exists, before the launch (config files)."""

    def launched(self) -> None:
        """Runs right after the launch (helpers that watch the server)."""

    def wait_ready(self, deadline: float) -> None:
        """Return once the server is ready; raise ServerError when it dies or the deadline passes."""
        raise NotImplementedError

    def fail(self, why: str) -> ServerError:
        return ServerError(f"{self.title} {why}")

    # -- lifecycle ----------------------------------------------------------------------------
    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def start(self, timeout: float = 180.0) -> Self:
        """Launch the server and return once it is ready; on any failure (including Ctrl-C while
        waiting) stop everything started again and raise ServerError with the log tail."""
        if self.proc is not None:
            raise self.fail("is already started")
        busy = [p for p in self.ports.all() if not port_is_free(self.host, p)]
        if busy:
            raise self.fail(
                f"cannot start: port(s) {busy} on {self.host} are in use; "
                "stop what holds them or choose other ports"
            )
        self.workdir = Path(tempfile.mkdtemp(prefix=self.workdir_prefix, dir=self.temp_root)).resolve()
        atexit.register(self.stop)
        t0 = time.monotonic()
        try:
            self.prepare()
            assert self.log_path is not None
            self._console = self.log_path.open("wb")
            self.proc = subprocess.Popen(
                self.command(),
                cwd=self.cwd(),
                env=self.environment(),
                stdin=subprocess.DEVNULL,
                stdout=self._console,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # own process group: stop() reaches everything it spawns
            )
            self.launched()
            self.wait_ready(t0 + timeout)
        except BaseException as exc:
            tail = self.log_tail()
            self.stop()
            if isinstance(exc, ServerError):
                raise ServerError(f"{exc}\n{tail}") from None
            raise
        self.ready_seconds = time.monotonic() - t0
        return self

    def stop(self, grace_s: float = 15.0) -> None:
        """Stop the process group (`terminate`), then remove the work dir.

        State is cleared only after each step, so a stop() cut short (a second Ctrl-C) can be
        repeated and still finds the process group.
        """
        if self.proc is not None:
            self.terminate(self.proc, grace_s)
            self.proc = None
        self.cleanup(grace_s)
        if self._console is not None:
            self._console.close()
            self._console = None
        if self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)
            self.workdir = None
        atexit.unregister(self.stop)

    def terminate(self, proc: subprocess.Popen[bytes], grace_s: float) -> None:
        """SIGTERM the process group, SIGKILL it after grace_s."""
        if proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)

    def cleanup(self, grace_s: float) -> None:
        """Runs after the process group is stopped, before the work dir is removed."""
