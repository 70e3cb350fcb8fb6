"""The GPU checklist's sections for the MiniLM and ResNet-18 archives, inside a time budget.

A GPU is lent for minutes, and one `make gpu-check` must fit in 8 of them with the digits
checks included. Every step here runs in order of value (correctness first, then the graph
count, then the benchmark) and asks the `Budget` first: a step that would not fit is skipped
and the report says so, rather than the lease ending with nothing written.

Sections (each a `checklist.Section`):
- `verify_families`: every minilm_*/resnet18_* archive of the store on the device vs the
  family's eager archive on the CPU (tolerances in `workloads`); AOTInductor packages
  exported again on this device; int8 variants stay on the CPU (their kernels are CPU-only);
  ONNX on CUDA needs onnxruntime-gpu and is marked skipped where only the CPU provider exists;
  the eager archive with `autocast: bf16` (and, on CUDA, `cudaGraphs: true`) as extra rows.
- `family_recompiles`: the CUDA-graphed eager archives (and resnet18_compiled on CUDA) driven
  at every batch size 1..top after the handler's warm-up: graphs compiled, recompiles and
  unrecorded calls must all be 0.
- `accel_bench` (in `bench`): Mariner vs stock TorchServe with and without bf16 and
  CUDA graphs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from mariner.loadtest.gpu_check.workloads import (
    ACCEL_VARIANTS,
    compare,
    drive_every_batch_size,
    eager_fallbacks,
    export_aoti_here,
    family_archives,
    graph_counts,
    inputs,
    load,
    on_gpu,
    variant_archive,
)

if TYPE_CHECKING:  # gpu_check imports this module; the class is needed for annotations only
    from mariner.loadtest.gpu_check.checklist import Section
    from mariner.loadtest.servers import ServerProcess


@dataclass(frozen=True)
class Budget:
    """A deadline on the monotonic clock; steps ask whether their estimate still fits."""

    deadline: float

    @classmethod
    def of(cls, seconds: float) -> Budget:
        return cls(time.monotonic() + seconds)

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def fits(self, estimate_s: float) -> bool:
        return self.left() >= estimate_s


def _ok(flag: Any) -> str:
    return "yes" if flag else "NO"


def _onnx_cuda_available() -> bool:
    try:
        import onnxruntime as ort
    except ImportError:
        return False
    return "CUDAExecutionProvider" in ort.get_available_providers()


def _format_of(mar: Path) -> str:
    for fmt in ("int8", "aoti", "onnx", "torchscript", "compiled", "eager"):
        if fmt in mar.stem:
            return fmt
    return "?"


def verify_families(sec: Section, store: Path, device: str, work: Path, n: int, budget: Budget) -> None:
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 compared with fp32, not TF32
    torch.backends.cudnn.allow_tf32 = False
    found = family_archives(store)
    if not found:
        sec.status = "skipped"
        sec.notes.append(f"{store / 'index.json'} lists no minilm_* or resnet18_* archive.")
        return
    for family, mars in sorted(found.items()):
        eager = next((m for m in mars if m.stem.endswith("_eager")), None)
        if eager is None:
            sec.rows.append(
                {"archive": f"{family} (all)", "ok": "NO", "error": "no eager archive to compare with"}
            )
            continue
        bodies = inputs(family, n)
        t0 = time.perf_counter()
        ref = load(eager, work, "cpu").answers(bodies)
        cost = time.perf_counter() - t0  # what one load-and-answer takes here, for the budget
        for mar in mars:
            if mar == eager and device == "cpu":
                continue  # the reference itself
            _verify_one(sec, family, mar, eager, bodies, ref, device, work, budget, cost)
        if device == "cuda" and not any(_format_of(m) == "aoti" for m in mars):
            # a default store has no AOTInductor archive: export one here and serve it as one
            _verify_one(sec, family, eager, eager, bodies, ref, device, work, budget, cost, as_aoti=True)
        variants = ["bf16"] + (["bf16+graphs"] if device == "cuda" else [])
        for name in variants:
            _verify_one(sec, family, eager, eager, bodies, ref, device, work, budget, cost, accel=name)
    if device != "cuda":
        sec.notes.append(
            "On the CPU the eager archives are the reference (no row of their own), and cudaGraphs "
            "is CUDA-only (the plain function runs elsewhere): its rows are CUDA-only."
        )
    sec.notes.append(
        "Reference: the family's eager archive on the CPU, same request bodies (held-out sentences; "
        "JPEG crops at varied sizes), batches of batchSize through handle(). TF32 off."
    )
    if any(str(r.get("ok")).startswith("NO") for r in sec.rows):
        sec.status = "failed"


def _verify_one(
    sec: Section,
    family: str,
    mar: Path,
    eager: Path,
    bodies: list[Any],
    ref: list[Any],
    device: str,
    work: Path,
    budget: Budget,
    cost: float,
    accel: str | None = None,
    as_aoti: bool = False,
) -> None:
    fmt = "aoti" if as_aoti else _format_of(mar)
    name = f"{family}_aoti (from {mar.stem})" if as_aoti else mar.stem
    row: dict[str, Any] = {"archive": name + (f" +{accel}" if accel else "")}
    keys: dict[str, Any] = dict(ACCEL_VARIANTS[accel]) if accel else {}
    artefact = None
    compiles = device == "cuda" and (fmt in ("aoti", "compiled") or "graphs" in (accel or ""))
    needs = cost * 3 + (120.0 if compiles else 0.0)  # an export or a graph per bucket: minutes
    if not budget.fits(needs):
        row.update(ok="skipped", note=f"time budget: {budget.left():.0f} s left, needs ~{needs:.0f} s")
        sec.rows.append(row)
        return
    if device == "cpu" and fmt == "compiled":  # the store build verified it on the CPU already
        row.update(
            ok="skipped", note="inductor compiles every bucket at load: minutes on a CPU; checked on CUDA"
        )
        sec.rows.append(row)
        return
    if device == "cuda" and fmt == "onnx" and not _onnx_cuda_available():
        row.update(ok="skipped", note="onnxruntime here has no CUDAExecutionProvider (needs onnxruntime-gpu)")
        sec.rows.append(row)
        return
    try:
        if device == "cuda" and fmt == "aoti":
            t0 = time.perf_counter()
            artefact = export_aoti_here(family, eager, work, device)
            keys.update(format="aoti", device="cuda")
            row["note"] = f"AOTInductor exported on this device ({time.perf_counter() - t0:.0f} s)"
        loaded = load(mar, work, device, keys, artefact, top=on_gpu(device, mar))
        got = loaded.answers(bodies)
        reduced = fmt == "int8" or accel is not None
        figures = compare(family, ref, got, reduced)
        ok = figures.pop("ok")
        row.update(device=loaded.device, **figures, ok=_ok(ok))
        if device == "cuda" and not loaded.device.startswith("cuda") and fmt != "int8":
            row["ok"] = "NO (ran on the CPU)"
    except Exception as exc:
        row.update(ok="NO", error=f"{type(exc).__name__}: {exc}"[:200])
    sec.rows.append(row)


def family_recompiles(sec: Section, store: Path, device: str, work: Path, top: int, budget: Budget) -> None:
    found = family_archives(store)
    targets: list[tuple[str, Path, dict[str, Any]]] = []
    for family, mars in sorted(found.items()):
        by_stem = {m.stem: m for m in mars}
        eager = by_stem.get(f"{family}_eager")
        if eager is not None:
            targets.append((family, eager, dict(ACCEL_VARIANTS["bf16+graphs"])))
        compiled = by_stem.get(f"{family}_compiled")
        if compiled is not None and device == "cuda":  # CPU inductor takes minutes per bucket
            targets.append((family, compiled, {}))
    if not targets:
        sec.status = "skipped"
        sec.notes.append("No minilm_*/resnet18_* eager or compiled archive in the store.")
        return
    for family, mar, keys in targets:
        name = mar.stem + (" +bf16+graphs" if keys else "")
        if not budget.fits(30.0):
            sec.rows.append(
                {"archive": name, "ok": "skipped", "note": f"time budget: {budget.left():.0f} s left"}
            )
            continue
        row: dict[str, Any] = {"archive": name}
        try:
            t0 = time.perf_counter()
            # the handler records (CUDA graphs) or compiles its buckets here, at load
            loaded = load(mar, work, device, keys, top=on_gpu(device, mar))
            load_s = time.perf_counter() - t0
            graphs0, recompiles0 = graph_counts()
            sizes = min(top, loaded.batch_size)  # a server never hands a handler more than batchSize
            seconds = drive_every_batch_size(loaded, inputs(family, sizes), sizes)
            graphs1, recompiles1 = graph_counts()
            fallbacks = eager_fallbacks(loaded.handler)
            row.update(
                {
                    "device": loaded.device,
                    "load + warm-up s": f"{load_s:.1f}",
                    "batch sizes": f"1..{sizes}",
                    "graphs compiled after warm-up": graphs1 - graphs0,
                    "recompiles": recompiles1 - recompiles0,
                    "unrecorded calls": fallbacks,
                    "seconds": f"{seconds:.2f}",
                }
            )
            clean = graphs1 == graphs0 and recompiles1 == recompiles0 and fallbacks == 0
            row["ok"] = _ok(clean)
        except Exception as exc:
            row.update(ok="NO", error=f"{type(exc).__name__}: {exc}"[:200])
        sec.rows.append(row)
    if device != "cuda":
        sec.notes.append(
            "On the CPU cudaGraphs is off (the plain function runs) and resnet18_compiled is not "
            "driven (inductor takes minutes per bucket here): this only proves the check runs."
        )
    if any(str(r.get("ok")).startswith("NO") for r in sec.rows):
        sec.status = "failed"


def workers_on(server: ServerProcess, name: str) -> list[str]:
    """Where the model's workers run ("cpu", "gpu"), from the management API's describe."""
    import requests

    desc = requests.get(f"{server.management_url}/models/{name}", timeout=30).json()
    return sorted({("gpu" if w.get("gpu") else "cpu") for d in desc for w in d.get("workers", [])})


def serve_families(sec: Section, store: Path, device: str, work: Path, n: int, budget: Budget) -> None:
    """Each family's eager archive served by `mariner serve` (`--require-gpu` on CUDA): answers
    as the CPU reference's, workers on the device."""
    import requests

    from mariner.loadtest.servers import MarinerProcess

    found = family_archives(store)
    names = [f"{fam}_eager" for fam in sorted(found) if (store / f"{fam}_eager.mar").exists()]
    if not names:
        sec.status = "skipped"
        sec.notes.append("No minilm_eager or resnet18_eager archive in the store.")
        return
    if not budget.fits(60.0):
        sec.status = "skipped"
        sec.notes.append(f"time budget: {budget.left():.0f} s left, serving takes ~60 s")
        return
    refs = {}
    for name in names:
        family = name.removesuffix("_eager")
        bodies = inputs(family, n)
        refs[name] = (family, bodies, load(store / f"{name}.mar", work, "cpu").answers(bodies))
    extra = ("--require-gpu",) if device == "cuda" else ()
    served = work / "serve-store"  # the archives as built, on CUDA with deviceType: gpu
    for name in names:
        variant_archive(store / f"{name}.mar", served, {}, on_gpu(device, store / f"{name}.mar"))
    with MarinerProcess(served, ",".join(f"{m}.mar" for m in names), extra_args=extra) as srv:
        for name, (family, bodies, ref) in refs.items():
            url = f"{srv.http_url}/predictions/{name}"
            replies = [
                requests.post(url, data=b.data, headers={"Content-Type": b.content_type}, timeout=120)
                for b in bodies
            ]
            bad = [r.status_code for r in replies if r.status_code != 200]
            devices = workers_on(srv, name)
            row: dict[str, Any] = {"model": name, "requests": len(bodies), "non-200": len(bad)}
            if not bad:
                figures = compare(family, ref, [r.json() for r in replies], reduced=False)
                ok = figures.pop("ok")
                row.update(figures)
            else:
                ok = False
            row.update(
                {"workers on": ",".join(devices), "ok": _ok(ok and (device != "cuda" or devices == ["gpu"]))}
            )
            sec.rows.append(row)
    if any(r["ok"] != "yes" for r in sec.rows):
        sec.status = "failed"
