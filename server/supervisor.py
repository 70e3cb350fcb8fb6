"""`mariner serve`: the supervisor. It runs no model code and answers no inference call.

It reads the config, opens and checks every archive (a bad one is logged and reported, the
others serve), reserves the inference ports, starts `minWorkers` model worker processes per
model version and `--frontends` frontend processes (fresh interpreters, never fork), tells
every frontend where the workers are (a `ModelTable` over its control channel, at start and
after every change), restarts any child that dies with exponential backoff, and serves the
control plane: management (REST 8081, gRPC 7071), health of the whole server on the management
port, and `/metrics` (8082) merged over every process by prometheus_client's multiprocess mode.

Shutdown (SIGTERM/SIGINT): not ready; SIGTERM to every frontend, each of which refuses new
calls and answers every accepted one; then the workers stop; then the supervisor exits 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from grpc_health.v1 import health_pb2
from grpc_health.v1.health import aio as health_aio
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from mariner.server.app import (
    _EmbeddedUvicorn,
    _split,
    _uvicorn_config,
    check_exposure,
)
from mariner.server.config import ServerConfig, frontend_count, model_specs, pinned_digests, server_layers
from mariner.server.control import channel, health
from mariner.server.control.management_http import management_app
from mariner.server.control.metrics import Metrics, MetricsConfig, MultiprocessMetrics
from mariner.server.control.metrics_http import metrics_app
from mariner.server.core.archive import ArchiveLimits, ModelArchive, open_archive, resolve_in_store
from mariner.server.core.dataplane import ModelSpec
from mariner.server.core.errors import Code, ServingError
from mariner.server.core.model_settings import (
    ModelSettings,
    SettingsOverrides,
    archive_overrides,
    resolve_model_settings,
)
from mariner.server.core.tensors import ModelSignature
from mariner.server.core.types import ModelInfo, ModelState, WorkerInfo
from mariner.server.protocols.grpc_listener import bind_port, build_management_server
from mariner.server.protocols.http_common import json_response
from mariner.server.security import OPEN_HTTP_HEALTH_PATHS, GrpcTokenAuth, HttpTokenAuth, grpc_credentials
from mariner.server.workers.api import ModelEntry, WorkerEndpoint, WorkerSpec
from mariner.server.workers.process import socket_dir_for, socket_path_for

log = logging.getLogger("mariner.supervisor")

WORKER_START_TIMEOUT_S = 300.0  # torch import + handler initialise on a loaded machine
FIRST_BACKOFF_S = 0.2
MAX_BACKOFF_S = 30.0
STABLE_AFTER_S = 30.0  # a child that ran this long starts its next restart at the first backoff
TABLE_ACK_TIMEOUT_S = 10.0


def _mark_dead(pid: int | None) -> None:
    """Drop a dead process's live gauges from the merged metrics (multiprocess mode only)."""
    if pid is None or not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        return
    from prometheus_client import multiprocess

    with contextlib.suppress(OSError):
        multiprocess.mark_process_dead(pid)


def visible_gpus() -> int:
    """GPUs the workers may use, without initialising CUDA in the supervisor.

    `CUDA_VISIBLE_DEVICES` when it is set, else the devices `nvidia-smi -L` lists, else none.
    """
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        ids = [d for d in env.split(",") if d.strip()]
        return 0 if not ids or ids[0].strip() == "-1" else len(ids)
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return 0
    import subprocess

    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=10, check=False).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(1 for line in out.splitlines() if line.startswith("GPU "))


def _resident_bytes(pid: int | None) -> int | None:
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/statm", "rb") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def reserve_port(address: str) -> socket.socket:
    """Bind (without listening) a SO_REUSEPORT socket on `address`; port 0 picks a free one.

    The frontends listen on the same port with SO_REUSEPORT; this socket keeps the port ours
    while a frontend restarts (the kernel lets only sockets of the same user with SO_REUSEPORT
    share it, so a foreign server cannot take it), and resolves port 0 before they start.
    A port that another server holds fails here, before anything is started.
    """
    host, port = _split(address)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise OSError(f"cannot listen on {address!r}: {exc.strerror or exc}") from exc
    return sock


# -- model workers -------------------------------------------------------------------------------
@dataclass
class _Instance:
    """One worker slot of a model version: its current process and how it is doing."""

    index: int
    generation: int = 0
    process: Any = None  # mariner.server.workers.process.WorkerProcess
    endpoint: WorkerEndpoint | None = None
    status: str = "LOADING"
    started_at: float | None = None
    retired: bool = False
    task: asyncio.Task[None] | None = None
    first: asyncio.Future[None] | None = None  # the first start's outcome


