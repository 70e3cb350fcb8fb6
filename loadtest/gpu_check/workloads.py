"""The GPU checklist for the sentence encoder (minilm_*) and the image classifier (resnet18_*).

Split from `checklist` and `digits` (the report and the digits checks) because these two
families are checked through the TorchServe contract alone: every archive is unpacked with the
server's `open_archive`, its handler imported with the server's `load_entry_point`, and driven
with real request bodies (held-out English sentences as text/plain; JPEG crops of the photos
scikit-learn ships) through `handle(data, context)`, exactly as a worker calls it. The answers
are compared with the same family's eager archive on the CPU:

- minilm: cosine of each embedding with the reference, >= 0.9999 fp32, >= 0.99 int8 and bf16;
- resnet18: the top-5 classes identical and probabilities within 1e-3 (fp32); top-1 agreeing
  on >= 95% of images for int8 and bf16.

bf16 autocast and CUDA graphs (`handlers/accel.py`) are checked as variants of the eager
archive whose model-config handler section sets `autocast: bf16` / `cudaGraphs: true`; the
same rewritten archives are what the benchmark serves (`variant_archive`).
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import time
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml

from mariner.server.common.archive import ModelArchive, open_archive
from mariner.server.compat.torchserve.forms import decode_value, mime_type
from mariner.server.worker.context import Context
from mariner.server.worker.entry_point import load_entry_point
from mariner.server.worker.torchvision_ops import ensure_torchvision_importable

FAMILIES = {"minilm": "minilm_", "resnet18": "resnet18_"}
COSINE_FP32 = 0.9999
COSINE_REDUCED = 0.99  # int8 weights or bf16 arithmetic
PROB_FP32 = 1e-3
TOP1_REDUCED = 0.95
SEED = 20261130
# Accelerator settings the checklist tries on each family's eager archive (name suffix -> handler keys).
ACCEL_VARIANTS: dict[str, dict[str, Any]] = {
    "bf16": {"autocast": "bf16"},
    "graphs": {"cudaGraphs": True},
    "bf16+graphs": {"autocast": "bf16", "cudaGraphs": True},
}


@dataclass(frozen=True)
class Body:
    """One request as a client sends it: raw bytes and their Content-Type."""

    data: bytes
    content_type: str


def family_of(name: str) -> str | None:
    return next((f for f, prefix in FAMILIES.items() if name.startswith(prefix)), None)


def family_archives(store: Path) -> dict[str, list[Path]]:
    """The store's archives of each family, as index.json lists them (the verified allowlist);
    a store a family pipeline built alone has no index, and then every archive in it counts."""
    index = store / "index.json"
    files = (
        [store / e["file"] for e in json.loads(index.read_text())["archives"]]
        if index.is_file()
        else sorted(store.glob("*.mar"))
    )
    found: dict[str, list[Path]] = {}
    for mar in files:
        family = family_of(mar.stem)
        if family is not None:
            found.setdefault(family, []).append(mar)
    return found


def inputs(family: str, n: int) -> list[Body]:
    """n real requests of the family: held-out sentences, or JPEG crops at varied sizes."""
    if family == "minilm":
        from mariner.training.text_data import sentences

        texts = sentences("heldout")[:n]
        return [Body(t.encode(), "text/plain; charset=utf-8") for t in texts]
    from mariner.training.image_data import encoded_set

    return [Body(jpeg, "image/jpeg") for jpeg in encoded_set(n, SEED)]


# -- archives with another handler section -----------------------------------------------------


def with_keys(
    config: dict[str, Any], handler: dict[str, Any], top: dict[str, Any] | None = None
) -> dict[str, Any]:
    """model-config with `handler` merged into its handler section and `top` into the top level."""
    cfg = copy.deepcopy(config)
    section = cfg.get("handler")
    cfg["handler"] = {**(section if isinstance(section, dict) else {}), **handler}
    cfg.update(top or {})
    return cfg


def on_gpu(device: str, mar: Path) -> dict[str, Any]:
    """The top-level keys that make an archive run on the GPU being checked: `deviceType: gpu`,
    which also forbids a silent CPU fallback, so a CPU row in the report is a refusal, never a
    quiet success. Not for int8 artefacts (their kernels are CPU kernels); a CPU AOTInductor
    archive gets its package exported again on the device first."""
    return {"deviceType": "gpu"} if device == "cuda" and "int8" not in mar.stem else {}


def variant_archive(
    mar: Path, out_dir: Path, keys: dict[str, Any], top: dict[str, Any] | None = None
) -> Path:
    """A copy of the archive, same file name and members, whose model-config handler section
    also carries `keys` (and its top level `top`): the variants are the archive users have, one
    knob changed."""
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / mar.name
    if not keys and not top:  # nothing to change: the same bytes, without re-compressing 90 MB
        out.unlink(missing_ok=True)
        try:
            os.link(mar, out)
        except OSError:
            shutil.copy(mar, out)
        return out
    with zipfile.ZipFile(mar) as src, zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as dst:
        for item in src.infolist():
            data = src.read(item)
            if item.filename == "model-config.yaml":
                cfg = with_keys(yaml.safe_load(data) or {}, keys, top)
                data = yaml.safe_dump(cfg, sort_keys=False).encode()
            dst.writestr(item, data)
    return out


# -- the handler, driven as a worker drives it -----------------------------------------------


class Loaded:
    """An archive's handler initialised on a device, called with whole batches of bodies."""

    def __init__(self, archive: ModelArchive, device: str) -> None:
        self.archive = archive
        self.batch_size = int(archive.model_config.get("batchSize", 1))
        self.ctx = Context(
            archive.name,
            str(archive.model_dir),
            archive.manifest,
            batch_size=self.batch_size,
            gpu_id=0 if device == "cuda" else None,
            model_yaml_config=archive.model_config,
        )
        ensure_torchvision_importable()  # as a worker does before it imports the handler
        self._handle, initialize = load_entry_point(archive)
        initialize(self.ctx)
        self.handler = getattr(self._handle, "__self__", None)

    @property
    def device(self) -> str:
        return str(getattr(self.handler, "device", "?"))

    def batch(self, bodies: Sequence[Body]) -> list[tuple[int, Any]]:
        """One handle() call: (status, decoded answer) per body, in order."""
        data = [{"body": decode_value(b.data, mime_type(b.content_type), "body")} for b in bodies]
        self.ctx.begin_batch(
            [str(i) for i in range(len(bodies))], [{"Content-Type": b.content_type} for b in bodies]
        )
        outputs = self._handle(data, self.ctx)
        if len(outputs) != len(bodies):
            raise RuntimeError(f"handler returned {len(outputs)} answers for {len(bodies)} requests")
        return [(self.ctx.get_response_status(i)[0], _decoded(o)) for i, o in enumerate(outputs)]

    def answers(self, bodies: Sequence[Body], rows: int | None = None) -> list[Any]:
        """Every body answered, in batches of `rows` (default batchSize); a non-200 raises."""
        rows = rows or self.batch_size
        out: list[Any] = []
        for k in range(0, len(bodies), rows):
            for status, answer in self.batch(bodies[k : k + rows]):
                if status != 200:
                    raise RuntimeError(f"handler answered {status}: {str(answer)[:200]}")
                out.append(answer)
        return out


