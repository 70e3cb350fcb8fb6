"""TorchServe-contract handler for the digits CNN, whatever artefact its archive carries.

One handler serves every variant the pipeline builds. The archive's model-config YAML has a
`handler:` section (TorchServe passes unknown sections through to `context.model_yaml_config`)
that says which artefact format the serialized file is:

    eager | compiled   state_dict (weights_only=True) + digits_model.py; compiled adds torch.compile
    torchscript        torch.jit.load (also the dynamic-int8 variant)
    aoti               torch._inductor.aoti_load_package (.pt2 built for `aoti_device`)
    onnx               onnxruntime InferenceSession

Device rules (in `handler_support.py`, shipped beside this file): an archive that must run on a
GPU (`deviceType: gpu`, or the server's `require_gpu`) fails to initialise rather than serve on
the CPU; AOTInductor packages and ONNX sessions are checked to run where they were meant to.
The compiled variant only ever sees the batch sizes warmed up at load (power-of-two buckets up
to batchSize; a batch is zero-padded to its bucket), so live traffic never compiles or records.

Inputs, one per request (`data` or `body`): a JSON list of 64 pixel intensities in 0..16, an
8x8 nested list, an array/tensor of either shape, or a PNG/JPEG image (grayscale, resized to
8x8; dark ink on light paper is inverted to match the training data's light-on-dark). Output:
`{"label": int, "topk": [{"label": int, "probability": float}, ...]}`. A bad item gets
`{"error": ..., "code": 400}` and status 400 for its index only; its batch-mates are answered.

The module defines exactly one class because TorchServe's loader requires that of a handler
module, and it imports nothing from the `ts` package, so Mariner can load it without TorchServe.
"""

from __future__ import annotations

import importlib.util
import io
import json
import logging
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

log = logging.getLogger(__name__)

PIXELS = 64
SIDE = 8
PIXEL_MAX = 16.0
IMAGE_MAGIC = (b"\x89PNG\r\n\x1a\n", b"\xff\xd8\xff")
MAX_IMAGE_PIXELS = 4096 * 4096  # decoding is bounded before PIL allocates anything
FORMATS = ("eager", "compiled", "torchscript", "aoti", "onnx")
# Formats whose artefact autograd can differentiate (explanations); AOTI and ONNX cannot.
EXPLAINABLE = ("eager", "compiled", "torchscript")


def _explaining(context: Any, data: list[Any]) -> bool:
    """TorchServe's frontend sets `explain: True` on /explanations and KServe `:explain` requests;
    as in BaseHandler._is_explain, request 0 decides for the batch (Mariner never mixes them)."""
    getter = getattr(context, "get_request_header", None)
    if getter is None or not data:
        return False
    try:
        return getter(0, "explain") == "True"
    except (IndexError, KeyError, AttributeError):  # a context that holds no headers for this batch
        return False


def _explain_target(row: Any, classes: int) -> int | None:
    """The class to explain: the request's `target` (beside `data`, or in a JSON body object),
    or None for the predicted label."""
    target = row.get("target") if isinstance(row, dict) else None
    body = row.get("body") if isinstance(row, dict) else None
    if target is None and isinstance(body, dict):
        target = body.get("target")
    if isinstance(target, (bytes, bytearray, str)) and target.strip().isdigit():
        target = int(target)
    if target is None:
        return None
    if isinstance(target, bool) or not isinstance(target, int) or not 0 <= target < classes:
        raise ValueError(f"'target' must be a class index in [0, {classes - 1}], got {str(target)[:20]!r}")
    return target


# The helper every handler shares, beside this file in the repo and in the archive alike, loaded
# by path as it loads the other siblings (see its load_module_from: why by path, why registered).
_spec = importlib.util.spec_from_file_location(
    "mariner_digits_support", Path(__file__).with_name("handler_support.py")
)
if _spec is None or _spec.loader is None:
    raise ImportError(f"handler_support.py must ship beside {__file__}")
_support = sys.modules[_spec.name] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_support)


def _pixels_from_image(raw: bytes) -> np.ndarray:
    from PIL import Image, UnidentifiedImageError

    try:
        img = Image.open(io.BytesIO(raw))  # reads the header only
        width, height = img.size
        if width * height > MAX_IMAGE_PIXELS:
            raise ValueError(
                f"image is {width}x{height}; at most {MAX_IMAGE_PIXELS} pixels are accepted "
                "(it is resized to 8x8 anyway)"
            )
        img.load()
    except (UnidentifiedImageError, OSError, Image.DecompressionBombError) as exc:
        raise ValueError(f"body looks like an image but could not be decoded: {exc}") from exc
    gray = np.asarray(img.convert("L"), dtype=np.float32)
    border = np.concatenate([gray[0], gray[-1], gray[:, 0], gray[:, -1]])
    if border.mean() > 127.0:  # dark ink on light paper: flip to the training data's polarity
        gray = 255.0 - gray
    small = Image.fromarray(gray.astype(np.uint8)).resize((SIDE, SIDE), Image.Resampling.BOX)
    return np.asarray(small, dtype=np.float32).reshape(PIXELS) * (PIXEL_MAX / 255.0)


