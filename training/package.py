"""Stage each variant's files and package them as TorchServe .mar archives.

Archives are made by the real `torch-model-archiver`, so stock TorchServe and Mariner load
the very same bytes. Each archive carries the handler and the helper every handler shares
(`handler_support.py`, loaded by the handler from its own directory), the artefact,
`norm.json`, `labels.json`, `model-config.yaml` and the variant's `verification.json`.
The staging and archiving steps here serve every family (MiniLM and ResNet stage their own
side files, then ship their code with `ship_code` and archive with `archive_variant`).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

if TYPE_CHECKING:
    from mariner.training.export import Artefact

ROOT = Path(__file__).resolve().parent.parent
HANDLER = ROOT / "handlers" / "digits_handler.py"
# Beside the handler in every archive of every family: what all handlers share.
HANDLER_SUPPORT = ROOT / "handlers" / "handler_support.py"
ACCEL = ROOT / "handlers" / "accel.py"  # autocast / CUDA graphs: the MiniLM and ResNet handlers
HANDLER_HELPERS = (HANDLER_SUPPORT,)
MODEL_DEF = ROOT / "training" / "model.py"
ARCHIVE_VERSION = "1.0"
SIGNATURE: dict[str, Any] = {
    "inputs": [{"name": "pixels", "datatype": "FP32", "shape": [-1, 64]}],
    "outputs": [
        {"name": "logits", "datatype": "FP32", "shape": [-1, 10]},
        {"name": "probabilities", "datatype": "FP32", "shape": [-1, 10]},
        {"name": "label", "datatype": "INT64", "shape": [-1]},
    ],
}


@dataclass(frozen=True)
class Staged:
    """A variant's model dir before archiving: exactly what the archive will unpack to."""

    variant: str
    model_name: str
    dir: Path
    artefact: Path
    manifest: dict[str, Any]
    model_config: dict[str, Any]
    extra_files: tuple[Path, ...]
    handler: str = HANDLER.name  # file name of the handler inside `dir` (other families ship their own)


