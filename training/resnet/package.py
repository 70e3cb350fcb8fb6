"""Stage each ResNet-18 variant's model dir; `mariner.training.package.archive` makes the .mar.

An archive carries the handler and the helpers it loads by path (`resnet_image.py` for
decoding, `handler_support.py` for what every handler needs, `accel.py` for autocast/CUDA graphs), the
artefact, `labels.json`, `model-config.yaml`, `verification.json` and, for the eager and
compiled variants, the architecture as `resnet_model.py`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from mariner.training import package as shared

if TYPE_CHECKING:
    from mariner.training.export import Artefact

ROOT = Path(__file__).resolve().parents[2]
HANDLER = ROOT / "handlers" / "resnet_handler.py"
HELPERS = (ROOT / "handlers" / "resnet_image.py", shared.HANDLER_SUPPORT, shared.ACCEL)
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
    # compiled: every bucket compiles at load; a 2-core machine needs minutes for that.
    timeout = 600 if fmt == "compiled" else 60
    return shared.family_model_config(handler, SIGNATURE, device, (batch_size, max_batch_delay_ms, timeout))


def stage(
    exported: Artefact,
    *,
    work: Path,
    labels: list[str],
    batch_size: int,
    max_batch_delay_ms: int,
) -> shared.Staged:
    """Copy the artefact and the side files into `work/resnet18_<variant>/`."""
    variant, fmt, device, artefact = exported.variant, exported.format, exported.device, exported.path
    name = f"resnet18_{variant}"
    d, art = shared.fresh_stage_dir(work, name, artefact)
    (d / "labels.json").write_text(json.dumps(labels) + "\n")
    cfg = model_config(fmt, device, batch_size=batch_size, max_batch_delay_ms=max_batch_delay_ms)
    (d / "model-config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    code = {"resnet_model.py": MODEL_DEF} if fmt in ("eager", "compiled") else {}
    extras = [d / "labels.json", *shared.ship_code(d, HANDLER, HELPERS, code)]
    manifest = shared.manifest_for(name, art, HANDLER)
    return shared.Staged(variant, name, d, art, manifest, cfg, tuple(extras), handler=HANDLER.name)
