"""The protocol-neutral core: which models exist, whether they are ready, and inference.

Transports translate wire messages to `InferRequest` and call `DataPlane.infer`; this module
resolves the model version, admits the request (readiness, draining) and hands it to that
version's batcher. Nothing here knows about gRPC or HTTP.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mariner.server.control.metrics import Metrics
from mariner.server.core.archive import ArchiveLimits, ModelArchive, open_archive, resolve_in_store
from mariner.server.core.batcher import Batcher, BatchPolicy, BatchRunner
from mariner.server.core.errors import Code, ServingError
from mariner.server.core.model_settings import (
    ModelSettings,
    ServerLayers,
    SettingsOverrides,
    archive_overrides,
    resolve_model_settings,
)
from mariner.server.core.runner import Placement, Runner, place_instances
from mariner.server.core.tensors import ModelSignature
from mariner.server.core.types import InferRequest, InferResult, ModelInfo, ModelState, WorkerInfo
from mariner.server.workers.process import ProcessRunner, socket_dir_for

log = logging.getLogger("mariner.dataplane")


@dataclass(frozen=True)
class ModelSpec:
    """One model to load: an archive file in the store, the name to serve it under, and the
    register call's settings (the top layer; empty for models loaded at start-up)."""

    archive: str
    name: str | None = None
    overrides: SettingsOverrides = SettingsOverrides()
    sha256: str | None = None
    loaded_at_startup: bool = True


@dataclass(frozen=True)
class PlaneSettings:
    """Server-wide settings of the DataPlane. `model_layers` are the config.properties
    `models={...}` entries and the flags/env that every model version's settings resolve over,
    at start-up and for a register call alike."""

    model_store: Path
    work_dir: Path
    default_max_queue: int = 1024
    torch_threads: int | None = None
    management_enabled: bool = False
    limits: ArchiveLimits = ArchiveLimits()
    model_layers: ServerLayers = ServerLayers()
    # "process": every model instance is a worker process (the default); "thread": a thread of
    # this process (no isolation: a hung handler cannot be killed, archives share sys.path).
    worker_mode: str = "process"
    # How long a worker may take to load its model before it is killed and counted as failed.
    worker_start_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if self.worker_mode not in ("process", "thread"):
            raise ValueError(f"worker_mode must be 'process' or 'thread', not {self.worker_mode!r}")


class _ObserverAdapter:
    """Feeds batcher events into the Prometheus metrics of one model version."""

    def __init__(self, metrics: Metrics, model: str, version: str) -> None:
        self._depth = metrics.queue_depth.labels(model, version)
        self._queue = metrics.queue_duration.labels(model, version)
        self._compute = metrics.compute_duration.labels(model, version)
        self._size = metrics.batch_size.labels(model, version)

    def queue_depth(self, items: int) -> None:
        self._depth.set(items)

    def batch_started(self, items: int, queue_waits: Sequence[float]) -> None:
        self._size.observe(items)
        for w in queue_waits:
            self._queue.observe(w)

    def batch_finished(self, seconds: float) -> None:
        self._compute.observe(seconds)


def _resident_bytes(pid: int | None = None) -> int | None:
    """A process's resident set size (Linux /proc; this process by default); None where it
    cannot be read (e.g. the process is gone)."""
    try:
        with open(f"/proc/{pid or 'self'}/statm", "rb") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


