"""Start and stop stock TorchServe 0.12 on 127.0.0.1: the oracle and the baseline Mariner is held to.

Tests use it to check that an archive behaves the same on stock TorchServe and on Mariner, and the
benchmark uses it as the side-by-side baseline; `make serve` runs the CLI at the bottom.

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

import argparse
import atexit
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import IO, Any, Self

import psutil
import requests

LOCALHOST = "127.0.0.1"
POLL_INTERVAL_S = 0.2
HTTP_TIMEOUT_S = 2.0

# Run by a watchdog process in its own session, reading a pipe only the owner holds. EOF means
# the owner called stop() or died in a way no cleanup code survives (SIGKILL, OOM): either way
# the TorchServe process group is terminated and the temp dir removed, so Java never outlives us.
_GUARD_SOURCE = """
import os, shutil, signal, sys, time
pgid, workdir = int(sys.argv[1]), sys.argv[2]
sys.stdin.buffer.read()
for sig, grace in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 0.0)):
    deadline = time.monotonic() + grace
    try:
        os.killpg(pgid, sig)
        while time.monotonic() < deadline:
            time.sleep(0.2)
            os.killpg(pgid, 0)
    except ProcessLookupError:
        break
shutil.rmtree(workdir, ignore_errors=True)
"""


@dataclass(frozen=True)
class TorchServePorts:
    """The five listeners of a TorchServe instance."""

    inference: int
    management: int
    metrics: int
    grpc_inference: int
    grpc_management: int

    @classmethod
    def defaults(cls) -> TorchServePorts:
        """TorchServe's documented defaults, which Mariner also uses (8080/8081/8082/7070/7071)."""
        return cls(inference=8080, management=8081, metrics=8082, grpc_inference=7070, grpc_management=7071)

    def all(self) -> tuple[int, ...]:
        return (self.inference, self.management, self.metrics, self.grpc_inference, self.grpc_management)


def pick_free_ports(host: str = LOCALHOST) -> TorchServePorts:
    """Five distinct ports the kernel calls free right now.

    All five sockets are held open until every port is chosen, so the kernel cannot hand out the
    same port twice. Another process can still grab one before TorchServe binds it; start()
    reports that as a port clash with the log tail.
    """
    with contextlib.ExitStack() as stack:
        ports: list[int] = []
        for _ in range(5):
            sock = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            sock.bind((host, 0))
            ports.append(int(sock.getsockname()[1]))
    return TorchServePorts(*ports)


