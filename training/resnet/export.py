"""Export the seeded ResNet-18 into every artefact format the resnet handler serves.

Reuses the digits exports' machinery where it is generic (AOTInductor packaging for a portable
CPU baseline and the metadata the handler checks, `mariner.training.export`). Every graph
capture declares the batch dimension dynamic from the first `torch.export` on (see TRAPS:
PT2E otherwise specialises the batch size). The compiled variant ships the eager state_dict;
the handler compiles it at load with static shapes, one graph per batch bucket.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from mariner.training import export as shared
from mariner.training.export import Artefact, aoti_cpu_package, aoti_target, timed

DEFAULT_VARIANTS = ("eager", "torchscript", "onnx")
FULL_VARIANTS = (*DEFAULT_VARIANTS, "aoti", "compiled", "int8_pt2e")


def example_input(batch: int = 2) -> torch.Tensor:
    # batch 2, not 1: export would otherwise be tempted to specialise on a size-1 dim.
    return torch.randn(batch, 3, 224, 224)


def export_program(model: nn.Module) -> torch.export.ExportedProgram:
    return shared.export_program(model, example_input())


def export_eager(model: nn.Module, out: Path) -> Artefact:
    return shared.export_state_dict(model, out, "resnet18_eager.pt")


def export_torchscript(model: nn.Module, out: Path) -> Artefact:
    return shared.export_torchscript(model, out, "resnet18_ts.pt")


def export_onnx(model: nn.Module, out: Path) -> Artefact:
    return shared.export_onnx(model, out, "resnet18.onnx", example_input())


def export_aoti(model: nn.Module, out: Path) -> Artefact:
    path = out / "resnet18_aoti.pt2"
    secs = timed(lambda: aoti_cpu_package(export_program(model), path))
    return Artefact("aoti", path, "aoti", "cpu", secs, aoti_target(path))


def quantize_pt2e_int8(model: nn.Module, calibration: torch.Tensor, out: Path) -> Artefact:
    """Static int8 (torchao PT2E, x86 inductor quantizer) calibrated on photo crops -> AOTI."""
    return shared.quantize_pt2e_int8(
        model, calibration, out, name="resnet18_int8_pt2e.pt2", example=example_input, chunk=16
    )


def export_variants(
    model: nn.Module, out: Path, variants: tuple[str, ...], calibration: torch.Tensor
) -> list[Artefact]:
    """The artefacts of `variants`, in the order given (eager first: the others reuse nothing)."""
    out.mkdir(parents=True, exist_ok=True)
    arts: list[Artefact] = []
    eager: Artefact | None = None
    for v in variants:
        if v == "eager":
            eager = export_eager(model, out)
            arts.append(eager)
        elif v == "compiled":
            eager = eager or export_eager(model, out)
            arts.append(Artefact("compiled", eager.path, "compiled", "any", 0.0))
        elif v == "torchscript":
            arts.append(export_torchscript(model, out))
        elif v == "onnx":
            arts.append(export_onnx(model, out))
        elif v == "aoti":
            arts.append(export_aoti(model, out))
        elif v == "int8_pt2e":
            arts.append(quantize_pt2e_int8(model, calibration, out))
        else:
            raise ValueError(f"unknown resnet18 variant {v!r}; known: {', '.join(FULL_VARIANTS)}")
    return arts