@dataclass
class _Version:
    """One model version the supervisor serves."""

    archive: ModelArchive
    spec: ModelSpec
    settings: ModelSettings
    signature: ModelSignature | None
    instances: dict[int, _Instance] = field(default_factory=dict)
    ever_ready: bool = False
    load_seconds: float | None = None
    t0: float = field(default_factory=time.perf_counter)

    @property
    def name(self) -> str:
        return self.archive.name

    @property
    def version(self) -> str:
        return self.archive.version

    @property
    def state(self) -> ModelState:
        live = [i for i in self.instances.values() if not i.retired]
        if any(i.status == "READY" for i in live):
            return ModelState.READY
        if self.ever_ready:
            return ModelState.RESTARTING
        if live and all(i.status == "FAILED" for i in live):
            return ModelState.FAILED
        return ModelState.LOADING


class ModelRegistry:
    """Every model version, its worker processes, and the management API over them.

    It provides the methods the management apps call on the single-process server's DataPlane
    (models, describe, register, unregister, scale, set_default, readiness), so the same
    management REST and gRPC apps serve both. `on_change` is called whenever what frontends
    must know changed (a worker ready or gone, a model added or removed, a new default); it
    returns once every frontend applied the change (bounded).
    """

    def __init__(
        self,
        cfg: ServerConfig,
        work_dir: Path,
        socket_dir: Path,
        metrics: Metrics,
        on_change: Callable[[], Any],
    ) -> None:
        self.cfg = cfg
        self.management_enabled = cfg.enable_model_management
        self.draining = False
        self.metrics = MultiprocessMetrics()  # what /metrics renders: every process merged
        self._own_metrics = metrics
        self._work_dir = work_dir
        self._socket_dir = socket_dir
        self._on_change = on_change
        self._versions: dict[str, dict[str, _Version]] = {}
        self._defaults: dict[str, str] = {}
        self._expected = 0
        self._gpus = visible_gpus()
        self._next_gpu = 0
        self._layers = server_layers(cfg)
        self._limits = ArchiveLimits()
        self._frontends_ok: Callable[[], bool] = lambda: True

    # -- opening ----------------------------------------------------------------------------
    def _open(self, spec: ModelSpec) -> _Version:
        path = resolve_in_store(self.cfg.model_store, spec.archive)
        archive = open_archive(
            path, self._work_dir, limits=self._limits, expected_sha256=spec.sha256, name_override=spec.name
        )
        try:
            # The one resolution, as the single-process server does it (dataplane.ModelEndpoint).
            settings = resolve_model_settings(
                SettingsOverrides(max_queue=self.cfg.max_queue),
                archive_overrides(archive.model_config, archive.path.name),
                *self._layers.for_model(archive.name, archive.version, archive.path.name),
                spec.overrides,
            )
            try:
                signature = ModelSignature.from_config(archive.model_config.get("signature"))
            except (ValueError, KeyError, TypeError) as exc:
                msg = f"archive {archive.path.name}: bad signature: {exc}"
                raise ServingError(Code.INVALID_ARGUMENT, msg) from exc
            versions = self._versions.setdefault(archive.name, {})
            if archive.version in versions:
                raise ServingError(
                    Code.INVALID_ARGUMENT, f"model {archive.name} version {archive.version} is loaded twice"
                )
        except BaseException:
            shutil.rmtree(archive.model_dir, ignore_errors=True)
            if not self._versions.get(archive.name):
                self._versions.pop(archive.name, None)
            raise
        v = _Version(archive, spec, settings, signature)
        versions[archive.version] = v
        self._defaults.setdefault(archive.name, archive.version)
        return v

    def open_models(self, specs: Sequence[ModelSpec]) -> list[_Version]:
        """Check and unpack every archive; a bad one is logged and skipped, the others serve."""
        opened = []
        for spec in specs:
            try:
                opened.append(self._open(spec))
            except ServingError as exc:
                log.error("refusing archive %s: %s", spec.archive, exc.message)
                continue
            self._expected += 1
        return opened

    # -- workers ----------------------------------------------------------------------------
    def _torch_threads(self) -> int:
        if self.cfg.torch_threads:
            return self.cfg.torch_threads
        workers = sum(len(v.instances) for vs in self._versions.values() for v in vs.values())
        return max(1, (os.cpu_count() or 1) // max(1, workers))

    def _gpu_for(self, v: _Version) -> int | None:
        if v.settings.device_type == "cpu" or not self._gpus:
            return None
        gpu = self._next_gpu % self._gpus
        self._next_gpu += 1
        return gpu

    def _spec(self, v: _Version, inst: _Instance, gpu: int | None) -> WorkerSpec:
        return WorkerSpec(
            model=v.name,
            version=v.version,
            instance=inst.index,
            generation=inst.generation,
            model_dir=str(v.archive.model_dir),
            archive_file=str(v.archive.path),
            sha256=v.archive.sha256,
            manifest=v.archive.manifest,
            model_config=v.archive.model_config,
            batch_size=v.settings.batch_size,
            gpu_id=gpu,
            torch_threads=self._torch_threads(),
            socket_path=socket_path_for(self._socket_dir, v.name, v.version, inst.index, inst.generation),
        )

    def _add_instances(self, v: _Version, count: int) -> list[_Instance]:
        added = []
        for _ in range(count):
            index = max(v.instances, default=-1) + 1
            inst = _Instance(index, first=asyncio.get_running_loop().create_future())
            # At start-up nobody awaits the first start (its failure is logged and retried).
            inst.first.add_done_callback(lambda f: f.cancelled() or f.exception())  # type: ignore[union-attr]
            v.instances[index] = inst
            added.append(inst)
        for inst in added:
            inst.task = asyncio.create_task(self._keep_running(v, inst), name=f"worker-{v.name}-{inst.index}")
        return added

    async def _keep_running(self, v: _Version, inst: _Instance) -> None:
        """Start the instance's worker; whenever it exits, restart it with exponential backoff."""
        from mariner.server.workers.process import WorkerProcess

        gpu = self._gpu_for(v)
        backoff = FIRST_BACKOFF_S
        while not inst.retired and not self.draining:
            spec = self._spec(v, inst, gpu)
            proc = WorkerProcess(spec)
            inst.process, inst.status, inst.endpoint = proc, "LOADING", None
            t0 = time.perf_counter()
            try:
                inst.endpoint = await proc.start(WORKER_START_TIMEOUT_S)
            except (ServingError, OSError) as exc:
                reason = exc.message if isinstance(exc, ServingError) else str(exc)
                log.error("worker %s failed to start: %s; retrying in %.1f s", spec.id, reason, backoff)
                inst.status = "FAILED"
                if inst.first is not None and not inst.first.done():
                    inst.first.set_exception(exc)
                _mark_dead(proc.pid)
                await self._changed()
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, MAX_BACKOFF_S)
                inst.generation += 1
                continue
            inst.status, inst.started_at = "READY", time.time()
            if not v.ever_ready:
                v.ever_ready = True
                v.load_seconds = time.perf_counter() - v.t0
                self._own_metrics.model_load_seconds.labels(v.name, v.version).set(v.load_seconds)
            log.info("worker %s (pid %d, %s) ready in %.2f s", spec.id, proc.pid, spec.device,
                     time.perf_counter() - t0)  # fmt: skip
            if inst.first is not None and not inst.first.done():
                inst.first.set_result(None)
            await self._changed()
            rc = await proc.wait()
            _mark_dead(proc.pid)
            if inst.retired or self.draining:
                break
            ran = time.time() - inst.started_at
            backoff = FIRST_BACKOFF_S if ran > STABLE_AFTER_S else backoff
            log.error(
                "worker %s (pid %d) exited with %s; restarting in %.1f s", spec.id, proc.pid, rc, backoff
            )
            self._own_metrics.instance_restarts.labels(v.name, v.version, "exited").inc()
            inst.status, inst.endpoint = "LOADING", None
            await self._changed()
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, MAX_BACKOFF_S)
            inst.generation += 1

    async def _changed(self) -> None:
        if not self.draining:
            await self._on_change()

    async def start_workers(self, versions: Sequence[_Version]) -> None:
        """Start every version's minWorkers at once; they load in parallel."""
        for v in versions:
            v.t0 = time.perf_counter()
            self._add_instances(v, v.settings.min_workers)

    async def _stop_instances(self, instances: Sequence[_Instance], grace: float) -> None:
        for inst in instances:
            inst.retired = True
        procs = [i.process for i in instances if i.process is not None and i.process.returncode is None]
        await asyncio.gather(*(p.stop(grace) for p in procs), return_exceptions=True)
        for inst in instances:
            if inst.task is not None:
                inst.task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await inst.task
            if inst.process is not None:
                _mark_dead(inst.process.pid)
            inst.status = "STOPPED"

    async def close(self, grace: float) -> None:
        """Stop every worker (after the frontends have drained) and remove unpacked archives."""
        self.draining = True
        every = [v for vs in self._versions.values() for v in vs.values()]
        await self._stop_instances([i for v in every for i in v.instances.values()], grace)
        for v in every:
            shutil.rmtree(v.archive.model_dir, ignore_errors=True)

    def worker_pids(self) -> list[int]:
        return [
            i.process.pid
            for vs in self._versions.values()
            for v in vs.values()
            for i in v.instances.values()
            if i.process is not None and i.process.pid is not None and i.process.returncode is None
        ]

    # -- what frontends learn ---------------------------------------------------------------------
    def table(self) -> tuple[ModelEntry, ...]:
        """Every version with one endpoint per instance: the live worker when it is READY, else
        where the instance stands (LOADING / FAILED), so a frontend keeps its place."""
        entries = []
        for name in sorted(self._versions):
            for v in self._versions[name].values():
                workers = []
                for inst in sorted(v.instances.values(), key=lambda i: i.index):
                    if inst.retired:
                        continue
                    if inst.status == "READY" and inst.endpoint is not None:
                        workers.append(inst.endpoint)
                    else:
                        pid = inst.process.pid if inst.process is not None else 0
                        workers.append(
                            WorkerEndpoint(
                                id=f"{v.name}-{v.version}-{inst.index}.{inst.generation}",
                                instance=inst.index,
                                generation=inst.generation,
                                socket_path="",
                                pid=pid or 0,
                                device="cpu",
                                status=inst.status,
                            )
                        )
                entries.append(
                    ModelEntry(
                        name=v.name,
                        version=v.version,
                        archive_file=v.archive.path.name,
                        sha256=v.archive.sha256,
                        model_dir=str(v.archive.model_dir),
                        manifest=v.archive.manifest,
                        model_config=v.archive.model_config,
                        settings=v.settings,
                        is_default=self._defaults.get(v.name) == v.version,
                        loaded_at_startup=v.spec.loaded_at_startup,
                        workers=tuple(workers),
                    )
                )
        return tuple(entries)

    # -- lookups (the management apps' slice of the DataPlane) ----------------------------------
    def resolve(self, model: str, version: str | None = None) -> _Version:
        versions = self._versions.get(model)
        if not versions:
            served = sorted(self._versions)
            listed = ", ".join(served[:10]) + (f" and {len(served) - 10} more" if len(served) > 10 else "")
            shown = repr(model[:80] + ("..." if len(model) > 80 else ""))
            raise ServingError(
                Code.NOT_FOUND, f"model {shown} is not served here; served: {listed or 'none'}"
            )
        v = version or self._defaults[model]
        found = versions.get(v)
        if found is None:
            raise ServingError(
                Code.NOT_FOUND,
                f"model {model!r} has no version {v[:80]!r}; versions served: {', '.join(sorted(versions))}",
            )
        return found

    def _info(self, v: _Version) -> ModelInfo:
        s = v.settings
        workers = []
        for inst in sorted(v.instances.values(), key=lambda i: i.index):
            if inst.retired:
                continue
            pid = inst.process.pid if inst.process is not None else None
            ep = inst.endpoint
            workers.append(
                WorkerInfo(
                    ep.id if ep is not None else f"{v.name}-{v.version}-{inst.index}",
                    ep.device if ep is not None else "cpu",
                    inst.status,
                    0,  # batches are counted where they run (the frontends' metrics), not here
                    pid=pid,
                    memory_bytes=_resident_bytes(pid),
                    started_at=inst.started_at if inst.status == "READY" else None,
                )
            )
        return ModelInfo(
            name=v.name,
            version=v.version,
            archive=v.archive.path.name,
            sha256=v.archive.sha256,
            handler=v.archive.handler,
            is_default=self._defaults.get(v.name) == v.version,
            state=v.state,
            batch_size=s.batch_size,
            max_batch_delay_ms=s.max_batch_delay_ms,
            response_timeout_s=s.response_timeout_s,
            queue_size=s.max_queue,
            min_workers=s.min_workers,
            max_workers=s.max_workers,
            workers=tuple(workers),
            load_seconds=v.load_seconds,
            signature=v.signature,
            loaded_at_startup=v.spec.loaded_at_startup,
            device_type=s.device_type,
        )

    def models(self) -> list[ModelInfo]:
        return [self._info(v) for name in sorted(self._versions) for v in self._versions[name].values()]

    def describe(self, model: str, version: str | None = None) -> list[ModelInfo]:
        if version is None or version == "all":
            if model not in self._versions:
                self.resolve(model)
            return [self._info(v) for v in self._versions[model].values()]
        return [self._info(self.resolve(model, version))]

    def known_label(self, model: str, version: str | None) -> tuple[str, str]:
        try:
            v = self.resolve(model, version)
        except ServingError:
            return "unknown", "unknown"
        return v.name, v.version

    def is_live(self) -> bool:
        return True

    def models_ready(self) -> bool:
        every = [v for vs in self._versions.values() for v in vs.values()]
        return (
            bool(every) and len(every) >= self._expected and all(v.state is ModelState.READY for v in every)
        )

    def is_ready(self) -> bool:
        """Every model has a live worker, every frontend is up, and the server is not draining."""
        return not self.draining and self._frontends_ok() and self.models_ready()

    def model_ready(self, model: str, version: str | None = None) -> bool:
        try:
            return not self.draining and self.resolve(model, version).state is ModelState.READY
        except ServingError:
            return False

    # -- management -------------------------------------------------------------------------------
    def _require_management(self, what: str) -> None:
        if not self.management_enabled:
            raise ServingError(
                Code.PERMISSION_DENIED,
                f"{what} is disabled: start the server with --enable-model-management to allow it "
                "(archives are then taken only from the model store)",
            )

    async def _await_first(self, instances: Sequence[_Instance]) -> None:
        """Wait for each instance's first start; raise the first failure."""
        results = await asyncio.gather(*(i.first for i in instances if i.first), return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException):
                if isinstance(r, ServingError):
                    raise r
                raise ServingError(Code.INTERNAL, f"a model worker failed to start: {r}")

    async def register(self, archive_name: str, **overrides: Any) -> list[ModelInfo]:
        self._require_management("model registration")
        name = overrides.pop("name", None)
        spec = ModelSpec(
            archive=archive_name, name=name, overrides=SettingsOverrides(**overrides), loaded_at_startup=False
        )
        v = await asyncio.to_thread(self._open, spec)
        added = self._add_instances(v, v.settings.min_workers)
        await self._changed()
        try:
            await self._await_first(added)
        except BaseException:
            await self._remove(v)
            raise
        self._expected += 1
        return [self._info(v)]

    async def _remove(self, v: _Version) -> None:
        versions = self._versions.get(v.name, {})
        versions.pop(v.version, None)
        if not versions:
            self._versions.pop(v.name, None)
            self._defaults.pop(v.name, None)
        elif self._defaults.get(v.name) == v.version:
            self._defaults[v.name] = next(iter(versions))
        await self._changed()  # frontends stop sending it batches before its workers stop
        await self._stop_instances(list(v.instances.values()), v.settings.response_timeout_s)
        shutil.rmtree(v.archive.model_dir, ignore_errors=True)

    async def unregister(self, model: str, version: str | None = None) -> None:
        self._require_management("model unregistration")
        v = self.resolve(model, version)
        self._expected = max(0, self._expected - 1)
        await self._remove(v)

    async def set_default(self, model: str, version: str) -> None:
        self._require_management("changing the default version")
        self.resolve(model, version)
        self._defaults[model] = version
        await self._changed()

    async def scale(self, model: str, version: str | None, min_workers: int, max_workers: int) -> None:
        """Start or stop worker processes until the version has `min_workers` of them."""
        self._require_management("scaling workers")
        if min_workers < 1:
            raise ServingError(Code.INVALID_ARGUMENT, f"min_worker must be at least 1, got {min_workers}")
        v = self.resolve(model, version)
        live = sorted((i for i in v.instances.values() if not i.retired), key=lambda i: i.index)
        v.settings = dataclasses.replace(v.settings, min_workers=min_workers, max_workers=max_workers)
        if min_workers > len(live):
            added = self._add_instances(v, min_workers - len(live))
            await self._changed()
            try:
                await self._await_first(added)
            except BaseException:
                await self._stop_instances(added, 1.0)
                for inst in added:
                    v.instances.pop(inst.index, None)
                await self._changed()
                raise
        elif min_workers < len(live):
            gone = live[min_workers:]
            for inst in gone:
                inst.retired = True
            await self._changed()  # frontends stop sending them batches first
            await self._stop_instances(gone, v.settings.response_timeout_s)
            for inst in gone:
                v.instances.pop(inst.index, None)
        log.info("model %s version %s scaled to %d workers", v.name, v.version, min_workers)


