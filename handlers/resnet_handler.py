"""TorchServe-contract handler for the ResNet-18 image classifier, whatever artefact it carries.

The archive's model-config `handler:` section says the artefact's format:

    eager | compiled   state_dict (weights_only=True) + resnet_model.py; compiled adds torch.compile
                       with static shapes, batches zero-padded to power-of-two buckets warmed at load
    torchscript        torch.jit.load
    aoti               torch._inductor.aoti_load_package (also the PT2E int8 variant)
    onnx               onnxruntime InferenceSession (dynamic batch)

optional `autocast` / `cudaGraphs` (read by `accel.py`), `topk` (default 5),
`warmup_batch_sizes` and `decodeThreads` (images decoded in parallel; default min(4, cores)).
What every handler needs (sibling imports, device rules, artefact loaders) comes from
`handler_support.py` and image decoding from `resnet_image.py`; all three ship beside this file
in the archive.

Requests, one per TorchServe request: a JPEG or PNG as the raw body or as a multipart/form
field (`data`, `body`, or any other field holding bytes), answered with
`{"topk": [{"label", "index", "probability"} x5]}`. On Mariner's Open Inference Protocol path a
request is `{"tensors": {name: array}}` with one input: BYTES [N] or [N, 1] of encoded images,
or FP32 [N, 3, 224, 224] already normalised; it is answered with arrays `probabilities` FP32
[N, 5] and `indices` INT64 [N, 5]. A bad request gets `{"error", "code": 400}` and status 400
for its index only; its batch-mates are answered. The whole batch is one forward pass (in
chunks of at most `maxRowsPerCall` rows, else batchSize, when tensor requests bring more).

The module defines exactly one class (TorchServe's loader requires it) and imports nothing
from `ts`, so Mariner loads it without TorchServe.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch

log = logging.getLogger(__name__)

FORMATS = ("eager", "compiled", "torchscript", "aoti", "onnx")
TOPK = 5
CLASSES = 1000


# The helper every handler shares, beside this file in the repo and in the archive alike, loaded
# by path as it loads the other siblings (see its load_module_from: why by path, why registered).
_HERE = Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location("mariner_resnet_support", _HERE / "handler_support.py")
if _spec is None or _spec.loader is None:
    raise ImportError(f"handler_support.py must ship beside {__file__}")
_support = sys.modules[_spec.name] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_support)
_image = _support.load_module_from(_HERE / "resnet_image.py", "mariner_resnet_image")


def _image_bytes(row: Any) -> bytes:
    """The encoded image of one TorchServe request: raw body, or a multipart field's bytes."""
    if not isinstance(row, dict):
        payload: Any = row
    elif row.get("data") is not None:
        payload = row["data"]
    elif row.get("body") is not None:
        payload = row["body"]
    else:  # multipart/form-data: one key per field; take the first that holds bytes
        payload = next((v for v in row.values() if isinstance(v, (bytes, bytearray, memoryview))), None)
    if isinstance(payload, (bytearray, memoryview)):
        payload = bytes(payload)
    if not isinstance(payload, bytes):
        kind = "nothing" if payload is None else type(payload).__name__
        raise ValueError(
            f"expected a JPEG or PNG image as the body or a form file field, got {kind}; "
            "send the image bytes with a non-text Content-Type (e.g. image/jpeg)"
        )
    return payload


def _tensor_rows(tensors: dict[str, np.ndarray]) -> torch.Tensor:
    """One OIP request's single input -> (N, 3, 224, 224) normalised rows."""
    if len(tensors) != 1:
        raise ValueError(f"expected one input (BYTES images or FP32 [N, 3, 224, 224]), got {sorted(tensors)}")
    ((name, arr),) = tensors.items()
    if arr.dtype.kind in "OSU":
        if arr.ndim not in (1, 2) or (arr.ndim == 2 and arr.shape[1] != 1) or len(arr) == 0:
            raise ValueError(
                f"BYTES input {name!r} must have shape [N] or [N, 1] with N >= 1, got {list(arr.shape)}"
            )
        images = []
        for k, v in enumerate(arr.reshape(-1)):
            raw = v.encode() if isinstance(v, str) else bytes(v)
            try:
                images.append(_image.decode(raw))
            except ValueError as exc:
                raise ValueError(f"input {name!r} element {k}: {exc}") from None
        return _image.normalise(images)
    return _image.check_tensor(arr, name)


