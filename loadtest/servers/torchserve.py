"""Start and stop stock TorchServe 0.12 on 127.0.0.1: the oracle and the baseline Mariner is held to.

Tests use it to check that an archive behaves the same on stock TorchServe and on Mariner, and the
benchmark uses it as the side-by-side baseline; `make serve-torchserve` runs `serve()` at the bottom
(through `python -m mariner.loadtest.bench serve-torchserve`). It speaks the vocabulary of every
server here (`mariner.loadtest.servers.process.ServerProcess`).

Things stock TorchServe does that this module works around (each one cost time to find):

* The `torchserve` launcher keeps a pid file in the system temp dir and refuses to start while
  another TorchServe on the machine owns it. Each instance here gets a private `TMPDIR`, so two
  users of this module (or a developer's own TorchServe) never collide.
* Logs, metrics logs and extracted archives go to `LOG_LOCATION`, `METRICS_LOCATION` and
  `java.io.tmpdir` (from `TEMP`); all three point into the private temp dir, so nothing lands in
  the repository and `stop()` removes everything.
* Workers run `--python` of the launcher (the frontend's `python` config key is overwritten by
  it), so the launcher is run as `<python> -m ts.model_server`, the exact entry point of the
  `torchserve` console script, with this interpreter: workers then import torch and the handler's
  dependencies from the same virtualenv, whatever `python` is on PATH.
* An archive's `model-config.yaml` (`batchSize`, `maxBatchDelay`) wins over the
  `models={...}` key of config.properties for models loaded at startup (`load_models`): the
  frontend only consults the config when the archive says nothing. Explicit values on the
  management API's register call win over both, so when `batch_size` or `max_batch_delay_ms` is
  given the models are registered through that API (which then has to be enabled) instead of
  `load_models`. `models={...}` is still written, for archives that carry no settings.
* `/ping` says Healthy before the gRPC ports accept connections and before workers are up, so
  readiness also waits for a READY worker on every model and for both gRPC ports.
* `--foreground` keeps the launcher attached, and the launcher, the Java frontend and the Python
  workers share the process group created here; stopping signals the whole group.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import psutil
import requests

from mariner.loadtest.servers.archives import resolve_models
from mariner.loadtest.servers.leftovers import GUARD_SOURCE, processes_mentioning
from mariner.loadtest.servers.process import LOCALHOST, Ports, ServerError, ServerProcess, port_accepts

POLL_INTERVAL_S = 0.2
HTTP_TIMEOUT_S = 2.0


class StockTorchServe(ServerProcess):
    """One stock TorchServe, private to its owner: own ports, temp dir, logs and process group.

    Use as a context manager (`with StockTorchServe(...) as ts:`) or call start() and stop();
    stop() is idempotent and also runs at interpreter exit, so no TorchServe or Java process
    outlives its owner.
    """

    title = "stock TorchServe"
    workdir_prefix = "stock-torchserve-"

    def __init__(
        self,
        model_store: Path,
        models: str | Sequence[str] = "all",
        *,
        batch_size: int | None = None,
        max_batch_delay_ms: int | None = None,
        workers: int = 1,
        response_timeout_s: int | None = None,
        ports: Ports | None = None,
        host: str = LOCALHOST,
        python: Path | None = None,
        system_metrics: bool = False,
        max_worker_restarts: int | None = 3,
        temp_root: Path | None = None,
        extra_config: Mapping[str, str] | None = None,
    ) -> None:
        """Nothing is started here; archives are resolved now so a typo fails before Java starts.

        ports=None picks free ports (for tests); pass Ports.defaults() for the usual
        ones. system_metrics=False disables TorchServe's per-minute system-metrics subprocess,
        which perturbs latency measurements on a small machine. extra_config entries are written
        last into config.properties and override anything this class sets.
        max_worker_restarts: TorchServe restarts a worker whose handler fails to load forever
        (with backoff), so start() gives up, with the log tail, after that many restarts instead
        of waiting for its timeout; None waits. temp_root: where the private temp dir is made
        (default: the system temp dir); tests pass their tmp_path to check for leftovers.
        """
        if workers < 1:
            raise ValueError("workers must be >= 1")
        if batch_size is not None and batch_size < 1:
            raise ValueError("batch_size must be >= 1")
        if max_batch_delay_ms is not None and max_batch_delay_ms < 0:
            raise ValueError("max_batch_delay_ms must be >= 0")
        self.model_store = Path(model_store).resolve()
        if not self.model_store.is_dir():
            raise ServerError(f"model store {self.model_store} does not exist (run `make models`)")
        self._load_all = isinstance(models, str) and models.strip() == "all"
        self.archives = resolve_models(self.model_store, models)
        self.batch_size = batch_size
        self.max_batch_delay_ms = max_batch_delay_ms
        self.workers = workers
        self.response_timeout_s = response_timeout_s
        super().__init__(ports, host=host, temp_root=temp_root)
        self.python = Path(python) if python is not None else Path(sys.executable)
        self.system_metrics = system_metrics
        self.max_worker_restarts = max_worker_restarts
        self.extra_config = dict(extra_config or {})
        self._short_tmp: Path | None = None  # TMPDIR/TEMP when the workdir's path is too long
        self._guard: subprocess.Popen[bytes] | None = None

    @property
    def model_names(self) -> list[str]:
        return [a.name for a in self.archives]

    @property
    def log_dir(self) -> Path | None:
        return None if self.workdir is None else self.workdir / "logs"

    def cleanup(self, grace_s: float) -> None:
        """The guard goes once the group is gone; the short temp dir (if any) with the workdir."""
        if self._guard is not None:
            try:
                self._guard.communicate(timeout=grace_s)  # EOF: it finds the group gone and exits
            except subprocess.TimeoutExpired:
                self._guard.kill()
                self._guard.wait()
            self._guard = None
        if self._short_tmp is not None:
            shutil.rmtree(self._short_tmp, ignore_errors=True)
            self._short_tmp = None

    @property
    def temp_dir(self) -> Path | None:
        """TorchServe's TMPDIR and java.io.tmpdir: the workdir, or a short private dir beside it.

        The frontend reaches each worker over a Unix socket `<java.io.tmpdir>/.ts.sock.<port>`;
        a socket path is limited to 107 bytes, so a long temp root (a test's tmp_path, a deep
        TMPDIR) would make every worker fail to bind.
        """
        return self._short_tmp or self.workdir

    def log_files(self) -> list[Path]:
        """The launcher/frontend console and the workers' model_log."""
        if self.workdir is None:
            return []
        return [self.workdir / "console.log", self.workdir / "logs" / "model_log.log"]

    # -- internals -------------------------------------------------------------------------
    @property
    def _register_via_api(self) -> bool:
        # Explicit batching settings only take effect through the management API (module doc).
        return self.batch_size is not None or self.max_batch_delay_ms is not None

    def config_properties(self) -> dict[str, str]:
        """The config.properties entries this instance runs with (public for tests and docs)."""
        assert self.workdir is not None
        models: dict[str, dict[str, dict[str, Any]]] = {}
        for a in self.archives:
            entry: dict[str, Any] = {
                "defaultVersion": True,
                "marName": a.file,
                "minWorkers": self.workers,
                "maxWorkers": self.workers,
            }
            if self.batch_size is not None:
                entry["batchSize"] = self.batch_size
            if self.max_batch_delay_ms is not None:
                entry["maxBatchDelay"] = self.max_batch_delay_ms
            if self.response_timeout_s is not None:
                entry["responseTimeout"] = self.response_timeout_s
            models[a.name] = {a.version: entry}
        if self._register_via_api:
            load_models = ""
        elif self._load_all:
            load_models = "all"
        else:
            load_models = ",".join(f"{a.name}={a.file}" for a in self.archives)
        props = {
            "inference_address": self.http_url,
            "management_address": self.management_url,
            "metrics_address": self.metrics_url,
            "grpc_inference_address": self.host,
            "grpc_management_address": self.host,
            "grpc_inference_port": str(self.ports.grpc_inference),
            "grpc_management_port": str(self.ports.grpc_management),
            "model_store": str(self.model_store),
            "load_models": load_models,
            "models": json.dumps(models, separators=(",", ":")),
            "metrics_mode": "prometheus",
            "disable_token_authorization": "true",
            "enable_model_api": "true" if self._register_via_api else "false",
            "default_workers_per_model": str(self.workers),
            "install_py_dep_per_model": "false",
            "disable_system_metrics": "false" if self.system_metrics else "true",
            # Documentary: the launcher's --python (this interpreter) overrides this key.
            "python": str(self.python),
        }
        if self.response_timeout_s is not None:
            props["default_response_timeout"] = str(self.response_timeout_s)
        props.update(self.extra_config)
        return props

    def prepare(self) -> None:
        assert self.workdir is not None
        if len(str(self.workdir / ".ts.sock.65535")) > SOCKET_PATH_MAX:
            self._short_tmp = Path(tempfile.mkdtemp(prefix="ts-", dir=_short_temp_root())).resolve()
        (self.workdir / "logs").mkdir()
        config = self.workdir / "config.properties"
        config.write_text("".join(f"{k}={v}\n" for k, v in self.config_properties().items()))

    def environment(self) -> dict[str, str]:
        assert self.workdir is not None
        logs = self.workdir / "logs"
        env = {k: v for k, v in os.environ.items() if not k.startswith("TS_")}  # TS_CONFIG_FILE etc.
        env.update(
            LOG_LOCATION=str(logs),
            METRICS_LOCATION=str(logs),
            TMPDIR=str(self.temp_dir),  # the launcher's pid file: private per instance
            TEMP=str(self.temp_dir),  # java.io.tmpdir: archives are extracted, worker sockets live here
            PATH=f"{self.python.parent}{os.pathsep}{env.get('PATH', '')}",
        )
        return env

    def cwd(self) -> Path | None:
        return self.workdir

    def command(self) -> list[str]:
        assert self.workdir is not None
        cmd = [
            str(self.python),
            "-m",
            "ts.model_server",
            "--start",
            "--foreground",
            "--ncs",
            "--disable-token-auth",
            "--model-store",
            str(self.model_store),
            "--ts-config",
            str(self.workdir / "config.properties"),
        ]
        if self._register_via_api:
            cmd.append("--enable-model-api")
        return cmd

    def launched(self) -> None:
        assert self.proc is not None
        assert self.workdir is not None
        self._guard = subprocess.Popen(
            [str(self.python), "-c", GUARD_SOURCE, str(self.proc.pid), str(self.workdir)],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # a Ctrl-C meant for the owner must not take the guard down
        )

    def _check_alive(self) -> None:
        if self.proc is not None and self.proc.poll() is not None:
            # The launcher exits 0 even when Java failed; the log tail says why.
            raise self.fail(f"exited while starting (launcher exit code {self.proc.returncode})")
        restarts = self._worker_restarts()
        if self.max_worker_restarts is not None and restarts >= self.max_worker_restarts:
            raise self.fail(f"restarted dying workers {restarts} times; a handler fails to load")

    def _worker_restarts(self) -> int:
        # The frontend logs this line (ts_log, on the console) each time it schedules a restart.
        console = None if self.workdir is None else self.workdir / "console.log"
        if console is None or not console.exists():
            return 0
        return console.read_bytes().count(b"Retry worker: ")

    def wait_ready(self, deadline: float) -> None:
        self._poll_until(deadline, self._pinged, "did not answer /ping with Healthy")
        if self._register_via_api:
            self._register_models()
        self._poll_until(deadline, self._models_ready, "did not get a READY worker for every model")
        self._poll_until(
            deadline,
            lambda: all(
                port_accepts(self.host, p) for p in (self.ports.grpc_inference, self.ports.grpc_management)
            ),
            "did not open its gRPC ports",
        )

    def _poll_until(self, deadline: float, ready: Callable[[], bool], what: str) -> None:
        while True:
            self._check_alive()
            if ready():
                return
            if time.monotonic() > deadline:
                raise self.fail(f"{what} in time ({self._status_summary()})")
            time.sleep(POLL_INTERVAL_S)

    def _pinged(self) -> bool:
        try:
            r = requests.get(f"{self.http_url}/ping", timeout=HTTP_TIMEOUT_S)
        except requests.RequestException:
            return False
        return r.status_code == 200 and r.json().get("status") == "Healthy"

    def _register_models(self) -> None:
        for a in self.archives:
            params: dict[str, str | int] = {
                "url": a.file,
                "model_name": a.name,
                "initial_workers": self.workers,
                "synchronous": "false",  # register all at once; readiness is polled afterwards
            }
            if self.batch_size is not None:
                params["batch_size"] = self.batch_size
            if self.max_batch_delay_ms is not None:
                params["max_batch_delay"] = self.max_batch_delay_ms
            if self.response_timeout_s is not None:
                params["response_timeout"] = self.response_timeout_s
            r = requests.post(f"{self.management_url}/models", params=params, timeout=60)
            if r.status_code not in (200, 202):
                raise self.fail(f"refused to register {a.file}: HTTP {r.status_code} {r.text.strip()}")

    def describe(self, model: str) -> list[dict[str, Any]]:
        """Management API's description of a model: versions, batchSize, maxBatchDelay, workers."""
        r = requests.get(f"{self.management_url}/models/{model}", timeout=HTTP_TIMEOUT_S)
        r.raise_for_status()
        out: list[dict[str, Any]] = r.json()
        return out

    def _models_ready(self) -> bool:
        try:
            for name in self.model_names:
                versions = self.describe(name)
                workers = [w for v in versions for w in v.get("workers", [])]
                if not workers or any(w.get("status") != "READY" for w in workers):
                    return False
        except (requests.RequestException, ValueError):
            return False
        return True

    def _status_summary(self) -> str:
        states = []
        for name in self.model_names:
            try:
                workers = [w for v in self.describe(name) for w in v.get("workers", [])]
                states.append(f"{name}: {[w.get('status') for w in workers] or 'no workers'}")
            except (requests.RequestException, ValueError):
                states.append(f"{name}: not registered")
        return "; ".join(states)

    def terminate(self, proc: subprocess.Popen[bytes], grace_s: float) -> None:
        """SIGTERM the process group (launcher, Java, workers), SIGKILL what is left after grace_s.

        Descendants are collected before signalling, so a worker that left the group (none does
        in 0.12, but a handler could) is still found and killed.
        """
        workdir = self.workdir
        try:
            launcher = psutil.Process(proc.pid)
            members = [launcher, *launcher.children(recursive=True)]
        except psutil.NoSuchProcess:
            members = []
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGTERM)
        for p in members:  # anything that left the group
            with contextlib.suppress(psutil.Error):
                p.terminate()
        _, alive = psutil.wait_procs(members, timeout=grace_s)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        # Last sweep: whatever still names the private workdir on its command line (the Java
        # frontend's config path, the workers' socket paths) is ours, even if it was orphaned.
        alive += processes_mentioning(workdir) if workdir is not None else []
        for p in alive:
            with contextlib.suppress(psutil.Error):
                p.kill()
        psutil.wait_procs(alive, timeout=5)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5)


SOCKET_PATH_MAX = 100  # below sun_path's 107 usable bytes, with room for a longer port suffix


def _short_temp_root() -> str:
    """A temp root short enough for Unix socket paths: /tmp where it exists, else the default."""
    short = Path("/tmp")
    return str(short) if short.is_dir() and os.access(short, os.W_OK) else tempfile.gettempdir()
