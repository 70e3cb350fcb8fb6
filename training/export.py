"""Export the trained digits CNN into every artefact format the handler serves.

All exports start from the same checkpoint, loaded with weights_only=True, and every
graph-capturing export declares the batch dimension dynamic from the first `torch.export`
on: PT2E quantization of a statically exported graph specialises the batch size and the
later export of the converted model then fails.

AOTInductor packages are machine code. The inductor's default is `-march=native` with the build
CPU's widest vector ISA (AVX-512 or AMX here), which dies with SIGILL on an older serving CPU.
The pipeline builds them for a portable baseline instead, `-march=x86-64-v3` with AVX2 vectors
(Haswell/Zen 1 and later), and records that baseline and the CPU flags it needs in the
package's own metadata, which the handler checks against /proc/cpuinfo before loading.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.export import Dim

from mariner.handlers.handler_support import (
    ISA_CPU_FLAGS,
    MARCH_CPU_FLAGS,
    META_CPU_FLAGS,
    META_MARCH,
    host_cpu_flags,
)
from mariner.training.model import DigitsCNN
from mariner.training.train import load_checkpoint

MAX_BATCH = 1024  # upper bound of the dynamic batch dim in exported graphs
AOTI_MARCH = "x86-64-v3"  # portable CPU baseline for AOTInductor packages (see the docstring)
AOTI_SIMDLEN = 256  # AVX2 vectors; the inductor would otherwise pick the build CPU's widest


@dataclass(frozen=True)
class Artefact:
    """One exported file and how the handler must load it."""

    variant: str
    path: Path
    format: str  # eager | compiled | torchscript | aoti | onnx
    device: str  # "any", or the only device the artefact runs on ("cpu")
    seconds: float  # time the export took
    target: str = "any device"  # what the artefact was built for, as the variant report says it


def load_eager(checkpoint: Path) -> tuple[DigitsCNN, dict[str, Any]]:
    """Rebuild the model from a weights_only checkpoint, in eval mode on CPU."""
    ck = load_checkpoint(checkpoint)
    cfg = ck["config"]
    model = DigitsCNN(width=cfg["width"], hidden=cfg["hidden"], dropout=cfg["dropout"])
    model.load_state_dict(ck["model"])
    return model.eval(), ck


def model_kwargs(ck: dict[str, Any]) -> dict[str, Any]:
    cfg = ck["config"]
    return {"width": cfg["width"], "hidden": cfg["hidden"], "dropout": cfg["dropout"]}


def example_input(batch: int = 2) -> torch.Tensor:
    # batch 2, not 1: export would otherwise be tempted to specialise on a size-1 dim.
    return torch.randn(batch, 1, 8, 8)


def batch_dynamic_shapes() -> dict[str, dict[int, Any]]:
    return {"x": {0: Dim("batch", min=1, max=MAX_BATCH)}}


def export_program(model: nn.Module, example: torch.Tensor | None = None) -> torch.export.ExportedProgram:
    """torch.export of a one-input model with the batch dim dynamic; every family's image models
    export this way (`example` is theirs; the digits input by default)."""
    x = example_input() if example is None else example
    return torch.export.export(model, (x,), dynamic_shapes=batch_dynamic_shapes())


def timed(fn: Callable[[], None]) -> float:
    """Seconds `fn` took: each family's export records how long its artefact took to build."""
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def export_state_dict(model: nn.Module, out: Path, name: str = "digits_eager.pt") -> Artefact:
    """The eager variant: the state_dict alone (the archive ships the architecture as code)."""
    path = out / name
    secs = timed(lambda: torch.save(model.state_dict(), path))
    return Artefact("eager", path, "eager", "any", secs)


def export_torchscript(
    model: nn.Module, out: Path, name: str = "digits_ts.pt", variant: str = "torchscript", device: str = "any"
) -> Artefact:
    path = out / name

    def run() -> None:
        with warnings.catch_warnings():
            # TorchScript is deprecated upstream but still what many TorchServe users deploy.
            warnings.simplefilter("ignore", DeprecationWarning)
            scripted = torch.jit.script(model)
        scripted.save(str(path))

    return Artefact(variant, path, "torchscript", device, timed(run))


def onnx_file(
    model: nn.Module,
    args: tuple[torch.Tensor, ...],
    path: Path,
    *,
    dynamic_shapes: dict[str, dict[int, Any]],
    input_names: list[str],
    output_names: list[str],
) -> float:
    """torch.onnx's dynamo export into one self-contained file (no external data); returns the
    seconds it took. Every family's ONNX artefact is made here, with its own inputs and dims."""

    def run() -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            program = torch.onnx.export(
                model,
                args,
                dynamo=True,
                dynamic_shapes=dynamic_shapes,
                input_names=input_names,
                output_names=output_names,
                external_data=False,
            )
        program.save(str(path))

    return timed(run)


# Build-host flags that -march=native may turn into instructions (recorded when it cannot be avoided).
_NATIVE_FLAG_PREFIXES = ("avx", "amx", "fma", "f16c", "bmi", "sse", "ssse", "movbe", "abm", "popcnt")


