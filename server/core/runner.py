"""A model instance: `ModelHost` loads one handler and runs its batches (synchronously), and
`Runner` drives a host on a dedicated thread of this process.

By default each instance is a worker process (`mariner.server.workers`) that runs a `ModelHost`
of its own; `Runner` is the in-process option. Either way inference never runs on the event
loop: the handler is initialised and called on the same OS thread for its whole life (CUDA
context, stream and thread-local torch state stay put), and the event loop only awaits.
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import itertools
import json
import logging
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from mariner.server.core.archive import ModelArchive
from mariner.server.core.batcher import InstanceFailed
from mariner.server.core.context import Context
from mariner.server.core.errors import Code, ServingError
from mariner.server.core.types import InferRequest, InferResult, instance_id

log = logging.getLogger("mariner.runner")
_module_ids = itertools.count()


@dataclass(frozen=True)
class Placement:
    """Where an instance runs: `gpu_id` None means CPU."""

    gpu_id: int | None
    torch_threads: int | None = None

    @property
    def device(self) -> str:
        return "cpu" if self.gpu_id is None else f"cuda:{self.gpu_id}"


def place_instances(count: int, *, device_type: str | None, torch_threads: int | None) -> list[Placement]:
    """Round-robin instances over visible GPUs; CPU when there are none or the model asks for CPU."""
    gpus = 0
    if device_type != "cpu":
        try:
            import torch

            gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        except ImportError:  # pragma: no cover - torch is a hard dependency
            gpus = 0
    return [Placement(gpu_id=(i % gpus) if gpus else None, torch_threads=torch_threads) for i in range(count)]


class _OutOfMemory(Exception):
    """Internal signal: the handler ran out of (device or host) memory on this batch."""


def _is_oom(exc: BaseException) -> bool:
    return isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError"


def _release_cached_memory(placement: Placement) -> None:
    if placement.gpu_id is not None:
        import torch

        torch.cuda.empty_cache()


def handler_input(req: InferRequest) -> Mapping[str, Any]:
    """What the handler receives for one request, decided by the request's typed `tensors` field.

    A tensor request reaches the handler as {"tensors": {name: ndarray}}, the shape handlers
    that serve the Open Inference Protocol know; any other request hands over its `data` as is.
    The decision never looks inside `data`, so a TorchServe form field named "tensors" stays a
    form field.
    """
    if req.tensors is not None:
        return {"tensors": req.tensors}
    return req.data


class _NotPlainJson(Exception):
    """Internal signal: a value `pretty_json` leaves to `json.dumps` (any type but the plain ones)."""


_JSON_STR = json.encoder.encode_basestring_ascii  # what json.dumps uses with ensure_ascii
_FLOAT_REPR = float.__repr__
_INT_REPR = int.__repr__
_INF = float("inf")
_PRETTY_MAX_DEPTH = 64  # deeper values go to json.dumps, which reports cycles and recursion itself


def _pretty_scalar(o: Any, t: type) -> str:
    if t is str:
        return _JSON_STR(o)
    if o is None:
        return "null"
    if o is True:
        return "true"
    if o is False:
        return "false"
    if t is int:
        return _INT_REPR(o)
    if t is float:
        if o != o:
            return "NaN"
        if o == _INF:
            return "Infinity"
        if o == -_INF:
            return "-Infinity"
        return _FLOAT_REPR(o)
    raise _NotPlainJson


def _pretty_into(o: Any, out: list[str], level: int) -> None:
    t = type(o)
    if t is dict:
        if not o:
            out.append("{}")
            return
        if level >= _PRETTY_MAX_DEPTH:
            raise _NotPlainJson
        nl = "\n" + "  " * (level + 1)
        opener = "{"
        for k, v in o.items():
            if type(k) is not str:
                raise _NotPlainJson
            out.append(opener + nl + _JSON_STR(k) + ": ")
            opener = ","
            _pretty_into(v, out, level + 1)
        out.append("\n" + "  " * level + "}")
    elif t is list or t is tuple:
        if not o:
            out.append("[]")
            return
        if level >= _PRETTY_MAX_DEPTH:
            raise _NotPlainJson
        nl = "\n" + "  " * (level + 1)
        opener = "["
        for v in o:
            out.append(opener + nl)
            opener = ","
            _pretty_into(v, out, level + 1)
        out.append("\n" + "  " * level + "]")
    else:
        out.append(_pretty_scalar(o, t))


def pretty_json(value: Any) -> str:
    """`json.dumps(value, indent=2)`, the same text, in about half the time.

    With an indent the standard library encodes in pure Python through nested generators, which
    was the largest per-request cost of answering a small result. This writes the same layout
    directly for the plain types (dict with str keys, list, tuple, str, int, float, bool, None,
    exact types only, using json's own string and float formatting); any other value, including
    subclasses, non-str keys and very deep nesting, goes to `json.dumps` itself.
    """
    out: list[str] = []
    try:
        _pretty_into(value, out, 0)
    except _NotPlainJson:
        return json.dumps(value, indent=2)
    return "".join(out)


def encode_output(value: Any) -> bytes:
    """Encode one handler result exactly as TorchServe's Python backend does."""
    if isinstance(value, (bytes, bytearray)):
        return bytes(value)
    if isinstance(value, str):
        return value.encode("utf-8")
    try:
        import torch

        if isinstance(value, torch.Tensor):
            import io

            buf = io.BytesIO()
            torch.save(value, buf)
            return buf.getvalue()
    except ImportError:  # pragma: no cover
        pass
    return pretty_json(value).encode("utf-8")


def load_entry_point(archive: ModelArchive) -> tuple[Any, Any]:
    """Import the archive's handler the way TorchServe does; return (handle, initialize).

    `handler` is `file.py`, `file.py:function` or `module:function`. A module must define a
    `handle` function or exactly one class (instantiated, then its `initialize`/`handle`).
    The model dir goes on sys.path so the handler can import files shipped beside it.
    """
    spec_str = archive.handler
    module_part, _, func_name = spec_str.partition(":")
    file_name = module_part if module_part.endswith(".py") else f"{module_part}.py"
    path = archive.model_dir / file_name
    if not path.is_file():
        raise ServingError(
            Code.INVALID_ARGUMENT,
            f"handler {spec_str!r} is not a file in the archive; "
            "built-in TorchServe handlers need the ts package",
        )
    if str(archive.model_dir) not in sys.path:
        sys.path.append(str(archive.model_dir))
    mod_name = f"mariner_handler_{next(_module_ids)}_{path.stem}"
    spec = importlib.util.spec_from_file_location(mod_name, path)
    if spec is None or spec.loader is None:
        raise ServingError(Code.INVALID_ARGUMENT, f"cannot import handler {spec_str!r}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = module
    spec.loader.exec_module(module)
    func_name = func_name or "handle"
    if hasattr(module, func_name) and callable(getattr(module, func_name)):
        return getattr(module, func_name), getattr(module, "initialize", lambda _ctx: None)
    classes = [c for c in vars(module).values() if isinstance(c, type) and c.__module__ == mod_name]
    if len(classes) != 1:
        raise ServingError(
            Code.INVALID_ARGUMENT,
            f"handler module {file_name} must define a 'handle' function or exactly one class, "
            f"found {len(classes)}",
        )
    instance = classes[0]()
    return instance.handle, getattr(instance, "initialize", lambda _ctx: None)


class ModelHost:
    """The synchronous half of a model instance: loads the handler and runs batches on the calling
    thread. The thread `Runner` and the worker process (`mariner.server.workers.main`) both use
    it, so the handler contract, the out-of-memory split and the result encoding live here once.

    Call `load()` and `run_batch()` from one thread for the instance's whole life (its CUDA
    stream and thread-local torch state stay put). `on_oom` is called once per split.
    """

    def __init__(
        self,
        archive: ModelArchive,
        *,
        id: str,
        placement: Placement,
        batch_size: int,
        on_oom: Callable[[], None] | None = None,
    ) -> None:
        self.archive = archive
        self.id = id
        self.placement = placement
        self.batch_size = batch_size
        self.on_oom = on_oom
        self.batches = 0
        self.failed = False
        self.load_seconds: float | None = None
        self._handle: Any = None
        self._context: Context | None = None
        self._stream: Any = None

    def load(self) -> float:
        """Set threads and device, import the handler and initialise it; returns the seconds taken."""
        t0 = time.perf_counter()
        import torch

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
        handle, initialize = load_entry_point(self.archive)
        self._run_on_stream(initialize, self._context)
        self._handle = handle
        self.load_seconds = time.perf_counter() - t0
        log.info("instance %s ready on %s in %.2f s", self.id, self.placement.device, self.load_seconds)
        return self.load_seconds

    def unload(self) -> None:
        # Let the handler and its model go: what they hold is released with them (an AOTInductor
        # package's extracted .so and its aotinductor_* temp dir are removed only then).
        self._handle = None

    def _run_on_stream(self, fn: Any, *args: Any) -> Any:
        if self._stream is None:
            return fn(*args)
        import torch

        with torch.cuda.stream(self._stream):
            out = fn(*args)
        self._stream.synchronize()
        return out

    def run_batch(self, requests: list[InferRequest]) -> list[InferResult]:
        """Run a batch; on out-of-memory, split it in halves and retry each (down to one request).

        Raises ServingError for a whole-batch failure, InstanceFailed when the handler ended
        the instance (SystemExit & co).
        """
        try:
            return self._handle_batch(requests)
        except _OutOfMemory:
            if len(requests) == 1:
                raise ServingError(
                    Code.RESOURCE_EXHAUSTED,
                    "the model ran out of memory on this request alone; send a smaller input",
                ) from None
            if self.on_oom is not None:
                self.on_oom()
            _release_cached_memory(self.placement)
            mid = len(requests) // 2
            log.warning("instance %s out of memory on a batch of %d: retrying as %d + %d", self.id,
                        len(requests), mid, len(requests) - mid)  # fmt: skip
            return self.run_batch(requests[:mid]) + self.run_batch(requests[mid:])

    def _handle_batch(self, requests: list[InferRequest]) -> list[InferResult]:
        ctx = self._context
        if ctx is None or self._handle is None:
            raise ServingError(Code.UNAVAILABLE, f"model instance {self.id} is not loaded")
        data = [handler_input(req) for req in requests]
        request_ids = [req.request_id for req in requests]
        headers = [req.headers for req in requests]
        ctx.begin_batch(request_ids, headers)
        try:
            outputs = self._run_on_stream(self._handle, data, ctx)
        except ServingError:
            raise
        except Exception as exc:
            if _is_oom(exc):
                raise _OutOfMemory from None
            log.exception("handler of %s raised for a batch of %d", self.id, len(data))
            raise ServingError(
                Code.INTERNAL, "the model's handler failed on this batch; see the server log"
            ) from None
        except BaseException as exc:  # SystemExit & co: the instance is gone, not just this batch
            log.error(
                "handler of %s ended its instance (%s); it will be replaced", self.id, type(exc).__name__
            )
            self.failed = True
            raise InstanceFailed(f"handler raised {type(exc).__name__}") from None
        finally:
            self.batches += 1
        if not isinstance(outputs, list) or len(outputs) != len(data):
            got = len(outputs) if isinstance(outputs, list) else type(outputs).__name__
            log.error("handler of %s returned %s results for a batch of %d", self.id, got, len(data))
            raise ServingError(
                Code.INTERNAL, f"the model's handler returned {got} results for a batch of {len(data)}"
            )
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
                    headers={k: v for k, v in meta.headers.items() if k != "content-type"},
                    model_version=self.archive.version,
                )
            )
        return results


