"""Let `import torchvision` work beside a CPU torch whose torchvision's C ops cannot load.

Why: TorchServe's vision built-in handlers (`image_classifier`, `vision_handler`,
`image_segmenter`, `object_detector`) import torchvision. The torchvision wheel that matches the
pinned torch on the package registry is built for CUDA torch: its `_C` extension links
`libtorch_cuda.so`, which a CPU torch lacks, so it fails to load. torchvision tolerates that
(`extension._has_ops()` is then False), except that `torchvision/_meta_registrations.py` then
registers fake kernels for `torchvision::nms` and `torchvision::qnms` unguarded, and `import
torchvision` dies with "operator torchvision::nms does not exist". Transforms and models are
pure Python on top of torch and would work.

So, only on a CPU torch whose torchvision `_C` does not load, and before torchvision is first
imported, this module defines those operators with torchvision's own schemas and a pure-torch CPU
kernel that is a line-by-line vectorisation of torchvision's C++ one (same stable descending sort,
same float arithmetic in the boxes' dtype, `iou > threshold` compared in double), so
`torchvision.ops.nms`, `batched_nms` and TorchScript programs calling `torchvision::nms` give the
answers the real build gives. `torchvision.ops.boxes` checks `_assert_has_ops()` before calling
them; an import hook gives that one module a check that passes, since every operator it calls is
then registered (`box_iou_rotated` too, raising torchvision's own "Couldn't load custom C++ ops"
error). Every other C operator (`roi_align`, `roi_pool`, `deform_conv2d`, ...) stays absent and
fails, or falls back to its Python version, exactly as torchvision decides without its `_C`.

Nothing happens when torchvision is not installed (one `find_spec`), when torch is a CUDA or ROCm
build (its torchvision is expected to match), or when `_C` loads (then its real operators are
registered, as `import torchvision` would have done).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import logging
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any

log = logging.getLogger(__name__)

NMS_SCHEMA = "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor"
QNMS_SCHEMA = "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor"
BOX_IOU_ROTATED_SCHEMA = "box_iou_rotated(Tensor boxes1, Tensor boxes2) -> Tensor"
_GATED_MODULE = "torchvision.ops.boxes"

# None: not decided yet; "absent" / "native" / "fallback": what was found (and done).
_state: str | None = None
# Registrations live as long as their Library object: held here for the process's life.
_library: Any = None


def ensure_torchvision_importable() -> None:
    """Make `import torchvision` work here if it would fail only because its `_C` cannot load.

    Call before a handler is imported. Idempotent; cheap when torchvision is not installed."""
    global _state
    if _state is not None:
        return
    if "torchvision" in sys.modules or importlib.util.find_spec("torchvision") is None:
        _state = "absent"
        return
    import torch

    if torch.version.cuda is not None or getattr(torch.version, "hip", None) is not None:
        _state = "native"
        return
    if _load_native_ops():
        _state = "native"
        return
    _register_fallback_ops()
    sys.meta_path.insert(0, _GateBoxesOnImport())
    _state = "fallback"
    log.info(
        "torchvision's C ops do not load beside this torch (a CPU build): nms/qnms run on a "
        "pure-torch kernel, other C ops (roi_align, ...) are unavailable as torchvision says"
    )


def fallback_active() -> bool:
    """Whether this process runs torchvision's nms on the pure-torch kernel."""
    return _state == "fallback"


def _load_native_ops() -> bool:
    """Load torchvision's `_C` as `torchvision.extension._load_library` does; False if it fails."""
    import torch

    spec = importlib.util.find_spec("torchvision")
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        return False
    finder = importlib.machinery.FileFinder(
        locations[0], (importlib.machinery.ExtensionFileLoader, importlib.machinery.EXTENSION_SUFFIXES)
    )
    ext = finder.find_spec("_C")
    if ext is None or ext.origin is None:
        return False
    try:
        torch.ops.load_library(ext.origin)
    except OSError as exc:
        log.debug("torchvision's _C does not load: %s", exc)
        return False
    return True


def _register_fallback_ops() -> None:
    global _library
    import torch

    lib = torch.library.Library("torchvision", "DEF")
    lib.define(NMS_SCHEMA)
    lib.define(QNMS_SCHEMA)
    lib.define(BOX_IOU_ROTATED_SCHEMA)
    lib.impl("nms", nms_cpu, "CPU")
    lib.impl("qnms", qnms_cpu, "CPU")
    lib.impl("box_iou_rotated", _box_iou_rotated_unavailable, "CompositeExplicitAutograd")
    _library = lib


def _check_shapes(dets: Any, scores: Any) -> None:
    """torchvision's own checks and messages (nms_kernel / qnms_kernel)."""
    if dets.dim() != 2:
        raise RuntimeError(f"boxes should be a 2d tensor, got {dets.dim()}D")
    if dets.size(1) != 4:
        raise RuntimeError(f"boxes should have 4 elements in dimension 1, got {dets.size(1)}")
    if scores.dim() != 1:
        raise RuntimeError(f"scores should be a 1d tensor, got {scores.dim()}D")
    if dets.size(0) != scores.size(0):
        raise RuntimeError(
            "boxes and scores should have same number of elements in dimension 0, "
            f"got {dets.size(0)} and {scores.size(0)}"
        )
    if dets.dtype != scores.dtype:
        raise RuntimeError("dets should have the same type as scores")


