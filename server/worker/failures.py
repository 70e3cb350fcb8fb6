"""What kind of failure a handler's exception is: out of memory, a fatal device error, or other.

The runner answers each kind differently (`ModelHost.run_batch`): out of memory splits the batch
and retries the halves, a fatal device error ends the instance (its process is replaced), anything
else fails the batch alone. Every model format reports these failures in its own words, and
mostly as a plain RuntimeError, so the class name alone (`torch.OutOfMemoryError`, raised only by
eager and compiled code) misses most of them. The patterns below are the texts each runtime uses,
checked against torch 2.13 and onnxruntime 1.32:

- eager / torch.compile: `torch.OutOfMemoryError` ("CUDA out of memory. Tried to allocate ...");
- TorchScript: the interpreter rethrows a RuntimeError whose text ends with the original one
  ("CUDA out of memory", "CUDA error: out of memory");
- host memory in torch (any format): RuntimeError "[enforce fail at alloc_cpu.cpp] ...
  DefaultCPUAllocator: can't allocate memory" (older builds: "not enough memory");
- onnxruntime: `onnxruntime...Fail` / `RuntimeException`, "... BFCArena::AllocateRawInternal ...
  Failed to allocate memory for requested buffer" (CPU arena), "CUDA failure 2: out of memory"
  or "CUDA error ... out of memory" (CUDA provider);
- cuBLAS / cuDNN workspaces: "CUBLAS_STATUS_ALLOC_FAILED", "CUDNN_STATUS_ALLOC_FAILED";
- AOTInductor: `AOTIModelContainerRunner` turns *every* failure into RuntimeError("run_func_(...)
  API call failed at .../model_container_runner.cpp, line N"); the cause ("CUDA out of memory",
  an allocator error, ...) is only printed to stderr by the model's own .so. Such an error is
  therefore `POSSIBLE_OOM`: the batch is split like an out-of-memory one (at most 2n-1 calls for
  n requests), but a single request that still fails gets the plain handler-failure answer, never
  "out of memory", since the cause is unknown;
- Python's own `MemoryError` (an rlimit, a huge numpy allocation).

A fatal device error leaves the CUDA context unusable for the rest of the process ("sticky"
errors): every later kernel fails the same way, so the only recovery is a new process. Where the
text hides it (AOTInductor, a handler that rewords errors), a GPU instance asks the device itself
after the failure (`device.device_error`: a synchronize reports the sticky error).

Exceptions are read along their `__cause__` / `__context__` chain, so a handler that wraps the
runtime's error (`raise ValueError("inference failed") from exc`) is still understood.
"""

from __future__ import annotations

import enum

OOM_CLASS_NAMES = frozenset({"OutOfMemoryError"})

OOM_PATTERNS: tuple[str, ...] = (
    "out of memory",  # CUDA (torch, TorchScript, onnxruntime's CUDA provider), HIP
    "defaultcpuallocator: can't allocate memory",
    "defaultcpuallocator: not enough memory",
    "failed to allocate memory",  # onnxruntime's arena
    "cublas_status_alloc_failed",
    "cudnn_status_alloc_failed",
)

# AOTInductor's runner hides the cause behind this text (see the module docstring).
POSSIBLE_OOM_PATTERNS: tuple[str, ...] = ("api call failed at",)

FATAL_DEVICE_PATTERNS: tuple[str, ...] = (
    "an illegal memory access",
    "illegal address",
    "an illegal instruction",
    "misaligned address",
    "device-side assert triggered",
    "unspecified launch failure",
    "cublas_status_execution_failed",
    "cudnn_status_execution_failed",
    "uncorrectable ecc error",
    "cuda error: launch failed",
)

_CHAIN_LIMIT = 8  # a wrapped error is a few links deep; a cycle must not loop


class Failure(enum.Enum):
    """How the runner answers a handler's exception."""

    OOM = "oom"  # split the batch and retry; alone: RESOURCE_EXHAUSTED
    POSSIBLE_OOM = "possible_oom"  # split like OOM; alone: the ordinary handler failure
    FATAL_DEVICE = "fatal_device"  # the device is unusable in this process: end the instance
    OTHER = "other"  # this batch fails, the instance goes on


def _chain(exc: BaseException) -> list[BaseException]:
    out: list[BaseException] = []
    cur: BaseException | None = exc
    while cur is not None and len(out) < _CHAIN_LIMIT and all(cur is not e for e in out):
        out.append(cur)
        cur = cur.__cause__ if cur.__cause__ is not None else cur.__context__
    return out


def classify(exc: BaseException) -> Failure:
    """The kind of `exc` (and the errors it wraps). A fatal device error wins over everything:
    splitting a batch on a broken device only fails more batches."""
    chain = _chain(exc)
    texts = [str(e).lower() for e in chain]
    if any(p in t for t in texts for p in FATAL_DEVICE_PATTERNS):
        return Failure.FATAL_DEVICE
    if any(isinstance(e, MemoryError) or type(e).__name__ in OOM_CLASS_NAMES for e in chain):
        return Failure.OOM
    if any(p in t for t in texts for p in OOM_PATTERNS):
        return Failure.OOM
    if any(p in t for t in texts for p in POSSIBLE_OOM_PATTERNS):
        return Failure.POSSIBLE_OOM
    return Failure.OTHER


def fatal_reason(exc: BaseException) -> str:
    """A short, sanitized name for a fatal device error (the matched pattern, never the text)."""
    for e in _chain(exc):
        text = str(e).lower()
        for p in FATAL_DEVICE_PATTERNS:
            if p in text:
                return p
    return "fatal device error"
