"""Tiny models made at test time and saved as TorchServe users save them (no downloads).

Weights come from a fixed seed, so both servers load the same bytes and answer the same numbers.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch
from torch import nn

from tests.integration.ts_examples.examples import SRC


def seeded(seed: int = 0) -> None:
    torch.manual_seed(seed)


def save_mnist_state_dict(path: Path) -> None:
    """`torch.save(model.state_dict())` of src/mnist.py's Net, as the MNIST example ships it."""
    spec = importlib.util.spec_from_file_location("dropin_mnist_model", SRC / "mnist.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
        seeded(1)
        torch.save(module.Net().state_dict(), path)
    finally:
        del sys.modules[spec.name]


def save_scripted_linear(path: Path, n_in: int, n_out: int, seed: int = 2) -> None:
    """A TorchScript nn.Linear (torch.jit.script + torch.jit.save)."""
    seeded(seed)
    torch.jit.save(torch.jit.script(nn.Linear(n_in, n_out).eval()), str(path))


class TinyImageNet(nn.Module):
    """3-channel image in, `classes` logits out; any image size (global average pool)."""

    def __init__(self, classes: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(4, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.pool(torch.relu(self.conv(x))), 1))


def save_scripted_image_model(path: Path, classes: int) -> None:
    seeded(3)
    torch.jit.save(torch.jit.script(TinyImageNet(classes).eval()), str(path))


class TinyTextNet(nn.Module):
    """The shape TorchServe's text_classifier expects: `embedding` (an EmbeddingBag, read by
    captum) and forward(text, offsets)."""

    def __init__(self, vocab: int, classes: int) -> None:
        super().__init__()
        self.embedding = nn.EmbeddingBag(vocab, 8, mode="mean")
        self.fc = nn.Linear(8, classes)

    def forward(self, text: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        return self.fc(self.embedding(text, offsets))


def save_scripted_text_model(path: Path, vocab: int, classes: int) -> None:
    seeded(4)
    torch.jit.save(torch.jit.script(TinyTextNet(vocab, classes).eval()), str(path))


def save_vocab(path: Path, words: list[str]) -> None:
    """source_vocab.pt: token -> index, loaded by TextHandler with torch.load."""
    torch.save({w: i for i, w in enumerate(words)}, path)


def export_onnx_linear(path: Path, n_in: int, n_out: int) -> None:
    """As TorchServe's ONNX test exports: input 'modelInput', output 'modelOutput', dynamic batch."""
    seeded(5)
    model = nn.Linear(n_in, n_out).eval()
    torch.onnx.export(
        model,
        (torch.randn(1, n_in),),
        str(path),
        export_params=True,
        do_constant_folding=True,
        input_names=["modelInput"],
        output_names=["modelOutput"],
        dynamic_axes={"modelInput": {0: "batch_size"}, "modelOutput": {0: "batch_size"}},
        dynamo=False,  # the exporter TorchServe's example uses; the dynamo one needs onnxscript
    )
