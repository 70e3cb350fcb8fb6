"""What every handler of the archives needs: loading its sibling files, the device, the artefact.

The digits, MiniLM and ResNet handlers each ship this file beside them in their archive and
load it by path (then load their other siblings with `load_module_from`), so it works the same
under stock TorchServe, Mariner and in the repo: it imports only torch, numpy and the standard
library, never `ts` or `mariner.server`. It holds what the handlers would otherwise each carry
a copy of: a sibling import, the model-config handler section, the batch buckets, the Open
Inference Protocol tensor-request test, device selection and the checks on where an artefact
may run, the AOTInductor/ONNX/torch.compile loaders, and the host-to-device batch copy.

Why the device checks exist: a worker that was meant to run on a GPU but quietly serves on the
CPU looks healthy and is 10-100x slower; an ONNX session that could not get CUDA falls back to
the CPU without a word; an AOTInductor package is machine code for one device (and, on the CPU,
for one instruction set) and crashes the worker with SIGILL, or mis-runs, where it was not
built for. Each of these is refused at load with an error that says what to change.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import sys
import zipfile
from collections.abc import Callable, Iterable
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
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


# -- the archive's files and its model-config -----------------------------------------------


def load_module_from(path: Path, name: str) -> ModuleType:
    """Import a .py file shipped in the archive by its path, as `name`, without touching sys.path.

    By path, not by `import`: the archive dir is not first on sys.path (Mariner appends it, and
    several archives may share one process), so a top-level name could find an installed module
    or another archive's copy. The module is registered in sys.modules under `name` before its
    code runs, as `import` does: dataclasses resolve their module's annotations through
    sys.modules, and pickle finds a class by its module's name there. A failed import leaves
    no entry behind.
    """
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        if sys.modules.get(name) is module:
            del sys.modules[name]
        raise
    return module


def config_section(context: Any) -> dict[str, Any]:
    """The model-config's `handler:` section (TorchServe passes unknown sections through)."""
    cfg = getattr(context, "model_yaml_config", None) or {}
    section = cfg.get("handler") or {}
    if not isinstance(section, dict):
        raise ValueError("model-config 'handler' section must be a mapping")
    return section


def artefact_format(section: dict[str, Any], formats: tuple[str, ...]) -> str:
    """The section's `format`, one of the handler's `formats`; anything else fails the load."""
    fmt = str(section.get("format", "")).lower()
    if fmt not in formats:
        raise ValueError(f"model-config handler.format must be one of {formats}, got {fmt!r}")
    return fmt


def read_labels(model_dir: Path, default: list[str]) -> list[str]:
    """The archive's labels.json (class names by index), or `default` where it ships none."""
    path = model_dir / "labels.json"
    if not path.exists():
        return default
    return [str(v) for v in json.loads(path.read_text())]


def serialized_file(context: Any, fallback: Any = None) -> str:
    """The artefact's file name, as the archive's manifest names it."""
    serialized = (context.manifest or {}).get("model", {}).get("serializedFile") or fallback
    if not serialized:
        raise ValueError("the archive's manifest names no serializedFile")
    return str(serialized)


def batch_buckets(batch_size: int, explicit: Any = None) -> list[int]:
    """The batch sizes a padded model runs at: powers of two up to batchSize, and batchSize."""
    if explicit:
        return sorted({int(b) for b in explicit})
    top = max(1, batch_size)
    return sorted({min(2**k, top) for k in range(int(math.log2(top)) + 1)} | {top})


def is_tensor_request(row: Any) -> bool:
    """Mariner's OIP path hands numpy arrays; JSON from a client can never produce an ndarray, so
    a TorchServe request with a field named "tensors" is not mistaken for a tensor request."""
    tensors = row.get("tensors") if isinstance(row, dict) else None
    return (
        isinstance(tensors, dict)
        and bool(tensors)
        and all(isinstance(v, np.ndarray) for v in tensors.values())
    )


def refuse(results: list[Any], context: Any, i: int, message: str, status: int = 400) -> None:
    """Answer request i alone with an error (and its status, where the context takes one)."""
    results[i] = {"error": message, "code": status}
    setter = getattr(context, "set_response_status", None)
    if setter is not None:
        setter(status, message, idx=i)


# -- devices ------------------------------------------------------------------------------------


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


def load_onnx(artefact: Path, device: torch.device) -> Any:
    """The artefact's ONNX Runtime session, with as many intra-op threads as torch uses."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = torch.get_num_threads()
    return onnx_session(ort, artefact, opts, device)


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


def load_aoti(artefact: Path, device: torch.device) -> Any:
    """An AOTInductor package, once its metadata says it may run on this device and CPU."""
    meta = aoti_metadata(artefact)
    check_aoti_package(meta, device, host_cpu_flags(), artefact.name)
    index = device.index if device.type == "cuda" and device.index is not None else -1
    return torch._inductor.aoti_load_package(str(artefact), device_index=index)


# -- loading the artefact ------------------------------------------------------------------------


def load_weights(model: torch.nn.Module, artefact: Path, device: torch.device) -> torch.nn.Module:
    """The archive's architecture with the artefact's state_dict (weights_only=True: a state_dict
    holds tensors, never code), in eval mode on the device."""
    model.load_state_dict(torch.load(artefact, map_location="cpu", weights_only=True))
    return model.eval().to(device)


def load_artefact(fmt: str, artefact: Path, device: torch.device) -> Any:
    """A self-contained artefact (torchscript, aoti or onnx) loaded for the device; the eager and
    compiled formats are a state_dict and need the archive's model code (`load_weights`)."""
    if fmt == "torchscript":
        return torch.jit.load(str(artefact), map_location=device).eval()
    if fmt == "aoti":
        return load_aoti(artefact, device)
    if fmt == "onnx":
        return load_onnx(artefact, device)
    raise ValueError(f"{fmt!r} is not a self-contained artefact format (torchscript, aoti, onnx)")


# -- torch.compile -----------------------------------------------------------------------------


def compile_for_buckets(model: torch.nn.Module, cfg: dict[str, Any], buckets: list[int]) -> Any:
    """torch.compile with the handler section's `compile` settings, for a model run only at the
    batch buckets: one graph per bucket (and, with mode reduce-overhead, one CUDA graph each),
    all made by the warm-up, so dynamo's cache must hold them all or it falls back to eager."""
    limit = len(buckets) + 2
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, limit)
    return torch.compile(model, mode=cfg.get("mode", "default"), dynamic=cfg.get("dynamic", False))


# -- host -> device copies --------------------------------------------------------------------


def batch_on_device(
    x: torch.Tensor, rows: int, device: torch.device, staging: HostStaging | None, padded: bool
) -> torch.Tensor:
    """x zero-padded to `rows` rows, on the device (padding rows are independent in eval mode).

    Through the pinned staging buffer when there is one and the batch fits; otherwise one plain
    copy (the CPU, or a batch beyond the buffer). A model that runs only at padded sizes gets a
    fresh tensor even when no row is added: what dynamo guards on stays constant, an inference
    tensor at storage offset 0, like every padded batch. Call it in inference mode.
    """
    n = len(x)
    if staging is not None and rows <= staging.rows:
        return staging.to_device(x, rows)
    if rows > n:
        x = torch.cat([x, x.new_zeros((rows - n, *x.shape[1:]))])
    elif padded:
        x = x.clone()
    return x.to(device)


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
