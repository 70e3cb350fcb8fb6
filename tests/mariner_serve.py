"""`mariner serve` for the tests, exactly as users run it: a subprocess on loopback ports.

The supervisor, its frontends and the model worker processes are the production assembly;
the tests talk to them over real sockets. Settings are ServerConfig fields, written to a YAML
config file (`--config-file`, the same keys a user's file has); every address is
`127.0.0.1:0` unless a test says otherwise, and the ports the supervisor bound are read from
its start-up log line. `start()` waits until start-up has settled (every model READY or
FAILED, the supervisor's "models ready" line) and, when every model is ready, until the
frontend's /readyz answers 200: an event, never a fixed sleep.
"""

from __future__ import annotations

import ast
import contextlib
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import requests
import yaml

REPO = Path(__file__).resolve().parents[1]
START_TIMEOUT_S = 300.0
_LISTENING = re.compile(r"supervisor pid (\d+): listening (\{[^}]*\}); (\d+) frontends")
_SETTLED = re.compile(r"models ready: .*\(all ready: (True|False)")
_ADDRESSES = {
    "inference_address": "inference",
    "management_address": "management",
    "metrics_address": "metrics",
    "grpc_inference_address": "grpc_inference",
    "grpc_management_address": "grpc_management",
}


class ServeFailed(AssertionError):
    """The server exited or did not settle; the message ends with its log."""


@dataclass(frozen=True)
class BoundPorts:
    inference: int
    management: int
    metrics: int
    grpc_inference: int
    grpc_management: int


def _yaml_value(value: Any) -> Any:
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, dict):
        return {k: _yaml_value(v) for k, v in value.items()}
    return value


