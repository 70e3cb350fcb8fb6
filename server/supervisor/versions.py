"""A model version as the supervisor holds it (its archive, settings, worker slots), and how it
is shown: to management (`model_info`) and to the frontends (`table_entry`)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from mariner.server.common.archive import ModelArchive
from mariner.server.common.model_settings import ModelSettings
from mariner.server.common.models import ModelSource, ModelSpec, resident_bytes, version_info
from mariner.server.contracts.tensors import ModelSignature
from mariner.server.contracts.types import ModelInfo, ModelState, WorkerInfo, instance_id
from mariner.server.contracts.worker_api import ModelEntry, WorkerEndpoint
from mariner.server.supervisor.failed_models import FailedModel


@dataclass
class Instance:
    """One worker slot of a model version: its current process and how it is doing."""

    index: int
    generation: int = 0
    process: Any = None  # mariner.server.supervisor.worker_process.WorkerProcess
    endpoint: WorkerEndpoint | None = None
    status: str = "LOADING"
    started_at: float | None = None
    error: str | None = None  # why its last start failed (cleared once it is ready)
    retired: bool = False
    task: asyncio.Task[None] | None = None
    first: asyncio.Future[None] | None = None  # the first start's outcome
    # Set when the slot is retired: its task stops waiting (a backoff, a start) at once.
    retired_event: asyncio.Event = field(default_factory=asyncio.Event, repr=False)

    def retire(self) -> None:
        """No new process for this slot, and none of its waits goes on (see WorkerPool)."""
        self.retired = True
        self.retired_event.set()


@dataclass
class Version:
    """One model version the supervisor serves."""

    archive: ModelArchive
    spec: ModelSpec
    settings: ModelSettings
    signature: ModelSignature | None
    instances: dict[int, Instance] = field(default_factory=dict)
    ever_ready: bool = False
    load_seconds: float | None = None
    t0: float = field(default_factory=time.perf_counter)
    # One lifecycle change at a time (register's start, scale): a change waits for the one
    # before it. Unregister does not wait: it sets `removed` and stops every slot, which ends
    # a change in progress (its slots' first starts fail) and refuses the ones waiting.
    lifecycle: asyncio.Lock = field(default_factory=asyncio.Lock, repr=False)
    removed: bool = False
    # What one worker is expected to cost before one is measured (worker_budget.archive_estimate).
    worker_estimate: int = 0

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
        if not live and self.settings.min_workers == 0:
            return ModelState.NO_WORKERS
        if self.ever_ready:
            return ModelState.RESTARTING
        if live and all(i.status == "FAILED" for i in live):
            return ModelState.FAILED
        return ModelState.LOADING

    @property
    def error(self) -> str | None:
        """Why a FAILED version is not served: its first live instance's start failure."""
        if self.state is not ModelState.FAILED:
            return None
        return next((i.error for i in self.live_instances() if i.error), None)

    def live_instances(self) -> list[Instance]:
        """The instances not being retired, by index."""
        return sorted((i for i in self.instances.values() if not i.retired), key=lambda i: i.index)


def instance_device(inst: Instance) -> str:
    """Where an instance runs: its live worker's device, else the device its (loading) worker
    process was placed on; "cpu" only before any process exists for it."""
    if inst.endpoint is not None:
        return inst.endpoint.device
    if inst.process is not None:
        return str(inst.process.spec.device)
    return "cpu"


def table_entry(v: Version, is_default: bool) -> ModelEntry:
    """The version as frontends learn it, with one endpoint per instance: the live worker when
    it is READY, else where the instance stands (LOADING / FAILED), so a frontend keeps its place."""
    workers = []
    for inst in v.live_instances():
        if inst.status == "READY" and inst.endpoint is not None:
            workers.append(inst.endpoint)
            continue
        pid = inst.process.pid if inst.process is not None else 0
        workers.append(
            WorkerEndpoint(
                id=instance_id(v.name, v.version, inst.index, inst.generation),
                instance=inst.index,
                generation=inst.generation,
                socket_path="",
                pid=pid or 0,
                device=instance_device(inst),
                status=inst.status,
            )
        )
    return ModelEntry(
        name=v.name,
        version=v.version,
        archive_file=v.archive.path.name,
        sha256=v.archive.sha256,
        model_dir=str(v.archive.model_dir),
        manifest=v.archive.manifest,
        model_config=v.archive.model_config,
        settings=v.settings,
        is_default=is_default,
        loaded_at_startup=v.spec.loaded_at_startup,
        workers=tuple(workers),
        error=v.error,
    )


def failed_entry(f: FailedModel, is_default: bool) -> ModelEntry:
    """A FAILED version as frontends learn it: no workers, so the frontend never calls it ready
    (its `/readyz` and the model's readiness stay false while the supervisor reports it)."""
    return ModelEntry(
        name=f.name,
        version=f.version,
        archive_file=f.archive_file,
        sha256="",
        model_dir="",
        manifest={},
        model_config={},
        settings=ModelSettings(),
        is_default=is_default,
        loaded_at_startup=True,
        workers=(),
        error=f.reason,
    )


def model_info(v: Version, is_default: bool) -> ModelInfo:
    """The version as management shows it: settings, state, and each worker's pid and memory."""
    workers = []
    for inst in v.live_instances():
        pid = inst.process.pid if inst.process is not None else None
        ep = inst.endpoint
        workers.append(
            WorkerInfo(
                ep.id if ep is not None else instance_id(v.name, v.version, inst.index, inst.generation),
                instance_device(inst),
                inst.status,
                0,  # batches are counted where they run (the frontends' metrics), not here
                pid=pid,
                memory_bytes=resident_bytes(pid) if pid is not None else None,
                started_at=inst.started_at if inst.status == "READY" else None,
            )
        )
    source = ModelSource(v.archive.path.name, v.archive.sha256, v.archive.handler, v.spec.loaded_at_startup)
    return version_info(
        v.name,
        v.version,
        source,
        v.settings,
        is_default=is_default,
        state=v.state,
        workers=tuple(workers),
        load_seconds=v.load_seconds,
        signature=v.signature,
        error=v.error,
    )
