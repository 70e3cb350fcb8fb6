"""`mariner serve` as users run it: a subprocess on free loopback ports, with a readiness poll.

Shared by the end-to-end tests. The process runs in its own session (so a kill takes its
children too) and logs to a file the tests read afterwards (the drain accounting line).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import requests

REPO = Path(__file__).resolve().parents[2]


def free_ports(n: int) -> list[int]:
    socks = []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


class ServeProcess:
    """`python -m server.cli serve` on five free ports; `extra_args` are more `mariner serve` flags."""

    def __init__(
        self, model_store: Path, models: str, log_path: Path, extra_args: Sequence[str] = ()
    ) -> None:
        self.ports = dict(zip(("http", "mgmt", "metrics", "grpc", "grpc_mgmt"), free_ports(5), strict=True))
        self.log_path = log_path
        cmd = [
            sys.executable, "-m", "server.cli", "serve",
            "--model-store", str(model_store), "--models", models,
            "--inference-address", f"127.0.0.1:{self.ports['http']}",
            "--management-address", f"127.0.0.1:{self.ports['mgmt']}",
            "--metrics-address", f"127.0.0.1:{self.ports['metrics']}",
            "--grpc-inference-address", f"127.0.0.1:{self.ports['grpc']}",
            "--grpc-management-address", f"127.0.0.1:{self.ports['grpc_mgmt']}",
            "--grace-seconds", "20",
            *extra_args,
        ]  # fmt: skip
        self.log = log_path.open("wb")
        self.proc = subprocess.Popen(
            cmd, cwd=REPO, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True
        )

    def url(self, which: str = "http") -> str:
        return f"http://127.0.0.1:{self.ports[which]}"

    def target(self, which: str = "grpc") -> str:
        return f"127.0.0.1:{self.ports[which]}"

    def wait_ready(self, timeout: float = 120.0) -> float:
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if self.proc.poll() is not None:
                raise AssertionError(
                    f"mariner exited with {self.proc.returncode}:\n{self.log_path.read_text()[-3000:]}"
                )
            try:
                if requests.get(f"{self.url()}/readyz", timeout=1).status_code == 200:
                    return time.monotonic() - t0
            except (requests.ConnectionError, requests.Timeout):  # not listening yet, or busy loading
                pass
            time.sleep(0.05)
        raise AssertionError(f"not ready after {timeout} s:\n{self.log_path.read_text()[-3000:]}")

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        self.log.close()
