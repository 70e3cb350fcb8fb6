"""One served model version: its settings, signature, instances (runners) and batcher.

`ModelEndpoint` holds what every served version has, however its instances run: admission,
the deadline, the batcher, readiness and what management shows. It is built from pieces that
are already resolved. Where the instances come from is a subclass's job:

- `ArchiveEndpoint.from_archive`: an archive this process opened; its instances are worker
  processes (or threads) this endpoint starts and restarts itself (the single-process server).
- `frontend.RemoteEndpoint.from_entry`: a supervisor's model-table entry; its instances are
  connections to worker processes that the supervisor runs and restarts.

The settings of a version are resolved once, by `resolve_model`, in whichever process opens
the archive (the single-process server or the supervisor).
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from mariner.server.control.metrics import Metrics
from mariner.server.core.archive import ArchiveLimits, ModelArchive
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
from mariner.server.core.token_cost import TokenCounter, load_token_counter
from mariner.server.core.types import InferRequest, InferResult, ModelInfo, ModelState, WorkerInfo
from mariner.server.workers.process import ProcessRunner, socket_dir_for

log = logging.getLogger("mariner.dataplane")


def failed_message(name: str, version: str) -> str:
    """What a call to a FAILED version hears (the reason is for operators, in describe)."""
    return (
        f"model {name} version {version} failed to load and is not served; "
        "the management API's describe says why"
    )


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
    # --require-gpu: a model that does not ask for the CPU fails to load without a usable GPU.
    require_gpu: bool = False

    def __post_init__(self) -> None:
        if self.worker_mode not in ("process", "thread"):
            raise ValueError(f"worker_mode must be 'process' or 'thread', not {self.worker_mode!r}")


@dataclass(frozen=True)
class ModelSource:
    """Where a served version came from, as management shows it."""

    archive_file: str
    sha256: str
    handler: str
    loaded_at_startup: bool = True


def resolve_model(
    archive: ModelArchive, spec: ModelSpec, *, default_max_queue: int, layers: ServerLayers
) -> tuple[ModelSettings, ModelSignature | None]:
    """The one resolution of a version's settings and signature.

    Settings: defaults < archive model-config < config.properties < flags/env < register call.
    A bad value anywhere refuses this archive with the field named.
    """
    settings = resolve_model_settings(
        SettingsOverrides(max_queue=default_max_queue),
        archive_overrides(archive.model_config, archive.path.name),
        *layers.for_model(archive.name, archive.version, archive.path.name),
        spec.overrides,
    )
    load_token_counter(archive.model_config, archive.path.name, archive.model_dir)  # refuses a bad one
    try:
        signature = ModelSignature.from_config(archive.model_config.get("signature"))
    except (ValueError, KeyError, TypeError) as exc:
        msg = f"archive {archive.path.name}: bad signature: {exc}"
        raise ServingError(Code.INVALID_ARGUMENT, msg) from exc
    return settings, signature


class MetricsObserver:
    """Feeds batcher events into the Prometheus metrics of one model version."""

    def __init__(self, metrics: Metrics, model: str, version: str) -> None:
        self._depth = metrics.queue_depth.labels(model, version)
        self._queue = metrics.queue_duration.labels(model, version)
        self._compute = metrics.compute_duration.labels(model, version)
        self._size = metrics.batch_size.labels(model, version)
        self._tokens_padded = metrics.batch_tokens.labels(model, version, "padded")
        self._tokens_unpadded = metrics.batch_tokens.labels(model, version, "unpadded")
        self._ts, self._model, self._version = metrics.ts, model, version

    def queue_depth(self, items: int) -> None:
        self._depth.set(items)

    def batch_started(self, items: int, queue_waits: Sequence[float]) -> None:
        self._size.observe(items)
        for w in queue_waits:
            self._queue.observe(w)
        self._ts.record_batch(self._model, self._version, queue_waits)

    def batch_finished(self, seconds: float) -> None:
        self._compute.observe(seconds)
        self._ts.record_compute(self._model, self._version, seconds)

    def batch_tokens(self, padded: int, unpadded: int) -> None:
        self._tokens_padded.observe(padded)
        self._tokens_unpadded.observe(unpadded)


def resident_bytes(pid: int | None = None) -> int | None:
    """A process's resident set size (Linux /proc; this process by default); None where it
    cannot be read (e.g. the process is gone)."""
    try:
        with open(f"/proc/{pid or 'self'}/statm", "rb") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def _loop_time_of(deadline: float | None) -> float | None:
    """A time.monotonic() instant on the running loop's clock (they differ under uvloop)."""
    if deadline is None:
        return None
    return asyncio.get_running_loop().time() + (deadline - time.monotonic())


