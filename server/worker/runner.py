"""A model instance's body: `ModelHost` loads one handler and runs its batches.

Each instance is a model worker process (`mariner.server.worker.main`) running one
`ModelHost` on one thread for its whole life (CUDA context, stream and thread-local torch state
stay put): the thread of the worker's event loop. A plain `handle` is called with the loop
hidden (`batch_server.call_off_loop`), so a handler sees no running loop, as under TorchServe
(`run_batch`); a coroutine handler (`async def handle`) is awaited on that loop, several batches
at once (`run_batch_async`), as TorchServe's asyncCommunication worker runs it. The batch logic
is the same for both (`worker.batch_steps`, driven by `worker.handler_calls`). A handler's
intermediate answers (`send_intermediate_predict_response`) reach the caller's `deliver` as they
are sent. Where the instance runs and what its device says is `worker.device`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import inspect
import logging
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mariner.server.common.archive import ModelArchive
from mariner.server.contracts.errors import Code, ServingError
from mariner.server.contracts.types import InferRequest, InferResult
from mariner.server.worker.batch_steps import BatchSteps
from mariner.server.worker.context import Context
from mariner.server.worker.device import Placement, release_cached_memory, usable_gpu
from mariner.server.worker.entry_point import load_entry_point
from mariner.server.worker.handler_calls import HandlerCall, drive, drive_async, run_awaitable
from mariner.server.worker.intermediate import Deliver
from mariner.server.worker.rows import max_rows_for

__all__ = ["ModelHost", "load_entry_point"]

log = logging.getLogger("mariner.runner")


class ModelHost(BatchSteps):
    """The synchronous half of a model instance: loads the handler and runs batches on the calling
    thread. The worker process (`mariner.server.worker.main`) and the tools that time a handler
    in-process use it, so the handler contract, the out-of-memory split and the result encoding
    live here once (the batch logic in its base, `batch_steps.BatchSteps`).

    Call `load()` and `run_batch()` from one thread for the instance's whole life (its CUDA
    stream and thread-local torch state stay put). `on_oom` is called once per split.
    `max_rows` caps the rows of one tensor request per handler call (default: the model-config's
    `maxRowsPerCall`, else 4 x batch_size; see `worker.rows`).
    """

    def __init__(
        self,
        archive: ModelArchive,
        *,
        id: str,
        placement: Placement,
        batch_size: int,
        on_oom: Callable[[], None] | None = None,
        max_rows: int | None = None,
    ) -> None:
        self.archive = archive
        self.id = id
        self.placement = placement
        self.batch_size = batch_size
        self.on_oom = on_oom
        self.max_rows = max_rows or max_rows_for(getattr(archive, "model_config", None) or {}, batch_size)
        self.batches = 0
        self.failed = False
        self.load_seconds: float | None = None
        self._handle: Any = None
        self._context: Context | None = None
        self._stream: Any = None
        self._private_loop: asyncio.AbstractEventLoop | None = None
        # A coroutine handler (`async def handle`): run_batch_async serves it, calls overlapping.
        self.is_async = False

    def load(self) -> float:
        """Set threads and device, import the handler and initialise it; returns the seconds taken."""
        t0 = time.perf_counter()
        import torch

        self._check_device()
        if self.placement.torch_threads and self.placement.gpu_id is None:
            torch.set_num_threads(self.placement.torch_threads)
        if self.placement.gpu_id is not None:
            torch.cuda.set_device(self.placement.gpu_id)
            self._stream = torch.cuda.Stream()
        self._context = Context(
            self.archive.name,
            str(self.archive.model_dir),
            self.archive.manifest,
            batch_size=self.batch_size,
            gpu_id=self.placement.gpu_id,
            model_yaml_config=self.archive.model_config,
        )
        # Handlers that pick their own device read this: True means "never fall back to the CPU".
        self._context.system_properties["require_gpu"] = self.placement.require_gpu
        handle, initialize = load_entry_point(self.archive)
        context = self._context
        self._run_on_stream(lambda: self._settled(initialize(context)))
        self._handle = handle
        self.is_async = inspect.iscoroutinefunction(handle)
        if self.is_async and self._stream is not None:
            # Calls interleave on this thread: each cannot enter and leave the stream in turn.
            torch.cuda.set_stream(self._stream)
        self.load_seconds = time.perf_counter() - t0
        log.info("instance %s ready on %s in %.2f s", self.id, self.placement.device, self.load_seconds)
        return self.load_seconds

    def _check_device(self) -> None:
        """Refuse a GPU-bound model without a usable GPU; run a placed-on-GPU model that may use
        the CPU on the CPU when CUDA turns out unusable here, and say so (describe reports
        `placement.device`, the device it really runs on)."""
        if self.placement.gpu_id is None and not self.placement.require_gpu:
            return
        why = usable_gpu(self.placement.gpu_id)
        if why is None:
            return
        if self.placement.require_gpu:
            config_asks = self.archive.model_config.get("deviceType") == "gpu"
            asked = "deviceType: gpu" if config_asks else "--require-gpu"
            raise ServingError(
                Code.UNAVAILABLE,
                f"model {self.archive.name} version {self.archive.version} requires a GPU ({asked}) "
                f"but {why}; it is not served on the CPU",
            )
        log.warning("instance %s was placed on %s but %s; it runs on the CPU", self.id,
                    self.placement.device, why)  # fmt: skip
        self.placement = dataclasses.replace(self.placement, gpu_id=None)

    def unload(self) -> None:
        """Let the handler, its module, its context and its model go: what they hold is released
        with them (device memory; an AOTInductor package's extracted .so and its aotinductor_*
        temp dir are removed only then)."""
        self._handle = None
        self._context = None
        self._stream = None
        if self._private_loop is not None:
            self._private_loop.close()
            self._private_loop = None
        # The archive's modules' globals may hold the model too: forget every module loaded from it.
        root = self.archive.model_dir.resolve()
        for name, module in list(sys.modules.items()):
            origin = getattr(module, "__file__", None)
            if origin and Path(origin).resolve().is_relative_to(root):
                sys.modules.pop(name, None)
        # Objects frozen by gc.freeze() are never collected: a model in a reference cycle would
        # outlive its unregistration. Thaw, collect, and freeze what is still alive again.
        refreeze = gc.get_freeze_count() > 0
        if refreeze:
            gc.unfreeze()
        gc.collect()
        if refreeze:
            gc.freeze()
        release_cached_memory()

    def _run_on_stream(self, fn: Any, *args: Any) -> Any:
        if self._stream is None:
            return fn(*args)
        import torch

        with torch.cuda.stream(self._stream):
            out = fn(*args)
        self._stream.synchronize()
        return out

    def _settled(self, value: Any) -> Any:
        """`value`, or what it gives once awaited when the handler returned an awaitable from a
        call made synchronously (a coroutine is run to its end on a private loop)."""
        if not inspect.isawaitable(value):
            return value
        if self._private_loop is None:
            self._private_loop = asyncio.new_event_loop()
        return run_awaitable(self._private_loop, value)

    def _call_sync(self, call: HandlerCall) -> Any:
        return self._run_on_stream(lambda: self._settled(self._handle(call.data, call.context)))

    def _call_async(self, call: HandlerCall) -> Any:
        return self._handle(call.data, call.context)  # the driver awaits what it returns

    def run_batch(self, requests: list[InferRequest], deliver: Deliver | None = None) -> list[InferResult]:
        """Run a batch on this thread; on out-of-memory, split it in halves and retry each (down
        to one request, then a tensor request's rows). A tensor request of more than `max_rows`
        rows runs in chunks of `max_rows`. `deliver(request_id, part)` gets each intermediate
        answer the handler sends.

        Raises ServingError for a whole-batch failure, InstanceFailed when the handler ended
        the instance (SystemExit & co, or a fatal device error).
        """
        return drive(self._batch_steps(requests, deliver, shared=True), self._call_sync)

    async def run_batch_async(
        self, requests: list[InferRequest], deliver: Deliver | None = None
    ) -> list[InferResult]:
        """`run_batch` for a coroutine handler, awaited on the running loop: several may run at
        once, each with a Context of its own (`Context.for_call`)."""
        steps = self._batch_steps(requests, deliver, shared=False)
        out = await drive_async(steps, self._call_async)
        if self._stream is not None:
            self._stream.synchronize()
        return out
