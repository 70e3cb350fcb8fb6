"""The model worker processes: start each version's worker slots, restart a worker that exits
(with backoff), stop them. Which slots exist is the registry's call; this keeps them running."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

from mariner.server.control.metrics import Metrics
from mariner.server.core.errors import ServingError
from mariner.server.supervisor.children import Backoff, mark_dead
from mariner.server.supervisor.devices import allocator, device_ids_of
from mariner.server.supervisor.versions import Instance, Version
from mariner.server.workers.api import WorkerSpec
from mariner.server.workers.process import worker_spec

log = logging.getLogger("mariner.supervisor")


class WorkerPool:
    """Keeps every worker slot it was given running until it is retired or the server drains.

    `on_change` is awaited whenever a worker became ready, failed or exited (what frontends must
    learn); `worker_count` is the number of slots server-wide, over which the cores are shared
    when `--torch-threads` is not given; `draining` says the server is shutting down (no restart).
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
    ) -> None:
        self._torch_threads_flag = torch_threads
        self._socket_dir = socket_dir
        self._metrics = metrics
        self._on_change = on_change
        self._worker_count = worker_count
        self._draining = draining
        self._require_gpu = require_gpu

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
        except ValueError as exc:
            log.warning("model %s version %s: %s; using every visible GPU", v.name, v.version, exc)
            ids = None
        return allocator().next(ids)

    def _needs_gpu(self, v: Version) -> bool:
        """The worker must refuse to run on the CPU: deviceType gpu, or --require-gpu (unless the
        model asked for the CPU)."""
        return v.settings.device_type == "gpu" or (self._require_gpu and v.settings.device_type != "cpu")

    def _spec(self, v: Version, inst: Instance, gpu: int | None) -> WorkerSpec:
        return worker_spec(
            v.archive,
            instance=inst.index,
            generation=inst.generation,
            batch_size=v.settings.batch_size,
            gpu_id=gpu,
            torch_threads=self._torch_threads(),
            socket_dir=self._socket_dir,
            require_gpu=self._needs_gpu(v),
        )

    def add(self, v: Version, count: int) -> list[Instance]:
        """Add `count` worker slots to `v` and start them; each slot's `first` says how its
        first start went."""
        added = []
        for _ in range(count):
            index = max(v.instances, default=-1) + 1
            first: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            # At start-up nobody awaits the first start (its failure is logged and retried).
            first.add_done_callback(_retrieve)
            inst = Instance(index, first=first)
            v.instances[index] = inst
            added.append(inst)
        for inst in added:
            inst.task = asyncio.create_task(self._keep_running(v, inst), name=f"worker-{v.name}-{inst.index}")
        return added

    async def _changed(self) -> None:
        if not self._draining():
            await self._on_change()

    async def _keep_running(self, v: Version, inst: Instance) -> None:
        """Start the instance's worker; whenever it exits, restart it with exponential backoff."""
        from mariner.server.workers.process import WorkerProcess

        gpu = self._gpu_for(v)
        backoff = Backoff()
        while not inst.retired and not self._draining():
            spec = self._spec(v, inst, gpu)
            proc = WorkerProcess(spec)
            inst.process, inst.status, inst.endpoint = proc, "LOADING", None
            t0 = time.perf_counter()
            try:
                inst.endpoint = await proc.start(v.settings.startup_timeout_s)
            except (ServingError, OSError) as exc:
                reason = exc.message if isinstance(exc, ServingError) else str(exc)
                log.error("worker %s failed to start: %s; retrying in %.1f s", spec.id, reason, backoff.delay)
                inst.status, inst.error = "FAILED", reason
                if inst.first is not None and not inst.first.done():
                    inst.first.set_exception(exc)
                mark_dead(proc.pid)
                await self._changed()
                await backoff.wait()
                inst.generation += 1
                continue
            inst.status, inst.started_at, inst.error = "READY", time.time(), None
            if not v.ever_ready:
                v.ever_ready = True
                v.load_seconds = time.perf_counter() - v.t0
                self._metrics.model_load_seconds.labels(v.name, v.version).set(v.load_seconds)
            log.info("worker %s (pid %d, %s) ready in %.2f s", spec.id, proc.pid, spec.device,
                     time.perf_counter() - t0)  # fmt: skip
            if inst.first is not None and not inst.first.done():
                inst.first.set_result(None)
            await self._changed()
            rc = await proc.wait()
            mark_dead(proc.pid)
            if inst.retired or self._draining():
                break
            delay = backoff.after_run(time.time() - inst.started_at)
            log.error("worker %s (pid %d) exited with %s; restarting in %.1f s", spec.id, proc.pid, rc, delay)
            self._metrics.instance_restarts.labels(v.name, v.version, "exited").inc()
            inst.status, inst.endpoint = "LOADING", None
            await self._changed()
            await backoff.wait()
            inst.generation += 1

    async def stop(self, instances: Sequence[Instance], grace: float) -> None:
        """Retire the instances and stop their workers (SIGKILL after `grace` seconds)."""
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
                mark_dead(inst.process.pid)
            inst.status = "STOPPED"


def _retrieve(first: asyncio.Future[None]) -> None:
    """Mark a first start's failure as seen, so asyncio does not log it as never retrieved."""
    if not first.cancelled():
        first.exception()
