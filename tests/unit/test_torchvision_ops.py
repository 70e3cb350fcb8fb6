"""The CPU fallback for torchvision's nms (server/worker/torchvision_ops.py).

The kernel is checked against a brute-force transliteration of torchvision's C++ loop (one box
pair at a time, numpy scalars of the boxes' dtype, the threshold compared in double); importing
torchvision and TorchServe's vision handlers is checked in fresh interpreters, since registering
operators is a once-per-process act.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from mariner.server.worker import torchvision_ops
from mariner.server.worker.torchvision_ops import nms_cpu, qnms_cpu

pytestmark = pytest.mark.unit

HAS_TORCHVISION = importlib.util.find_spec("torchvision") is not None


def reference_nms(
    dets: np.ndarray, scores: np.ndarray, iou_threshold: float, quantized: bool = False
) -> list[int]:
    """torchvision's nms_kernel_impl / qnms_kernel_impl, element by element."""
    n = len(dets)
    order = sorted(range(n), key=lambda i: -float(scores[i]))  # stable, descending
    f = np.float32 if quantized else dets.dtype.type
    if quantized:
        areas = [np.float32((int(d[2]) - int(d[0])) * (int(d[3]) - int(d[1]))) for d in dets]
    else:
        areas = [(d[2] - d[0]) * (d[3] - d[1]) for d in dets]
    suppressed = [False] * n
    keep = []
    for a in range(n):
        i = order[a]
        if suppressed[i]:
            continue
        keep.append(i)
        for b in range(a + 1, n):
            j = order[b]
            if suppressed[j]:
                continue
            xx1 = max(f(dets[i][0]), f(dets[j][0]))
            yy1 = max(f(dets[i][1]), f(dets[j][1]))
            xx2 = min(f(dets[i][2]), f(dets[j][2]))
            yy2 = min(f(dets[i][3]), f(dets[j][3]))
            w = max(f(0), f(xx2 - xx1))
            h = max(f(0), f(yy2 - yy1))
            inter = f(w * h)
            ovr = f(inter / f(f(areas[i] + areas[j]) - inter))
            if float(ovr) > iou_threshold:
                suppressed[j] = True
    return keep


def random_boxes(rng: np.random.Generator, n: int, dtype: type, grid: bool = False) -> np.ndarray:
    if grid:  # integer corners: many equal and exactly-at-threshold overlaps
        xy = rng.integers(0, 8, size=(n, 2)).astype(dtype)
        wh = rng.integers(1, 5, size=(n, 2)).astype(dtype)
    else:
        xy = rng.uniform(0, 100, size=(n, 2)).astype(dtype)
        wh = rng.uniform(1, 40, size=(n, 2)).astype(dtype)
    return np.concatenate([xy, xy + wh], axis=1).astype(dtype)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("iou_threshold", [0.0, 0.1, 0.3, 0.5, 0.7, 1.0])
def test_nms_matches_the_reference_on_random_boxes(dtype: type, iou_threshold: float) -> None:
    rng = np.random.default_rng(int(iou_threshold * 10) + (dtype is np.float64) * 100)
    for n in (1, 2, 7, 60):
        dets = random_boxes(rng, n, dtype)
        scores = rng.uniform(0, 1, size=n).astype(dtype)
        got = nms_cpu(torch.from_numpy(dets), torch.from_numpy(scores), iou_threshold)
        assert got.dtype == torch.long
        assert got.tolist() == reference_nms(dets, scores, iou_threshold), (n, iou_threshold)


@pytest.mark.parametrize("iou_threshold", [0.25, 0.3, 0.5, 1 / 3])
def test_ties_in_scores_and_in_overlap_follow_the_reference(iou_threshold: float) -> None:
    """Equal scores keep index order (a stable sort, as torchvision's kernel); an IoU exactly at
    the threshold does not suppress (`>`), with the threshold compared unrounded."""
    rng = np.random.default_rng(7)
    for n in (5, 40, 150):  # 150: past the size where torch's unstable CPU sort reorders ties
        dets = random_boxes(rng, n, np.float32, grid=True)
        scores = rng.integers(0, 3, size=n).astype(np.float32)
        got = nms_cpu(torch.from_numpy(dets), torch.from_numpy(scores), iou_threshold)
        assert got.tolist() == reference_nms(dets, scores, iou_threshold), n


