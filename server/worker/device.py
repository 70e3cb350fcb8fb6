"""Where a model instance runs, and what its CUDA device says: the placement, whether the GPU is
usable here, the sticky error a broken context reports, the cache given back after a failure.

Apart from `runner.py` and `batch_steps.py` because both ask these questions (loading checks the
GPU, unloading and a failed handler call free the cache, a failed call probes the context), and
`batch_steps` cannot import them from `runner`, whose `ModelHost` inherits its `BatchSteps`.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from mariner.server.worker.failures import Failure, classify, fatal_reason


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


def release_cached_memory() -> None:
    """Give the CUDA caching allocator's free blocks back, when this process uses CUDA at all
    (`is_initialized` never initialises it)."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def device_error() -> str | None:
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


def usable_gpu(gpu_id: int | None) -> str | None:
    """None when `gpu_id` names a device torch can use in this process, else why not."""
    if gpu_id is None:
        return "no GPU is visible to the server"
    import torch

    if not torch.cuda.is_available():
        return "CUDA is not available in the worker (no driver, or a CPU-only torch build)"
    if gpu_id >= torch.cuda.device_count():
        return f"cuda:{gpu_id} is not one of the {torch.cuda.device_count()} visible devices"
    return None
