"""Device decisions for the digits handler: which device, and whether the artefact may run there.

Split out of `digits_handler.py` (TorchServe's loader wants exactly one class in a handler
module, and the handler stays readable). The archive ships this file next to the handler; the
handler imports it by path, so it works the same under TorchServe, Mariner and in the repo.

Why these checks exist: a worker that was meant to run on a GPU but quietly serves on the CPU
looks healthy and is 10-100x slower; an ONNX session that could not get CUDA falls back to the
CPU without a word; an AOTInductor package is machine code for one device (and, on the CPU,
for one instruction set) and crashes the worker with SIGILL, or mis-runs, where it was not
built for. Each of these is refused at load with an error that says what to change.
"""

from __future__ import annotations

import json
import logging
import zipfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

# The /proc/cpuinfo flags the code of each vector ISA may use, as AOTInductor names the ISA in a
# package's metadata (`AOTI_CPU_ISA`, e.g. "AVX512 AVX512_VNNI"); the inductor adds exactly these
# -m flags when it compiles for that ISA.
ISA_CPU_FLAGS: dict[str, frozenset[str]] = {
    "AVX2": frozenset({"avx2", "fma", "f16c"}),
    "AVX512": frozenset({"avx512f", "avx512dq", "avx512vl", "avx512bw", "fma"}),
    "AVX512_VNNI": frozenset({"avx512_vnni"}),
    "AMX_TILE": frozenset({"amx_tile", "amx_bf16", "amx_int8"}),
}
# What `-march=x86-64-v3` lets the compiler use (the portable baseline the pipeline builds for).
MARCH_CPU_FLAGS: dict[str, frozenset[str]] = {
    "x86-64-v3": frozenset(
        {"cx16", "lahf_lm", "popcnt", "sse4_1", "sse4_2", "ssse3", "avx", "avx2", "bmi1", "bmi2", "f16c"}
        | {"fma", "abm", "movbe", "xsave"}
    ),
}
# Metadata keys the pipeline adds to its AOTInductor packages (torch adds the AOTI_* ones).
META_MARCH = "MARINER_MARCH"
META_CPU_FLAGS = "MARINER_REQUIRED_CPU_FLAGS"


def _truthy(value: Any) -> bool:
    return str(value).strip().lower() in {"1", "true", "yes", "on"}


def gpu_required(context: Any) -> bool:
    """The archive says `deviceType: gpu`, or the server was told to serve on GPUs only."""
    cfg = getattr(context, "model_yaml_config", None) or {}
    props = context.system_properties
    return str(cfg.get("deviceType", "")).lower() == "gpu" or _truthy(props.get("require_gpu", False))


def pick_device(context: Any, prefer: str) -> torch.device:
    """cuda:{gpu_id} when the server gave this instance a GPU and CUDA is usable; else the CPU.

    `prefer` is the handler section's `device`: "cpu" for artefacts that only run there (int8
    kernels, CPU AOTInductor packages), which stay on the CPU whatever GPU they are offered. A
    GPU-capable archive that must run on a GPU (see `gpu_required`) never falls back to the CPU:
    initialize fails instead, so the server reports the instance as failed, not as healthy.
    """
    cfg = getattr(context, "model_yaml_config", None) or {}
    gpu_id = context.system_properties.get("gpu_id")
    cpu_only = prefer == "cpu" or str(cfg.get("deviceType", "")).lower() == "cpu"
    if cpu_only:
        if str(cfg.get("deviceType", "")).lower() == "gpu":
            raise RuntimeError(
                "model-config says deviceType: gpu but the archive's artefact runs only on the CPU "
                "(handler.device: cpu); package a GPU artefact or set deviceType: cpu"
            )
        return torch.device("cpu")
    usable = torch.cuda.is_available()
    if usable and gpu_id is not None:
        return torch.device(f"cuda:{int(gpu_id)}")
    if gpu_required(context):
        why = "torch sees no usable CUDA device" if not usable else "the server assigned this instance no GPU"
        raise RuntimeError(
            f"this model must run on a GPU (deviceType: gpu or require_gpu) but {why}; "
            "refusing to serve it on the CPU"
        )
    return torch.device("cpu")


# -- ONNX Runtime -------------------------------------------------------------------------------


def onnx_session(ort: Any, artefact: Path, options: Any, device: torch.device) -> Any:
    """An InferenceSession on this instance's GPU (CUDA provider with its device_id) or the CPU.

    ONNX Runtime falls back to the CPU provider when CUDA cannot be set up (missing libraries,
    wrong CUDA version) and only logs it; the provider it actually got is checked here.
    """
    if device.type != "cuda":
        return ort.InferenceSession(str(artefact), sess_options=options, providers=["CPUExecutionProvider"])
    available = list(ort.get_available_providers())
    if "CUDAExecutionProvider" not in available:
        raise RuntimeError(
            f"instance is on {device} but this onnxruntime has no CUDAExecutionProvider "
            f"(available: {', '.join(available)}); install onnxruntime-gpu"
        )
    sess = ort.InferenceSession(
        str(artefact),
        sess_options=options,
        providers=[("CUDAExecutionProvider", {"device_id": int(device.index or 0)}), "CPUExecutionProvider"],
    )
    got = list(sess.get_providers())
    if not got or got[0] != "CUDAExecutionProvider":
        raise RuntimeError(
            f"onnxruntime could not create a CUDA session on {device} (got providers {got}); "
            "refusing to serve this GPU instance on the CPU"
        )
    return sess


