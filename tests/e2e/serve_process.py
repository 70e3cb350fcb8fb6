"""`mariner serve` as users run it: a subprocess on free loopback ports, with a readiness poll.

Shared by the end-to-end tests. The process runs in its own session (so a kill takes its
children too) and logs to a file the tests read afterwards (the drain accounting line).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from mariner.loadtest.servers import ServerError, pick_free_ports, wait_http_ok

REPO = Path(__file__).resolve().parents[2]
# Each frontend logs its own accounting when it has drained; the server's is their sum.
DRAIN_LINE = re.compile(r"drained: accepted=(\d+) answered=(\d+) ok=(\d+)")


def drain_totals(log: str) -> tuple[int, int, int, int]:
    """(accepted, answered, ok, frontends) summed over every frontend's "drained:" line."""
    lines = [tuple(map(int, m.groups())) for m in DRAIN_LINE.finditer(log)]
    return (
        sum(x[0] for x in lines),
        sum(x[1] for x in lines),
        sum(x[2] for x in lines),
        len(lines),
    )


class ServeProcess:
    """`python -m mariner.server.cli serve` on five free ports; `extra_args` are more flags.
    `launcher` replaces `python -m mariner.server.cli` (an installed `mariner` script), run from
    `cwd` (the repository by default)."""

    def __init__(
        self,
        model_store: Path,
        models: str,
        log_path: Path,
        extra_args: Sequence[str] = (),
        *,
        launcher: Sequence[str] = (sys.executable, "-m", "mariner.server.cli"),
        cwd: Path = REPO,
    ) -> None:
        self.ports = dict(
            zip(("http", "mgmt", "metrics", "grpc", "grpc_mgmt"), pick_free_ports().all(), strict=True)
        )
        self.log_path = log_path
        cmd = [
            *launcher, "serve",
            "--model-store", str(model_store), "--models", models,
            "--inference-address", f"127.0.0.1:{self.ports['http']}",
            "--management-address", f"127.0.0.1:{self.ports['mgmt']}",
            "--metrics-address", f"127.0.0.1:{self.ports['metrics']}",
            "--grpc-inference-address", f"127.0.0.1:{self.ports['grpc']}",
            "--grpc-management-address", f"127.0.0.1:{self.ports['grpc_mgmt']}",
            "--grace-seconds", "20",
            "--disable-token-auth",  # no key_file.json in the repository: these tests check other things
            *extra_args,
        ]  # fmt: skip
        self.log = log_path.open("wb")
        # TorchServe's log files and config snapshots go beside the log, never into the repository
        # (a snapshot there would be restored by the next server started without a config file).
        logs = str(log_path.parent / "logs")
        env = {**os.environ, "LOG_LOCATION": logs, "METRICS_LOCATION": logs}
        self.proc = subprocess.Popen(
            cmd, cwd=cwd, env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True
        )

    def url(self, which: str = "http") -> str:
        return f"http://127.0.0.1:{self.ports[which]}"

    def target(self, which: str = "grpc") -> str:
        return f"127.0.0.1:{self.ports[which]}"

    def wait_ready(self, timeout: float = 120.0) -> float:
        """Seconds until the whole server is ready: the supervisor's /ping (every frontend up,
        every model with a live worker), then a frontend's /readyz."""
        try:
            took = wait_http_ok(f"{self.url('mgmt')}/ping", self.proc, timeout)
            return took + wait_http_ok(f"{self.url()}/readyz", self.proc, timeout)
        except ServerError as exc:
            raise AssertionError(f"{exc}:\n{self.log_path.read_text()[-3000:]}") from None

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        self.log.close()