# -- frontends -----------------------------------------------------------------------------------
@dataclass
class _Frontend:
    index: int
    process: asyncio.subprocess.Process | None = None
    writer: asyncio.StreamWriter | None = None
    listening: bool = False
    applied: int = 0
    drained: channel.Drained | None = None


class FrontendPool:
    """The frontend processes: spawn, deliver tables, restart with backoff, stop in order."""

    def __init__(self, cfg: ServerConfig, count: int, http_port: int, grpc_port: int) -> None:
        self.cfg = cfg
        self.count = count
        self.http_port = http_port
        self.grpc_port = grpc_port
        self.stopping = False
        self._frontends = [_Frontend(i) for i in range(count)]
        self._tasks: list[asyncio.Task[None]] = []
        self._table: channel.ModelTable = channel.ModelTable(0, ())
        self._progress = asyncio.Condition()
        self.start_error: str | None = None
        self.drained: list[channel.Drained] = []
        self._readers: set[asyncio.Task[None]] = set()

    def all_up(self) -> bool:
        return all(
            f.listening and f.process is not None and f.process.returncode is None for f in self._frontends
        )

    def pids(self) -> list[int]:
        return [
            f.process.pid for f in self._frontends if f.process is not None and f.process.returncode is None
        ]

    async def _notify(self) -> None:
        async with self._progress:
            self._progress.notify_all()

    async def start(self) -> None:
        """Start every frontend; returns once all listen, raises if one cannot start."""
        self._tasks = [
            asyncio.create_task(self._keep_running(f), name=f"frontend-{f.index}") for f in self._frontends
        ]
        async with self._progress:
            await self._progress.wait_for(lambda: self.all_up() or self.start_error is not None)
        if self.start_error is not None:
            raise ServingError(Code.UNAVAILABLE, self.start_error)

    async def _spawn(self, f: _Frontend) -> None:
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "mariner.server.frontend", "--control-fd", str(child.fileno()),
                pass_fds=(child.fileno(),),
            )  # fmt: skip
        finally:
            child.close()
        reader, writer = await asyncio.open_unix_connection(sock=parent)
        f.process, f.writer, f.listening = proc, writer, False
        await channel.send(writer, channel.FrontendInit(self.cfg, f.index, self.http_port, self.grpc_port))
        await channel.send(writer, self._table)
        # Kept referenced: the loop holds tasks only weakly.
        reading = asyncio.create_task(self._read(f, proc, reader), name=f"frontend-{f.index}-channel")
        self._readers.add(reading)
        reading.add_done_callback(self._readers.discard)

    async def _read(
        self, f: _Frontend, proc: asyncio.subprocess.Process, reader: asyncio.StreamReader
    ) -> None:
        while (msg := await channel.receive(reader)) is not None:
            if f.process is not proc:
                return
            if isinstance(msg, channel.Listening):
                f.listening = True
            elif isinstance(msg, channel.TableApplied):
                f.applied = max(f.applied, msg.version)
            elif isinstance(msg, channel.Drained):
                f.drained = msg
                self.drained.append(msg)
            await self._notify()

    async def _keep_running(self, f: _Frontend) -> None:
        backoff = FIRST_BACKOFF_S
        first = True
        while not self.stopping:
            started = time.monotonic()
            try:
                await self._spawn(f)
            except OSError as exc:
                self.start_error = f"cannot start frontend {f.index}: {exc}"
                await self._notify()
                return
            assert f.process is not None
            log.info("frontend %d started (pid %d)", f.index, f.process.pid)
            rc = await f.process.wait()
            _mark_dead(f.process.pid)
            await self._notify()
            if self.stopping:
                return
            if first and not f.listening:
                self.start_error = f"frontend {f.index} exited with {rc} before listening (see its log above)"
                await self._notify()
                return
            first = False
            if time.monotonic() - started > STABLE_AFTER_S:
                backoff = FIRST_BACKOFF_S
            log.error(
                "frontend %d (pid %d) exited with %s; restarting in %.1f s",
                f.index,
                f.process.pid,
                rc,
                backoff,
            )
            f.listening = False
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, MAX_BACKOFF_S)

    async def publish(self, entries: tuple[channel.ModelEntry, ...]) -> None:
        """Send the table to every frontend; wait (bounded) until the live ones applied it."""
        self._table = channel.ModelTable(self._table.version + 1, entries)
        version = self._table.version
        for f in self._frontends:
            if f.writer is not None and f.process is not None and f.process.returncode is None:
                with contextlib.suppress(OSError, ConnectionError):
                    await channel.send(f.writer, self._table)

        def applied() -> bool:
            return all(
                f.applied >= version
                for f in self._frontends
                if f.listening and f.process is not None and f.process.returncode is None
            )

        async with self._progress:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._progress.wait_for(applied), TABLE_ACK_TIMEOUT_S)

    async def stop(self, wait_s: float) -> None:
        """SIGTERM every frontend (each drains), wait for them, SIGKILL any left after `wait_s`."""
        self.stopping = True
        procs = [f.process for f in self._frontends if f.process is not None and f.process.returncode is None]
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                p.send_signal(signal.SIGTERM)
        done, pending = await asyncio.wait([asyncio.ensure_future(p.wait()) for p in procs], timeout=wait_s)
        for p in procs:
            if p.returncode is None:
                log.error("frontend pid %d did not stop within %.0f s; killing it", p.pid, wait_s)
                with contextlib.suppress(ProcessLookupError):
                    p.kill()
                await p.wait()
            _mark_dead(p.pid)
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for f in self._frontends:
            if f.writer is not None:
                f.writer.close()