class Runner:
    """One instance of one model version on a dedicated thread of this process.

    Kept as an explicit option (`PlaneSettings.worker_mode = "thread"`): a hung handler cannot
    be killed here, and every model shares this process's `sys.path`.
    """

    def __init__(
        self,
        archive: ModelArchive,
        *,
        instance: int,
        placement: Placement,
        batch_size: int,
        generation: int = 0,
        on_oom: Callable[[], None] | None = None,
    ) -> None:
        self.archive = archive
        self.instance = instance
        self.generation = generation
        self.id = instance_id(archive.name, archive.version, instance, generation)
        self.placement = placement
        self.batch_size = batch_size
        self.status = "LOADING"
        self.load_seconds: float | None = None
        self.host = ModelHost(archive, id=self.id, placement=placement, batch_size=batch_size, on_oom=on_oom)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"runner-{self.id}")

    @property
    def batches(self) -> int:
        return self.host.batches

    @property
    def pid(self) -> int:
        return os.getpid()

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            self.load_seconds = await loop.run_in_executor(self._executor, self.host.load)
        except BaseException:
            self.status = "FAILED"
            raise
        self.status = "READY"

    async def run(self, requests: Sequence[InferRequest]) -> list[InferResult]:
        """Run one batch on this instance's thread; raises ServingError for whole-batch failures."""
        loop = asyncio.get_running_loop()
        try:
            fut = loop.run_in_executor(self._executor, self.host.run_batch, list(requests))
        except RuntimeError as exc:  # executor shut down: this instance is gone
            raise InstanceFailed(f"instance {self.id} is stopped") from exc
        try:
            return await fut
        except InstanceFailed:
            self.status = "FAILED"
            raise

    def close(self) -> None:
        self.status = "STOPPED"
        self._executor.shutdown(wait=False, cancel_futures=True)
        self.host.unload()

    async def stop(self, grace: float) -> None:
        """Same as close(): a thread has nothing to wait for once its batcher is closed."""
        self.close()

    def abandon(self) -> None:
        """Give up on this instance (hung or failed). Python cannot kill a thread: a handler stuck
        in a call keeps its thread until the call returns, but nothing will be sent to it again."""
        self.status = "FAILED"
        self._executor.shutdown(wait=False, cancel_futures=True)