def _port_is_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def _port_accepts(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


@dataclass(frozen=True)
class ArchiveInfo:
    """What TorchServe will call a model, read from the archive's MAR-INF/MANIFEST.json."""

    name: str
    version: str
    file: str  # file name inside the model store, e.g. "digits_onnx.mar"


def read_archive(path: Path) -> ArchiveInfo:
    """Name and version from the manifest, which is what TorchServe registers the model under."""
    try:
        with zipfile.ZipFile(path) as zf:
            manifest = json.loads(zf.read("MAR-INF/MANIFEST.json"))
    except (OSError, KeyError, zipfile.BadZipFile, json.JSONDecodeError) as exc:
        raise TorchServeError(f"{path} is not a readable .mar archive with a manifest: {exc}") from exc
    model = manifest.get("model") or {}
    return ArchiveInfo(
        name=str(model.get("modelName") or path.stem),
        version=str(model.get("modelVersion") or "1.0"),
        file=path.name,
    )


def resolve_models(model_store: Path, models: str | Sequence[str]) -> list[ArchiveInfo]:
    """Archives for `models`: 'all', comma-separated names, or a list (names with or without .mar)."""
    if isinstance(models, str):
        wanted = [m.strip() for m in models.split(",") if m.strip()]
    else:
        wanted = [str(m).strip() for m in models]
    if not wanted:
        raise TorchServeError("no models given: pass 'all' or archive names")
    if wanted == ["all"]:
        paths = sorted(model_store.glob("*.mar"))
        if not paths:
            raise TorchServeError(f"no .mar archives in {model_store} (run `make models`)")
    else:
        paths = []
        for name in wanted:
            path = model_store / (name if name.endswith(".mar") else f"{name}.mar")
            if not path.is_file():
                have = ", ".join(p.stem for p in sorted(model_store.glob("*.mar"))) or "none"
                raise TorchServeError(f"archive {path} not found; archives in the store: {have}")
            paths.append(path)
    return [read_archive(p) for p in paths]


class TorchServeError(RuntimeError):
    """TorchServe could not be started, or died; the message carries the tail of its logs."""


class StockTorchServe:
    """One stock TorchServe, private to its owner: own ports, temp dir, logs and process group.

    Use as a context manager (`with StockTorchServe(...) as ts:`) or call start() and stop();
    stop() is idempotent and also runs at interpreter exit, so no TorchServe or Java process
    outlives its owner.
    """

    def __init__(
        self,
        model_store: Path,
        models: str | Sequence[str] = "all",
        *,
        batch_size: int | None = None,
        max_batch_delay_ms: int | None = None,
        workers: int = 1,
        response_timeout_s: int | None = None,
        ports: TorchServePorts | None = None,
        host: str = LOCALHOST,
        python: Path | None = None,
        system_metrics: bool = False,
        max_worker_restarts: int | None = 3,
        temp_root: Path | None = None,
        extra_config: Mapping[str, str] | None = None,
    ) -> None:
        """Nothing is started here; archives are resolved now so a typo fails before Java starts.

        ports=None picks free ports (for tests); pass TorchServePorts.defaults() for the usual
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
            raise TorchServeError(f"model store {self.model_store} does not exist (run `make models`)")
        self._load_all = isinstance(models, str) and models.strip() == "all"
        self.archives = resolve_models(self.model_store, models)
        self.batch_size = batch_size
        self.max_batch_delay_ms = max_batch_delay_ms
        self.workers = workers
        self.response_timeout_s = response_timeout_s
        self.host = host
        self.ports = ports if ports is not None else pick_free_ports(host)
        self.python = Path(python) if python is not None else Path(sys.executable)
        self.system_metrics = system_metrics
        self.max_worker_restarts = max_worker_restarts
        self.temp_root = temp_root
        self.extra_config = dict(extra_config or {})
        self.workdir: Path | None = None
        self._short_tmp: Path | None = None  # TMPDIR/TEMP when the workdir's path is too long
        self._proc: subprocess.Popen[bytes] | None = None
        self._console: IO[bytes] | None = None
        self._guard: subprocess.Popen[bytes] | None = None

    # -- addresses -------------------------------------------------------------------------
    @property
    def base_url(self) -> str:
        """Inference API, e.g. http://127.0.0.1:8080 (POST /predictions/<model>, GET /ping)."""
        return f"http://{self.host}:{self.ports.inference}"

    @property
    def management_url(self) -> str:
        return f"http://{self.host}:{self.ports.management}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.host}:{self.ports.metrics}"

    @property
    def grpc_inference_target(self) -> str:
        """host:port for a gRPC channel to org.pytorch.serve.grpc.inference.InferenceAPIsService."""
        return f"{self.host}:{self.ports.grpc_inference}"

    @property
    def grpc_management_target(self) -> str:
        return f"{self.host}:{self.ports.grpc_management}"

    @property
    def model_names(self) -> list[str]:
        return [a.name for a in self.archives]

    @property
    def pid(self) -> int | None:
        """The launcher's pid, which is also the process group of the frontend and its workers."""
        return None if self._proc is None else self._proc.pid

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def log_dir(self) -> Path | None:
        return None if self.workdir is None else self.workdir / "logs"

    # -- lifecycle -------------------------------------------------------------------------
    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def start(self, timeout: float = 180.0) -> Self:
        """Launch TorchServe and return once every model answers; raise TorchServeError otherwise.

        On any failure (including Ctrl-C while waiting) everything started is stopped again.
        """
        if self._proc is not None:
            raise TorchServeError("this TorchServe is already started")
        busy = [p for p in self.ports.all() if not _port_is_free(self.host, p)]
        if busy:
            raise TorchServeError(
                f"port(s) {busy} on {self.host} are in use; stop what holds them or choose other ports"
            )
        self.workdir = Path(tempfile.mkdtemp(prefix="stock-torchserve-", dir=self.temp_root)).resolve()
        atexit.register(self.stop)
        if len(str(self.workdir / ".ts.sock.65535")) > SOCKET_PATH_MAX:
            self._short_tmp = Path(tempfile.mkdtemp(prefix="ts-", dir=_short_temp_root())).resolve()
        try:
            self._launch()
            self._wait_ready(time.monotonic() + timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM the process group (launcher, Java, workers), SIGKILL what is left after grace_s.

        Descendants are collected before signalling, so a worker that left the group (none does
        in 0.12, but a handler could) is still found and killed. The temp dir is removed last.
        """
        # State is cleared only after each step, so a stop() cut short (a second Ctrl-C) can be
        # repeated and still finds the process group.
        if self._proc is not None:
            self._kill_tree(self._proc, grace_s, self.workdir)
            self._proc = None
        if self._guard is not None:
            try:
                self._guard.communicate(timeout=grace_s)  # EOF: it finds the group gone and exits
            except subprocess.TimeoutExpired:
                self._guard.kill()
                self._guard.wait()
            self._guard = None
        if self._console is not None:
            self._console.close()
            self._console = None
        if self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)
            self.workdir = None
        if self._short_tmp is not None:
            shutil.rmtree(self._short_tmp, ignore_errors=True)
            self._short_tmp = None
        atexit.unregister(self.stop)

    @property
    def temp_dir(self) -> Path | None:
        """TorchServe's TMPDIR and java.io.tmpdir: the workdir, or a short private dir beside it.

        The frontend reaches each worker over a Unix socket `<java.io.tmpdir>/.ts.sock.<port>`;
        a socket path is limited to 107 bytes, so a long temp root (a test's tmp_path, a deep
        TMPDIR) would make every worker fail to bind.
        """
        return self._short_tmp or self.workdir

    def log_tail(self, lines: int = 60) -> str:
        """Last lines of the launcher/frontend console and of the workers' model_log."""
        if self.workdir is None:
            return "(no logs: TorchServe is not started)"
        parts = []
        for path in (self.workdir / "console.log", self.workdir / "logs" / "model_log.log"):
            if path.exists():
                text = path.read_text(errors="replace").splitlines()[-lines:]
                parts.append(f"--- {path.name} (last {len(text)} lines) ---\n" + "\n".join(text))
        return "\n".join(parts) or "(TorchServe wrote no logs)"

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
            "inference_address": self.base_url,
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

    def _launch(self) -> None:
        assert self.workdir is not None
        logs = self.workdir / "logs"
        logs.mkdir()
        config = self.workdir / "config.properties"
        config.write_text("".join(f"{k}={v}\n" for k, v in self.config_properties().items()))
        env = {k: v for k, v in os.environ.items() if not k.startswith("TS_")}  # TS_CONFIG_FILE etc.
        env.update(
            LOG_LOCATION=str(logs),
            METRICS_LOCATION=str(logs),
            TMPDIR=str(self.temp_dir),  # the launcher's pid file: private per instance
            TEMP=str(self.temp_dir),  # java.io.tmpdir: archives are extracted, worker sockets live here
            PATH=f"{self.python.parent}{os.pathsep}{env.get('PATH', '')}",
        )
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
            str(config),
        ]
        if self._register_via_api:
            cmd.append("--enable-model-api")
        self._console = (self.workdir / "console.log").open("wb")
        self._proc = subprocess.Popen(
            cmd,
            cwd=self.workdir,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=self._console,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # own process group: stop() signals launcher, Java and workers
        )
        self._guard = subprocess.Popen(
            [str(self.python), "-c", _GUARD_SOURCE, str(self._proc.pid), str(self.workdir)],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # a Ctrl-C meant for the owner must not take the guard down
        )

    def _fail(self, why: str) -> TorchServeError:
        return TorchServeError(f"stock TorchServe {why}\n{self.log_tail()}")

    def _check_alive(self) -> None:
        if self._proc is not None and self._proc.poll() is not None:
            # The launcher exits 0 even when Java failed; the log tail says why.
            raise self._fail(f"exited while starting (launcher exit code {self._proc.returncode})")
        restarts = self._worker_restarts()
        if self.max_worker_restarts is not None and restarts >= self.max_worker_restarts:
            raise self._fail(f"restarted dying workers {restarts} times; a handler fails to load")

    def _worker_restarts(self) -> int:
        # The frontend logs this line (ts_log, on the console) each time it schedules a restart.
        console = None if self.workdir is None else self.workdir / "console.log"
        if console is None or not console.exists():
            return 0
        return console.read_bytes().count(b"Retry worker: ")

    def _wait_ready(self, deadline: float) -> None:
        self._poll_until(deadline, self._pinged, "did not answer /ping with Healthy")
        if self._register_via_api:
            self._register_models()
        self._poll_until(deadline, self._models_ready, "did not get a READY worker for every model")
        self._poll_until(
            deadline,
            lambda: all(
                _port_accepts(self.host, p) for p in (self.ports.grpc_inference, self.ports.grpc_management)
            ),
            "did not open its gRPC ports",
        )

    def _poll_until(self, deadline: float, ready: Callable[[], bool], what: str) -> None:
        while True:
            self._check_alive()
            if ready():
                return
            if time.monotonic() > deadline:
                raise self._fail(f"{what} in time ({self._status_summary()})")
            time.sleep(POLL_INTERVAL_S)

    def _pinged(self) -> bool:
        try:
            r = requests.get(f"{self.base_url}/ping", timeout=HTTP_TIMEOUT_S)
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
                raise self._fail(f"refused to register {a.file}: HTTP {r.status_code} {r.text.strip()}")

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

    @staticmethod
    def _kill_tree(proc: subprocess.Popen[bytes], grace_s: float, workdir: Path | None) -> None:
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
        alive += _processes_mentioning(workdir) if workdir is not None else []
        for p in alive:
            with contextlib.suppress(psutil.Error):
                p.kill()
        psutil.wait_procs(alive, timeout=5)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5)