# Exactly the types JSON numbers decode to; bool is not among them (it is a subclass of int).
_PLAIN_NUMBERS = frozenset({int, float})


def _check_numbers(value: Any, depth: int = 0) -> None:
    """Walk a JSON list before numpy sees it: numpy would turn "3" or true into 3.0 and 1.0."""
    if isinstance(value, (list, tuple)):
        if depth >= 2 or len(value) not in (PIXELS, SIDE):
            where = "a nested row" if depth else "the list"
            raise ValueError(
                "expected 64 pixels as a flat list of 64 numbers or an 8x8 nested list, "
                f"but {where} has {len(value)} items"
            )
        # The common case in one C-level pass: every item a plain int or float passes the walk
        # below; anything else takes the walk, which finds and names the offending item.
        if _PLAIN_NUMBERS.issuperset(map(type, value)):
            return
        for v in value:
            _check_numbers(v, depth + 1)
    elif isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"pixels must be numbers in [0, 16], got {type(value).__name__} {str(value)[:20]!r}")


def _pixels_from_array(value: Any) -> np.ndarray:
    if isinstance(value, dict):
        if "data" not in value:
            raise ValueError("a JSON object input must have a 'data' key holding the 64 pixels")
        value = value["data"]
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu().numpy()
    if not isinstance(value, np.ndarray):
        _check_numbers(value)
    try:
        arr = np.asarray(value, dtype=np.float32)
    except (TypeError, ValueError, OverflowError) as exc:
        raise ValueError(f"pixels must be a flat list of 64 numbers or an 8x8 nested list: {exc}") from exc
    if arr.shape not in ((PIXELS,), (SIDE, SIDE)):
        raise ValueError(
            f"expected 64 pixels as a flat list of 64 or an 8x8 nested list, got shape {list(arr.shape)}"
        )
    if not np.isfinite(arr).all():
        raise ValueError("pixels must be finite numbers (no NaN or Infinity)")
    if arr.min() < 0.0 or arr.max() > PIXEL_MAX:
        raise ValueError(f"pixel intensities must be in [0, 16], got min {arr.min():g} and max {arr.max():g}")
    return arr.reshape(PIXELS)


def _pixels_from_tensor(tensors: Any) -> np.ndarray:
    """An OIP request's `pixels` input, [N, 64] (or [N, 8, 8]), as (N, 64) float32 rows."""
    if not isinstance(tensors, dict) or "pixels" not in tensors:
        raise ValueError("a tensor request must carry the input 'pixels' [N, 64] FP32")
    arr = np.asarray(tensors["pixels"], dtype=np.float32)
    if arr.ndim not in (2, 3) or arr.shape[1:] not in ((PIXELS,), (SIDE, SIDE)) or len(arr) == 0:
        raise ValueError(f"input 'pixels' must be [N, 64] or [N, 8, 8] with N >= 1, got {list(arr.shape)}")
    if not np.isfinite(arr).all():
        raise ValueError("input 'pixels' must be finite numbers (no NaN or Infinity)")
    if arr.min() < 0.0 or arr.max() > PIXEL_MAX:
        raise ValueError(f"pixel intensities must be in [0, 16], got min {arr.min():g} and max {arr.max():g}")
    return arr.reshape(len(arr), PIXELS)


def decode_item(row: Any) -> np.ndarray:
    """One request -> 64 raw pixel intensities in 0..16; ValueError says what was wrong."""
    payload = row
    if isinstance(row, dict) and ("data" in row or "body" in row):
        payload = row.get("data") if row.get("data") is not None else row.get("body")
    if payload is None:
        raise ValueError("empty request: send 64 pixels as JSON or a PNG/JPEG image")
    if isinstance(payload, (bytes, bytearray, memoryview)):
        raw = bytes(payload)
        if not raw.strip():
            raise ValueError("empty body: send 64 pixels as JSON or a PNG/JPEG image")
        if raw.startswith(IMAGE_MAGIC):
            return _pixels_from_image(raw)
        try:
            payload = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ValueError("body is neither UTF-8 JSON nor a PNG/JPEG image") from exc
    if isinstance(payload, str):
        if not payload.strip():
            raise ValueError("empty body: send 64 pixels as JSON or a PNG/JPEG image")
        try:
            payload = json.loads(payload)
        except json.JSONDecodeError as exc:
            raise ValueError(f"body is not valid JSON ({exc.msg} at position {exc.pos})") from exc
        except RecursionError:
            raise ValueError("body is JSON nested too deeply; send 64 pixels") from None
    return _pixels_from_array(payload)


