"""Stage each variant's files and package them as TorchServe .mar archives.

Archives are made by the real `torch-model-archiver`, so stock TorchServe and Mariner load
the very same bytes. Each archive carries the handler and its device helper
(`handler_support.py`, imported by the handler from its own directory), the artefact,
`norm.json`, `labels.json`, `model-config.yaml` and the variant's `verification.json`.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
HANDLER = ROOT / "handlers" / "digits_handler.py"
HANDLER_HELPERS = (ROOT / "handlers" / "handler_support.py",)  # beside the handler in every archive
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
    cfg: dict[str, Any] = {
        "minWorkers": 1,
        "maxWorkers": 1,
        "batchSize": batch_size,
        "maxBatchDelay": max_batch_delay_ms,
        "responseTimeout": 120 if fmt == "compiled" else 30,
        "handler": handler,
        # The tensor signature Mariner serves as Open Inference Protocol ModelMetadata and checks
        # requests against. `pixels` are raw intensities 0..16; the handler normalises them.
        "signature": SIGNATURE,
    }
    if device == "cpu":
        cfg["deviceType"] = "cpu"
    return cfg


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


def stage(
    *,
    variant: str,
    fmt: str,
    device: str,
    artefact: Path,
    work: Path,
    norm: dict[str, float],
    model_kwargs: dict[str, Any],
    batch_size: int,
    max_batch_delay_ms: int,
) -> Staged:
    """Copy the artefact and the side files into `work/<model_name>/`."""
    name = f"digits_{variant}"
    d, art = fresh_stage_dir(work, name, artefact)
    (d / "norm.json").write_text(json.dumps(norm, indent=2) + "\n")
    (d / "labels.json").write_text(json.dumps([str(i) for i in range(10)]) + "\n")
    cfg = model_config(
        fmt, device, batch_size=batch_size, max_batch_delay_ms=max_batch_delay_ms, model_kwargs=model_kwargs
    )
    (d / "model-config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    shutil.copy2(HANDLER, d / HANDLER.name)
    extras = [d / "norm.json", d / "labels.json"]
    for helper in HANDLER_HELPERS:
        shutil.copy2(helper, d / helper.name)
        extras.append(d / helper.name)
    if fmt in ("eager", "compiled"):
        shutil.copy2(MODEL_DEF, d / "digits_model.py")
        extras.append(d / "digits_model.py")
    manifest = {
        "model": {
            "modelName": name,
            "serializedFile": art.name,
            "handler": HANDLER.name,
            "modelVersion": ARCHIVE_VERSION,
            "configFile": "model-config.yaml",
        }
    }
    return Staged(variant, name, d, art, manifest, cfg, tuple(extras))


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
