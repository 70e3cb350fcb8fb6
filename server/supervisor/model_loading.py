"""How the supervisor's model versions come to be and go: each archive opened and checked once
(in the supervisor: workers and frontends unpack nothing), its requirements installed, its
settings resolved and admitted into the worker budget, its version added; the versions' workers
started at start-up and stopped at shutdown.

`ModelLoading` is the base of `ModelRegistry` (`registry`), which adds the management API over
the versions (register, unregister, scale...) and reuses these steps for a register; apart from
it so the registry module holds only what a management call changes. Keeping the slots'
processes running is `WorkerPool`'s.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

from mariner.server.common.archive import (
    UNLISTED,
    ArchiveLimits,
    ModelArchive,
    open_archive,
    resolve_in_store,
    with_envelope,
)
from mariner.server.common.config import ServerConfig
from mariner.server.common.configured_models import server_layers
from mariner.server.common.metrics import Metrics, MultiprocessMetrics
from mariner.server.common.models import ModelSpec, resolve_model, resolve_worker_origin
from mariner.server.contracts.errors import Code, ServingError
from mariner.server.supervisor.devices import allocator
from mariner.server.supervisor.failed_models import FailedModel
from mariner.server.supervisor.machine import archive_estimate
from mariner.server.supervisor.model_views import ModelViews
from mariner.server.supervisor.requirements import PipLimits, requirements_step
from mariner.server.supervisor.versions import Version
from mariner.server.supervisor.worker_budget import Limits, WorkerBudget
from mariner.server.supervisor.worker_pool import WorkerPool
from mariner.server.supervisor.worker_process import WorkerOutputs
from mariner.server.supervisor.worker_slots import admit

log = logging.getLogger("mariner.supervisor")


async def _no_change_hook() -> None:
    """`on_management_change` until the supervisor sets its own."""


class ModelLoading(ModelViews):
    """The versions' archives, settings and worker budget, and their workers' start and stop
    (the constructor's arguments: see `ModelRegistry`)."""

    def __init__(
        self,
        cfg: ServerConfig,
        work_dir: Path,
        socket_dir: Path,
        metrics: Metrics,
        on_change: Callable[[], Awaitable[None]],
        frontends_ok: Callable[[], bool] = lambda: True,
        worker_output: WorkerOutputs | None = None,
    ) -> None:
        super().__init__(frontends_ok)
        self.cfg = cfg
        self.management_enabled = cfg.enable_model_management
        self.metrics = MultiprocessMetrics()  # what /metrics renders: every process merged
        self._work_dir = work_dir
        self._on_change = on_change
        self._background: set[asyncio.Task[None]] = set()  # asynchronous registers still starting
        # Every count of workers asked for (start-up, register, scale) is admitted here, once.
        self.budget = WorkerBudget(Limits.from_config(cfg))
        self._workers = WorkerPool(
            cfg.torch_threads,
            socket_dir,
            metrics,
            on_change=on_change,
            worker_count=lambda: sum(len(v.instances) for v in self._every()),
            draining=lambda: self.draining,
            require_gpu=cfg.require_gpu,
            budget=self.budget,
            output=worker_output,
        )
        self._layers = server_layers(cfg, gpus=allocator().count)  # default: a worker per GPU, else core
        self._limits = ArchiveLimits()
        self._pip_limits = PipLimits(
            timeout_s=cfg.install_py_dep_timeout_s,
            max_bytes=cfg.install_py_dep_max_mb << 20,
            allow_builds=cfg.install_py_dep_allow_builds,
        )
        # Awaited after every management change that succeeded, before the call answers (the
        # supervisor's config snapshot: TorchServe writes it before it answers, and its tests
        # look for the file as soon as the answer comes).
        self.on_management_change: Callable[[], Awaitable[None]] = _no_change_hook

    # -- opening ----------------------------------------------------------------------------
    async def _unpack(self, spec: ModelSpec) -> ModelArchive:
        """Hash, check and unpack the archive off the event loop (a large one takes seconds,
        and this loop also serves management, health and the frontends' control channels)."""
        path = resolve_in_store(self.cfg.model_store, spec.archive)
        archive = await asyncio.to_thread(
            open_archive,
            path,
            self._work_dir,
            limits=self._limits,
            expected_sha256=spec.sha256,
            name_override=spec.name,
        )
        return with_envelope(archive, self.cfg.service_envelope)

    async def _requirements(self, archive: ModelArchive) -> None:
        """Install the archive's requirements before any worker (its handler may import them);
        on a failure its unpacked directory is removed."""
        try:
            await requirements_step(
                archive, install=self.cfg.install_py_dep_per_model, limits=self._pip_limits
            )
        except BaseException:
            shutil.rmtree(archive.model_dir, ignore_errors=True)
            raise

    def _install(self, archive: ModelArchive, spec: ModelSpec) -> Version:
        """Resolve the archive's settings and add the version (no worker yet); on a refusal its
        unpacked directory is removed and nothing is left behind."""
        try:
            if archive.version in self._versions.get(archive.name, {}):
                raise ServingError(  # TorchServe's 409 ConflictStatusException, same sentence
                    Code.ALREADY_EXISTS,
                    f"Model version {archive.version} is already registered for model {archive.name}",
                )
            # The one resolution of a version's settings (frontend.endpoint.resolve_model).
            settings, signature = resolve_model(
                archive, spec, default_max_queue=self.cfg.max_queue, layers=self._layers
            )
            origin = resolve_worker_origin(
                archive, spec, default_max_queue=self.cfg.max_queue, layers=self._layers
            )
            estimate = archive_estimate(archive.model_dir, spawned=self._workers.spawns(settings))
            settings = admit(
                self.budget, self._every(), archive, settings, origin, estimate, spec.loaded_at_startup
            )
        except BaseException:
            shutil.rmtree(archive.model_dir, ignore_errors=True)
            raise
        v = Version(archive, spec, settings, signature, worker_estimate=estimate)
        self._versions.setdefault(archive.name, {})[archive.version] = v
        self._defaults.setdefault(archive.name, archive.version)
        return v

    async def open_models(self, specs: Sequence[ModelSpec]) -> list[Version]:
        """Check and unpack every archive; a bad one is logged in one line and kept as a FAILED
        version with the reason (see `supervisor.failed_models`), the others serve."""
        opened = []
        for spec in specs:
            archive: ModelArchive | None = None
            try:
                archive = await self._unpack(spec)
                await self._requirements(archive)  # a failure keeps its name and version
                opened.append(self._install(archive, spec))
            except ServingError as exc:
                named = exc.message.startswith(f"archive {spec.archive}")
                log.error("refusing %s", exc.message if named else f"archive {spec.archive}: {exc.message}")
                if spec.sha256 != UNLISTED:  # off the --pin-index allowlist: left out by design
                    name, version = (archive.name, archive.version) if archive else (spec.name, None)
                    self._failed.add(FailedModel.of(spec.archive, exc.message, name, version))
        return opened

    # -- workers ----------------------------------------------------------------------------
    async def _changed(self) -> None:
        if not self.draining:
            await self._on_change()

    async def start_workers(self, versions: Sequence[Version]) -> None:
        """Start every version's minWorkers at once; they load in parallel."""
        for v in versions:
            v.t0 = time.perf_counter()
            missing = v.settings.min_workers - len(v.live_instances())  # a scale may have come first
            if missing > 0 and not v.removed:
                self._workers.add(v, missing)

    async def close(self, grace: float) -> None:
        """Stop every worker (after the frontends have drained) and remove unpacked archives."""
        self.draining = True
        for task in list(self._background):
            task.cancel()
        every = self._every()
        await self._workers.stop(
            [i for v in every for i in v.instances.values()], grace, why="the server is shutting down"
        )
        for v in every:
            shutil.rmtree(v.archive.model_dir, ignore_errors=True)