class ModelEndpoint:
    """One served model version: admission, deadline, batcher, readiness and its facts.

    Built from already-resolved pieces; subclasses say where the runners come from and how a
    failed one is replaced (`replace_runner`).
    """

    def __init__(
        self,
        name: str,
        version: str,
        source: ModelSource,
        settings: ModelSettings,
        signature: ModelSignature | None,
        metrics: Metrics,
        runners: Sequence[BatchRunner] = (),
    ) -> None:
        self.name = name
        self.version = version
        self.source = source
        self.settings = settings
        self.batch_size = settings.batch_size
        self.max_batch_delay_ms = settings.max_batch_delay_ms
        self.response_timeout_s = settings.response_timeout_s
        self.min_workers = settings.min_workers
        self.max_workers = settings.max_workers
        self.max_queue = settings.max_queue
        self.loaded_at_startup = source.loaded_at_startup
        self.signature = signature
        self.state = ModelState.LOADING
        self.load_seconds: float | None = None
        self._metrics = metrics
        self._oom = metrics.oom_splits.labels(name, version)
        self.runners: list[Any] = list(runners)
        self._ready_since: dict[str, float] = {}  # runner id -> time.time() it became ready
        self.batcher: Batcher | None = None
        # Set by a subclass from the archive's tokenCounter: length-aware batching within a budget.
        self.token_counter: TokenCounter | None = None
        self.policy = BatchPolicy(
            self.batch_size,
            self.max_batch_delay_ms / 1e3,
            self.max_queue,
            batch_timeout_s=self.response_timeout_s,
        )

    def _start_batcher(self, runners: Sequence[BatchRunner]) -> Batcher:
        self.batcher = Batcher(
            runners,
            self.policy,
            observer=MetricsObserver(self._metrics, self.name, self.version),
            replace_runner=self.replace_runner,
            tokens=self.token_counter,
        )
        self.batcher.start()
        return self.batcher

    def _set_ready(self, ready: bool) -> None:
        self._metrics.model_ready.labels(self.name, self.version).set(1 if ready else 0)

    async def replace_runner(self, old: BatchRunner, reason: str) -> BatchRunner | None:
        """The batcher lost `old` (failed or hung on a batch): the subclass says what replaces it."""
        raise NotImplementedError

    async def infer(self, req: InferRequest) -> InferResult:
        if self.state is ModelState.FAILED:
            raise ServingError(Code.UNAVAILABLE, failed_message(self.name, self.version))
        if self.state is not ModelState.READY or self.batcher is None:
            raise ServingError(
                Code.UNAVAILABLE, f"model {self.name} version {self.version} is {self.state.value}"
            )
        deadline = time.monotonic() + self.response_timeout_s
        if req.deadline is None or req.deadline > deadline:
            req = replace(req, deadline=deadline)
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
        """Stop admitting; the batcher answers what it holds within `timeout`."""
        self.state = ModelState.STOPPING
        self._set_ready(False)
        if self.batcher is not None:
            await self.batcher.close(timeout)

    def _worker_info(self, runner: Any) -> WorkerInfo:
        return WorkerInfo(
            runner.id,
            runner.placement.device,
            runner.status,
            runner.batches,
            pid=runner.pid,
            memory_bytes=resident_bytes(runner.pid) if runner.pid is not None else None,
            started_at=self._ready_since.get(runner.id),
        )

    def info(self, is_default: bool) -> ModelInfo:
        """This version's facts for management: settings, live queue depth and its workers."""
        return ModelInfo(
            name=self.name,
            version=self.version,
            archive=self.source.archive_file,
            sha256=self.source.sha256,
            handler=self.source.handler,
            is_default=is_default,
            state=self.state,
            batch_size=self.batch_size,
            max_batch_delay_ms=self.max_batch_delay_ms,
            response_timeout_s=self.response_timeout_s,
            queue_size=self.max_queue,
            min_workers=self.min_workers,
            max_workers=self.max_workers,
            workers=tuple(self._worker_info(r) for r in self.runners),
            load_seconds=self.load_seconds,
            signature=self.signature,
            loaded_at_startup=self.loaded_at_startup,
            pending_requests=self.batcher.queued_items if self.batcher is not None else 0,
            device_type=self.settings.device_type,
        )


class ArchiveEndpoint(ModelEndpoint):
    """A version from an archive this process opened; it starts and restarts its own instances:
    worker processes (the default) or threads of this process (`PlaneSettings.worker_mode`)."""

    def __init__(
        self,
        archive: ModelArchive,
        source: ModelSource,
        settings: ModelSettings,
        signature: ModelSignature | None,
        plane: PlaneSettings,
        metrics: Metrics,
    ) -> None:
        super().__init__(archive.name, archive.version, source, settings, signature, metrics)
        self.archive = archive
        self._plane = plane
        self.token_counter = load_token_counter(archive.model_config, archive.path.name, archive.model_dir)
        self._socket_dir: Path | None = None
        self._socket_dir_is_temp = False
        torch_threads = plane.torch_threads
        if plane.worker_mode == "process" and torch_threads:
            # The thread budget is the cores: each worker process takes its share of it.
            torch_threads = max(1, torch_threads // self.min_workers)
        placements = place_instances(
            self.min_workers,
            device_type=settings.device_type,
            torch_threads=torch_threads,
            require_gpu=plane.require_gpu,
            model_config=archive.model_config,
        )
        self.runners = [self._new_runner(i, p) for i, p in enumerate(placements)]

    @classmethod
    def from_archive(
        cls, archive: ModelArchive, spec: ModelSpec, plane: PlaneSettings, metrics: Metrics
    ) -> ArchiveEndpoint:
        """Resolve the archive's settings and signature (refusing bad ones) and build its runners."""
        settings, signature = resolve_model(
            archive, spec, default_max_queue=plane.default_max_queue, layers=plane.model_layers
        )
        source = ModelSource(archive.path.name, archive.sha256, archive.handler, spec.loaded_at_startup)
        return cls(archive, source, settings, signature, plane, metrics)

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
        self._set_ready(ready)

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
            self._set_ready(False)
            raise
        self._start_batcher(self.runners)
        self.load_seconds = time.perf_counter() - t0
        self.state = ModelState.READY
        self._metrics.model_load_seconds.labels(self.name, self.version).set(self.load_seconds)
        self._set_ready(True)

    async def close(self, timeout: float | None) -> None:
        await super().close(timeout)
        # Workers finish the batch in hand (none: the batcher is closed) and exit; a worker that
        # does not is killed after a short grace, so no process outlives the server.
        await asyncio.gather(*(r.stop(5.0) for r in self.runners))
        if self._socket_dir is not None and self._socket_dir_is_temp:
            shutil.rmtree(self._socket_dir, ignore_errors=True)
        shutil.rmtree(self.archive.model_dir, ignore_errors=True)