def nms_cpu(dets: Any, scores: Any, iou_threshold: float) -> Any:
    """`torchvision::nms` on the CPU: indices kept, in decreasing order of score (int64)."""
    import torch

    _check_shapes(dets, scores)
    if dets.dtype not in (torch.float32, torch.float64):
        raise RuntimeError(f"\"nms_kernel\" not implemented for '{str(dets.dtype).removeprefix('torch.')}'")
    if dets.numel() == 0:
        return torch.empty(0, dtype=torch.long)
    x1, y1, x2, y2 = (dets[:, k].contiguous() for k in range(4))
    areas = (x2 - x1) * (y2 - y1)
    return _greedy(x1, y1, x2, y2, areas, scores, iou_threshold)


def qnms_cpu(dets: Any, scores: Any, iou_threshold: float) -> Any:
    """`torchvision::qnms`: nms on quantized boxes' integer representations (what
    `torchvision.ops.nms` passes for quantized tensors). As in torchvision, areas are integer
    products stored as float (the scale cancels out of the IoU) and the rest is float."""
    import torch

    _check_shapes(dets, scores)
    if dets.dtype not in (torch.uint8, torch.int8, torch.int32):
        raise RuntimeError(f"\"qnms_kernel\" not implemented for '{str(dets.dtype).removeprefix('torch.')}'")
    if dets.numel() == 0:
        return torch.empty(0, dtype=torch.long)
    wide = dets.to(torch.int64)
    areas = ((wide[:, 2] - wide[:, 0]) * (wide[:, 3] - wide[:, 1])).to(torch.float32)
    x1, y1, x2, y2 = (dets[:, k].to(torch.float32).contiguous() for k in range(4))
    return _greedy(x1, y1, x2, y2, areas, scores, iou_threshold)


def _greedy(x1: Any, y1: Any, x2: Any, y2: Any, areas: Any, scores: Any, iou_threshold: float) -> Any:
    """torchvision's greedy loop, one box against all lower-ranked ones at a time.

    Checking already-suppressed lower-ranked boxes again (the C++ skips them) changes nothing:
    suppression only ever sets the flag."""
    import numpy as np
    import torch

    order = torch.sort(scores, dim=0, descending=True, stable=True).indices
    x1, y1, x2, y2, areas = (t[order] for t in (x1, y1, x2, y2, areas))
    n = int(order.numel())
    zero = torch.zeros((), dtype=x1.dtype)
    suppressed = np.zeros(n, dtype=bool)
    keep: list[int] = []
    for r in range(n):
        if suppressed[r]:
            continue
        keep.append(r)
        if r + 1 == n:
            break
        xx1 = torch.maximum(x1[r], x1[r + 1 :])
        yy1 = torch.maximum(y1[r], y1[r + 1 :])
        xx2 = torch.minimum(x2[r], x2[r + 1 :])
        yy2 = torch.minimum(y2[r], y2[r + 1 :])
        inter = torch.maximum(zero, xx2 - xx1) * torch.maximum(zero, yy2 - yy1)
        iou = inter / (areas[r] + areas[r + 1 :] - inter)
        # C++ compares `scalar_t > double`: the float is widened, the threshold is not rounded.
        suppressed[r + 1 :] |= (iou.to(torch.float64) > iou_threshold).numpy()
    return order[torch.tensor(keep, dtype=torch.long)]


def _box_iou_rotated_unavailable(boxes1: Any, boxes2: Any) -> Any:
    """Rotated IoU has no fallback kernel: fail as torchvision does without its C ops."""
    try:
        from torchvision.extension import _assert_has_ops
    except ImportError:  # only torchvision calls this operator; someone else may, without it
        pass
    else:
        _assert_has_ops()
    raise RuntimeError("torchvision::box_iou_rotated is not available without torchvision's C ops")


def _boxes_ops_present() -> None:
    """`torchvision.ops.boxes`'s `_assert_has_ops` here: every operator that module calls is
    registered (nms and qnms on the kernel above). TorchScript compiles it as nms's callee."""
    pass


class _GateBoxesOnImport(importlib.abc.MetaPathFinder):
    """Gives `torchvision.ops.boxes` its operator check once it has been executed."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != _GATED_MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        if spec is not None and spec.loader is not None:
            spec.loader = _GatingLoader(spec.loader)
        return spec


class _GatingLoader(importlib.abc.Loader):
    def __init__(self, inner: importlib.abc.Loader) -> None:
        self._inner = inner

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._inner.exec_module(module)
        module._assert_has_ops = _boxes_ops_present  # type: ignore[attr-defined]  # torchvision's name

    def __getattr__(self, name: str) -> Any:
        # get_source, get_filename, ...: inspect and TorchScript read boxes.py's source through them.
        return getattr(self._inner, name)


__all__ = ["ensure_torchvision_importable", "fallback_active", "nms_cpu", "qnms_cpu"]
