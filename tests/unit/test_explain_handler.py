"""The digits handler's explanations: input-gradient saliency behind TorchServe's `explain` header.

The saliency is checked against autograd run on the reference model directly (d logit[target] /
d raw pixel), so a wrong normalisation, target or row order fails here.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from sklearn.datasets import load_digits

from mariner.handlers.digits_handler import DigitsHandler
from mariner.server.worker.context import Context
from mariner.training.model import DigitsCNN

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
MODEL_KWARGS = {"width": 8, "hidden": 32, "dropout": 0.25}
NORM = {"mean": 4.9, "std": 6.0}
EXPLAIN = {"explain": "True"}


def _context(model_dir: Path, fmt: str, serialized: str) -> Context:
    manifest = {"model": {"modelName": "d", "serializedFile": serialized, "handler": "digits_handler.py"}}
    config = {"batchSize": 4, "handler": {"format": fmt, "model_kwargs": MODEL_KWARGS}}
    return Context("d", str(model_dir), manifest, batch_size=4, gpu_id=None, model_yaml_config=config)


@pytest.fixture(scope="module")
def reference_model() -> DigitsCNN:
    torch.manual_seed(99)
    return DigitsCNN(**MODEL_KWARGS).eval()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory, reference_model: DigitsCNN) -> Path:
    d = tmp_path_factory.mktemp("explain")
    torch.save(reference_model.state_dict(), d / "weights.pt")
    torch.jit.script(reference_model).save(str(d / "model_ts.pt"))
    shutil.copy2(ROOT / "training" / "model.py", d / "digits_model.py")
    (d / "norm.json").write_text(json.dumps(NORM))
    return d


@pytest.fixture(scope="module")
def pixels() -> np.ndarray:
    return load_digits().data[:3].astype(np.float32)


def _run(fmt: str, model_dir: Path, batch: list[Any], headers: dict[str, str]) -> tuple[list[Any], Context]:
    h = DigitsHandler()
    ctx = _context(model_dir, fmt, "model_ts.pt" if fmt == "torchscript" else "weights.pt")
    h.initialize(ctx)
    ctx.begin_batch([f"r{i}" for i in range(len(batch))], [headers for _ in batch])
    out = h.handle(batch, ctx)
    assert len(out) == len(batch)
    return out, ctx


def _expected(model: DigitsCNN, px: np.ndarray, target: int | None) -> tuple[int, int, np.ndarray]:
    raw = torch.from_numpy(px.copy()).requires_grad_(True)
    logits = model(((raw - NORM["mean"]) / NORM["std"]).reshape(1, 1, 8, 8))[0]
    label = int(logits.argmax())
    chosen = label if target is None else target
    logits[chosen].backward()
    assert raw.grad is not None
    return label, chosen, raw.grad.reshape(8, 8).numpy()


@pytest.mark.filterwarnings("ignore:`torch.jit.*` is deprecated:DeprecationWarning")
@pytest.mark.parametrize("fmt", ["eager", "torchscript"])
def test_explanation_is_the_input_gradient_of_the_target_logit(
    fmt: str, model_dir: Path, reference_model: DigitsCNN, pixels: np.ndarray
) -> None:
    batch = [
        {"body": pixels[0].tolist()},
        {"body": {"data": pixels[1].tolist(), "target": 7}},  # a JSON body naming the class
        {"data": pixels[2].tolist(), "target": 2},  # a KServe instance row
    ]
    out, ctx = _run(fmt, model_dir, batch, EXPLAIN)
    for i, (px, target) in enumerate([(pixels[0], None), (pixels[1], 7), (pixels[2], 2)]):
        label, chosen, grad = _expected(reference_model, px, target)
        assert out[i]["method"] == "input_gradient"
        assert (out[i]["label"], out[i]["target"]) == (label, chosen)
        np.testing.assert_allclose(np.array(out[i]["saliency"]), grad, atol=2e-5)
        assert ctx.get_response_status(i)[0] == 200


def test_without_the_header_the_handler_predicts(model_dir: Path, pixels: np.ndarray) -> None:
    out, _ = _run("eager", model_dir, [{"body": pixels[0].tolist()}], {"explain": "False"})
    assert set(out[0]) == {"label", "topk"}


def test_a_bad_item_fails_alone(model_dir: Path, pixels: np.ndarray) -> None:
    batch = [{"body": {"data": pixels[0].tolist(), "target": 10}}, {"body": pixels[1].tolist()}]
    out, ctx = _run("eager", model_dir, batch, EXPLAIN)
    assert ctx.get_response_status(0)[0] == 400
    assert "target" in out[0]["error"]
    assert ctx.get_response_status(1)[0] == 200
    assert len(out[1]["saliency"]) == 8


@pytest.mark.parametrize("fmt", ["aoti", "onnx"])
def test_variants_without_gradients_answer_501(fmt: str, model_dir: Path, pixels: np.ndarray) -> None:
    h = DigitsHandler()
    ctx = _context(model_dir, "eager", "weights.pt")
    h.initialize(ctx)
    h.format = fmt  # the branch taken for those artefacts, without exporting one here
    ctx.begin_batch(["r0"], [EXPLAIN])
    out = h.handle([{"body": pixels[0].tolist()}], ctx)
    assert ctx.get_response_status(0)[0] == 501
    assert f"the {fmt} variant of this model cannot explain" in out[0]["error"]