def family_model_config(
    handler: dict[str, Any],
    signature: dict[str, Any],
    device: str,
    batching: tuple[int, int, int],
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The model-config every family's archives carry: one worker, the batching keys, the
    handler section, the tensor signature Mariner serves as Open Inference Protocol
    ModelMetadata (and checks requests against) and, for an artefact that runs only on the CPU
    (AOTInductor CPU packages, int8 kernels), `deviceType: cpu`. `extra` keys (a family's own,
    such as MiniLM's token budget) go after responseTimeout. `batching` is (batchSize,
    maxBatchDelay in ms, responseTimeout in s)."""
    batch_size, max_batch_delay_ms, response_timeout = batching
    cfg: dict[str, Any] = {
        "minWorkers": 1,
        "maxWorkers": 1,
        "batchSize": batch_size,
        "maxBatchDelay": max_batch_delay_ms,
        "responseTimeout": response_timeout,
        **(extra or {}),
        "handler": handler,
        "signature": signature,
    }
    if device == "cpu":
        cfg["deviceType"] = "cpu"
    return cfg


def model_config(
    fmt: str,
    device: str,
    *,
    batch_size: int,
    max_batch_delay_ms: int,
    model_kwargs: dict[str, Any],
) -> dict[str, Any]:
    """TorchServe model-config keys plus the handler section our handler reads."""
    handler: dict[str, Any] = {"format": fmt, "device": device, "topk": 3}
    if fmt in ("eager", "compiled"):
        handler["model_kwargs"] = model_kwargs
    if fmt == "compiled":
        # dynamic=False: the handler pads every batch to a power-of-two bucket up to batchSize
        # and compiles each bucket at load, so live traffic never compiles (or, with mode
        # reduce-overhead, records a CUDA graph); static shapes also give the faster kernels.
        handler["compile"] = {"mode": "default", "dynamic": False}
    # `pixels` in the signature are raw intensities 0..16; the handler normalises them.
    timeout = 120 if fmt == "compiled" else 30
    return family_model_config(handler, SIGNATURE, device, (batch_size, max_batch_delay_ms, timeout))


def fresh_stage_dir(work: Path, name: str, artefact: Path) -> tuple[Path, Path]:
    """An empty `work/<name>/` holding a copy of the artefact; every family stages this way, so a
    rebuilt archive never carries a file left over from an earlier build."""
    d = work / name
    if d.exists():
        shutil.rmtree(d)
    d.mkdir(parents=True)
    art = d / artefact.name
    shutil.copy2(artefact, art)
    return d, art


def ship_code(
    d: Path, handler: Path, helpers: tuple[Path, ...], model_code: dict[str, Path] | None = None
) -> list[Path]:
    """Copy the handler, the helpers it loads from its own directory and the model code (archive
    name -> source; the eager formats' architecture) into the stage dir `d`. Returns the files
    that go to torch-model-archiver's --extra-files (all but the handler, which is --handler)."""
    shutil.copy2(handler, d / handler.name)
    extras = []
    for helper in helpers:
        shutil.copy2(helper, d / helper.name)
        extras.append(d / helper.name)
    for name, source in (model_code or {}).items():
        shutil.copy2(source, d / name)
        extras.append(d / name)
    return extras


def manifest_for(model_name: str, artefact: Path, handler: Path) -> dict[str, Any]:
    """The MANIFEST.json `model` section the archive will carry (what the handler reads)."""
    return {
        "model": {
            "modelName": model_name,
            "serializedFile": artefact.name,
            "handler": handler.name,
            "modelVersion": ARCHIVE_VERSION,
            "configFile": "model-config.yaml",
        }
    }


def stage(
    exported: Artefact,
    *,
    work: Path,
    norm: dict[str, float],
    model_kwargs: dict[str, Any],
    batch_size: int,
    max_batch_delay_ms: int,
) -> Staged:
    """Copy the artefact and the side files into `work/<model_name>/`."""
    variant, fmt, device, artefact = exported.variant, exported.format, exported.device, exported.path
    name = f"digits_{variant}"
    d, art = fresh_stage_dir(work, name, artefact)
    (d / "norm.json").write_text(json.dumps(norm, indent=2) + "\n")
    (d / "labels.json").write_text(json.dumps([str(i) for i in range(10)]) + "\n")
    cfg = model_config(
        fmt, device, batch_size=batch_size, max_batch_delay_ms=max_batch_delay_ms, model_kwargs=model_kwargs
    )
    (d / "model-config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    code = {"digits_model.py": MODEL_DEF} if fmt in ("eager", "compiled") else {}
    extras = [d / "norm.json", d / "labels.json", *ship_code(d, HANDLER, HANDLER_HELPERS, code)]
    return Staged(variant, name, d, art, manifest_for(name, art, HANDLER), cfg, tuple(extras))


def write_verification(staged: Staged, record: dict[str, Any]) -> Path:
    path = staged.dir / "verification.json"
    path.write_text(json.dumps(record, indent=2) + "\n")
    return path


def archive(staged: Staged, verification: Path, store: Path) -> Path:
    """Run torch-model-archiver (the real tool) and return the .mar path.

    The archive is written beside the store and moved in with one rename, so a server reading
    the store never sees a half-written file.
    """
    store.mkdir(parents=True, exist_ok=True)
    staging = store / f".staging-{staged.model_name}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    tool = Path(sys.executable).parent / "torch-model-archiver"
    extras = [*staged.extra_files, verification]
    cmd = [
        str(tool if tool.exists() else "torch-model-archiver"),
        "--model-name", staged.model_name,
        "--version", ARCHIVE_VERSION,
        "--serialized-file", str(staged.artefact),
        "--handler", str(staged.dir / staged.handler),
        "--extra-files", ",".join(str(p) for p in extras),
        "--config-file", str(staged.dir / "model-config.yaml"),
        "--export-path", str(staging),
        "--force",
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:  # say why: the tool's stderr is captured, not shown
        raise RuntimeError(
            f"torch-model-archiver failed for {staged.model_name}: {done.stderr.strip()[-2000:]}"
        )
    target = store / f"{staged.model_name}.mar"
    os.replace(staging / target.name, target)
    staging.rmdir()
    return target


def archive_variant(
    staged: Staged, record: dict[str, Any], store: Path, *, fmt: str, device: str
) -> dict[str, Any]:
    """Write the verification record into the staged dir, archive it into `store` and return the
    archive's index.json entry: the last step of every family's per-variant build."""
    from mariner.training.family import index_entry

    mar = archive(staged, write_verification(staged, record), store)
    return index_entry(
        mar, model=staged.model_name, version=ARCHIVE_VERSION, fmt=fmt, device=device, verification=record
    )
