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
import time
from collections.abc import Sequence
from typing import Any, Protocol

from mariner.server.common.batch_policy import BatchPolicy, BatchRunner
from mariner.server.common.model_settings import (
    ModelSettings,
)
from mariner.server.common.models import (
    ModelSource,
    failed_message,
    no_worker_message,
    resident_bytes,
    version_info,
)
from mariner.server.common.token_cost import TokenCounter
from mariner.server.contracts.errors import Code, ServingError
from mariner.server.contracts.tensors import ModelSignature
from mariner.server.contracts.types import InferRequest, InferResult, ModelInfo, ModelState, WorkerInfo
from mariner.server.frontend.batcher import Batcher

log = logging.getLogger("mariner.dataplane")


class ServingMetrics(Protocol):
    """The Prometheus metrics a frontend's endpoints feed (`common.metrics.Metrics` is the real
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
        # (one timer for all it holds: see frontend.deadlines).
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