def aoti_cpu_configs() -> dict[str, Any]:
    """Inductor settings for a portable CPU package, and the metadata recording them.

    A torch without the `cpp.march` knob compiles with -march=native: the package then records
    every vector/bit-manipulation flag of the build CPU, so the handler refuses it on any host
    lacking one of them rather than risk SIGILL.
    """
    if hasattr(torch._inductor.config.cpp, "march"):
        flags = MARCH_CPU_FLAGS[AOTI_MARCH] | ISA_CPU_FLAGS["AVX2"]
        return {
            "cpp.march": AOTI_MARCH,
            "cpp.simdlen": AOTI_SIMDLEN,
            "aot_inductor.metadata": {META_MARCH: AOTI_MARCH, META_CPU_FLAGS: " ".join(sorted(flags))},
        }
    host = host_cpu_flags() or frozenset()
    native = sorted(f for f in host if f.startswith(_NATIVE_FLAG_PREFIXES))
    return {"aot_inductor.metadata": {META_MARCH: "native", META_CPU_FLAGS: " ".join(native)}}


def aoti_cpu_package(program: torch.export.ExportedProgram, path: Path) -> None:
    torch._inductor.aoti_compile_and_package(
        program, package_path=str(path), inductor_configs=aoti_cpu_configs()
    )


def aoti_target(path: Path) -> str:
    """What a package was built for, read back from its own metadata (what the handler checks)."""
    from mariner.handlers.handler_support import aoti_metadata

    meta = aoti_metadata(path)
    march = meta.get(META_MARCH, "native")
    return f"{meta.get('AOTI_DEVICE_KEY')} -march={march} ({meta.get('AOTI_CPU_ISA')})"


def export_aoti(program: torch.export.ExportedProgram, path: Path, variant: str) -> Artefact:
    """AOTInductor package; tied to this torch version and to the CPU, built for a baseline ISA."""
    secs = timed(lambda: aoti_cpu_package(program, path))
    return Artefact(variant, path, "aoti", "cpu", secs, aoti_target(path))


def export_onnx(
    model: nn.Module, out: Path, name: str = "digits.onnx", example: torch.Tensor | None = None
) -> Artefact:
    """A one-input image model to ONNX, batch dynamic (`example`: the digits input by default)."""
    path = out / name
    x = example_input() if example is None else example
    secs = onnx_file(
        model, (x,), path, dynamic_shapes=batch_dynamic_shapes(), input_names=["x"], output_names=["logits"]
    )
    return Artefact("onnx", path, "onnx", "any", secs)


def quantize_dynamic_int8(model: nn.Module, out: Path) -> Artefact:
    """Dynamic int8 on the Linear layers (weights int8, activations quantized per batch).

    Saved as TorchScript: dynamic-quantized modules hold packed weights that only script
    serialisation round-trips. Quantized kernels are CPU-only, hence device "cpu".
    """
    torch.backends.quantized.engine = (
        "x86" if "x86" in torch.backends.quantized.supported_engines else "fbgemm"
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        qmodel = torch.ao.quantization.quantize_dynamic(model, {nn.Linear}, dtype=torch.qint8)
    art = export_torchscript(qmodel, out, name="digits_int8_dynamic.pt", variant="int8_dynamic", device="cpu")
    return replace(art, target="cpu (x86 int8 kernels)")


def quantize_pt2e_int8(
    model: nn.Module,
    calibration: torch.Tensor,
    out: Path,
    *,
    name: str = "digits_int8_pt2e.pt2",
    example: Callable[[], torch.Tensor] = example_input,
    chunk: int = 128,
) -> Artefact:
    """Static int8 with PT2E (torchao): export -> prepare -> calibrate -> convert -> AOTI.

    `example` makes the export's example batch (one per export), `chunk` is the calibration
    batch size; both are the family's (the digits CNN's by default)."""
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e
    from torchao.quantization.pt2e.quantizer.x86_inductor_quantizer import (
        X86InductorQuantizer,
        get_default_x86_inductor_quantization_config,
    )

    path = out / name

    def run() -> None:
        quantizer = X86InductorQuantizer()
        quantizer.set_global(get_default_x86_inductor_quantization_config())
        prepared = prepare_pt2e(export_program(model, example()).module(), quantizer)
        with torch.no_grad():
            for rows in calibration.split(chunk):
                prepared(rows)
        converted = convert_pt2e(prepared)
        aoti_cpu_package(export_program(converted, example()), path)

    secs = timed(run)
    return Artefact("int8_pt2e", path, "aoti", "cpu", secs, aoti_target(path))


def export_all(
    checkpoint: Path, out: Path, calibration: torch.Tensor
) -> tuple[list[Artefact], dict[str, Any]]:
    """Every artefact the store ships, plus the checkpoint dict they came from."""
    out.mkdir(parents=True, exist_ok=True)
    model, ck = load_eager(checkpoint)
    eager = export_state_dict(model, out)
    arts = [
        eager,
        Artefact("compiled", eager.path, "compiled", "any", 0.0),
        export_torchscript(model, out),
        export_aoti(export_program(model), out / "digits_aoti.pt2", "aoti"),
        export_onnx(model, out),
        quantize_dynamic_int8(load_eager(checkpoint)[0], out),
        quantize_pt2e_int8(load_eager(checkpoint)[0], calibration, out),
    ]
    return arts, ck
