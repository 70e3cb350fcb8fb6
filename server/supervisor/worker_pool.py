"""The model worker processes: start each version's worker slots, restart a worker that exits
(with backoff), stop them. Which slots exist is the registry's call; this keeps them running.

Nothing a slot meets may end the supervisor: a start that fails in any way (the worker's own
refusal, a fork or thread the machine cannot create: OSError, RuntimeError("can't start new
thread"), MemoryError...) fails that start (the slot is FAILED, its first start's future says
why) and is retried with backoff; anything else a slot's task raises is logged and reflected
the same way, never left to end the task silently.

Retries follow TorchServe's policy in time: a slot whose worker keeps failing (start failures
and exits alike, since its last ready start) is retried with the backoff until it has been
failing for the archive's `maxRetryTimeoutInSec` (TorchServe's model-config key, default 300 s),
then left FAILED. Each retry is told in TorchServe's words too (`compat.torchserve.logs.words`: "Worker
disconnected", "Auto recovery start timestamp", "Retry worker"...), a start past its
startupTimeout as TorchServe's "Backend worker error", for the tools that wait for them.

Stopping a slot never leaves its process behind, whatever the slot is doing (`worker_stop`).
What a failed or stopped slot says, and how long it is retried, is `worker_failures`'.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

from mariner.server.common.metrics import Metrics
from mariner.server.common.model_settings import ModelSettings
from mariner.server.compat.torchserve.logs import words
from mariner.server.compat.torchserve.metrics import log_worker_load
from mariner.server.contracts.errors import ServingError
from mariner.server.contracts.worker_api import WorkerSpec
from mariner.server.supervisor.children import MAX_BACKOFF_S, Backoff, mark_dead
from mariner.server.supervisor.devices import allocator, device_ids_of
from mariner.server.supervisor.versions import Instance, Version
from mariner.server.supervisor.worker_budget import WorkerBudget
from mariner.server.supervisor.worker_failures import (
    fail_first,
    logged_reason,
    max_retry_s,
    retrieve_failure,
    start_error,
    stopped_error,
)
from mariner.server.supervisor.worker_process import (
    START_ENV,
    WorkerOutputs,
    WorkerStartTimeout,
    worker_spec,
)
from mariner.server.supervisor.worker_stop import kill_worker, stop_slot

log = logging.getLogger("mariner.supervisor")


class WorkerPool:
    """Keeps every worker slot it was given running until it is retired or the server drains.

    `on_change` is awaited whenever a worker became ready, failed or exited (what frontends must
    learn); `worker_count` is the number of slots server-wide, over which the cores are shared
    when `--torch-threads` is not given; `draining` says the server is shutting down (no restart).
    `budget`, when given, measures every worker once it is ready (worker_budget).
    """

    def __init__(
        self,
        torch_threads: int | None,
        socket_dir: Path,
        metrics: Metrics,
        on_change: Callable[[], Awaitable[None]],
        worker_count: Callable[[], int],
        draining: Callable[[], bool],
        require_gpu: bool = False,
        budget: WorkerBudget | None = None,
        output: WorkerOutputs | None = None,
    ) -> None:
        self._torch_threads_flag = torch_threads
        self._socket_dir = socket_dir
        self._metrics = metrics
        self._on_change = on_change
        self._worker_count = worker_count
        self._draining = draining
        self._require_gpu = require_gpu
        self._budget = budget
        self._output = output  # who reads the workers' stdout and stderr (TorchServe's MODEL_LOG)
        self._next_port = words.FIRST_WORKER_PORT  # TorchServe's number per slot, as its ports

    def _torch_threads(self) -> int:
        if self._torch_threads_flag:
            return self._torch_threads_flag
        return max(1, (os.cpu_count() or 1) // max(1, self._worker_count()))

    def _gpu_for(self, v: Version) -> int | None:
        """The next GPU of the server-wide round-robin (within the model-config's deviceIds);
        None for CPU models or without GPUs."""
        if v.settings.device_type == "cpu":
            return None
        try:
            ids = device_ids_of(v.archive.model_config)
        except ServingError as exc:  # refused at registration; kept for configs checked elsewhere
            log.warning("model %s version %s: %s; using every visible GPU", v.name, v.version, exc.message)
            ids = None
        return allocator().next(ids)

    def _needs_gpu(self, v: Version) -> bool:
        """The worker must refuse to run on the CPU: deviceType gpu, or --require-gpu (unless the
        model asked for the CPU)."""
        return v.settings.device_type == "gpu" or (self._require_gpu and v.settings.device_type != "cpu")

    def spawns(self, settings: ModelSettings) -> bool:
        """Whether a version's workers are fresh interpreters rather than forks of the zygote (a
        GPU worker, one that requires a GPU, or MARINER_WORKER_START=spawn): they cost more."""
        on_gpu = settings.device_type != "cpu" and allocator().count > 0
        needs_gpu = settings.device_type == "gpu" or (self._require_gpu and settings.device_type != "cpu")
        return on_gpu or needs_gpu or os.environ.get(START_ENV, "zygote") == "spawn"

    def _spec(self, v: Version, inst: Instance, gpu: int | None, port: int) -> WorkerSpec:
        return worker_spec(
            v.archive,
            instance=inst.index,
            generation=inst.generation,
            batch_size=v.settings.batch_size,
            gpu_id=gpu,
            torch_threads=self._torch_threads(),
            socket_dir=self._socket_dir,
            require_gpu=self._needs_gpu(v),
            ts_port=port,
        )

    def add(self, v: Version, count: int) -> list[Instance]:
        """Add `count` worker slots to `v` and start them; each slot's `first` says how its
        first start went (it is always resolved: ready, failed, or stopped before it was ready)."""
        added = []
        loop = asyncio.get_running_loop()
        for _ in range(count):
            index = max(v.instances, default=-1) + 1
            first: asyncio.Future[None] = loop.create_future()
            # At start-up nobody awaits the first start (its failure is logged and retried).
            first.add_done_callback(retrieve_failure)
            inst = Instance(index, first=first)
            v.instances[index] = inst
            added.append(inst)
        for inst in added:
            recovery = words.Recovery(self._next_port, v.name, v.version)
            self._next_port += 1
            try:
                inst.task = asyncio.create_task(
                    self._keep_running(v, inst, recovery), name=f"worker-{v.name}-{inst.index}"
                )
            except Exception as exc:  # noqa: BLE001 - e.g. MemoryError: this slot fails, not the caller
                err = start_error(v, exc)
                log.error("worker slot %d of model %s version %s cannot run: %s", inst.index, v.name,
                          v.version, err.message)  # fmt: skip
                inst.status, inst.error = "FAILED", err.message
                fail_first(inst, err)
        return added

    async def _changed(self) -> None:
        if self._draining():
            return
        try:
            await self._on_change()
        except Exception:  # noqa: BLE001 - telling the frontends failed; the slot goes on
            log.exception("publishing a worker change failed")

    def _wanted(self, inst: Instance) -> bool:
        return not inst.retired and not self._draining()

    async def _pause(self, inst: Instance, backoff: Backoff) -> None:
        """The backoff's delay, cut short when the slot is retired."""
        delay = backoff.delay
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(inst.retired_event.wait(), delay)
        backoff.delay = min(delay * 2, MAX_BACKOFF_S)

    async def _keep_running(self, v: Version, inst: Instance, recovery: words.Recovery) -> None:
        """Run the slot (`_run_slot`); whatever escapes it is logged and reflected (FAILED, its
        first start's future), then the slot carries on after a backoff. The first start's
        future is resolved however the task ends."""
        backoff = Backoff()
        try:
            while self._wanted(inst):
                try:
                    await self._run_slot(v, inst, recovery)
                    return
                except Exception as exc:  # noqa: BLE001 - never end the slot, nor the supervisor, silently
                    err = start_error(v, exc)
                    log.exception("worker slot %d of model %s version %s failed: %s", inst.index, v.name,
                                  v.version, err.message)  # fmt: skip
                    inst.status, inst.error, inst.endpoint = "FAILED", err.message, None
                    fail_first(inst, err)
                    await kill_worker(inst.process)
                    await self._changed()
                    await self._pause(inst, backoff)
                    inst.generation += 1
        finally:
            why = "the server is shutting down" if self._draining() else None
            fail_first(inst, stopped_error(inst, why and f"model {v.name} version {v.version}: {why}"))

    async def _run_slot(self, v: Version, inst: Instance, recovery: words.Recovery) -> None:
        """Start the instance's worker; whenever it fails to start or exits, restart it with
        exponential backoff, until it has been failing for maxRetryTimeoutInSec."""
        from mariner.server.supervisor.worker_process import WorkerProcess

        gpu = self._gpu_for(v)
        backoff = Backoff()
        give_up_after = max_retry_s(v.archive.model_config)
        timeouts = 0  # consecutive starts past the startupTimeout (TorchServe counts them)
        while self._wanted(inst):
            proc: WorkerProcess | None = None
            t0 = time.perf_counter()
            try:
                spec = self._spec(v, inst, gpu, recovery.port)
                proc = WorkerProcess(spec, output=self._output)
                # A slot whose last start failed stays FAILED (with its reason) while it retries:
                # the version does not flicker FAILED/LOADING with each backoff.
                inst.process, inst.endpoint = proc, None
                inst.status = "FAILED" if inst.status == "FAILED" and inst.error else "LOADING"
                endpoint = await proc.start(v.settings.startup_timeout_s)
            except Exception as exc:  # noqa: BLE001 - any failed start fails this start only
                await kill_worker(proc)  # whatever it had started is gone before anything else
                if not self._wanted(inst):
                    return  # stopped while starting: not a failure
                err = start_error(v, exc)
                worker = proc.spec.id if proc is not None else f"{v.name}/{v.version}#{inst.index}"
                if isinstance(exc, WorkerStartTimeout):
                    timeouts += 1
                    words.worker_timed_out(recovery.thread, timeouts)
                said = logged_reason(v, exc)
                inst.status, inst.error = "FAILED", err.message
                fail_first(inst, err)
                if proc is not None:
                    mark_dead(proc.pid)
                recovery.stopped("WORKER_STARTED")
                if self._gave_up(v, inst, recovery, give_up_after, f"failed to start: {said}"):
                    await self._changed()
                    return
                log.error("worker %s failed to start: %s; retrying in %.1f s", worker, said, backoff.delay)
                recovery.retry(backoff.delay)
                await self._changed()
                await self._pause(inst, backoff)
                inst.generation += 1
                continue
            if not self._wanted(inst):  # retired while it loaded: it never serves
                await kill_worker(proc)
                return
            timeouts = 0
            recovery.loaded()
            log_worker_load(spec.ts_name, time.perf_counter() - t0)  # TorchServe's WorkerLoadTime line
            inst.endpoint = endpoint
            inst.status, inst.started_at, inst.error = "READY", time.time(), None
            if not v.ever_ready:
                v.ever_ready = True
                v.load_seconds = time.perf_counter() - v.t0
                self._metrics.model_load_seconds.labels(v.name, v.version).set(v.load_seconds)
            if self._budget is not None:
                self._budget.note_ready((v.name, v.version), proc.pid)
            log.info("worker %s (pid %d, %s) ready in %.2f s", spec.id, proc.pid, spec.device,
                     time.perf_counter() - t0)  # fmt: skip
            if inst.first is not None and not inst.first.done():
                inst.first.set_result(None)
            await self._changed()
            rc = await proc.wait()
            mark_dead(proc.pid)
            if not self._wanted(inst):
                return
            delay = backoff.after_run(time.time() - (inst.started_at or time.time()))
            self._metrics.instance_restarts.labels(v.name, v.version, "exited").inc()
            inst.status, inst.endpoint = "LOADING", None
            recovery.stopped("WORKER_MODEL_LOADED")
            if self._gave_up(v, inst, recovery, give_up_after, f"exited with {rc}"):
                await self._changed()
                return
            log.error("worker %s (pid %d) exited with %s; restarting in %.1f s", spec.id, proc.pid, rc, delay)
            recovery.retry(delay)
            await self._changed()
            await self._pause(inst, backoff)
            inst.generation += 1

    def _gave_up(self, v: Version, inst: Instance, recovery: words.Recovery, limit: float, what: str) -> bool:
        """Whether the slot stops retrying: it has been failing (since its last ready start) for
        the archive's maxRetryTimeoutInSec. It is then left FAILED, saying so."""
        failing = recovery.failing_for_s()
        if failing < limit:
            return False
        why = (
            f"model {v.name} version {v.version}: worker slot {inst.index} {what}; it has been failing for "
            f"{failing:.0f} s (maxRetryTimeoutInSec {limit:g}) and is no longer retried"
        )
        log.error("%s", why)
        inst.status, inst.error, inst.endpoint = "FAILED", why, None
        return True

    async def stop(
        self, instances: Sequence[Instance], grace: float, *, drain: bool = False, why: str | None = None
    ) -> None:
        """Retire the instances and stop their workers, leaving no process behind.

        A worker still loading is SIGKILLed at once (it has no batch to finish), and one whose
        process is being created is killed as soon as it exists. A ready one gets SIGTERM (it
        finishes the batch in hand), SIGKILL after `grace` seconds; with `drain`, first the
        frontends' connections to it close (each frontend closes its connection to a worker
        the table no longer lists once the batch it runs there is answered), within `grace`.
        A first start still pending fails, saying `why` the worker was stopped."""
        for inst in instances:
            inst.retire()
        await asyncio.gather(*(stop_slot(i, grace, drain, why) for i in instances), return_exceptions=True)