def test_iou_exactly_at_the_threshold_keeps_both() -> None:
    # IoU of these two is exactly 0.5 (overlap 2x4 = 8, union 16).
    dets = torch.tensor([[0.0, 0.0, 4.0, 4.0], [0.0, 0.0, 4.0, 2.0]])
    scores = torch.tensor([0.9, 0.8])
    assert nms_cpu(dets, scores, 0.5).tolist() == [0, 1]
    assert nms_cpu(dets, scores, 0.4999).tolist() == [0]


def test_empty_input_gives_an_empty_long_tensor() -> None:
    out = nms_cpu(torch.zeros((0, 4)), torch.zeros(0), 0.5)
    assert out.dtype == torch.long
    assert out.shape == (0,)
    assert (
        qnms_cpu(torch.zeros((0, 4), dtype=torch.uint8), torch.zeros(0, dtype=torch.uint8), 0.5).numel() == 0
    )


def test_bad_shapes_and_dtypes_fail_with_torchvisions_messages() -> None:
    with pytest.raises(RuntimeError, match="boxes should be a 2d tensor, got 1D"):
        nms_cpu(torch.zeros(4), torch.zeros(1), 0.5)
    with pytest.raises(RuntimeError, match="boxes should have 4 elements in dimension 1, got 5"):
        nms_cpu(torch.zeros((2, 5)), torch.zeros(2), 0.5)
    with pytest.raises(RuntimeError, match="same number of elements in dimension 0, got 2 and 3"):
        nms_cpu(torch.zeros((2, 4)), torch.zeros(3), 0.5)
    with pytest.raises(RuntimeError, match="dets should have the same type as scores"):
        nms_cpu(torch.zeros((2, 4)), torch.zeros(2, dtype=torch.float64), 0.5)
    with pytest.raises(RuntimeError, match="not implemented for 'Half'|not implemented for 'float16'"):
        nms_cpu(torch.zeros((2, 4), dtype=torch.half), torch.zeros(2, dtype=torch.half), 0.5)


def test_qnms_matches_the_reference_on_integer_representations() -> None:
    rng = np.random.default_rng(3)
    for iou_threshold in (0.2, 0.5):
        dets = random_boxes(rng, 50, np.float32, grid=True).astype(np.uint8) * 10
        scores = rng.integers(0, 255, size=50).astype(np.uint8)
        got = qnms_cpu(torch.from_numpy(dets), torch.from_numpy(scores), iou_threshold)
        assert got.tolist() == reference_nms(dets, scores, iou_threshold, quantized=True)


def test_ensure_is_a_no_op_without_torchvision(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torchvision_ops, "_state", None)
    monkeypatch.setattr(torchvision_ops, "_library", None)  # an earlier test's registration
    asked: list[str] = []

    def find_spec(name: str, *args: object) -> None:
        asked.append(name)

    monkeypatch.setattr(torchvision_ops.importlib.util, "find_spec", find_spec)
    monkeypatch.delitem(sys.modules, "torchvision", raising=False)
    meta_path = list(sys.meta_path)
    torchvision_ops.ensure_torchvision_importable()
    torchvision_ops.ensure_torchvision_importable()
    assert asked == ["torchvision"], "asked once, then remembered"
    assert sys.meta_path == meta_path
    assert torchvision_ops._library is None
    assert not torchvision_ops.fallback_active()


def test_ensure_does_nothing_beside_a_cuda_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a CUDA (or ROCm) torch the installed torchvision is expected to match it: nothing is
    loaded, registered or hooked, whatever is installed."""
    monkeypatch.setattr(torchvision_ops, "_state", None)
    monkeypatch.setattr(torchvision_ops, "_library", None)  # an earlier test's registration
    monkeypatch.setattr(torchvision_ops.importlib.util, "find_spec", lambda name, *a: object())
    monkeypatch.delitem(sys.modules, "torchvision", raising=False)
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    loaded: list[str] = []
    monkeypatch.setattr(torchvision_ops, "_load_native_ops", lambda: loaded.append("x") or True)
    meta_path = list(sys.meta_path)
    torchvision_ops.ensure_torchvision_importable()
    assert loaded == []
    assert sys.meta_path == meta_path
    assert torchvision_ops._library is None
    assert not torchvision_ops.fallback_active()


def test_ensure_registers_nothing_when_torchvisions_own_ops_load(monkeypatch: pytest.MonkeyPatch) -> None:
    """A CPU torchvision beside the CPU torch (the PyTorch CPU index): its `_C` loads, and its
    operators are the ones registered."""
    monkeypatch.setattr(torchvision_ops, "_state", None)
    monkeypatch.setattr(torchvision_ops, "_library", None)  # an earlier test's registration
    monkeypatch.setattr(torchvision_ops.importlib.util, "find_spec", lambda name, *a: object())
    monkeypatch.delitem(sys.modules, "torchvision", raising=False)
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(torchvision_ops, "_load_native_ops", lambda: True)
    meta_path = list(sys.meta_path)
    torchvision_ops.ensure_torchvision_importable()
    assert sys.meta_path == meta_path
    assert torchvision_ops._library is None
    assert not torchvision_ops.fallback_active()


# One fresh interpreter does what a worker does (ensure, then import the handler and torchvision)
# and reports; registering operators is a once-per-process act, so it cannot happen in this one.
WORKER_LIKE = """
import json, numpy as np, torch
from mariner.server.worker.torchvision_ops import ensure_torchvision_importable, fallback_active
ensure_torchvision_importable()
ensure_torchvision_importable()  # idempotent: registering twice would raise
from ts.torch_handler.image_classifier import ImageClassifier
from ts.torch_handler.image_segmenter import ImageSegmenter
from ts.torch_handler.object_detector import ObjectDetector
import torchvision
from torchvision import models, transforms
from torchvision.ops import batched_nms, box_iou, nms, roi_align, roi_pool

