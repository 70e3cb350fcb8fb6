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

import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mariner.handlers.handler_support import load_module_from
from mariner.server.worker.context import Context

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


def load_handler_class(path: Path = HANDLER_PATH, name: str = "DigitsHandler") -> type:
    """The handler class `name` of the handler file at `path` (the digits one by default),
    imported by path as a server imports an archive's handler; every family verifies this way."""
    handler_class: type = getattr(load_module_from(path, f"mariner_verify_{path.stem}"), name)
    return handler_class


def init_handler(
    handler_class: type,
    model_dir: Path,
    manifest: dict[str, Any],
    model_config: dict[str, Any],
    gpu_id: int | None = None,
) -> Any:
    """A handler initialised on a staged (unarchived) model dir with a TorchServe-shaped Context,
    on the CPU or on GPU `gpu_id`: what is verified is what a server loads."""
    ctx = Context(
        manifest["model"]["modelName"],
        str(model_dir),
        manifest,
        batch_size=int(model_config.get("batchSize", 1)),
        gpu_id=gpu_id,
        model_yaml_config=model_config,
    )
    handler = handler_class()
    handler.initialize(ctx)
    return handler


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
    return init_handler(load_handler_class(), model_dir, manifest, model_config, gpu_id)


def median_ms(fn: Callable[[], Any], repeats: int) -> float:
    """Median wall time in ms of `repeats` calls after one warm call: every family's latency
    figure; 0.0 when repeats is 0 (tests that skip timing)."""
    if repeats < 1:
        return 0.0
    fn()  # warm
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def logit_latencies(logits: Callable[[torch.Tensor], Any], x: torch.Tensor, repeats: int) -> dict[str, float]:
    """`median_ms` of one forward pass at batch 1 and at batch 32: a record's `latency_b1_ms`
    and `latency_b32_ms`."""
    return {
        "latency_b1_ms": median_ms(lambda: logits(x[:1]), repeats),
        "latency_b32_ms": median_ms(lambda: logits(x[:32]), repeats),
    }


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
        **logit_latencies(handler.logits, x, repeats),
        load_seconds=load_s,
        tolerance=tolerance,
        passed=passed,
        target=target,
    )
