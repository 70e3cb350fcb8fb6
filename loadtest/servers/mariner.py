"""Mariner as users run it, `mariner serve` in a subprocess, and the transport floor beside it.

A subprocess, so the server's CPU time and event loop are its own and a client in this process
cannot steal either. `FloorProcess` runs the transport floor (`mariner.loadtest.servers.floor`:
the same RPC and route, fixed bytes, no model).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from mariner.loadtest.servers.process import LOCALHOST, Ports, ServerProcess, pick_free_ports, wait_http_ok

REPO = Path(__file__).resolve().parents[2]


class RepoCommand(ServerProcess):
    """A command run from the repository root, ready when `ready_path` answers 200."""

    ready_path = "/ping"

    def __init__(self, cmd: Sequence[str], ports: Ports, env: dict[str, str] | None = None) -> None:
        super().__init__(ports)
        self.cmd = list(cmd)
        self.env = env

    def command(self) -> list[str]:
        return self.cmd

    def environment(self) -> dict[str, str] | None:
        return self.env

    def cwd(self) -> Path | None:
        return REPO

    def wait_ready(self, deadline: float) -> None:
        assert self.proc is not None
        wait_http_ok(f"{self.http_url}{self.ready_path}", self.proc, max(0.0, deadline - time.monotonic()))


class MarinerProcess(RepoCommand):
    """`mariner serve` on five free ports; ready when /readyz says every model is loaded."""

    title = "mariner serve"
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
        ports: Ports | None = None,
        python: str = sys.executable,
    ) -> None:
        """Nothing starts here. Unset settings are left to the archive (batchSize, maxBatchDelay)."""
        p = ports or pick_free_ports()
        cmd = [
            python, "-m", "mariner.server.cli", "serve",
            "--model-store", str(Path(model_store).resolve()), "--models", models,
            "--inference-address", f"{LOCALHOST}:{p.inference}",
            "--management-address", f"{LOCALHOST}:{p.management}",
            "--metrics-address", f"{LOCALHOST}:{p.metrics}",
            "--grpc-inference-address", f"{LOCALHOST}:{p.grpc_inference}",
            "--grpc-management-address", f"{LOCALHOST}:{p.grpc_management}",
            "--log-level", log_level,
            # TorchServe's token authorization (on by default, as in TorchServe) would need every
            # load-test client to read key_file.json; the comparison runs stock TorchServe without it.
            "--disable-token-auth",
            # TorchServe's metric names on /metrics, as the stock TorchServe it is compared with is
            # configured (its own default, `log`, writes a metric log line per event instead).
            "--metrics-mode", "prometheus",
        ]  # fmt: skip
        if batch_size is not None:
            cmd += ["--batch-size", str(batch_size)]
        if max_batch_delay_ms is not None:
            cmd += ["--max-batch-delay-ms", str(max_batch_delay_ms)]
        if torch_threads is not None:
            cmd += ["--torch-threads", str(torch_threads)]
        super().__init__([*cmd, *extra_args], p, env)

    def environment(self) -> dict[str, str] | None:
        """TorchServe's log files and config snapshots go into this server's work dir, never into
        the repository it runs in (a snapshot there would be restored by the next server)."""
        assert self.workdir is not None
        logs = str(self.workdir / "logs")
        return {
            **(self.env if self.env is not None else os.environ),
            "LOG_LOCATION": logs,
            "METRICS_LOCATION": logs,
        }


class FloorProcess(RepoCommand):
    """The transport floor: Mariner's RPC and route answering fixed bytes; ready on /ping."""

    title = "the transport floor"

    def __init__(self, *, python: str = sys.executable, grpc_server: str = "aio") -> None:
        p = pick_free_ports()
        cmd = [
            python, "-m", "mariner.loadtest.servers.floor",
            "--grpc-port", str(p.grpc_inference), "--http-port", str(p.inference),
            "--grpc-server", grpc_server,
        ]  # fmt: skip
        super().__init__(cmd, p)