class MarinerServe:
    """One `mariner serve` process tree (supervisor + frontends + workers) for a test."""

    def __init__(
        self,
        model_store: Path,
        models: str,
        *,
        env: dict[str, str] | None = None,
        args: tuple[str, ...] = (),
        cwd: Path | None = None,
        **settings: Any,
    ) -> None:
        self._tmp = tempfile.TemporaryDirectory(prefix="mariner-test-")
        tmp = Path(self._tmp.name)
        config = {name: "127.0.0.1:0" for name in _ADDRESSES}
        # No refusal window after the drain unless a test asks: no client of a test retries
        # elsewhere, and each stop would wait it out (a second per server here).
        config.update(
            {"model_store": str(model_store), "models": models, "grace_seconds": 20.0, "refuse_seconds": 0.0}
        )
        # One worker per model unless a test says otherwise (the archive's minWorkers or a
        # setting still wins): TorchServe's default is one per core, and ~100 servers on a
        # 2-core machine would double their processes. `default_workers_per_model=None` leaves
        # the server's own default (a YAML null sets nothing).
        config["default_workers_per_model"] = 1
        # A queue of 1,024 items unless a test says otherwise: TorchServe's default of 100 counts
        # requests, Mariner's queue counts rows (an OIP request of 3 rows takes 3), and tests that
        # fire a hundred multi-row requests at once measure batching, not the queue's limit.
        config["job_queue_size"] = 1024
        # TorchServe's token authorization off unless a test says otherwise: its key_file.json is
        # written in the working directory (the repository here), and most tests check other things.
        config["disable_token_auth"] = True
        config.update({k: _yaml_value(v) for k, v in settings.items()})
        self.config = config
        self.config_file = tmp / "mariner.yaml"
        self.config_file.write_text(yaml.safe_dump(config))
        self.log_path = tmp / "serve.log"
        # TS_* variables only from the test: a developer's TS_CONFIG_FILE must not reach every server.
        inherited = {k: v for k, v in os.environ.items() if not k.startswith("TS_")}
        # TorchServe's log files and config snapshots (LOG_LOCATION) go to this server's own
        # directory unless a test says otherwise, never into the working directory.
        self.log_location = tmp / "logs"
        self._env = {
            **inherited,
            "LOG_LOCATION": str(self.log_location),
            "METRICS_LOCATION": str(self.log_location),
            **(env or {}),
        }
        self._args = args
        # The server's working directory (where TorchServe's key_file.json goes): the repository
        # unless a test says otherwise.
        self.cwd = cwd or REPO
        self.proc: subprocess.Popen[bytes] | None = None
        self.ports: BoundPorts | None = None
        self.supervisor_pid: int | None = None
        self.all_ready: bool | None = None
        self.frontends = 0

    # -- lifecycle ----------------------------------------------------------------------------
    def start(
        self, *, settle: bool = True, require_ready: bool = True, timeout: float = START_TIMEOUT_S
    ) -> MarinerServe:
        """Start the process; return once every frontend listens and (with `settle`) start-up
        settled, every model ready unless `require_ready` is False (a test of failed models)."""
        cmd = [sys.executable, "-m", "mariner.server.cli", "serve", "--config-file", str(self.config_file)]
        self._log = self.log_path.open("wb")
        self.proc = subprocess.Popen(
            [*cmd, *self._args],
            cwd=self.cwd,
            env=self._env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # a kill of its group takes the frontends and workers too
        )
        try:
            found = self._wait_log(_LISTENING, timeout)
            self.supervisor_pid = int(found.group(1))
            ports = ast.literal_eval(found.group(2))
            self.ports = BoundPorts(**{v: ports[v] for v in _ADDRESSES.values()})
            self.frontends = int(found.group(3))
            for index in range(self.frontends):  # each listens once it applied the first table
                self._wait_log(re.compile(rf'"frontend {index} \(pid \d+\) listening"'), timeout)
            if settle and not self.wait_settled(timeout) and require_ready:
                raise ServeFailed(f"start-up settled with models not ready:\n{self.log_tail()}")
        except BaseException:
            self.stop()
            raise
        return self

    def wait_settled(self, timeout: float = START_TIMEOUT_S) -> bool:
        """Wait for the supervisor's "models ready" line; when it says all are ready, also for
        every frontend's "ready" line (each follows the supervisor's model table, and says when
        its own /readyz turns 200). True when all are ready."""
        found = self._wait_log(_SETTLED, timeout)
        self.all_ready = found.group(1) == "True"
        if self.all_ready:
            for index in range(self.frontends):
                self._wait_log(re.compile(rf'"frontend {index} ready"'), timeout)
        return self.all_ready

    def wait_http_ok(
        self, url: str, timeout: float = START_TIMEOUT_S, headers: dict[str, str] | None = None
    ) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            self._check_alive()
            with contextlib.suppress(requests.RequestException):
                if requests.get(url, timeout=2, headers=headers).status_code == 200:
                    return
            time.sleep(0.05)
        raise ServeFailed(f"{url} did not answer 200 within {timeout:.0f} s\n{self.log_tail()}")

    def stop(self, timeout: float = 60.0) -> int | None:
        """SIGTERM (the ordered drain), then SIGKILL of the whole group if it does not exit."""
        code = None
        if self.proc is not None:
            if self.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.proc.pid, signal.SIGTERM)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    code = self.proc.wait(timeout)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
            code = self.proc.returncode if code is None else code
            self._log.close()
        return code

    # -- what tests read ----------------------------------------------------------------------
    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def log_tail(self, chars: int = 4000) -> str:
        return self.log_text()[-chars:]

    def alive(self) -> MarinerServe:
        """This server, after checking its process is still running (ServeFailed with the log if
        not): what a module using a server shared with other modules checks first."""
        self._check_alive()
        return self

    def _check_alive(self) -> None:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise ServeFailed(f"mariner serve exited with {self.proc.returncode}:\n{self.log_tail()}")

    def _wait_log(self, pattern: re.Pattern[str], timeout: float) -> re.Match[str]:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            found = pattern.search(self.log_text())
            if found:
                return found
            self._check_alive()
            time.sleep(0.05)
        raise ServeFailed(f"no {pattern.pattern!r} line within {timeout:.0f} s:\n{self.log_tail()}")

    def describe(self, model: str, version: str = "all") -> list[dict[str, Any]]:
        """The management API's describe of a model (TorchServe's JSON)."""
        r = requests.get(f"{self.management}/models/{model}/{version}", timeout=30)
        assert r.status_code == 200, r.text
        return r.json()

    def served_models(self) -> list[str]:
        r = requests.get(f"{self.management}/models", timeout=30)
        assert r.status_code == 200, r.text
        return [m["modelName"] for m in r.json()["models"]]

    def worker_pids(self, model: str) -> list[int]:
        """The pids of the model's (default version's) worker processes, from describe."""
        desc = next(d for d in self.describe(model) if d["mariner"]["isDefault"])
        return [int(w["pid"]) for w in desc["workers"] if w.get("pid")]

    def frontend_pids(self) -> list[int]:
        """The frontend processes (children of the supervisor running mariner.server.frontend.main)."""
        import psutil

        assert self.supervisor_pid is not None
        return [
            c.pid
            for c in psutil.Process(self.supervisor_pid).children()
            if "mariner.server.frontend.main" in " ".join(c.cmdline())
        ]

    def open_connections(self, port: int | None = None) -> int:
        """TCP connections the frontends hold open on `port` (the HTTP inference port by default):
        established, or closed by the client and not yet by the server."""
        import psutil

        assert self.ports is not None
        port = port or self.ports.inference
        held = ("ESTABLISHED", "CLOSE_WAIT")
        return sum(
            1
            for pid in self.frontend_pids()
            for c in psutil.Process(pid).net_connections(kind="tcp")
            if c.laddr and c.laddr.port == port and c.status in held
        )

    @property
    def http(self) -> str:
        assert self.ports is not None
        return f"http://127.0.0.1:{self.ports.inference}"

    @property
    def management(self) -> str:
        assert self.ports is not None
        return f"http://127.0.0.1:{self.ports.management}"

    @property
    def metrics(self) -> str:
        assert self.ports is not None
        return f"http://127.0.0.1:{self.ports.metrics}"

    @property
    def grpc_target(self) -> str:
        assert self.ports is not None
        return f"127.0.0.1:{self.ports.grpc_inference}"

    @property
    def grpc_management_target(self) -> str:
        assert self.ports is not None
        return f"127.0.0.1:{self.ports.grpc_management}"

    def __enter__(self) -> MarinerServe:
        return self.start() if self.proc is None else self

    def __exit__(self, *exc: object) -> None:
        self.stop()
        self._tmp.cleanup()