def _decoded(item: Any) -> Any:
    if isinstance(item, bytes | bytearray):
        item = bytes(item).decode()
    if isinstance(item, str):
        return json.loads(item)
    return item


def load(
    mar: Path,
    work: Path,
    device: str,
    keys: dict[str, Any] | None = None,
    artefact: Path | None = None,
    top: dict[str, Any] | None = None,
) -> Loaded:
    """Unpack (as the server does), optionally change handler keys (`keys`) and top-level ones
    (`top`) or serve another artefact file (copied beside the others, the manifest's
    serializedFile pointed at it), then load."""
    archive = open_archive(mar, work / f"{mar.stem}-{time.monotonic_ns()}")
    if keys or top:
        archive = replace(archive, model_config=with_keys(archive.model_config, keys or {}, top))
    if artefact is not None:
        shutil.copy(artefact, archive.model_dir / artefact.name)
        manifest = copy.deepcopy(archive.manifest)
        manifest["model"]["serializedFile"] = artefact.name
        archive = replace(archive, manifest=manifest)
    return Loaded(archive, device)


# -- comparison with the eager archive on the CPU -------------------------------------------


def _embeddings(answers: Sequence[Any]) -> np.ndarray:
    return np.asarray([a["embedding"] for a in answers], dtype=np.float64)


def _topk(answers: Sequence[Any]) -> tuple[np.ndarray, np.ndarray]:
    idx = np.asarray([[t["index"] for t in a["topk"]] for a in answers])
    prob = np.asarray([[t["probability"] for t in a["topk"]] for a in answers], dtype=np.float64)
    return idx, prob


