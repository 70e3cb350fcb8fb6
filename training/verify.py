"""Verify every staged variant against the eager model, through the serving handler.

Each variant is loaded by `handlers/digits_handler.py` exactly as a server loads it (from a
staged model dir, with a TorchServe-shaped Context), so what is verified is what is served.
Per variant: max |delta logit| vs eager on the whole test set, top-1 agreement, accuracy,
file size, and median latency at batch 1 and 32 on this machine.

On a GPU the fp32 tolerance (1e-4) only means something with TF32 off: TF32 matmuls and
convolutions keep 10 mantissa bits (~1e-3 relative), which would hide a real bug behind the
format's own rounding. `fp32_math()` turns TF32 off for the comparison and restores it after.
"""

from __future__ import annotations

import importlib.util
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mariner.server.core.context import Context

FP32_MAX_ABS_DIFF = 1e-4  # fp32 variants: same math, only op order and fusion may differ
INT8_MAX_ACC_DROP = 0.01  # int8 variants: at most one accuracy point lost
HANDLER_PATH = Path(__file__).resolve().parent.parent / "handlers" / "digits_handler.py"


@dataclass(frozen=True)
class Verification:
    """One variant's record; written into its archive and into the store's report."""

    variant: str
    format: str
    quantized: bool
    max_abs_logit_diff: float
    top1_agreement: float
    accuracy: float
    eager_accuracy: float
    file_bytes: int
    latency_b1_ms: float
    latency_b32_ms: float
    load_seconds: float
    tolerance: str
    passed: bool
    target: str = "any device"  # what the artefact was built for (AOTI: device, -march and ISA)


def load_handler_class() -> type:
    spec = importlib.util.spec_from_file_location("mariner_verify_digits_handler", HANDLER_PATH)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import the handler at {HANDLER_PATH}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.DigitsHandler


@contextmanager
def fp32_math() -> Iterator[None]:
    """TF32 off for CUDA matmuls and cuDNN convolutions while verifying (see the docstring)."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def load_staged(
    model_dir: Path, manifest: dict[str, Any], model_config: dict[str, Any], gpu_id: int | None = None
) -> Any:
    """Initialise the real handler on a staged (unarchived) model dir, on CPU or GPU `gpu_id`."""
    ctx = Context(
        manifest["model"]["modelName"],
        str(model_dir),
        manifest,
        batch_size=int(model_config.get("batchSize", 1)),
        gpu_id=gpu_id,
        model_yaml_config=model_config,
    )
    handler = load_handler_class()()
    handler.initialize(ctx)
    return handler


def median_ms(fn: Any, x: torch.Tensor, repeats: int) -> float:
    fn(x)  # warm
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn(x)
        samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def verify_variant(
    *,
    variant: str,
    fmt: str,
    quantized: bool,
    model_dir: Path,
    artefact: Path,
    manifest: dict[str, Any],
    model_config: dict[str, Any],
    test_pixels: np.ndarray,
    test_labels: np.ndarray,
    eager_logits: torch.Tensor,
    repeats: int = 50,
    target: str = "any device",
    gpu_id: int | None = None,
) -> Verification:
    t0 = time.perf_counter()
    handler = load_staged(model_dir, manifest, model_config, gpu_id)
    load_s = time.perf_counter() - t0
    x = handler.normalise(test_pixels)
    with fp32_math():
        logits = torch.cat([handler.logits(chunk) for chunk in x.split(32)])
    pred, eager_pred = logits.argmax(1).numpy(), eager_logits.argmax(1).numpy()
    acc = float((pred == test_labels).mean())
    eager_acc = float((eager_pred == test_labels).mean())
    diff = float((logits - eager_logits).abs().max())
    if quantized:
        tolerance = f"accuracy drop <= {INT8_MAX_ACC_DROP * 100:.0f} point"
        passed = eager_acc - acc <= INT8_MAX_ACC_DROP + 1e-12
    else:
        tolerance = f"max abs dlogit <= {FP32_MAX_ABS_DIFF:g}"
        passed = diff <= FP32_MAX_ABS_DIFF
    return Verification(
        variant=variant,
        format=fmt,
        quantized=quantized,
        max_abs_logit_diff=diff,
        top1_agreement=float((pred == eager_pred).mean()),
        accuracy=acc,
        eager_accuracy=eager_acc,
        file_bytes=artefact.stat().st_size,
        latency_b1_ms=median_ms(handler.logits, x[:1], repeats),
        latency_b32_ms=median_ms(handler.logits, x[:32], repeats),
        load_seconds=load_s,
        tolerance=tolerance,
        passed=passed,
        target=target,
    )
