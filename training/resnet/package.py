"""Stage each ResNet-18 variant's model dir; `mariner.training.package.archive` makes the .mar.

An archive carries the handler and the helpers it imports by path (`resnet_image.py` for
decoding, `handler_support.py` for the device rules, `accel.py` for autocast/CUDA graphs), the
artefact, `labels.json`, `model-config.yaml`, `verification.json` and, for the eager and
compiled variants, the architecture as `resnet_model.py`.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import yaml

from mariner.training.package import ARCHIVE_VERSION, Staged, fresh_stage_dir

ROOT = Path(__file__).resolve().parents[2]
HANDLER = ROOT / "handlers" / "resnet_handler.py"
HELPERS = tuple(ROOT / "handlers" / n for n in ("resnet_image.py", "handler_support.py", "accel.py"))
MODEL_DEF = Path(__file__).resolve().with_name("model.py")
# Mariner's OIP ModelMetadata and request check. The model takes its images in one of two forms,
# each an optional input (a request carries one): encoded JPEG/PNG bytes, or a decoded,
# ImageNet-normalised FP32 batch for clients that preprocess themselves.
SIGNATURE: dict[str, Any] = {
    "inputs": [
        {"name": "image", "datatype": "BYTES", "shape": [-1], "optional": True},
        {"name": "pixels", "datatype": "FP32", "shape": [-1, 3, 224, 224], "optional": True},
    ],
    "outputs": [
        {"name": "probabilities", "datatype": "FP32", "shape": [-1, 5]},
        {"name": "indices", "datatype": "INT64", "shape": [-1, 5]},
    ],
}
PERFORMANCE_NOTE = "PERFORMANCE workload: seeded, untrained weights (BatchNorm calibrated on photos)"


def model_config(fmt: str, device: str, *, batch_size: int, max_batch_delay_ms: int) -> dict[str, Any]:
    handler: dict[str, Any] = {"format": fmt, "device": device, "topk": 5, "note": PERFORMANCE_NOTE}
    if fmt == "compiled":
        # Static shapes: batches are padded to power-of-two buckets, each compiled at load.
        handler["compile"] = {"mode": "default", "dynamic": False}
    cfg: dict[str, Any] = {
        "minWorkers": 1,
        "maxWorkers": 1,
        "batchSize": batch_size,
        "maxBatchDelay": max_batch_delay_ms,
        # compiled: every bucket compiles at load; a 2-core machine needs minutes for that.
        "responseTimeout": 600 if fmt == "compiled" else 60,
        "handler": handler,
        "signature": SIGNATURE,
    }
    if device == "cpu":  # CPU-only artefacts (AOTInductor CPU packages, int8 kernels), as digits does
        cfg["deviceType"] = "cpu"
    return cfg


def stage(
    *,
    variant: str,
    fmt: str,
    device: str,
    artefact: Path,
    work: Path,
    labels: list[str],
    batch_size: int,
    max_batch_delay_ms: int,
) -> Staged:
    """Copy the artefact and the side files into `work/resnet18_<variant>/`."""
    name = f"resnet18_{variant}"
    d, art = fresh_stage_dir(work, name, artefact)
    (d / "labels.json").write_text(json.dumps(labels) + "\n")
    cfg = model_config(fmt, device, batch_size=batch_size, max_batch_delay_ms=max_batch_delay_ms)
    (d / "model-config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    shutil.copy2(HANDLER, d / HANDLER.name)
    extras = [d / "labels.json"]
    for helper in HELPERS:
        shutil.copy2(helper, d / helper.name)
        extras.append(d / helper.name)
    if fmt in ("eager", "compiled"):
        shutil.copy2(MODEL_DEF, d / "resnet_model.py")
        extras.append(d / "resnet_model.py")
    manifest = {
        "model": {
            "modelName": name,
            "serializedFile": art.name,
            "handler": HANDLER.name,
            "modelVersion": ARCHIVE_VERSION,
            "configFile": "model-config.yaml",
        }
    }
    return Staged(variant, name, d, art, manifest, cfg, tuple(extras), handler=HANDLER.name)