# -- AOTInductor packages ----------------------------------------------------------------------


def aoti_metadata(package: Path) -> dict[str, str]:
    """The metadata AOTInductor wrote beside the compiled model in the .pt2 (a zip)."""
    with zipfile.ZipFile(package) as zf:
        names = sorted(n for n in zf.namelist() if n.endswith("wrapper_metadata.json"))
        if not names:
            names = sorted(n for n in zf.namelist() if n.endswith("_metadata.json"))
        if not names:
            raise ValueError(f"{package.name} carries no AOTInductor metadata; is it an AOTI package?")
        meta = json.loads(zf.read(names[0]))
    return {str(k): str(v) for k, v in meta.items()}


def host_cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str] | None:
    """The CPU's feature flags, or None where /proc/cpuinfo says nothing (not Linux x86)."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return frozenset(value.split())
    return None


def required_cpu_flags(meta: dict[str, str]) -> frozenset[str]:
    """What the package's code needs: the recorded flags if the pipeline built it, else its ISA's."""
    recorded = meta.get(META_CPU_FLAGS, "").split()
    if recorded:
        return frozenset(recorded)
    needed: set[str] = set()
    for isa in meta.get("AOTI_CPU_ISA", "").split():
        needed |= ISA_CPU_FLAGS.get(isa.upper(), frozenset())
    return frozenset(needed)


def check_aoti_package(
    meta: dict[str, str], device: torch.device, host_flags: Iterable[str] | None, name: str
) -> None:
    """Refuse a package built for another device, or for CPU instructions this host lacks."""
    built_for = meta.get("AOTI_DEVICE_KEY", "")
    if built_for not in ("cpu", "cuda"):
        raise ValueError(f"{name}: AOTInductor package for device {built_for!r}; cpu and cuda are served")
    if built_for == "cuda" and device.type != "cuda":
        raise RuntimeError(
            f"{name} was compiled for CUDA but this instance is on the CPU; serve it on a GPU worker "
            "or export a CPU package"
        )
    if built_for == "cpu" and device.type == "cuda":
        raise RuntimeError(
            f"{name} was compiled for the CPU but this instance is configured for {device} "
            "(handler.device / deviceType); export the package on a CUDA machine or set handler.device: cpu"
        )
    if built_for != "cpu":
        return
    if meta.get("AOTI_MACHINE", "x86_64") not in ("x86_64", "AMD64"):
        return  # the flag names below are x86's
    if host_flags is None:
        log.warning("%s: cannot read this CPU's flags; not checking the package's ISA", name)
        return
    missing = sorted(required_cpu_flags(meta) - set(host_flags))
    if missing:
        raise RuntimeError(
            f"{name} was compiled for {meta.get(META_MARCH) or 'its build machine'} "
            f"(ISA {meta.get('AOTI_CPU_ISA') or '?'}) and needs CPU features this host lacks: "
            f"{', '.join(missing)}; rebuild it for a baseline this host meets (make models on it)"
        )
    if META_MARCH not in meta:
        log.warning(
            "%s carries no record of its -march; its ISA (%s) matches this host, but code built with "
            "-march=native may still use instructions beyond it",
            name,
            meta.get("AOTI_CPU_ISA"),
        )


# -- host -> device copies --------------------------------------------------------------------


def _pinned(shape: tuple[int, ...]) -> torch.Tensor:
    return torch.empty(shape, dtype=torch.float32, pin_memory=True)


class HostStaging:
    """One pinned host buffer per worker, reused for every batch's host-to-device copy.

    `pin_memory()` per batch allocates (and registers) page-locked memory every time; this
    buffer is allocated once, for the largest batch the worker pads to. A copy from it is
    asynchronous, so before the next batch overwrites the buffer we wait on an event recorded
    right after the previous copy was queued (on the stream the copy ran on): the buffer is
    never rewritten while the GPU may still be reading it. Zero rows pad a batch to its bucket.
    `allocate` and `new_event` are injectable so the logic is tested without CUDA.
    """

    def __init__(
        self,
        rows: int,
        row_shape: tuple[int, ...],
        device: torch.device,
        *,
        allocate: Callable[[tuple[int, ...]], torch.Tensor] = _pinned,
        new_event: Callable[[], Any] | None = None,
    ) -> None:
        self.rows = rows
        self.device = device
        self.buffer = allocate((rows, *row_shape))
        self._new_event = new_event or torch.cuda.Event
        self._in_flight: Any = None

    def fill(self, x: torch.Tensor, rows: int) -> torch.Tensor:
        """Write x into the buffer, zero rows up to `rows`; returns the buffer's view."""
        view = self.buffer[:rows]
        view[: len(x)].copy_(x)
        if rows > len(x):
            view[len(x) :].zero_()
        return view

    def to_device(self, x: torch.Tensor, rows: int | None = None) -> torch.Tensor:
        """x (at most `self.rows` rows), padded to `rows`, on the device; the copy is queued."""
        rows = len(x) if rows is None else rows
        if not len(x) <= rows <= self.rows:
            raise ValueError(f"staging holds {self.rows} rows; asked for {len(x)} padded to {rows}")
        if self._in_flight is not None:
            self._in_flight.synchronize()  # the previous copy has finished reading the buffer
            self._in_flight = None
        out = self.fill(x, rows).to(self.device, non_blocking=True)
        event = self._new_event()
        event.record()  # on the current stream, the one the copy was queued on
        self._in_flight = event
        return out