out = {"fallback": fallback_active(), "handlers": [ImageClassifier.__name__, ImageSegmenter.__name__,
       ObjectDetector.__name__]}
rng = np.random.default_rng(0)
xy = rng.uniform(0, 50, (200, 2)); wh = rng.uniform(1, 30, (200, 2))
b = np.concatenate([xy, xy + wh], 1).astype(np.float32)
s = rng.uniform(0, 1, 200).astype(np.float32)
bt, st = torch.from_numpy(b), torch.from_numpy(s)
out["boxes"], out["scores"] = b.tolist(), s.tolist()
out["nms"] = nms(bt, st, 0.5).tolist()
idx = torch.from_numpy(rng.integers(0, 3, 200))
out["batched"] = batched_nms(bt, st, idx, 0.5).tolist()
by_class = [torch.nonzero(idx == c).flatten() for c in range(3)]
out["batched_by_class"] = sorted(i for m in by_class for i in m[nms(bt[m], st[m], 0.5)].tolist())
out["scripted"] = torch.jit.script(torchvision.ops.nms)(bt, st, 0.5).tolist()
models.resnet18(weights=None)
transforms.Compose([transforms.Resize(8), transforms.ToTensor()])
x, rois = torch.rand(1, 3, 16, 16), [torch.tensor([[0.0, 0.0, 8.0, 8.0]])]
out["roi_align"] = list(roi_align(x, rois, 4).shape)  # torchvision's own Python fallback
out["errors"] = []
rotated = torch.rand(2, 5)
for call in (lambda: roi_pool(x, rois, 4), lambda: box_iou(rotated, rotated, fmt="cxcywhr")):
    try:
        call()
        out["errors"].append(None)
    except RuntimeError as exc:
        out["errors"].append(str(exc).split(".")[0])
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def worker_like() -> dict:
    if not HAS_TORCHVISION:
        pytest.skip("torchvision is not installed (it is optional: pyproject's `vision` extra)")
    proc = subprocess.run(
        [sys.executable, "-c", WORKER_LIKE], capture_output=True, text=True, timeout=300, check=False
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_torchserve_vision_handlers_import_after_ensure(worker_like: dict) -> None:
    assert worker_like["handlers"] == ["ImageClassifier", "ImageSegmenter", "ObjectDetector"]


@pytest.mark.slow
def test_torchvision_nms_matches_the_reference(worker_like: dict) -> None:
    """`torchvision.ops.nms`, `batched_nms` and a scripted nms answer as torchvision's kernel."""
    boxes = np.array(worker_like["boxes"], dtype=np.float32)
    scores = np.array(worker_like["scores"], dtype=np.float32)
    assert worker_like["nms"] == reference_nms(boxes, scores, 0.5)
    assert worker_like["scripted"] == worker_like["nms"]
    assert sorted(worker_like["batched"]) == worker_like["batched_by_class"]


@pytest.mark.slow
def test_other_c_ops_stay_unavailable_with_torchvisions_error(worker_like: dict) -> None:
    assert worker_like["roi_align"] == [1, 3, 4, 4]
    if worker_like["fallback"]:
        assert worker_like["errors"] == ["Couldn't load custom C++ ops"] * 2
    else:  # a torchvision whose C ops load: the real ones answered
        assert worker_like["errors"] == [None, None]