def _processes_mentioning(path: Path) -> list[psutil.Process]:
    """TorchServe processes (launcher, Java frontend, workers) whose command line names path.

    Matching on the private workdir finds an instance's processes even after they were orphaned;
    requiring a TorchServe marker too keeps, say, a `tail -f` of its log out of it.
    """
    needle = str(path)
    found = []
    for p in psutil.process_iter(["cmdline", "status"]):
        with contextlib.suppress(psutil.Error):
            cmdline = " ".join(p.info["cmdline"] or [])
            if (
                p.pid != os.getpid()
                and p.info["status"] != psutil.STATUS_ZOMBIE
                and needle in cmdline
                and any(marker in cmdline for marker in _TORCHSERVE_MARKERS)
            ):
                found.append(p)
    return found


SOCKET_PATH_MAX = 100  # below sun_path's 107 usable bytes, with room for a longer port suffix


def _short_temp_root() -> str:
    """A temp root short enough for Unix socket paths: /tmp where it exists, else the default."""
    short = Path("/tmp")
    return str(short) if short.is_dir() and os.access(short, os.W_OK) else tempfile.gettempdir()


_TORCHSERVE_MARKERS = ("ts.model_server", "org.pytorch.serve.ModelServer", "model_service_worker")


def leftover_processes(path: Path) -> list[int]:
    """Pids of TorchServe processes whose command line names path (an instance's workdir or the
    temp_root it was made in) that are still running; empty after stop()."""
    return [p.pid for p in _processes_mentioning(path)]


