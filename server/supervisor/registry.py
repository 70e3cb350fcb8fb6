"""The model versions the supervisor serves, and the management API over them.

`ModelRegistry` opens and checks each archive once (in the supervisor: workers and frontends
unpack nothing), decides which worker slots each version has (start-up, register, scale,
unregister) and answers the management apps (REST 8081, gRPC 7071). It is the one owner of
the model lifecycle; a frontend only follows its model table. Keeping the slots' processes
running is `WorkerPool`'s.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import shutil
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from mariner.server.common.archive import (
    UNLISTED,
    ArchiveLimits,
    ModelArchive,
    open_archive,
    resolve_in_store,
    with_envelope,
    with_handler,
)
from mariner.server.common.config import ServerConfig, server_layers
from mariner.server.common.metrics import Metrics, MultiprocessMetrics
from mariner.server.common.model_settings import SettingsOverrides
from mariner.server.common.models import ModelSpec, require_management, resolve_model, resolve_worker_origin
from mariner.server.contracts.errors import Code, ServingError, TorchServeAnswer
from mariner.server.contracts.types import InferResult, ModelInfo, WireProtocol
from mariner.server.contracts.worker_wire import ask_describe, describe_request
from mariner.server.supervisor.admission import admit, check_scale
from mariner.server.supervisor.devices import allocator
from mariner.server.supervisor.failed_models import FailedModel
from mariner.server.supervisor.machine import archive_estimate
from mariner.server.supervisor.model_views import ModelViews
from mariner.server.supervisor.requirements import PipLimits, requirements_step
from mariner.server.supervisor.versions import Instance, Version
from mariner.server.supervisor.worker_budget import Limits, WorkerBudget
from mariner.server.supervisor.worker_pool import WorkerPool
from mariner.server.supervisor.worker_process import WorkerOutputs

log = logging.getLogger("mariner.supervisor")


class ModelRegistry(ModelViews):
    """Every model version, its worker processes, and the management API over them.

    It provides the methods the management apps call (models, describe, register, unregister,
    scale, set_default, readiness). `on_change` is called whenever what frontends
    must know changed (a worker ready or gone, a model added or removed, a new default); it
    returns once every frontend applied the change (bounded). `frontends_ok` says whether
    every frontend is up (part of the whole server's readiness).
    """

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
        # Called after every management change that succeeded (the supervisor's config snapshot).
        self.on_management_change: Callable[[], None] = lambda: None

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

    # -- management -------------------------------------------------------------------------------
    def _require_management(self, what: str) -> None:
        require_management(self.management_enabled, what)

    async def _await_first(self, v: Version, instances: Sequence[Instance]) -> None:
        """Wait for each instance's first start; raise the first failure as TorchServe answers a
        register or scale whose workers did not start (500 "Failed to start workers"), with the
        worker's own reason. A slot stopped while it started (CANCELLED) and a machine out of
        memory or processes (RESOURCE_EXHAUSTED) keep their own answers."""
        results = await asyncio.gather(*(i.first for i in instances if i.first), return_exceptions=True)
        for r in results:
            if not isinstance(r, BaseException):
                continue
            if isinstance(r, ServingError) and r.code in (Code.CANCELLED, Code.RESOURCE_EXHAUSTED):
                raise r
            why = r.message if isinstance(r, ServingError) else f"{type(r).__name__}: {r}"
            failed = f"Failed to start workers for model {v.name} version: {v.version}"
            raise ServingError(
                Code.INTERNAL,
                f"{failed}: {why}",
                torchserve=TorchServeAnswer(500, "InternalServerException", f"{failed}: {why}"),
            )

    async def register(
        self, archive_name: str, *, synchronous: bool = True, handler: str | None = None, **overrides: Any
    ) -> list[ModelInfo]:
        """Open, check and start one archive; all or nothing: when any step fails, nothing of it
        is left (no version, no worker, no unpacked directory) and readiness is as before. A
        worker count over the budget is refused before any worker starts.

        With `synchronous=False` (TorchServe's `synchronous=false`) the archive is still opened
        and checked before this returns (a bad or duplicate archive is refused to the caller),
        but the workers' start is awaited in the background; a failure there removes the
        version and is logged, as TorchServe unregisters a model whose workers failed.

        The version's lifecycle lock is held until its workers' first starts ended (a scale of
        it waits); an unregister meanwhile stops them and this answers that it was unregistered.

        `handler` replaces the manifest's handler (TorchServe's `handler=`), checked by the same
        rule; one that does not load registers (with no worker) and fails its workers' starts,
        as in TorchServe. Without a worker count from anywhere the version has none."""
        self._require_management("model registration")
        name = overrides.pop("name", None)
        spec = ModelSpec(
            archive=archive_name, name=name, overrides=SettingsOverrides(**overrides), loaded_at_startup=False
        )
        archive = await self._unpack(spec)
        if handler:
            try:
                archive = with_handler(archive, handler)
            except BaseException:
                shutil.rmtree(archive.model_dir, ignore_errors=True)
                raise
        return await self.register_opened(archive, spec, synchronous=synchronous)

    async def register_opened(
        self, archive: ModelArchive, spec: ModelSpec, *, synchronous: bool = True
    ) -> list[ModelInfo]:
        """The rest of `register` for an archive already opened and checked, whose directory it
        then owns (removed on a refusal): a workflow's function node, made from a .war."""
        if not self.management_enabled:
            shutil.rmtree(archive.model_dir, ignore_errors=True)
            self._require_management("model registration")
        await self._requirements(archive)
        v = self._install(archive, spec)
        # A new version's lock is free: taken without a wait, so nothing runs in between.
        await v.lifecycle.acquire()
        self._registering.add((v.name, v.version))
        try:
            added = self._workers.add(v, v.settings.min_workers)
        except BaseException:
            self._registering.discard((v.name, v.version))
            v.lifecycle.release()
            await self._remove(v)
            raise
        if not synchronous and added:
            task = asyncio.create_task(self._start_in_background(v, added))
            self._background.add(task)
            task.add_done_callback(self._background.discard)
            return [self._info(v)]
        await self._start_registered(v, added)
        return [self._info(v)]

    async def _start_registered(self, v: Version, added: Sequence[Instance], *, keep: bool = False) -> None:
        """Wait for a just-installed version's first starts; on failure remove all of it (unless
        `keep`: its workers go on retrying) and raise. Releases the version's lifecycle lock
        `register` took."""
        try:
            try:
                await self._changed()
                await self._await_first(v, added)
                # The ready workers reach every frontend before the caller hears "registered": a
                # predict sent right after the answer must not meet a table still saying LOADING.
                await self._changed()
            except BaseException:
                if not keep or v.removed:
                    await self._remove(v)
                raise
        finally:
            self._registering.discard((v.name, v.version))
            v.lifecycle.release()
        # A fixed archive registered under a name that failed at start-up supersedes that failure.
        if self._failed.clear(v.name):
            await self._changed()
        self.on_management_change()

    async def _start_in_background(self, v: Version, added: Sequence[Instance]) -> None:
        """An asynchronous register's second half: nobody waits for it, so a failure is logged
        and the version stays registered, its workers retrying with backoff (TorchServe keeps a
        model registered with `synchronous=false` whatever its workers do)."""
        try:
            await self._start_registered(v, added, keep=True)
        except Exception:  # each failed start was logged with its reason where it happened
            log.error("model %s version %s: its first worker start after registering failed; its workers "
                      "keep retrying", v.name, v.version)  # fmt: skip

    async def _remove(self, v: Version, why: str | None = None) -> None:
        """Stop serving `v`: out of the table first (frontends stop sending it batches and
        answer what they accepted), then its workers drain and stop, then its files go. Once
        only: a second call (a register failing because of an unregister) returns at once."""
        if v.removed:
            return
        v.removed = True
        versions = self._versions.get(v.name, {})
        if versions.get(v.version) is v:
            versions.pop(v.version)
            if not versions:
                self._versions.pop(v.name, None)
                self._defaults.pop(v.name, None)
            elif self._defaults.get(v.name) == v.version:
                self._defaults[v.name] = next(iter(versions))
        await self._changed()  # frontends stop sending it batches before its workers stop
        await self._workers.stop(
            list(v.instances.values()),
            v.settings.response_timeout_s,
            drain=True,
            why=why or f"model {v.name} version {v.version} was unregistered",
        )
        self.budget.forget((v.name, v.version))
        shutil.rmtree(v.archive.model_dir, ignore_errors=True)

    async def unregister(self, model: str, version: str | None = None) -> None:
        """Stop serving a version at once: it does not wait for a register or scale of it in
        progress (their workers still starting are stopped and they answer so)."""
        self._require_management("model unregistration")
        served = self._versions.get(model, {})
        if self._failed.of_model(model, version) and (not served or (version and version not in served)):
            self._failed.clear(model, version)  # a FAILED version is simply forgotten
            await self._changed()
            return
        await self._remove(self.resolve(model, version))
        self.on_management_change()

    async def customized_metadata(
        self, model: str, version: str | None, headers: Mapping[str, str], protocol: WireProtocol
    ) -> InferResult:
        """The handler's own description of the model (TorchServe's `describe_handle`), asked of
        one ready worker process on its socket, bounded by the version's response timeout."""
        v = self.resolve(model, version)
        ready = [i.endpoint for i in v.instances.values() if i.status == "READY" and i.endpoint is not None]
        if not ready:
            raise ServingError(Code.UNAVAILABLE, f'Model "{v.name}" has no worker to serve inference request')
        request = describe_request(v.name, v.version, headers, protocol)
        return await ask_describe(
            ready[0].socket_path, request, v.settings.response_timeout_s, expected_pid=ready[0].pid
        )

    async def set_default(self, model: str, version: str) -> None:
        """Allowed without model management, as in TorchServe: it loads no code."""
        self.resolve(model, version)
        self._defaults[model] = version
        await self._changed()
        self.on_management_change()

    async def scale(self, model: str, version: str | None, min_workers: int, max_workers: int) -> None:
        """Start or stop worker processes until the version has `min_workers` of them.

        Allowed without model management, as in TorchServe: it loads no new code, only more or
        fewer processes of an archive already served; the worker budget bounds how many (checked
        before any wait, so an asynchronous scale's refusal is still its caller's answer, and
        again once it is this version's turn); 0 stops every worker and keeps the version
        registered (TorchServe's scale to 0). One change of a version at a time: a scale waits
        for the register or scale before it. Scaling down drains each worker it stops: out of
        the table first, then its frontends' batches there are answered, then it stops."""
        if min_workers < 0:
            # TorchServe fails this with an internal error (500) after dropping the workers; here
            # nothing changes and the answer says why.
            raise ServingError(
                Code.INTERNAL, f"min_worker must be 0 or more, got {min_workers}; the workers are unchanged"
            )
        v = self.resolve(model, version)
        check_scale(self.budget, self._every(), v, min_workers)
        async with v.lifecycle:
            if v.removed:
                raise ServingError(
                    Code.NOT_FOUND,
                    f"model {v.name} version {v.version} was unregistered while this scale waited",
                )
            live = v.live_instances()
            if min_workers > len(live):
                check_scale(self.budget, self._every(), v, min_workers)  # what changed while it waited
            before = v.settings
            v.settings = dataclasses.replace(v.settings, min_workers=min_workers, max_workers=max_workers)
            if min_workers > len(live):
                added = self._workers.add(v, min_workers - len(live))
                await self._changed()
                try:
                    await self._await_first(v, added)
                    await self._changed()  # the new workers are in every frontend's table first
                except BaseException:
                    if not v.removed:
                        v.settings = before
                    await self._workers.stop(
                        added, 1.0, why=f"model {v.name} version {v.version}'s scale to {min_workers} failed"
                    )
                    for inst in added:
                        v.instances.pop(inst.index, None)
                    await self._changed()
                    raise
            elif min_workers < len(live):
                # Workers not serving (loading, failed) go first, then the newest.
                gone = sorted(live, key=lambda i: (i.status == "READY", -i.index))[: len(live) - min_workers]
                for inst in gone:
                    inst.retire()
                await self._changed()  # frontends stop sending them batches first
                await self._workers.stop(
                    gone,
                    v.settings.response_timeout_s,
                    drain=True,
                    why=f"model {v.name} version {v.version} was scaled down to {min_workers}",
                )
                for inst in gone:
                    v.instances.pop(inst.index, None)
                await self._changed()
        log.info("model %s version %s scaled to %d workers", v.name, v.version, min_workers)
        self.on_management_change()