class ResNetHandler:
    """Loads the archive's artefact once; answers batches of images with top-5 labels."""

    def __init__(self) -> None:
        self.initialized = False
        self.model: Any = None
        self.device = torch.device("cpu")
        self.format = ""
        self.labels: list[str] = [str(i) for i in range(CLASSES)]
        self.topk = TOPK
        self.buckets: list[int] = [1]
        self.chunk = 1
        self._pad = False
        self._ort: Any = None
        self._ort_input = ""
        self._staging: Any = None
        self._accel: Any = None
        self._accel_mod: Any = None
        self._decoders: ThreadPoolExecutor | None = None

    # -- TorchServe contract -------------------------------------------------------------
    def initialize(self, context: Any) -> None:
        props = context.system_properties
        model_dir = Path(props.get("model_dir") or ".")
        section = _support.config_section(context)
        self.format = _support.artefact_format(section, FORMATS)
        self.topk = int(section.get("topk", TOPK))
        serialized = _support.serialized_file(context)
        self.labels = _support.read_labels(model_dir, self.labels)
        batch_size = int(props.get("batch_size") or 1)
        cfg = getattr(context, "model_yaml_config", None) or {}
        # Rows per forward pass: bounds activations when tensor requests bring many rows.
        self.chunk = max(1, int(cfg.get("maxRowsPerCall") or batch_size))
        self.device = _support.pick_device(context, str(section.get("device", "any")))
        self.buckets = _support.batch_buckets(batch_size, section.get("warmup_batch_sizes"))
        if section.get("autocast") or section.get("cudaGraphs"):
            self._accel_mod = _support.load_module_from(_HERE / "accel.py", "mariner_resnet_accel")
            self._accel = self._accel_mod.settings(section)
        threads = int(section.get("decodeThreads", min(4, os.cpu_count() or 1)))
        if threads > 1:
            self._decoders = ThreadPoolExecutor(threads, thread_name_prefix="resnet-decode")
        self.model = self._load(model_dir / serialized, model_dir, section)
        if self.device.type == "cuda" and self.format != "onnx":
            self._staging = _support.HostStaging(
                max(self.buckets[-1], self.chunk), (3, 224, 224), self.device
            )
        self._warm_up()
        self.initialized = True
        log.info(
            "resnet handler ready: format=%s device=%s artefact=%s", self.format, self.device, serialized
        )

    def handle(self, data: list[Any], context: Any) -> list[Any]:
        """Decode every request, run one forward for the batch, split the answers back in order."""
        results: list[Any] = [None] * len(data)
        spans: list[tuple[int, int]] = []  # tensor requests: (request index, index in blocks)
        blocks: list[torch.Tensor] = []

        def fail(i: int, exc: ValueError) -> None:
            _support.refuse(results, context, i, str(exc))

        images: list[tuple[int, bytes]] = []  # single-image requests, decoded together
        for i, row in enumerate(data):
            try:
                if _support.is_tensor_request(row):
                    blocks.append(_tensor_rows(row["tensors"]))
                    spans.append((i, len(blocks) - 1))
                else:
                    images.append((i, _image_bytes(row)))
            except ValueError as exc:
                fail(i, exc)
        crops: list[np.ndarray] = []
        crop_slots: list[int] = []
        for (i, _), decoded in zip(images, self._decode_all([raw for _, raw in images]), strict=True):
            if isinstance(decoded, ValueError):
                fail(i, decoded)
            else:
                crops.append(decoded)
                crop_slots.append(i)
        if crops:
            blocks.append(_image.normalise(crops))
        if not blocks:
            return results
        x = torch.cat(blocks) if len(blocks) > 1 else blocks[0]
        probs, idx = self.predict_topk(x)
        n = 0
        for slot, block in spans:
            rows = len(blocks[block])
            results[slot] = {"tensors": {"probabilities": probs[n : n + rows], "indices": idx[n : n + rows]}}
            n += rows
        for k, slot in enumerate(crop_slots):
            results[slot] = {
                "topk": [
                    {"label": self.labels[int(c)], "index": int(c), "probability": round(float(p), 6)}
                    for c, p in zip(idx[n + k], probs[n + k], strict=True)
                ]
            }
        return results

    def _decode_all(self, raws: list[bytes]) -> list[np.ndarray | ValueError]:
        """Decode a batch's images on the decode threads (Pillow releases the GIL while it
        decodes and resizes): on a GPU the forward of 32 images takes milliseconds and serial
        JPEG decoding would be most of the batch's time."""

        def one(raw: bytes) -> np.ndarray | ValueError:
            try:
                return _image.decode(raw)
            except ValueError as exc:
                return exc

        if len(raws) < 2 or self._decoders is None:
            return [one(raw) for raw in raws]
        return list(self._decoders.map(one, raws))

    # -- model API used by verification --------------------------------------------------
    def predict_topk(self, x: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
        """Normalised (N, 3, 224, 224) -> top-k probabilities (float32) and indices (int64)."""
        probs = torch.softmax(self.logits(x), dim=1)
        p, i = probs.topk(min(self.topk, probs.shape[1]), dim=1)
        return p.numpy().astype(np.float32), i.numpy().astype(np.int64)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """Normalised (N, 3, 224, 224) host tensor -> (N, 1000) float32 logits on the host."""
        size = self.buckets[-1] if self._pad else self.chunk
        if len(x) <= size:
            return self._run(x)
        return torch.cat([self._run(c) for c in x.split(size)])

    def _run(self, x: torch.Tensor) -> torch.Tensor:
        if self.format == "onnx":
            return torch.from_numpy(self._ort.run(None, {self._ort_input: x.numpy()})[0])
        n = len(x)
        rows = next(b for b in self.buckets if b >= n) if self._pad else n
        with torch.inference_mode():
            x = _support.batch_on_device(x, rows, self.device, self._staging, self._pad)
            if self._accel is not None:
                with self._accel_mod.autocast(self._accel, self.device):
                    out = self.model(x)
            else:
                out = self.model(x)
            if isinstance(out, (tuple, list)):
                out = out[0]
            return out[:n].float().cpu()

    # -- loading --------------------------------------------------------------------------
    def _load(self, artefact: Path, model_dir: Path, section: dict[str, Any]) -> Any:
        if self.format in ("eager", "compiled"):
            module = _support.load_module_from(model_dir / "resnet_model.py", "mariner_resnet_model")
            model = _support.load_weights(
                module.ResNet18(num_classes=len(self.labels)), artefact, self.device
            )
            if self.format == "compiled":
                model = _support.compile_for_buckets(model, section.get("compile") or {}, self.buckets)
                self._pad = True
            elif self._accel is not None and self._accel.cuda_graphs and self.device.type == "cuda":
                self._pad = True
                example = lambda b: (torch.zeros((b, 3, 224, 224), device=self.device),)  # noqa: E731
                model = self._accel_mod.graphed(model, self._accel, self.device, self.buckets, example)
            return model
        loaded = _support.load_artefact(self.format, artefact, self.device)
        if self.format == "onnx":
            self._ort = loaded
            self._ort_input = loaded.get_inputs()[0].name
        return loaded

    def _warm_up(self) -> None:
        """Run batch 1 (and, when padding, every bucket) so no request pays a first-call cost."""
        sizes = self.buckets if self._pad else [1]
        zeros = torch.zeros((max(sizes), 3, 224, 224))
        for b in sizes:
            self.logits(zeros[:b])
