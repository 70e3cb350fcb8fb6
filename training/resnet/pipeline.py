"""Build the ResNet-18 archives: seeded weights -> export -> verify -> package.

`python -m mariner.training.resnet.pipeline --store DIR [--full]` builds this family alone;
the store builder (`mariner.training.pipeline`) calls `build()` and merges its index entries.
The default store has the quick variants (eager, TorchScript, ONNX); `--full` adds
AOTInductor, torch.compile (compiled at load) and PT2E int8, which take minutes on 2 cores.
Work files go under WORK/resnet/.
"""

from __future__ import annotations

import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from mariner.training import package as archiver
from mariner.training.family import FamilyBuild, family_main, print_verdict
from mariner.training.image_data import encoded_set
from mariner.training.resnet import package, weights
from mariner.training.resnet.export import DEFAULT_VARIANTS, FULL_VARIANTS, export_variants
from mariner.training.resnet.verify import markdown, verify_variant

QUANTIZED = {"int8_pt2e"}
VERIFY_IMAGES = 64
VERIFY_SEED = 2024  # held-out crops: not the BN-calibration seed
INT8_CALIBRATION_IMAGES = 64
INT8_CALIBRATION_SEED = 4321


def build(
    store: Path,
    work: Path,
    *,
    full: bool,
    batch_size: int,
    max_batch_delay_ms: int,
    repeats: int = 5,
    verify_images: int = VERIFY_IMAGES,
    variants: tuple[str, ...] | None = None,
) -> FamilyBuild:
    """Export, verify and archive the variants (default set, or every one with `full`)."""
    root = work / "resnet"
    chosen = variants or (FULL_VARIANTS if full else DEFAULT_VARIANTS)
    model = weights.make_model()
    x = weights.calibration_batch(verify_images, VERIFY_SEED)
    with torch.inference_mode():
        eager_logits = torch.cat([model(c) for c in x.split(32)])
    calibration = (
        weights.calibration_batch(INT8_CALIBRATION_IMAGES, INT8_CALIBRATION_SEED)
        if "int8_pt2e" in chosen
        else torch.empty(0)
    )
    jpegs = encoded_set(32, VERIFY_SEED + 1)
    labels = weights.labels()
    rows = []
    entries: list[dict[str, Any]] = []
    for art in export_variants(model, root / "artefacts", chosen, calibration):
        staged = package.stage(
            art,
            work=root / "stage",
            labels=labels,
            batch_size=batch_size,
            max_batch_delay_ms=max_batch_delay_ms,
        )
        rec = verify_variant(
            staged, fmt=art.format, quantized=art.variant in QUANTIZED, x=x, eager_logits=eager_logits,
            jpegs=jpegs, repeats=repeats, target=art.target,
        )  # fmt: skip
        record = {**asdict(rec), "export_seconds": round(art.seconds, 3), "note": package.PERFORMANCE_NOTE}
        entries.append(archiver.archive_variant(staged, record, store, fmt=art.format, device=art.device))
        rows.append(rec)
        print_verdict(f"resnet18_{art.variant}", rec.tolerance, rec.passed, (21, 28))
    return FamilyBuild.of("resnet", entries, markdown(rows, verify_images), rows)


def main(argv: list[str] | None = None) -> int:
    full_help = "also AOTInductor, compiled and PT2E int8"
    return family_main(build, doc=__doc__, label="resnet18", full_help=full_help, repeats=5, argv=argv)


if __name__ == "__main__":
    sys.exit(main())