class ModelEndpoint:
    """One loaded model version: its archive, runners, batcher and serving settings."""

    def __init__(
        self, archive: ModelArchive, spec: ModelSpec, settings: PlaneSettings, metrics: Metrics
    ) -> None:
        cfg = archive.model_config
        self.archive = archive
        self.name = archive.name
        self.version = archive.version
        # The one resolution: defaults < archive model-config < config.properties < flags/env <
        # register call. A bad value anywhere refuses this archive with the field named.
        self.settings: ModelSettings = resolve_model_settings(
            SettingsOverrides(max_queue=settings.default_max_queue),
            archive_overrides(cfg, archive.path.name),
            *settings.model_layers.for_model(archive.name, archive.version, archive.path.name),
            spec.overrides,
        )
        self.batch_size = self.settings.batch_size
        self.max_batch_delay_ms = self.settings.max_batch_delay_ms
        self.response_timeout_s = self.settings.response_timeout_s
        self.min_workers = self.settings.min_workers
        self.max_workers = self.settings.max_workers
        self.max_queue = self.settings.max_queue
        self.loaded_at_startup = spec.loaded_at_startup
        self.state = ModelState.LOADING
        self.load_seconds: float | None = None
        try:
            self.signature = ModelSignature.from_config(cfg.get("signature"))
        except (ValueError, KeyError, TypeError) as exc:
            msg = f"archive {archive.path.name}: bad signature: {exc}"
            raise ServingError(Code.INVALID_ARGUMENT, msg) from exc
        torch_threads = settings.torch_threads
        if settings.worker_mode == "process" and torch_threads:
            # The thread budget is the cores: each worker process takes its share of it.
            torch_threads = max(1, torch_threads // self.min_workers)
        placements = place_instances(
            self.min_workers, device_type=self.settings.device_type, torch_threads=torch_threads
        )
        self._plane = settings
        self._socket_dir: Path | None = None
        self._socket_dir_is_temp = False
        self._metrics = metrics
        self._oom = metrics.oom_splits.labels(self.name, self.version)
        self.runners = [self._new_runner(i, p) for i, p in enumerate(placements)]
        self._ready_since: dict[str, float] = {}  # runner id -> time.time() it became ready
        self.batcher: Batcher | None = None
        self.policy = BatchPolicy(
            self.batch_size,
            self.max_batch_delay_ms / 1e3,
            self.max_queue,
            batch_timeout_s=self.response_timeout_s,
        )

    def _new_runner(self, instance: int, placement: Placement, generation: int = 0) -> Runner | ProcessRunner:
        if self._plane.worker_mode == "process":
            if self._socket_dir is None:
                self._socket_dir, self._socket_dir_is_temp = socket_dir_for(self._plane.work_dir)
            return ProcessRunner(
                self.archive,
                instance=instance,
                placement=placement,
                batch_size=self.batch_size,
                socket_dir=self._socket_dir,
                generation=generation,
                on_oom=self._oom.inc,
                start_timeout_s=self._plane.worker_start_timeout_s,
            )
        return Runner(
            self.archive,
            instance=instance,
            placement=placement,
            batch_size=self.batch_size,
            generation=generation,
            on_oom=self._oom.inc,
        )

    def _refresh_state(self) -> None:
        """READY while at least one instance is; RESTARTING while every instance is being replaced."""
        if self.state in (ModelState.STOPPING, ModelState.LOADING, ModelState.FAILED):
            return
        ready = any(r.status == "READY" for r in self.runners)
        self.state = ModelState.READY if ready else ModelState.RESTARTING
        self._metrics.model_ready.labels(self.name, self.version).set(1 if ready else 0)

    async def replace_runner(self, old: BatchRunner, reason: str) -> Runner | ProcessRunner | None:
        """Replace a hung or failed instance on the same device, retrying with backoff.

        A worker process is SIGKILLed first (a hung one holds a core until then); its
        replacement is a new process, generation + 1.
        """
        assert isinstance(old, Runner | ProcessRunner)
        old.abandon()
        self._metrics.instance_restarts.labels(self.name, self.version, reason).inc()
        self._refresh_state()
        backoff = 0.2
        generation = old.generation + 1
        while self.state is not ModelState.STOPPING:
            new = self._new_runner(old.instance, old.placement, generation)
            self.runners[self.runners.index(old)] = new
            old = new
            try:
                await new.start()
            except Exception:
                log.exception("restarting instance %s failed; retrying in %.1f s", new.id, backoff)
                new.abandon()
                generation += 1
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 30.0)
                continue
            self._ready_since[new.id] = time.time()
            self._refresh_state()
            log.info("instance %s replaced (%s) and ready", new.id, reason)
            return new
        return None

    async def load(self) -> None:
        t0 = time.perf_counter()
        try:
            await asyncio.gather(*(r.start() for r in self.runners))
            self._ready_since.update(dict.fromkeys((r.id for r in self.runners), time.time()))
        except BaseException:
            # Workers that did load must not outlive a model that failed to.
            for r in self.runners:
                r.abandon()
            self.state = ModelState.FAILED
            self._metrics.model_ready.labels(self.name, self.version).set(0)
            raise
        self.batcher = Batcher(
            self.runners,
            self.policy,
            observer=_ObserverAdapter(self._metrics, self.name, self.version),
            replace_runner=self.replace_runner,
        )
        self.batcher.start()
        self.load_seconds = time.perf_counter() - t0
        self.state = ModelState.READY
        self._metrics.model_load_seconds.labels(self.name, self.version).set(self.load_seconds)
        self._metrics.model_ready.labels(self.name, self.version).set(1)

    async def infer(self, req: InferRequest) -> InferResult:
        if self.state is not ModelState.READY or self.batcher is None:
            raise ServingError(
                Code.UNAVAILABLE, f"model {self.name} version {self.version} is {self.state.value}"
            )
        deadline = time.monotonic() + self.response_timeout_s
        if req.deadline is None or req.deadline > deadline:
            req = _with_deadline(req, deadline)
        try:
            # asyncio.timeout, not wait_for: no extra task per request on the hot path.
            async with asyncio.timeout_at(_loop_time_of(req.deadline)):
                return await self.batcher.submit(req)
        except TimeoutError:
            raise ServingError(
                Code.DEADLINE_EXCEEDED,
                f"model {self.name} did not answer within the deadline "
                f"(responseTimeout {self.response_timeout_s:g} s or the client's)",
            ) from None

    async def close(self, timeout: float | None) -> None:
        self.state = ModelState.STOPPING
        self._metrics.model_ready.labels(self.name, self.version).set(0)
        if self.batcher is not None:
            await self.batcher.close(timeout)
        # Workers finish the batch in hand (none: the batcher is closed) and exit; a worker that
        # does not is killed after a short grace, so no process outlives the server.
        await asyncio.gather(*(r.stop(5.0) for r in self.runners))
        if self._socket_dir is not None and self._socket_dir_is_temp:
            shutil.rmtree(self._socket_dir, ignore_errors=True)
        shutil.rmtree(self.archive.model_dir, ignore_errors=True)

    def info(self, is_default: bool) -> ModelInfo:
        """This version's facts for management: settings, live queue depth and its workers.

        Each worker's pid and memory are its process's (this process's own in thread mode).
        """
        return ModelInfo(
            name=self.name,
            version=self.version,
            archive=self.archive.path.name,
            sha256=self.archive.sha256,
            handler=self.archive.handler,
            is_default=is_default,
            state=self.state,
            batch_size=self.batch_size,
            max_batch_delay_ms=self.max_batch_delay_ms,
            response_timeout_s=self.response_timeout_s,
            queue_size=self.max_queue,
            min_workers=self.min_workers,
            max_workers=self.max_workers,
            workers=tuple(
                WorkerInfo(
                    r.id,
                    r.placement.device,
                    r.status,
                    r.batches,
                    pid=r.pid,
                    memory_bytes=_resident_bytes(r.pid) if r.pid is not None else None,
                    started_at=self._ready_since.get(r.id),
                )
                for r in self.runners
            ),
            load_seconds=self.load_seconds,
            signature=self.signature,
            loaded_at_startup=self.loaded_at_startup,
            pending_requests=self.batcher.queued_items if self.batcher is not None else 0,
            device_type=self.settings.device_type,
        )


