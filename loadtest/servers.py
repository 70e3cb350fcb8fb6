"""Start and stop the servers the load tools measure, each as a subprocess on free 127.0.0.1 ports.

`MarinerProcess` runs `mariner serve` exactly as users do (a subprocess, so its CPU time and
its event loop are its own and a client in this process cannot steal either); `FloorProcess`
runs the transport floor (`mariner.loadtest.floor`: same RPC and route, fixed bytes, no model). Stock
TorchServe has its own helper, `mariner.loadtest.stock_torchserve.StockTorchServe`. quickbench, bench,
`make loadtest` and the load-test tests all start servers through here, so a fix to readiness
or shutdown lands everywhere at once.

Each server gets its own process group (stop() signals the group, so nothing it spawned
survives) and its own log file; start() raises ServerError with the log tail when the process
dies or never becomes ready. stop() is idempotent and also runs at interpreter exit.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Self

import psutil
import requests

from mariner.loadtest.stock_torchserve import LOCALHOST, TorchServePorts, pick_free_ports

REPO = Path(__file__).resolve().parent.parent
READY_POLL_S = 0.05


class ServerError(RuntimeError):
    """A server could not be started or died; the message carries the tail of its log."""


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


class ServerProcess:
    """A server subprocess in its own process group, with a log file and a readiness URL."""

    ready_path = "/ping"

    def __init__(
        self, cmd: Sequence[str], ports: TorchServePorts, *, env: dict[str, str] | None = None
    ) -> None:
        self.cmd = list(cmd)
        self.ports = ports
        self.env = env
        self.proc: subprocess.Popen[bytes] | None = None
        self.ready_seconds: float | None = None
        self._logdir: tempfile.TemporaryDirectory[str] | None = None

    # -- addresses ----------------------------------------------------------------------------
    @property
    def http_url(self) -> str:
        """Inference base URL, e.g. http://127.0.0.1:8080."""
        return f"http://{LOCALHOST}:{self.ports.inference}"

    @property
    def grpc_target(self) -> str:
        """host:port of the TorchServe gRPC inference service."""
        return f"{LOCALHOST}:{self.ports.grpc_inference}"

    @property
    def metrics_url(self) -> str:
        return f"http://{LOCALHOST}:{self.ports.metrics}"

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    @property
    def log_path(self) -> Path | None:
        return None if self._logdir is None else Path(self._logdir.name) / "server.log"

    def log_tail(self, lines: int = 40) -> str:
        path = self.log_path
        if path is None or not path.exists():
            return "(no server log)"
        text = path.read_text(errors="replace").splitlines()[-lines:]
        return f"--- server log (last {len(text)} lines) ---\n" + "\n".join(text)

    # -- lifecycle ----------------------------------------------------------------------------
    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def start(self, timeout: float = 180.0) -> Self:
        """Launch and return once `ready_path` answers 200; on any failure stop it again."""
        if self.proc is not None:
            raise ServerError("already started")
        self._logdir = tempfile.TemporaryDirectory(prefix="loadtest-server-")
        assert self.log_path is not None
        log = self.log_path.open("wb")
        atexit.register(self.stop)
        try:
            self.proc = subprocess.Popen(
                self.cmd,
                cwd=REPO,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # own process group: stop() reaches everything it spawns
            )
            log.close()
            self.ready_seconds = wait_http_ok(f"{self.http_url}{self.ready_path}", self.proc, timeout)
        except BaseException as exc:
            tail = self.log_tail()
            self.stop()
            if isinstance(exc, ServerError):
                raise ServerError(f"{exc}\n{tail}") from None
            raise
        return self

    def stop(self, grace_s: float = 15.0) -> None:
        """SIGTERM the process group, SIGKILL it after grace_s; remove the log."""
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
        if self._logdir is not None:
            self._logdir.cleanup()
            self._logdir = None
        atexit.unregister(self.stop)

    def cpu_seconds(self) -> float:
        """User + system CPU seconds of the server and all its descendants so far."""
        return process_tree_cpu_seconds(self.pid)


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


class MarinerProcess(ServerProcess):
    """`mariner serve` on five free ports; ready when /readyz says every model is loaded."""

    ready_path = "/readyz"

    def __init__(
        self,
        model_store: Path,
        models: str = "all",
        *,
        batch_size: int | None = None,
        max_batch_delay_ms: float | None = None,
        torch_threads: int | None = None,
        log_level: str = "WARNING",
        extra_args: Sequence[str] = (),
        env: dict[str, str] | None = None,
        ports: TorchServePorts | None = None,
        python: str = sys.executable,
    ) -> None:
        """Nothing starts here. Unset settings are left to the archive (batchSize, maxBatchDelay)."""
        ports = ports or pick_free_ports()
        cmd = [
            python, "-m", "mariner.server.cli", "serve",
            "--model-store", str(Path(model_store).resolve()), "--models", models,
            "--inference-address", f"{LOCALHOST}:{ports.inference}",
            "--management-address", f"{LOCALHOST}:{ports.management}",
            "--metrics-address", f"{LOCALHOST}:{ports.metrics}",
            "--grpc-inference-address", f"{LOCALHOST}:{ports.grpc_inference}",
            "--grpc-management-address", f"{LOCALHOST}:{ports.grpc_management}",
            "--log-level", log_level,
        ]  # fmt: skip
        if batch_size is not None:
            cmd += ["--batch-size", str(batch_size)]
        if max_batch_delay_ms is not None:
            cmd += ["--max-batch-delay-ms", str(max_batch_delay_ms)]
        if torch_threads is not None:
            cmd += ["--torch-threads", str(torch_threads)]
        cmd += list(extra_args)
        super().__init__(cmd, ports, env=env)


class FloorProcess(ServerProcess):
    """The transport floor (`mariner.loadtest.floor`): Mariner's RPC and route answering fixed bytes."""

    ready_path = "/ping"

    def __init__(self, *, python: str = sys.executable) -> None:
        ports = pick_free_ports()
        cmd = [
            python, "-m", "mariner.loadtest.floor",
            "--grpc-port", str(ports.grpc_inference), "--http-port", str(ports.inference),
        ]  # fmt: skip
        super().__init__(cmd, ports)
