"""TorchServe's vision built-ins and torchvision's nms in real `mariner serve` workers.

An archive that names TorchServe's `image_classifier` (no handler code of its own: the built-in
from `ts.torch_handler`, which imports torchvision and captum) serves a small TorchScript model,
and a module-level handler calls `torchvision.ops.nms`. With the registry's torchvision beside the
CPU torch, both work only because the worker defines torchvision's nms before it imports the
handler (server/worker/torchvision_ops.py); with a torchvision whose C ops load, they use those.
"""

from __future__ import annotations

import importlib.util
import io
import json
import zipfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import requests
import torch
from PIL import Image

from tests.mariner_serve import MarinerServe
from tests.unit.test_torchvision_ops import reference_nms

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(
        importlib.util.find_spec("torchvision") is None or importlib.util.find_spec("captum") is None,
        reason="the `vision` extra (torchvision, captum) is not installed",
    ),
]

LABELS = {str(i): f"class-{i}" for i in range(6)}
COLOUR = (200, 120, 40)
MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)  # ImageClassifier's Normalize

NMS_HANDLER = """
import json

import torch
import torchvision


def handle(data, context):
    if data is None:  # TorchServe's initialisation call of a module-level handler
        return None
    out = []
    for row in data:
        req = row.get("body") or row.get("data")
        if isinstance(req, (bytes, bytearray, str)):
            req = json.loads(req)  # TorchServe hands an application/json body over decoded
        keep = torchvision.ops.nms(torch.tensor(req["boxes"]), torch.tensor(req["scores"]), req["iou"])
        out.append(keep.tolist())
    return out
"""


class TinyClassifier(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3, stride=4)
        self.fc = torch.nn.Linear(4, len(LABELS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.relu(self.conv(x)).mean(dim=(2, 3)))


def _mar(path: Path, model: dict, files: dict[str, bytes]) -> Path:
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("MAR-INF/MANIFEST.json", json.dumps({"runtime": "python", "model": model}))
        for name, data in files.items():
            zf.writestr(name, data)
    return path


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, TinyClassifier]:
    root = tmp_path_factory.mktemp("vision-store")
    torch.manual_seed(0)
    model = TinyClassifier().eval()
    scripted = io.BytesIO()
    torch.jit.save(torch.jit.script(model), scripted)
    _mar(
        root / "tinycls.mar",
        {
            "modelName": "tinycls",
            "modelVersion": "1.0",
            "serializedFile": "model.pt",
            "handler": "image_classifier",
        },
        {"model.pt": scripted.getvalue(), "index_to_name.json": json.dumps(LABELS).encode()},
    )
    _mar(
        root / "boxes.mar",
        {"modelName": "boxes", "modelVersion": "1.0", "handler": "nms_handler.py"},
        {"nms_handler.py": NMS_HANDLER.encode()},
    )
    return root, model


@pytest.fixture(scope="module")
def server(
    store: tuple[Path, TinyClassifier], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[MarinerServe]:
    root, _ = store
    srv = MarinerServe(root, "all", work_dir=tmp_path_factory.mktemp("work")).start()
    yield srv
    srv.stop()


def test_the_image_classifier_built_in_serves_a_torchscript_model(
    server: MarinerServe, store: tuple[Path, TinyClassifier]
) -> None:
    _, model = store
    png = io.BytesIO()
    Image.new("RGB", (320, 240), COLOUR).save(png, format="PNG")
    r = requests.post(f"{server.http}/predictions/tinycls", data=png.getvalue(), timeout=120)
    assert r.status_code == 200, r.text
    answer = r.json()
    # A one-colour image stays one colour through Resize(256) and CenterCrop(224).
    pixel = torch.tensor([(c / 255 - m) / s for c, m, s in zip(COLOUR, MEAN, STD, strict=True)])
    with torch.no_grad():
        probs = torch.softmax(model(pixel.view(1, 3, 1, 1).expand(1, 3, 224, 224)), dim=1)[0]
    top = torch.topk(probs, 5)
    expected = {LABELS[str(i)]: p for p, i in zip(top.values.tolist(), top.indices.tolist(), strict=True)}
    assert list(answer) == list(expected)
    assert answer == pytest.approx(expected, abs=1e-5)


def test_torchvision_nms_runs_in_a_worker(server: MarinerServe) -> None:
    rng = np.random.default_rng(5)
    xy = rng.uniform(0, 50, (80, 2))
    boxes = np.concatenate([xy, xy + rng.uniform(1, 30, (80, 2))], 1).astype(np.float32)
    scores = rng.uniform(0, 1, 80).astype(np.float32)
    body = {"boxes": boxes.tolist(), "scores": scores.tolist(), "iou": 0.4}
    r = requests.post(f"{server.http}/predictions/boxes", json=body, timeout=120)
    assert r.status_code == 200, server.log_tail()
    assert r.json() == reference_nms(boxes, scores, 0.4)