def _shown(name: str, limit: int = 80) -> str:
    """A client-supplied name for an error message: quoted, escaped and bounded in length."""
    return repr(name[:limit] + ("..." if len(name) > limit else ""))


def _loop_time_of(deadline: float | None) -> float | None:
    """A time.monotonic() instant on the running loop's clock (they differ under uvloop)."""
    if deadline is None:
        return None
    return asyncio.get_running_loop().time() + (deadline - time.monotonic())


def _with_deadline(req: InferRequest, deadline: float) -> InferRequest:
    from dataclasses import replace

    return replace(req, deadline=deadline)


class DataPlane:
    """All model versions this server serves, and the one entry point for inference."""

    def __init__(self, settings: PlaneSettings, metrics: Metrics | None = None) -> None:
        self.settings = settings
        self.metrics = metrics or Metrics()
        self.management_enabled = settings.management_enabled
        self._endpoints: dict[str, dict[str, ModelEndpoint]] = {}
        self._defaults: dict[str, str] = {}
        self._expected: list[ModelSpec] = []
        self.draining = False
        # Accounting for the shutdown proof: every accepted request must be answered.
        self.accepted = 0
        self.answered = 0
        self.answered_ok = 0
        self._inflight = 0
        self._idle: asyncio.Event | None = None

    # -- loading --------------------------------------------------------------------------
    def open_models(self, specs: Sequence[ModelSpec]) -> None:
        """Check and unpack every archive; the models are then known (health NOT_SERVING) but LOADING.

        An archive that fails its checks (missing, unsafe, not allowlisted) is logged and skipped,
        so one bad file in the store does not take the others down; readiness covers the rest.
        """
        for spec in specs:
            try:
                self._open(spec)
            except ServingError as exc:
                log.error("refusing archive %s: %s", spec.archive, exc.message)
                continue
            self._expected.append(spec)

    async def load_models(self, specs: Sequence[ModelSpec] = ()) -> None:
        """Open `specs` (if any), then initialise every LOADING model concurrently."""
        self.open_models(specs)
        endpoints = [
            ep for v in self._endpoints.values() for ep in v.values() if ep.state is ModelState.LOADING
        ]
        results = await asyncio.gather(*(ep.load() for ep in endpoints), return_exceptions=True)
        for ep, res in zip(endpoints, results, strict=True):
            if isinstance(res, BaseException):
                log.error("model %s version %s failed to load: %r", ep.name, ep.version, res, exc_info=res)

    def _open(self, spec: ModelSpec) -> ModelEndpoint:
        path = resolve_in_store(self.settings.model_store, spec.archive)
        archive = open_archive(
            path,
            self.settings.work_dir,
            limits=self.settings.limits,
            expected_sha256=spec.sha256,
            name_override=spec.name,
        )
        versions = self._endpoints.setdefault(archive.name, {})
        if archive.version in versions:
            raise ServingError(
                Code.INVALID_ARGUMENT, f"model {archive.name} version {archive.version} is loaded twice"
            )
        ep = ModelEndpoint(archive, spec, self.settings, self.metrics)
        versions[archive.version] = ep
        self._defaults.setdefault(archive.name, archive.version)
        self.metrics.model_ready.labels(ep.name, ep.version).set(0)
        return ep

    def install_endpoint(self, ep: ModelEndpoint) -> None:
        """Serve an endpoint built elsewhere (a frontend's, from the supervisor's model table)."""
        versions = self._endpoints.setdefault(ep.name, {})
        versions[ep.version] = ep
        self._defaults.setdefault(ep.name, ep.version)
        self.metrics.model_ready.labels(ep.name, ep.version).set(0)

    def remove_endpoint(self, model: str, version: str) -> ModelEndpoint:
        """Stop serving one version (the caller closes it); the default moves to another version."""
        ep = self._endpoints[model].pop(version)
        if not self._endpoints[model]:
            del self._endpoints[model]
            self._defaults.pop(model, None)
        elif self._defaults.get(model) == version:
            self._defaults[model] = next(iter(self._endpoints[model]))
        return ep

    # -- lookups --------------------------------------------------------------------------
    def resolve(self, model: str, version: str | None = None) -> ModelEndpoint:
        versions = self._endpoints.get(model)
        if not versions:
            served = sorted(self._endpoints)
            listed = ", ".join(served[:10]) + (f" and {len(served) - 10} more" if len(served) > 10 else "")
            raise ServingError(
                Code.NOT_FOUND, f"model {_shown(model)} is not served here; served: {listed or 'none'}"
            )
        v = version or self._defaults[model]
        ep = versions.get(v)
        if ep is None:
            raise ServingError(
                Code.NOT_FOUND,
                f"model {model!r} has no version {_shown(v)}; versions served: {', '.join(sorted(versions))}",
            )
        return ep

    def known_label(self, model: str, version: str | None) -> tuple[str, str]:
        """Metric label values: a loaded model's name/version, or 'unknown' (bounded cardinality)."""
        try:
            ep = self.resolve(model, version)
        except ServingError:
            return "unknown", "unknown"
        return ep.name, ep.version

    def models(self) -> list[ModelInfo]:
        return [
            ep.info(ep.version == self._defaults.get(name))
            for name in sorted(self._endpoints)
            for ep in self._endpoints[name].values()
        ]

    def describe(self, model: str, version: str | None = None) -> list[ModelInfo]:
        if version is None or version == "all":
            if model not in self._endpoints:
                self.resolve(model)
            return [ep.info(ep.version == self._defaults[model]) for ep in self._endpoints[model].values()]
        ep = self.resolve(model, version)
        return [ep.info(ep.version == self._defaults[model])]

    def is_live(self) -> bool:
        return True

    def is_ready(self) -> bool:
        eps = [ep for v in self._endpoints.values() for ep in v.values()]
        return (
            not self.draining
            and bool(eps)
            and len(eps) >= len(self._expected)
            and all(ep.state is ModelState.READY for ep in eps)
        )

    def model_ready(self, model: str, version: str | None = None) -> bool:
        try:
            return not self.draining and self.resolve(model, version).state is ModelState.READY
        except ServingError:
            return False

    # -- inference ------------------------------------------------------------------------
    async def infer(self, req: InferRequest) -> InferResult:
        if self.draining:
            raise ServingError(Code.UNAVAILABLE, "server is shutting down; retry on another replica")
        ep = self.resolve(req.model, req.version)
        self.accepted += 1
        self._inflight += 1
        try:
            result = await ep.infer(req)
        finally:
            self.answered += 1
            self._inflight -= 1
            if self._inflight == 0 and self._idle is not None:
                self._idle.set()
        if result.status == 200:
            self.answered_ok += 1
        return result

    # -- management -----------------------------------------------------------------------
    def _require_management(self, what: str) -> None:
        if not self.management_enabled:
            raise ServingError(
                Code.PERMISSION_DENIED,
                f"{what} is disabled: start the server with --enable-model-management to allow it "
                "(archives are then taken only from the model store)",
            )

    async def register(self, archive_name: str, **overrides: Any) -> list[ModelInfo]:
        self._require_management("model registration")
        name = overrides.pop("name", None)
        # Keyword overrides are checked here like every other layer (SettingsOverrides does it).
        spec = ModelSpec(
            archive=archive_name, name=name, overrides=SettingsOverrides(**overrides), loaded_at_startup=False
        )
        ep = self._open(spec)
        self._expected.append(spec)
        await ep.load()
        return [ep.info(ep.version == self._defaults[ep.name])]

    async def unregister(self, model: str, version: str | None = None) -> None:
        self._require_management("model unregistration")
        ep = self.resolve(model, version)
        del self._endpoints[model][ep.version]
        if not self._endpoints[model]:
            del self._endpoints[model]
            self._defaults.pop(model, None)
        elif self._defaults.get(model) == ep.version:
            self._defaults[model] = next(iter(self._endpoints[model]))
        self._expected = [s for s in self._expected if (s.name or Path(s.archive).stem) != model]
        await ep.close(timeout=ep.response_timeout_s)

    async def set_default(self, model: str, version: str) -> None:
        self._require_management("changing the default version")
        self.resolve(model, version)
        self._defaults[model] = version

    async def scale(self, model: str, version: str | None, min_workers: int, max_workers: int) -> None:
        self._require_management("scaling workers")
        raise ServingError(
            Code.UNIMPLEMENTED,
            "scaling a loaded model is not supported yet; restart with --min-workers instead",
        )

    # -- shutdown -------------------------------------------------------------------------
    def start_draining(self) -> None:
        self.draining = True

    async def close(self, grace: float) -> None:
        """Finish accepted requests within `grace` seconds, then stop every runner."""
        self.draining = True
        deadline = time.monotonic() + grace
        if self._inflight:
            # Wait for every accepted request (queued, running, or between admission and the
            # batcher) to be answered before the batchers close.
            self._idle = asyncio.Event()
            try:
                await asyncio.wait_for(self._idle.wait(), grace)
            except TimeoutError:
                log.error("grace period over with %d requests still in flight", self._inflight)
        eps = [ep for v in self._endpoints.values() for ep in v.values()]
        left = max(0.0, deadline - time.monotonic())
        await asyncio.gather(*(ep.close(left) for ep in eps))
