"""One served model version: its settings, signature, instances (runners) and batcher.

`ModelEndpoint` holds what a served version has in a frontend: admission, the deadline, the
batcher, readiness and its facts. It is built from pieces that are already resolved; where the
instances come from is the subclass's job (`frontend.RemoteEndpoint.from_entry`: connections to
the worker processes the supervisor's model table lists; the supervisor runs and restarts them).

The settings of a version are resolved once, by `resolve_model`, in the supervisor, which is
the only process that opens archives.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

from mariner.server.core.archive import ModelArchive
from mariner.server.core.batcher import Batcher
from mariner.server.core.batching import BatchPolicy, BatchRunner, max_batch_bytes
from mariner.server.core.errors import Code, ServingError
from mariner.server.core.model_settings import (
    REGISTER_CALL,
    LayerSource,
    ModelSettings,
    ServerLayers,
    SettingsOverrides,
    archive_overrides,
    resolve_model_settings,
    worker_count_origin,
)
from mariner.server.core.tensors import ModelSignature
from mariner.server.core.token_cost import TokenCounter, load_token_counter
from mariner.server.core.types import InferRequest, InferResult, ModelInfo, ModelState, WorkerInfo

log = logging.getLogger("mariner.dataplane")


def failed_message(name: str, version: str) -> str:
    """What a call to a FAILED version hears (the reason is for operators, in describe)."""
    return (
        f"model {name} version {version} failed to load and is not served; "
        "the management API's describe says why"
    )


def no_worker_message(name: str, version: str | None) -> str:
    """TorchServe's answer (503) to a call to a model registered with no worker, word for word
    (ApiUtils.getStreamingInferenceErrorResponseMessage, its stray quote after a version too)."""
    which = f'Model "{name}' + (f'" Version {version}' if version else "")
    return (
        f'{which}" has no worker to serve inference request. Please use scale workers API to add workers. '
        "If this is a sequence inference, please check if it is closed, or expired; or exceeds "
        "maxSequenceJobQueueSize"
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
class ModelSource:
    """Where a served version came from, as management shows it."""

    archive_file: str
    sha256: str
    handler: str
    loaded_at_startup: bool = True


def resolve_model(
    archive: ModelArchive, spec: ModelSpec, *, default_max_queue: int | None, layers: ServerLayers
) -> tuple[ModelSettings, ModelSignature | None]:
    """The one resolution of a version's settings and signature.

    Settings: defaults < default_* < config.properties models= < archive model-config <
    flags/env < register call (core.model_settings). A bad value anywhere refuses this archive
    with the field named.
    """
    settings = resolve_model_settings(
        *(layer for _, layer in _named_layers(archive, spec, default_max_queue, layers))
    )
    load_token_counter(archive.model_config, archive.path.name, archive.model_dir)  # refuses a bad one
    max_batch_bytes(archive.model_config, archive.path.name)  # refuses a bad one
    try:
        signature = ModelSignature.from_config(archive.model_config.get("signature"))
    except (ValueError, KeyError, TypeError) as exc:
        msg = f"archive {archive.path.name}: bad signature: {exc}"
        raise ServingError(Code.INVALID_ARGUMENT, msg) from exc
    return settings, signature


def _named_layers(
    archive: ModelArchive, spec: ModelSpec, default_max_queue: int | None, layers: ServerLayers
) -> tuple[tuple[LayerSource | None, SettingsOverrides], ...]:
    """Every layer of a version's settings, lowest first, with where each comes from. A register
    call's `initial_workers=0` is no worker under the archive's and models=' counts (TorchServe's
    ApiUtils.handleRegister): it replaces default_workers_per_model rather than topping them."""
    call = spec.overrides
    no_default_workers = not spec.loaded_at_startup and call.min_workers == 0
    if no_default_workers:
        call = replace(call, min_workers=None, max_workers=None)
    return (
        (None, SettingsOverrides(max_queue=default_max_queue)),
        *layers.named_for_model(
            archive.name,
            archive.version,
            archive.path.name,
            archive_overrides(archive.model_config, archive.path.name),
            startup=spec.loaded_at_startup,
            no_default_workers=no_default_workers,
        ),
        (REGISTER_CALL if not spec.loaded_at_startup else None, call),
    )


def resolve_worker_origin(
    archive: ModelArchive, spec: ModelSpec, *, default_max_queue: int | None, layers: ServerLayers
) -> LayerSource | None:
    """Where a version's worker count (minWorkers) was set, for the worker budget's refusal
    (see `model_settings.worker_count_origin`); None for the built-in default count."""
    return worker_count_origin(_named_layers(archive, spec, default_max_queue, layers))


class ServingMetrics(Protocol):
    """The Prometheus metrics a frontend's endpoints feed (`control.metrics.Metrics` is the real
    one): core names what it needs and imports no other layer. Each is a labelled metric family
    (`.labels(...)` then `set`/`inc`/`observe`); `ts` records TorchServe's names beside ours."""

    model_ready: Any
    oom_splits: Any
    instance_restarts: Any
    queue_depth: Any
    queue_duration: Any
    compute_duration: Any
    batch_size: Any
    batch_tokens: Any
    ts: Any

    def defer(self, child: Any) -> Any:
        """The child with its writes made once per event-loop turn (they are on the hot path)."""
        ...


