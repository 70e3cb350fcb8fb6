"""A model instance's body: `ModelHost` loads one handler and runs its batches.

Each instance is a model worker process (`mariner.server.worker.main`) running one
`ModelHost` on one thread for its whole life (CUDA context, stream and thread-local torch state
stay put): the thread of the worker's event loop. A plain `handle` is called with the loop
hidden (`call_off_loop`), so a handler sees no running loop, as under TorchServe (`run_batch`);
a coroutine handler (`async def handle`) is awaited on that loop, several batches at once
(`run_batch_async`), as TorchServe's asyncCommunication worker runs it. The batch logic is the
same for both (`worker.handler_calls`). A handler's intermediate answers
(`send_intermediate_predict_response`) reach the caller's `deliver` as they are sent.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import inspect
import logging
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mariner.server.common.archive import ModelArchive
from mariner.server.common.batch_policy import InstanceFailed
from mariner.server.contracts.errors import Code, ServingError
from mariner.server.contracts.types import InferRequest, InferResult
from mariner.server.worker.context import Context
from mariner.server.worker.encoding import encode_output, pretty_json
from mariner.server.worker.entry_point import load_entry_point
from mariner.server.worker.failures import Failure, classify, fatal_reason
from mariner.server.worker.handler_calls import HandlerCall, Steps, drive, drive_async, run_awaitable
from mariner.server.worker.handler_errors import (
    bad_output,
    handler_failed,
    out_of_resources,
    prediction_exception,
)
from mariner.server.worker.intermediate import STREAM_NEXT_HEADER, Deliver
from mariner.server.worker.rows import join_rows, max_rows_for, split_rows, splittable

__all__ = [
    "ModelHost",
    "Placement",
    "encode_output",
    "handler_input",
    "load_entry_point",
    "pretty_json",
]

log = logging.getLogger("mariner.runner")


@dataclass(frozen=True)
class Placement:
    """Where an instance runs: `gpu_id` None means CPU. `require_gpu`: the model must not run
    on the CPU (its deviceType is gpu, or the server runs with --require-gpu); loading it without
    a usable GPU fails instead of falling back."""

    gpu_id: int | None
    torch_threads: int | None = None
    require_gpu: bool = False

    @property
    def device(self) -> str:
        return "cpu" if self.gpu_id is None else f"cuda:{self.gpu_id}"


def _release_cached_memory() -> None:
    """Give the CUDA caching allocator's free blocks back, when this process uses CUDA at all
    (`is_initialized` never initialises it)."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def _device_error() -> str | None:
    """The sticky error a broken CUDA context reports on the next synchronize, else None.

    An AOTInductor model ("API call failed", see worker.failures) or a handler that rewords its
    errors hides an illegal address or a device-side assert; the context stays broken all the
    same, so a GPU instance probes it after any failure that is not plainly out of memory."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return None
    try:
        torch.cuda.synchronize()
    except Exception as exc:  # noqa: BLE001 - whatever it raises is classified
        return fatal_reason(exc) if classify(exc) is Failure.FATAL_DEVICE else None
    return None


def _usable_gpu(gpu_id: int | None) -> str | None:
    """None when `gpu_id` names a device torch can use in this process, else why not."""
    if gpu_id is None:
        return "no GPU is visible to the server"
    import torch

    if not torch.cuda.is_available():
        return "CUDA is not available in the worker (no driver, or a CPU-only torch build)"
    if gpu_id >= torch.cuda.device_count():
        return f"cuda:{gpu_id} is not one of the {torch.cuda.device_count()} visible devices"
    return None


def handler_input(req: InferRequest) -> Mapping[str, Any]:
    """What the handler receives for one request, decided by the request's typed `tensors` field.

    A tensor request reaches the handler as {"tensors": {name: ndarray}}, the shape handlers
    that serve the Open Inference Protocol know; any other request hands over its `data` as is.
    The decision never looks inside `data`, so a TorchServe form field named "tensors" stays a
    form field.
    """
    if req.tensors is not None:
        return {"tensors": req.tensors}
    # TorchServe hands binary fields over as bytearray (handlers test for it); text and JSON
    # fields arrive decoded, as there.
    return {k: bytearray(v) if type(v) is bytes else v for k, v in req.data.items()}


class ModelHost:
    """The synchronous half of a model instance: loads the handler and runs batches on the calling
    thread. The worker process (`mariner.server.worker.main`) and the tools that time a handler
    in-process use it, so the handler contract, the out-of-memory split and the result encoding
    live here once.

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
        why = _usable_gpu(self.placement.gpu_id)
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
        _release_cached_memory()

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

    def _batch_steps(
        self, requests: list[InferRequest], deliver: Deliver | None, *, shared: bool
    ) -> Steps[list[InferResult]]:
        explain = [r.headers.get("explain") == "True" for r in requests]
        if any(explain) and not all(explain):
            # TorchServe handlers ask request 0 whether the whole batch explains (BaseHandler's
            # _is_explain): explanations and predictions run as separate handler calls.
            out: list[InferResult | None] = [None] * len(requests)
            for want in (False, True):
                idx = [i for i, e in enumerate(explain) if e is want]
                part = yield from self._batch_steps([requests[i] for i in idx], deliver, shared=shared)
                for i, res in zip(idx, part, strict=True):
                    out[i] = res
            return [r for r in out if r is not None]
        big = [r.tensors is not None and r.items > self.max_rows for r in requests]
        if not any(big):
            return (yield from self._split_steps(requests, deliver, shared))
        results: list[InferResult | None] = [None] * len(requests)
        small = [i for i, b in enumerate(big) if not b]
        if small:
            part = yield from self._split_steps([requests[i] for i in small], deliver, shared)
            for i, res in zip(small, part, strict=True):
                results[i] = res
        for i, b in enumerate(big):
            if b:
                results[i] = yield from self._rows_steps(requests[i], self.max_rows, deliver, shared)
        return [r for r in results if r is not None]

    def _rows_steps(
        self, req: InferRequest, rows: int, deliver: Deliver | None, shared: bool
    ) -> Steps[InferResult]:
        chunks = split_rows(req, rows)
        parts = []
        for c in chunks:
            parts.append((yield from self._split_steps([c], deliver, shared))[0])
        return join_rows(parts, [c.items for c in chunks])

    def _split_steps(
        self, requests: list[InferRequest], deliver: Deliver | None, shared: bool
    ) -> Steps[list[InferResult]]:
        outcome = yield from self._handle_steps(requests, deliver, shared)
        if not isinstance(outcome, Failure):
            return outcome
        # Here the handler's exception and its traceback are gone (PyTorch's FAQ: frames the
        # traceback keeps alive hold the batch's tensors), so emptying the cache frees them.
        _release_cached_memory()
        if len(requests) == 1 and not splittable(requests[0]):
            if outcome is Failure.POSSIBLE_OOM:  # the cause is unknown: not "out of memory"
                raise handler_failed(None)
            raise out_of_resources("the model ran out of memory on this request alone; send a smaller input")
        if self.on_oom is not None:
            self.on_oom()
        if len(requests) == 1:
            req = requests[0]
            log.warning("instance %s out of memory on one request of %d rows: retrying in halves",
                        self.id, req.items)  # fmt: skip
            return [(yield from self._rows_steps(req, (req.items + 1) // 2, deliver, shared))]
        mid = len(requests) // 2
        log.warning("instance %s out of memory on a batch of %d: retrying as %d + %d", self.id,
                    len(requests), mid, len(requests) - mid)  # fmt: skip
        first = yield from self._split_steps(requests[:mid], deliver, shared)
        return first + (yield from self._split_steps(requests[mid:], deliver, shared))

    def _handle_steps(
        self, requests: list[InferRequest], deliver: Deliver | None, shared: bool
    ) -> Steps[list[InferResult] | Failure]:
        """The handler's results, or the out-of-memory kind it failed with (returned, not raised,
        so the caller recovers outside the `except` block)."""
        ctx = self._context
        if ctx is None or self._handle is None:
            raise ServingError(Code.UNAVAILABLE, f"model instance {self.id} is not loaded")
        data = [handler_input(req) for req in requests]
        request_ids = [req.request_id for req in requests]
        headers = [req.headers for req in requests]
        if shared:  # one call at a time: the instance's own Context, as handlers that keep it expect
            ctx.begin_batch(request_ids, headers)
            ctx.cl_socket.deliver = deliver
        else:
            ctx = ctx.for_call(request_ids, headers, deliver)
        failure: Failure | None = None
        try:
            outputs = (yield HandlerCall(data, ctx)).unwrap()
        except ServingError:
            raise
        except Exception as exc:
            answer = prediction_exception(exc)
            if answer is not None:  # the handler chose the status and message
                log.warning("handler of %s raised PredictionException (%s) on a batch of %d: %s",
                            self.id, answer.torchserve and answer.torchserve.status, len(data),
                            answer.message[:300])  # fmt: skip
                raise answer from None
            failure = classify(exc)
            reason = fatal_reason(exc) if failure is Failure.FATAL_DEVICE else None
            if failure in (Failure.OTHER, Failure.POSSIBLE_OOM) and self.placement.gpu_id is not None:
                reason = _device_error()  # a sticky error the exception's text did not show
            if reason is not None:
                # The device is unusable in this process from now on: end the instance.
                log.error("handler of %s hit a fatal device error (%s); the instance ends and will be "
                          "replaced", self.id, reason, exc_info=exc)  # fmt: skip
                self.failed = True
                raise InstanceFailed(f"fatal device error: {reason}") from None
            if failure is Failure.OTHER:
                log.exception("handler of %s raised for a batch of %d", self.id, len(data))
                raise handler_failed(type(exc).__name__) from None
            log.warning("handler of %s: %s on a batch of %d: %s", self.id, failure.value, len(data),
                        str(exc)[-300:])  # fmt: skip
        except BaseException as exc:  # SystemExit & co: the instance is gone, not just this batch
            log.error(
                "handler of %s ended its instance (%s); it will be replaced", self.id, type(exc).__name__
            )
            self.failed = True
            raise InstanceFailed(f"handler raised {type(exc).__name__}") from None
        finally:
            self.batches += 1
            if shared:
                ctx.cl_socket.deliver = None  # a part sent after the call has no request to go to
        if failure is not None:
            return failure
        if not isinstance(outputs, list) or len(outputs) != len(data):
            error = bad_output(outputs, len(data))
            log.error("handler of %s: %s", self.id, error.message)
            raise error
        results = []
        for i, (req, value) in enumerate(zip(requests, outputs, strict=True)):
            meta = ctx.response_meta(i)
            tensors = value.get("tensors") if req.tensors is not None and isinstance(value, dict) else None
            results.append(
                InferResult(
                    body=b"" if tensors is not None else encode_output(value),
                    tensors=tensors,
                    status=meta.status,
                    phrase=meta.phrase,
                    content_type=meta.headers.get("content-type"),
                    headers={k: v for k, v in meta.headers.items() if k not in _NOT_PASSED_ON},
                    model_version=self.archive.version,
                )
            )
        return results


# Response headers a handler's Context holds that are not passed on as the answer's headers: the
# content type travels apart, and TorchServe's stream marker is the codec's, not the client's.
_NOT_PASSED_ON = frozenset({"content-type", STREAM_NEXT_HEADER})