# -- the supervisor -------------------------------------------------------------------------------
class Supervisor:
    def __init__(self, cfg: ServerConfig) -> None:
        self.cfg = cfg
        self.frontend_count = frontend_count(cfg)
        self._tmp = None if cfg.work_dir else tempfile.TemporaryDirectory(prefix="mariner-")
        self.work_dir = cfg.work_dir or Path(self._tmp.name)  # type: ignore[union-attr]
        self.work_dir.mkdir(parents=True, exist_ok=True)
        # Unix socket paths are limited to 107 bytes: the workers' sockets go where they stay short.
        self._socket_dir, self._socket_dir_is_temp = socket_dir_for(self.work_dir)
        self.metrics = Metrics(MetricsConfig(slo_seconds=cfg.slo_ms / 1e3))
        self.registry = ModelRegistry(cfg, self.work_dir, self._socket_dir, self.metrics, self._publish)
        self.registry._frontends_ok = self._frontends_ok
        self.frontends: FrontendPool | None = None
        self._reserved: list[socket.socket] = []
        self._http: list[_EmbeddedUvicorn] = []
        self._http_tasks: list[asyncio.Task[None]] = []
        self._grpc: Any = None
        self._health = health_aio.HealthServicer()
        self._health_task: asyncio.Task[None] | None = None
        self._known_models: set[str] = set()
        self.ports: dict[str, int] = {}
        self.draining = False

    def _frontends_ok(self) -> bool:
        return self.frontends is not None and self.frontends.all_up()

    async def _publish(self) -> None:
        if self.frontends is not None:
            await self.frontends.publish(self.registry.table())
        await self.refresh_health()

    async def refresh_health(self) -> None:
        if self.draining:
            return
        reg = self.registry
        serving, not_serving = (
            health_pb2.HealthCheckResponse.SERVING,
            health_pb2.HealthCheckResponse.NOT_SERVING,
        )
        await self._health.set("", serving if reg.is_ready() else not_serving)
        names = {i.name for i in reg.models()}
        for name in sorted(names):
            await self._health.set(
                name, serving if reg.model_ready(name) and self._frontends_ok() else not_serving
            )
        for gone in sorted(self._known_models - names):
            await self._health.set(gone, not_serving)
        self._known_models |= names

    async def _poll_health(self) -> None:
        while True:
            await asyncio.sleep(0.5)
            try:
                await self.refresh_health()
            except Exception:
                log.exception("health refresh failed")

    def _management_routes(self) -> list[Route]:
        reg = self.registry

        async def ping(request: Request) -> Response:
            """The whole server's health: every frontend up and every model with a live worker."""
            if reg.is_ready():
                return json_response({"status": "Healthy"})
            return json_response({"status": "Unhealthy"}, 500)

        return [Route("/ping", ping, methods=["GET"]), *health.http_routes(reg)]  # type: ignore[arg-type]

    async def start(self) -> None:
        cfg = self.cfg
        inference_tokens, management_tokens = check_exposure(cfg)
        # Reserve the shared inference ports first: a port in use fails here, before any child.
        http_sock = reserve_port(cfg.inference_address)
        grpc_sock = reserve_port(cfg.grpc_inference_address)
        self._reserved = [http_sock, grpc_sock]
        http_port, grpc_port = http_sock.getsockname()[1], grpc_sock.getsockname()[1]

        # Control plane: management (REST, gRPC) and metrics, all in this process.
        creds = (
            grpc_credentials(cfg.tls_cert_file, cfg.tls_key_file, cfg.tls_client_ca_file)
            if cfg.tls_cert_file and cfg.tls_key_file
            else None
        )
        self._grpc = build_management_server(
            self.registry,  # type: ignore[arg-type]
            max_message_bytes=cfg.max_request_bytes,
            health=self._health,
            on_change=self.refresh_health,
            interceptors=[GrpcTokenAuth(management_tokens, open_health=cfg.open_health)]
            if management_tokens
            else [],
        )
        grpc_mgmt_port = bind_port(self._grpc, cfg.grpc_management_address, "management", creds)
        await self.refresh_health()
        await self._grpc.start()
        metrics_tokens = (
            type(management_tokens)() if cfg.open_metrics else (management_tokens or inference_tokens)
        )
        health_paths = OPEN_HTTP_HEALTH_PATHS if cfg.open_health else frozenset()
        mgmt = management_app(self.registry)  # type: ignore[arg-type]
        for route in self._management_routes():
            mgmt.router.routes.append(route)
        for app, address in (
            (HttpTokenAuth(mgmt, management_tokens, open_paths=health_paths), cfg.management_address),
            (HttpTokenAuth(metrics_app(self.registry), metrics_tokens), cfg.metrics_address),  # type: ignore[arg-type]
        ):
            host, port = _split(address)
            # Bound here, so a port in use is an OSError naming it (uvicorn would sys.exit).
            try:
                family = socket.AF_INET6 if ":" in host else socket.AF_INET
                sock = socket.create_server((host, port), family=family, backlog=512)
            except OSError as exc:
                raise OSError(f"cannot listen on {address!r}: {exc.strerror or exc}") from exc
            self._reserved.append(sock)
            srv = _EmbeddedUvicorn(_uvicorn_config(app, host, sock.getsockname()[1], cfg))
            self._http.append(srv)
            self._http_tasks.append(asyncio.create_task(srv.serve(sockets=[sock])))
        while not all(s.started for s in self._http):
            for t, address in zip(
                self._http_tasks, (cfg.management_address, cfg.metrics_address), strict=True
            ):
                if t.done():
                    # uvicorn reports a failed bind by logging it and exiting (SystemExit).
                    with contextlib.suppress(Exception, SystemExit):
                        t.result()
                    raise OSError(f"cannot listen on {address!r}: address in use or not available")
            await asyncio.sleep(0.005)
        mgmt_port, metrics_port = (s.servers[0].sockets[0].getsockname()[1] for s in self._http)
        self.ports = {
            "inference": http_port,
            "management": mgmt_port,
            "metrics": metrics_port,
            "grpc_inference": grpc_port,
            "grpc_management": grpc_mgmt_port,
        }
        log.info(
            "supervisor pid %d: listening %s; %d frontends", os.getpid(), self.ports, self.frontend_count
        )

        # Archives are checked here, once; workers and frontends then start in parallel.
        pinned = pinned_digests(cfg.model_store) if cfg.pin_index else None
        versions = await asyncio.to_thread(self.registry.open_models, model_specs(cfg, pinned))
        self.frontends = FrontendPool(cfg, self.frontend_count, http_port, grpc_port)
        await self.registry.start_workers(versions)
        await self.frontends.start()
        await self._publish()
        self._health_task = asyncio.create_task(self._poll_health(), name="supervisor-health")

    async def wait_ready(self) -> None:
        """Log once when every model has a live worker and every frontend listens."""
        t0 = time.perf_counter()
        while not self.registry.is_ready() and not self.draining:
            await asyncio.sleep(0.05)
        if not self.draining:
            ready = [f"{i.name}:{i.version}" for i in self.registry.models()]
            log.info("models ready: %s (all ready: True, %.2f s after the listeners)", ", ".join(ready),
                     time.perf_counter() - t0)  # fmt: skip

    async def shutdown(self) -> None:
        """Not ready; frontends drain and exit; workers stop; listeners close."""
        if self.draining:
            return
        self.draining = True
        self.registry.draining = True
        log.info("shutting down: frontends drain for up to %.1f s", self.cfg.grace_seconds)
        if self._health_task is not None:
            self._health_task.cancel()
        with contextlib.suppress(Exception):
            await self._health.enter_graceful_shutdown()
        if self.frontends is not None:
            await self.frontends.stop(self.cfg.grace_seconds + self.cfg.refuse_seconds + 10.0)
            d = self.frontends.drained
            log.info(
                "all %d frontends drained: total accepted=%d answered=%d ok=%d", len(d),
                sum(x.accepted for x in d), sum(x.answered for x in d), sum(x.ok for x in d),
            )  # fmt: skip
        await self.registry.close(grace=5.0)
        for srv in self._http:
            srv.should_exit = True
        if self._grpc is not None:
            await self._grpc.stop(2.0)
        await asyncio.gather(*self._http_tasks, return_exceptions=True)
        for s in self._reserved:
            s.close()
        if self._socket_dir_is_temp:
            shutil.rmtree(self._socket_dir, ignore_errors=True)
        if self._tmp is not None:
            self._tmp.cleanup()
        log.info("stopped")


async def run(cfg: ServerConfig) -> int:
    """`mariner serve`: start, serve until SIGTERM/SIGINT, shut down in order. 0 on a clean stop."""
    sup = Supervisor(cfg)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    starting = asyncio.create_task(sup.start())
    stopper = asyncio.create_task(stop.wait())
    await asyncio.wait([starting, stopper], return_when=asyncio.FIRST_COMPLETED)
    if not starting.done():
        starting.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await starting
        await sup.shutdown()
        return 0
    if starting.exception() is not None:
        await sup.shutdown()
        raise starting.exception()  # type: ignore[misc]
    ready = asyncio.create_task(sup.wait_ready())
    await stopper
    ready.cancel()
    await sup.shutdown()
    return 0