class MetricsObserver:
    """Feeds batcher events into the Prometheus metrics of one model version."""

    def __init__(self, metrics: ServingMetrics, model: str, version: str) -> None:
        d = metrics.defer
        self._depth = d(metrics.queue_depth.labels(model, version))
        self._queue = d(metrics.queue_duration.labels(model, version))
        self._compute = d(metrics.compute_duration.labels(model, version))
        self._size = d(metrics.batch_size.labels(model, version))
        self._tokens_padded = d(metrics.batch_tokens.labels(model, version, "padded"))
        self._tokens_unpadded = d(metrics.batch_tokens.labels(model, version, "unpadded"))
        self._ts, self._model, self._version = metrics.ts, model, version

    def queue_depth(self, items: int) -> None:
        self._depth.set(items)

    def batch_started(
        self, items: int, queue_waits: Sequence[float], versions: Sequence[str | None] = ()
    ) -> None:
        self._size.observe(items)
        for w in queue_waits:
            self._queue.observe(w)
        self._ts.record_batch(self._model, self._version, queue_waits, versions)

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
        metrics: ServingMetrics,
        runners: Sequence[BatchRunner] = (),
        *,
        runner_concurrency: int = 1,
        envelope: str | None = None,
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
        # TorchServe's service_envelope the handler is wrapped in (kserve, kservev2, ...): KServe's
        # and OIP's routes then hand it the request body, as TorchServe does, instead of their own.
        self.envelope = envelope
        self.policy = BatchPolicy(
            self.batch_size,
            self.max_batch_delay_ms / 1e3,
            self.max_queue,
            batch_timeout_s=self.response_timeout_s,
            runner_concurrency=runner_concurrency,
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
        if self.state is ModelState.NO_WORKERS:
            raise ServingError(Code.UNAVAILABLE, no_worker_message(self.name, req.version))
        if self.state is not ModelState.READY or self.batcher is None:
            raise ServingError(
                Code.UNAVAILABLE, f"model {self.name} version {self.version} is {self.state.value}"
            )
        deadline = time.monotonic() + self.response_timeout_s
        if req.deadline is None or req.deadline > deadline:
            req = req.with_deadline(deadline)
        # The batcher answers DEADLINE_EXCEEDED when the deadline passes, queued or running
        # (one timer for all it holds: see core.deadlines).
        return await self.batcher.submit(req)

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
        return version_info(
            self.name,
            self.version,
            self.source,
            self.settings,
            is_default=is_default,
            state=self.state,
            workers=tuple(self._worker_info(r) for r in self.runners),
            load_seconds=self.load_seconds,
            signature=self.signature,
            pending_requests=self.batcher.queued_items if self.batcher is not None else 0,
        )


def version_info(
    name: str,
    version: str,
    source: ModelSource,
    settings: ModelSettings,
    *,
    is_default: bool,
    state: ModelState,
    workers: tuple[WorkerInfo, ...],
    load_seconds: float | None,
    signature: ModelSignature | None,
    pending_requests: int = 0,
    error: str | None = None,
) -> ModelInfo:
    """One version's ModelInfo from its source and settings: the one builder, for a frontend's
    endpoint and for the supervisor's registry alike."""
    return ModelInfo(
        name=name,
        version=version,
        archive=source.archive_file,
        sha256=source.sha256,
        handler=source.handler,
        is_default=is_default,
        state=state,
        batch_size=settings.batch_size,
        max_batch_delay_ms=settings.max_batch_delay_ms,
        response_timeout_s=settings.response_timeout_s,
        startup_timeout_s=settings.startup_timeout_s,
        queue_size=settings.max_queue,
        min_workers=settings.min_workers,
        max_workers=settings.max_workers,
        workers=workers,
        load_seconds=load_seconds,
        signature=signature,
        loaded_at_startup=source.loaded_at_startup,
        pending_requests=pending_requests,
        device_type=settings.device_type,
        error=error,
    )