# -- CLI: `make serve` -----------------------------------------------------------------------
def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m mariner.loadtest.stock_torchserve",
        description="Serve .mar archives with stock TorchServe 0.12 on 127.0.0.1 until Ctrl-C.",
    )
    parser.add_argument("--model-store", type=Path, default=Path("model_store"))
    parser.add_argument("--models", default="all", help="'all' or comma-separated archive names")
    parser.add_argument("--batch-size", type=int, default=None, help="override the archives' batchSize")
    parser.add_argument(
        "--max-batch-delay", type=int, default=None, help="override the archives' maxBatchDelay (ms)"
    )
    parser.add_argument("--workers", type=int, default=1, help="workers per model")
    parser.add_argument(
        "--free-ports", action="store_true", help="pick free ports instead of 8080/8081/8082/7070/7071"
    )
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for readiness")
    return parser.parse_args(argv)


def _interrupt(signum: int, _frame: object) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


def main(argv: Sequence[str] | None = None) -> int:
    """Start, print the URLs, wait for SIGINT/SIGTERM, stop. Exit 1 if TorchServe fails or dies."""
    args = _parse_args(argv)
    try:
        ts = StockTorchServe(
            args.model_store,
            args.models,
            batch_size=args.batch_size,
            max_batch_delay_ms=args.max_batch_delay,
            workers=args.workers,
            ports=None if args.free_ports else TorchServePorts.defaults(),
        )
    except TorchServeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    # Both signals take the Ctrl-C path, also while start() is still waiting (it cleans up on
    # KeyboardInterrupt). Installing the SIGINT handler explicitly matters: a shell starts
    # background jobs with SIGINT ignored, and Python would inherit that.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _interrupt)
    print(f"starting stock TorchServe with {', '.join(ts.model_names)} ...", flush=True)
    try:
        ts.start(timeout=args.timeout)
        print(
            f"inference   {ts.base_url}   (POST /predictions/<model>)\n"
            f"management  {ts.management_url}\n"
            f"metrics     {ts.metrics_url}/metrics\n"
            f"gRPC        {ts.grpc_inference_target} (inference), {ts.grpc_management_target} (management)\n"
            f"models      {', '.join(ts.model_names)}\n"
            f"logs        {ts.log_dir}\n"
            "Ctrl-C to stop",
            flush=True,
        )
        while ts.running:
            time.sleep(1.0)
        print(f"error: TorchServe exited on its own\n{ts.log_tail()}", file=sys.stderr)
        return 1
    except TorchServeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        # A second Ctrl-C must not cut the cleanup short and orphan Java; stop() is bounded.
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)
        ts.stop()
        print("stopped", flush=True)


if __name__ == "__main__":
    sys.exit(main())
