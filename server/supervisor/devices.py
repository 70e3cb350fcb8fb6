"""Which GPUs the model workers may use, found without initialising CUDA in the supervisor
(a forked or later-spawned child of a process that touched CUDA cannot use it), and which one
each new model instance gets.

Nothing here imports torch: `torch.cuda.is_available()` initialises the driver in the calling
process (unless PYTORCH_NVML_BASED_CUDA_CHECK=1), which the supervisor and frontends must never
do. GPUs are counted from `CUDA_VISIBLE_DEVICES` when set, else NVML (pynvml, when installed),
else `nvidia-smi -L`, else none.

A device id is an index into the server's visible devices (`cuda:N` as torch names it in the
server's environment). Workers inherit that environment unchanged, so `cuda:N` names the same
device inside every worker and describe and metrics report the id the handler sees.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from mariner.server.contracts.setting_values import device_ids

log = logging.getLogger("mariner.devices")


def _nvml_count() -> int | None:
    """GPUs NVML sees; None when pynvml is not installed or NVML cannot start (no driver)."""
    try:
        import pynvml  # type: ignore[import-not-found]  # optional: the gpu extra (nvidia-ml-py)
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        try:
            return int(pynvml.nvmlDeviceGetCount())
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # noqa: BLE001 - NVMLError and friends: no usable driver
        return 0


def _smi_count() -> int:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return 0
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=10, check=False).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(1 for line in out.splitlines() if line.startswith("GPU "))


def visible_gpus() -> int:
    """GPUs the workers may use: `CUDA_VISIBLE_DEVICES` when it is set, else what NVML or
    `nvidia-smi -L` lists, else none."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        ids = [d for d in env.split(",") if d.strip()]
        return 0 if not ids or ids[0].strip() == "-1" else len(ids)
    nvml = _nvml_count()
    return nvml if nvml is not None else _smi_count()


def device_ids_of(model_config: Mapping[str, Any]) -> tuple[int, ...] | None:
    """The model-config's `deviceIds` (TorchServe's key: the GPUs this model may use), or None
    when it names none. Raises ServingError for a value that is not a list of GPU ids (an
    archive's is checked when it is registered: `common.archive_settings.archive_overrides`)."""
    return device_ids("deviceIds", model_config.get("deviceIds"), "the model-config")


class GpuAllocator:
    """Process-wide round-robin of model instances over the visible GPUs.

    One allocator serves every model, so single-worker models spread over the devices instead of
    all starting on cuda:0. A model's `deviceIds` restricts its instances to those devices (ids
    not visible are dropped with a warning); the turn still advances server-wide.
    """

    def __init__(self, count: Callable[[], int] = visible_gpus) -> None:
        self._count_fn = count
        self._count: int | None = None
        self._last = -1
        self._lock = threading.Lock()

    @property
    def count(self) -> int:
        if self._count is None:
            self._count = self._count_fn()
        return self._count

    def allowed(self, device_ids: Sequence[int] | None) -> list[int]:
        """The devices an instance may use: all visible ones, or the visible ones of `device_ids`."""
        visible = list(range(self.count))
        if device_ids is None:
            return visible
        kept = sorted({i for i in device_ids if i < self.count})
        if len(kept) != len(set(device_ids)):
            log.warning("deviceIds %s: only %s are visible (%d GPUs)", list(device_ids), kept, self.count)
        return kept

    def next(self, device_ids: Sequence[int] | None = None) -> int | None:
        """The next GPU for a new instance, or None when it has none to run on."""
        with self._lock:
            allowed = self.allowed(device_ids)
            if not allowed:
                return None
            gpu = next((i for i in allowed if i > self._last), allowed[0])
            self._last = gpu
            return gpu


_ALLOCATOR = GpuAllocator()


def allocator() -> GpuAllocator:
    """The allocator of this process (shared by every model it places)."""
    return _ALLOCATOR


def set_allocator(new: GpuAllocator) -> GpuAllocator:
    """Replace the process's allocator (tests inject fake GPU counts); returns the old one."""
    global _ALLOCATOR
    old, _ALLOCATOR = _ALLOCATOR, new
    return old