def compare(family: str, ref: Sequence[Any], got: Sequence[Any], reduced: bool) -> dict[str, Any]:
    """The family's agreement figures (one set of columns for both families) and `ok`."""
    if family == "minilm":
        a, b = _embeddings(ref), _embeddings(got)
        cos = (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))
        tol = COSINE_REDUCED if reduced else COSINE_FP32
        return {
            "agreement": f"cosine min {cos.min():.6f}",
            "max abs diff": f"{np.abs(a - b).max():.2e}",
            "tolerance": f"cosine >= {tol}",
            "ok": bool(cos.min() >= tol),
        }
    (ri, rp), (gi, gp) = _topk(ref), _topk(got)
    top1 = float((ri[:, 0] == gi[:, 0]).mean())
    same5 = float((ri == gi).all(1).mean())
    dprob = float(np.abs(rp - gp).max()) if same5 == 1.0 else float("nan")
    row: dict[str, Any] = {"agreement": f"top-1 {top1:.1%}, top-5 identical {same5:.1%}", "max abs diff": "-"}
    if reduced:
        row.update(tolerance=f"top-1 >= {TOP1_REDUCED:.0%}", ok=top1 >= TOP1_REDUCED)
        return row
    row.update(
        {"max abs diff": f"{dprob:.2e} (probability)", "tolerance": f"top-5 same, dp <= {PROB_FP32:g}"}
    )
    row["ok"] = same5 == 1.0 and dprob <= PROB_FP32
    return row


# -- AOTInductor packages made on this device ----------------------------------------------


def export_aoti_here(family: str, eager_mar: Path, work: Path, device: str) -> Path:
    """Export the family's eager model as an AOTInductor package for `device`, here, with the
    pipeline's example inputs and dynamic shapes (a package runs only on the torch version and
    device that built it, so the store's CPU package cannot be checked on a GPU)."""
    dev = torch.device(device)
    if family == "minilm":
        from mariner.training.minilm import export as fx
        from mariner.training.minilm.model import load_encoder

        module: torch.nn.Module = _Positional(
            load_encoder(open_archive(eager_mar, work / "aoti-src").model_dir)
        )
        example = _as_tuple(fx.example_inputs())
    else:
        from mariner.training.resnet import export as fx  # type: ignore[no-redef]

        module = load(eager_mar, work, "cpu").handler.model  # the handler's own nn.Module
        example = _as_tuple(fx.example_input())
    module = module.eval().to(dev)
    example = tuple(t.to(dev) for t in example)
    path = work / f"{family}_aoti_{dev.type}.pt2"
    with torch.no_grad():
        program = torch.export.export(module, example, dynamic_shapes=_positional_shapes(fx.dynamic_shapes()))
        torch._inductor.aoti_compile_and_package(program, package_path=str(path))
    return path


class _Positional(torch.nn.Module):
    """The encoder with exactly (input_ids, attention_mask), as the exported artefacts are called."""

    def __init__(self, encoder: torch.nn.Module) -> None:
        super().__init__()
        self.encoder = encoder

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.encoder(input_ids, attention_mask)


def _as_tuple(x: Any) -> tuple[Any, ...]:
    return tuple(x) if isinstance(x, tuple | list) else (x,)


def _positional_shapes(shapes: Any) -> Any:
    """Dynamic shapes by position (the wrappers' argument names need not match the pipeline's)."""
    return tuple(shapes.values()) if isinstance(shapes, dict) else shapes


# -- graphs after warm-up ----------------------------------------------------------------------


def graph_counts() -> tuple[int, int]:
    """(graphs dynamo has compiled, recompilations) in this process so far."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"]), int(sum(counters["recompiles"].values()))


def eager_fallbacks(handler: Any) -> int:
    """Calls a handler's CUDA-graphed functions ran unrecorded (accel.Graphed.fallbacks)."""
    seen = [v for v in vars(handler).values() if hasattr(v, "fallbacks") and hasattr(v, "warmed")]
    return sum(int(v.fallbacks) for v in seen)


def drive_every_batch_size(loaded: Loaded, bodies: Sequence[Body], top: int) -> float:
    """Batches of 1..top requests (mixed lengths/sizes): what live traffic sends after warm-up."""
    t0 = time.perf_counter()
    for b in range(1, top + 1):
        loaded.batch([bodies[(b + k) % len(bodies)] for k in range(b)])
    return time.perf_counter() - t0