class DigitsHandler:
    """Loads the archive's artefact once; answers batches of digit images with top-k labels."""

    def __init__(self) -> None:
        self.initialized = False
        self.model: Any = None
        self.device = torch.device("cpu")
        self.format = ""
        self.mean = 0.0
        self.std = 1.0
        self.labels: list[str] = [str(i) for i in range(10)]
        self.topk = 3
        self._ort: Any = None
        self.buckets: list[int] = [1]
        self._pad = False  # compiled: run only at the warmed bucket sizes
        self._staging: Any = None  # one pinned host buffer per worker (GPU instances)

    # -- TorchServe contract -------------------------------------------------------------
    def initialize(self, context: Any) -> None:
        props = context.system_properties
        model_dir = Path(props.get("model_dir") or ".")
        section = _support.config_section(context)
        self.format = _support.artefact_format(section, FORMATS)
        self.topk = int(section.get("topk", 3))
        serialized = _support.serialized_file(context, section.get("artefact"))
        artefact = model_dir / serialized

        norm = json.loads((model_dir / "norm.json").read_text())
        self.mean, self.std = float(norm["mean"]), float(norm["std"])
        self.labels = _support.read_labels(model_dir, self.labels)

        # AOTI packages and dynamic-int8 kernels only run on the device they were built for.
        self.device = _support.pick_device(context, str(section.get("device", "any")))
        self.buckets = _support.batch_buckets(
            int(props.get("batch_size") or 1), section.get("warmup_batch_sizes")
        )
        self.model = self._load(artefact, model_dir, section)
        if self.device.type == "cuda" and self.format != "onnx":
            self._staging = _support.HostStaging(self.buckets[-1], (1, SIDE, SIDE), self.device)
        self._warm_up()
        self.initialized = True
        log.info(
            "digits handler ready: format=%s device=%s artefact=%s", self.format, self.device, serialized
        )

    def handle(self, data: list[Any], context: Any) -> list[Any]:
        """One forward pass for the whole batch; rows are split back per request, in order.

        A request is either one image (JSON / bytes / an image, answered with top-k JSON) or, on
        Mariner's Open Inference Protocol path, `{"tensors": {"pixels": array [N, 64]}}`,
        answered with `{"tensors": {"logits", "probabilities", "label"}}` as arrays (no JSON).
        """
        if _explaining(context, data):
            return self.explain_handle(data, context)
        results: list[Any] = [None] * len(data)
        spans: list[tuple[int, int, int, bool]] = []  # (request index, first row, end row, tensor?)
        rows: list[np.ndarray] = []
        n = 0
        for i, row in enumerate(data):
            try:
                is_tensor = _support.is_tensor_request(row)
                block = _pixels_from_tensor(row["tensors"]) if is_tensor else decode_item(row)[None, :]
            except ValueError as exc:
                _support.refuse(results, context, i, str(exc))
                continue
            rows.append(block)
            spans.append((i, n, n + len(block), is_tensor))
            n += len(block)
        if not rows:
            return results
        logits = self.logits(self.normalise(np.concatenate(rows)))
        probs = torch.softmax(logits, dim=1)
        top = probs.topk(min(self.topk, probs.shape[1]), dim=1)
        logits_np, probs_np = logits.numpy(), probs.numpy()
        top_p, top_i = top.values.numpy(), top.indices.numpy()
        for slot, a, b, is_tensor in spans:
            if is_tensor:
                results[slot] = {
                    "tensors": {
                        "logits": logits_np[a:b],
                        "probabilities": probs_np[a:b],
                        "label": top_i[a:b, 0].astype(np.int64),
                    }
                }
            else:
                results[slot] = {
                    "label": int(top_i[a, 0]),
                    "topk": [
                        {"label": int(c), "probability": round(float(p), 6)}
                        for c, p in zip(top_i[a], top_p[a], strict=True)
                    ],
                }
        return results

    def explain_handle(self, data: list[Any], context: Any) -> list[Any]:
        """Input-gradient saliency: d logit[target] / d pixel for each of the 64 raw pixels.

        One request is one image; the answer is `{"label", "target", "method", "saliency"}`
        with `saliency` as 8x8 rows. Variants without gradients (AOTI, ONNX, dynamic int8)
        answer 501 per request, a malformed one 400, as predictions do.
        """
        results: list[Any] = [None] * len(data)

        def fail(i: int, status: int, message: str) -> None:
            _support.refuse(results, context, i, message, status)

        cannot = (
            f"the {self.format} variant of this model cannot explain (its artefact has no gradients, "
            "e.g. AOTInductor, ONNX or dynamic-int8 kernels); use the eager or fp32 torchscript archive"
        )
        if self.format not in EXPLAINABLE:
            for i in range(len(data)):
                fail(i, 501, cannot)
            return results
        slots: list[int] = []
        rows: list[np.ndarray] = []
        targets: list[int | None] = []
        for i, row in enumerate(data):
            try:
                if _support.is_tensor_request(row):
                    raise ValueError("explanations take one image per request, not a tensor batch")
                rows.append(decode_item(row))
                targets.append(_explain_target(row, len(self.labels)))
                slots.append(i)
            except ValueError as exc:
                fail(i, 400, str(exc))
                del rows[len(slots) :]
        if not rows:
            return results
        # compiled: differentiate the eager module it wraps, so no graph is compiled at request time
        model = getattr(self.model, "_orig_mod", self.model)
        x = self.normalise(np.stack(rows)).to(self.device).requires_grad_(True)
        try:
            with torch.enable_grad():
                out = model(x)
                logits = (out[0] if isinstance(out, (tuple, list)) else out).float()
                predicted = logits.argmax(dim=1)
                wanted = [
                    t if t is not None else int(p) for t, p in zip(targets, predicted.tolist(), strict=True)
                ]
                picked = logits.gather(1, torch.tensor(wanted, device=logits.device)[:, None]).sum()
                (grad,) = torch.autograd.grad(picked, x)
        except RuntimeError as exc:  # e.g. dynamic-int8 kernels have no backward
            if "out of memory" in str(exc).lower():
                raise
            log.warning("explanation failed for format %s: %s", self.format, exc)
            for i in slots:
                fail(i, 501, cannot)
            return results
        saliency = (grad / self.std).reshape(-1, SIDE, SIDE).detach().cpu().numpy()
        for k, i in enumerate(slots):
            results[i] = {
                "label": int(predicted[k]),
                "target": wanted[k],
                "method": "input_gradient",
                "saliency": np.round(saliency[k].astype(np.float64), 6).tolist(),
            }
        return results

    # -- model API used by verification and by Mariner's tensor path ----------------------
    def normalise(self, pixels: np.ndarray) -> torch.Tensor:
        """(N, 64) raw 0..16 pixels -> (N, 1, 8, 8) normalised float32, on the host."""
        t = torch.from_numpy(np.ascontiguousarray(pixels, dtype=np.float32)).reshape(-1, 1, SIDE, SIDE)
        return (t - self.mean) / self.std

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """Normalised (N, 1, 8, 8) host tensor -> (N, 10) float32 logits on the host."""
        if self.format == "onnx":
            out = self._ort.run(None, {self._ort_input: x.numpy()})[0]
            return torch.from_numpy(out)
        if not self._pad:
            return self._forward(x, len(x))
        top = self.buckets[-1]  # larger batches (multi-row tensor requests) run as top-size chunks
        return torch.cat([self._forward(c, self._bucket(len(c))) for c in x.split(top)])

    def _bucket(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    def _forward(self, x: torch.Tensor, rows: int) -> torch.Tensor:
        """Run x zero-padded to `rows` rows (padding rows are independent in eval mode)."""
        n = len(x)
        with torch.inference_mode():
            x = _support.batch_on_device(x, rows, self.device, self._staging, self._pad)
            out = self.model(x)
            if isinstance(out, (tuple, list)):
                out = out[0]
            return out[:n].float().cpu()

    def predict_topk(self, pixels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        logits = self.logits(self.normalise(pixels))
        probs = torch.softmax(logits, dim=1)
        p, i = probs.topk(min(self.topk, probs.shape[1]), dim=1)
        return p.numpy(), i.numpy()

    # -- loading --------------------------------------------------------------------------
    def _load(self, artefact: Path, model_dir: Path, section: dict[str, Any]) -> Any:
        if self.format in ("eager", "compiled"):
            module = _support.load_module_from(model_dir / "digits_model.py", "mariner_digits_model")
            arch = module.DigitsCNN(**section.get("model_kwargs", {}))
            model = _support.load_weights(arch, artefact, self.device)
            if self.format == "compiled":
                model = _support.compile_for_buckets(model, section.get("compile") or {}, self.buckets)
                self._pad = True
            return model
        loaded = _support.load_artefact(self.format, artefact, self.device)
        if self.format == "onnx":
            self._ort = loaded
            self._ort_input = loaded.get_inputs()[0].name
        return loaded

    def _warm_up(self) -> None:
        """Run every batch-size bucket once so no request pays a compile or a first-call cost.

        For the compiled variant these are the only sizes it will ever run (batches are padded
        to them), so every graph it needs is compiled here; for the others it faults in kernels.
        """
        zeros = np.zeros((self.buckets[-1], PIXELS), dtype=np.float32)
        for b in self.buckets:
            self.logits(self.normalise(zeros[:b]))
