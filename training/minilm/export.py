"""Export the MiniLM encoder into the artefact formats the handler serves.

    eager          model.safetensors as shipped + minilm_model.py (the module is rebuilt at load)
    onnx           torch.onnx (dynamo) with dynamic batch and sequence axes, run by onnxruntime
    aoti           torch.export with dynamic batch and sequence dims + AOTInductor (CPU package,
                   portable x86-64-v3 baseline as the digits packages; full store only: minutes)
    int8_dynamic   torch.ao dynamic int8 on every Linear, traced to TorchScript (packed int8
                   weights only round-trip through TorchScript; CPU kernels only)

Every graph export declares batch and sequence dynamic from the first export: the handler pads a
batch to its longest text, so each batch has a new sequence length, and a graph specialised to
one length would either fail or silently pad everything to it.
"""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path

import torch
from torch import nn
from torch.export import Dim

from mariner.training.export import Artefact, aoti_cpu_package, aoti_target, onnx_file, timed
from mariner.training.minilm.model import MiniLMEncoder

MAX_BATCH = 1024
MAX_SEQ = 512  # the checkpoint's position table; the handler caps texts at maxLength (256)


def example_inputs(batch: int = 2, seq: int = 7) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and a mask with one padded row, so export sees masking at work; sizes above 1
    so neither dim is specialised as a broadcastable 1."""
    ids = torch.randint(1000, 2000, (batch, seq), dtype=torch.int64)
    mask = torch.ones(batch, seq, dtype=torch.int64)
    mask[-1, seq // 2 :] = 0
    ids[-1, seq // 2 :] = 0
    return ids, mask


def dynamic_shapes() -> dict[str, dict[int, Dim]]:
    batch = Dim("batch", min=1, max=MAX_BATCH)
    seq = Dim("seq", min=2, max=MAX_SEQ)
    return {"input_ids": {0: batch, 1: seq}, "attention_mask": {0: batch, 1: seq}}


class _TwoInputs(nn.Module):
    """The encoder with exactly (input_ids, attention_mask): token types are all zero for one
    text, and a fixed two-input signature is what the exported artefacts are called with."""

    def __init__(self, encoder: MiniLMEncoder) -> None:
        super().__init__()
        self.encoder = encoder

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.encoder(input_ids, attention_mask)


def export_eager(weights: Path, out: Path) -> Artefact:
    path = out / "model.safetensors"
    secs = timed(lambda: shutil.copy2(weights, path))
    return Artefact("eager", path, "eager", "any", secs)


def export_program(encoder: MiniLMEncoder) -> torch.export.ExportedProgram:
    with torch.no_grad():
        return torch.export.export(
            _TwoInputs(encoder).eval(), example_inputs(), dynamic_shapes=dynamic_shapes()
        )


def export_onnx(encoder: MiniLMEncoder, out: Path) -> Artefact:
    path = out / "minilm.onnx"
    secs = onnx_file(
        _TwoInputs(encoder).eval(),
        example_inputs(),
        path,
        dynamic_shapes=dynamic_shapes(),
        input_names=["input_ids", "attention_mask"],
        output_names=["sentence_embedding"],
    )
    return Artefact("onnx", path, "onnx", "any", secs)


def export_aoti(encoder: MiniLMEncoder, out: Path) -> Artefact:
    """AOTInductor CPU package with dynamic batch and sequence; tied to this torch version."""
    path = out / "minilm_aoti.pt2"
    secs = timed(lambda: aoti_cpu_package(export_program(encoder), path))
    return Artefact("aoti", path, "aoti", "cpu", secs, aoti_target(path))


def int8_layers(model: nn.Module) -> dict[str, object]:
    """The Linear layers quantized: the attention projections (q, k, v and output), per channel.

    Measured on the held-out sentences: every Linear at per-tensor int8 gives cosine 0.88 (min)
    vs fp32, per-channel 0.95, per-channel without the feed-forward layers 0.994. The FFN's
    activations carry outliers a per-batch int8 scale cannot hold, so it stays fp32.
    """
    qconfig = torch.ao.quantization.per_channel_dynamic_qconfig
    return {
        name: qconfig
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and ".attention." in f".{name}."
    }


def quantize_dynamic_int8(encoder: MiniLMEncoder, out: Path) -> Artefact:
    """Dynamic int8 (weights int8 per channel, activations quantized per batch) on the attention
    Linears, served as TorchScript traced once and checked at two other shapes before it is
    saved (the packed int8 weights round-trip only through TorchScript; CPU kernels only)."""
    path = out / "minilm_int8_dynamic.pt"

    def run() -> None:
        torch.backends.quantized.engine = (
            "x86" if "x86" in torch.backends.quantized.supported_engines else "fbgemm"
        )
        wrapped = _TwoInputs(encoder).eval()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            qmodel = torch.ao.quantization.quantize_dynamic(wrapped, int8_layers(wrapped), dtype=torch.qint8)
            with torch.no_grad():
                traced = torch.jit.trace(qmodel, example_inputs(), check_trace=False, strict=False)
                for shape in ((1, 3), (5, 40)):
                    args = example_inputs(*shape)
                    if not torch.allclose(traced(*args), qmodel(*args), atol=1e-5):
                        raise RuntimeError(f"traced int8 encoder disagrees with the module at shape {shape}")
        traced.save(str(path))

    return Artefact("int8_dynamic", path, "torchscript", "cpu", timed(run), "cpu (x86 int8 kernels)")
