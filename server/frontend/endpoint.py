"""One served model version in a frontend: admission, the deadline, the batcher, readiness, its
facts, and the connections to the worker processes that run it.

`ModelEndpoint` is built from the supervisor's model-table entry: the supervisor is the only
process that opens archives, and it resolved the version's settings once (`common.models.
resolve_model`). Its runners are connections to the workers the table lists as ready; the
supervisor starts and restarts those workers, so a failed one is only let go here and a later
table brings its successor (`update`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Hashable, Sequence
from pathlib import Path
from typing import Any, Protocol

from mariner.server.common.batch_policy import (
    ASYNC_BATCHES_PER_RUNNER,
    CALLER,
    BatchPolicy,
    BatchRunner,
    async_communication,
    max_batch_bytes,
)
from mariner.server.common.models import ModelSource, failed_message, no_worker_message, version_info
from mariner.server.common.token_cost import TokenCounter, token_counter_or_none
from mariner.server.compat.torchserve.logs import words
from mariner.server.contracts.errors import Code, ServingError
from mariner.server.contracts.tensors import ModelSignature
from mariner.server.contracts.types import (
    TORCHSERVE_PROTOCOLS,
    InferRequest,
    InferResult,
    ModelInfo,
    ModelState,
    WorkerInfo,
)
from mariner.server.contracts.worker_api import ModelEntry
from mariner.server.frontend.batcher import Batcher
from mariner.server.frontend.worker_client import WorkerConnection

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
    """One served model version: admission, deadline, batcher, readiness and its facts, over
    connections to the worker processes the supervisor's table lists for it (module docstring)."""

    def __init__(self, entry: ModelEntry, metrics: ServingMetrics) -> None:
        settings = entry.settings
        concurrent = async_communication(entry.model_config)
        if isinstance(concurrent, str):  # TorchServe warns and ignores a value that is not a boolean
            log.warning("model %s version %s: %s", entry.name, entry.version, concurrent)
        handler = str(entry.manifest.get("model", {}).get("handler", ""))
        self.entry = entry
        self.name = entry.name
        self.version = entry.version
        self.source = ModelSource(entry.archive_file, entry.sha256, handler, entry.loaded_at_startup)
        self.settings = settings
        self.batch_size = settings.batch_size
        self.max_batch_delay_ms = settings.max_batch_delay_ms
        self.response_timeout_s = settings.response_timeout_s
        self.min_workers = settings.min_workers
        self.max_workers = settings.max_workers
        self.max_queue = settings.max_queue
        self.loaded_at_startup = entry.loaded_at_startup
        self.signature = ModelSignature.from_config(entry.model_config.get("signature"))
        self.state = ModelState.LOADING
        self.load_seconds: float | None = None
        self._metrics = metrics
        self._oom = metrics.oom_splits.labels(entry.name, entry.version)
        self.runners: list[WorkerConnection] = []
        self._ready_since: dict[str, float] = {}  # runner id -> time.time() it became ready
        self.batcher: Batcher | None = None
        # The archive's tokenCounter: length-aware batching within a budget.
        self.token_counter: TokenCounter | None = token_counter_or_none(
            entry.model_config, entry.archive_file, Path(entry.model_dir)
        )
        # TorchServe's service_envelope the handler is wrapped in (kserve, kservev2, ...): KServe's
        # and OIP's routes then hand it the request body, as TorchServe does, instead of their own.
        self.envelope: str | None = entry.manifest.get("model", {}).get("envelope") or None
        self.policy = BatchPolicy(
            self.batch_size,
            self.max_batch_delay_ms / 1e3,
            self.max_queue,
            batch_timeout_s=self.response_timeout_s,
            runner_concurrency=ASYNC_BATCHES_PER_RUNNER if concurrent is True else 1,
            pipelined=concurrent is not True,  # its worker computes one at a time: send the next early
            # Checked when the supervisor opened the archive, which refuses a bad value.
            max_batch_bytes=max_batch_bytes(entry.model_config, entry.archive_file),
        )
        self._workers: dict[int, WorkerConnection] = {}  # instance -> its live connection, in the batcher
        self._ever_ready = False
        self._timeouts = 0  # batches past responseTimeout since one last came back (TorchServe counts them)
        self._t0 = time.perf_counter()

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

    def _set_state(self) -> None:
        if self.state is ModelState.STOPPING:
            return
        ready = bool(self._workers)
        if ready:
            self.state = ModelState.READY
            self._ever_ready = True
        elif self.entry.error is not None:  # a refused archive, or workers that cannot start
            self.state = ModelState.FAILED
        elif not self.entry.workers and self.entry.settings.min_workers == 0:
            self.state = ModelState.NO_WORKERS  # registered or scaled to no worker, on purpose
        else:
            self.state = ModelState.RESTARTING if self._ever_ready else ModelState.LOADING
        self._set_ready(ready)

    async def update(self, entry: ModelEntry) -> None:
        """Follow the supervisor's table: connect new workers, retire the ones that are gone."""
        self.entry = entry
        ready = {w.instance: w for w in entry.workers if w.status == "READY"}
        for instance, current in list(self._workers.items()):
            want = ready.get(instance)
            if want is None or want.id != current.id or want.pid != current.endpoint.pid:
                self._retire(current)
        for instance, endpoint in ready.items():
            if instance in self._workers:
                continue
            conn = WorkerConnection(endpoint, batch_size=self.batch_size, on_oom=self._oom.inc)
            try:
                await conn.start()
            except Exception as exc:  # the worker died since the table was sent: a later table says so
                log.warning("cannot connect to worker %s (pid %d): %s", endpoint.id, endpoint.pid, exc)
                continue
            self._workers[instance] = conn
            self.runners.append(conn)
            self._ready_since[conn.id] = endpoint.start_time or time.time()
            if self.batcher is None:
                self._start_batcher([conn])
                self.load_seconds = time.perf_counter() - self._t0
            else:
                self.batcher.add_runner(conn)
        self._set_state()

    def _retire(self, conn: WorkerConnection) -> None:
        if self._workers.get(conn.instance) is conn:
            del self._workers[conn.instance]
        if conn in self.runners:
            self.runners.remove(conn)
            if self.batcher is not None and not conn.retired:
                self.batcher.retire_runner(conn)
        conn.retire()

    async def replace_runner(self, old: BatchRunner, reason: str) -> None:
        """A worker failed or hung on a batch: let it go (SIGKILL when hung). The supervisor
        restarts it and its next table brings the new worker, so nothing is returned here."""
        assert isinstance(old, WorkerConnection)
        if self._workers.get(old.instance) is old:
            del self._workers[old.instance]
        if old in self.runners:
            self.runners.remove(old)
        if reason == "hung":
            old.abandon()  # no thread and no CPU are left behind: the process goes
            # TorchServe's words for it (its WorkerThread's), counted since a batch last came back.
            self._timeouts = 1 if old.batches else self._timeouts + 1
            words.worker_timed_out(old.endpoint.ts_name or old.id, self._timeouts)
        else:
            old.retire()
        self._metrics.instance_restarts.labels(self.name, self.version, reason).inc()
        self._set_state()

    async def infer(self, req: InferRequest) -> InferResult:
        return await self.enqueue(req, CALLER.get())

    def enqueue(self, req: InferRequest, caller: Hashable) -> asyncio.Future[InferResult]:
        """Hand `req` to this version's batcher (see `Batcher.enqueue`); refusals raise at once."""
        if self.state is ModelState.FAILED:
            raise ServingError(Code.UNAVAILABLE, failed_message(self.name, self.version))
        if self.state is ModelState.NO_WORKERS:
            raise ServingError(Code.UNAVAILABLE, no_worker_message(self.name, req.version))
        if self.state is not ModelState.READY or self.batcher is None:
            raise ServingError(
                Code.UNAVAILABLE, f"model {self.name} version {self.version} is {self.state.value}"
            )
        # OIP and KServe requests are answered within responseTimeout of arriving (or their
        # client's own deadline, if sooner). TorchServe's requests keep TorchServe's meaning:
        # responseTimeout bounds their batch's run, from its start (the batcher's batch timeout,
        # answered 500 "Worker died." and the worker replaced), not their wait in the queue,
        # which the queue bound limits; counting the wait answered requests "Worker died."
        # while no worker had, and failed in a burst what TorchServe serves.
        if req.protocol not in TORCHSERVE_PROTOCOLS:
            deadline = time.monotonic() + self.response_timeout_s
            if req.deadline is None or req.deadline > deadline:
                req = req.with_deadline(deadline)
        # The batcher answers DEADLINE_EXCEEDED when the deadline passes, queued or running
        # (one timer for all it holds: see frontend.deadlines).
        return self.batcher.enqueue(req, caller)

    async def close(self, timeout: float | None) -> None:
        """Stop admitting; the batcher answers what it holds within `timeout`; then let every
        worker connection go."""
        self.state = ModelState.STOPPING
        self._set_ready(False)
        if self.batcher is not None:
            await self.batcher.close(timeout)
        for conn in list(self._workers.values()):
            conn.retire()
        self._workers.clear()

    def _worker_info(self, conn: WorkerConnection) -> WorkerInfo:
        # The worker's memory is the supervisor's to report (management is served there).
        return WorkerInfo(
            conn.id,
            conn.endpoint.device,
            "STOPPED" if conn.retired else "READY",
            conn.batches,
            pid=conn.endpoint.pid,
            started_at=self._ready_since.get(conn.id),
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
