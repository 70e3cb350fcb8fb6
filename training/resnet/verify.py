"""Verify every staged ResNet-18 variant against the eager model, through the serving handler.

Each variant is loaded by `handlers/resnet_handler.py` from its staged model dir with a
TorchServe-shaped Context, exactly as a server loads it. The weights are untrained (a
PERFORMANCE workload), so accuracy against labels would be meaningless; what is checked is that
each variant computes the same function as eager on real photo crops:

- fp32 variants: max |logit - eager logit| <= FP32_MAX_ABS_DIFF. Logits here are O(1) (max
  about 2); fp32 has ~1e-7 relative precision, and a 18-layer network re-ordered or fused by
  TorchScript, ONNX Runtime or the inductor accumulates a few 1e-6 of difference. 1e-4 leaves
  a margin of 10-100x over that and is still 1e4 below the logit scale, so a wrong layer, a
  missing BatchNorm or a bad padding row cannot pass. Top-1 agreement is reported, not gated:
  with untrained weights the top two logits can be within 1e-5 of each other.
- int8 (PT2E) variants: per-image cosine of the logit vectors >= INT8_MIN_COSINE, and the
  mean overlap of the top-5 sets is reported.
Latency medians at batch 1 and 32 (forward only), and through `handle()` with JPEG requests
at batch 1, 8 and 32 (decode + preprocess + forward + answer).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mariner.training.package import Staged
from mariner.training.verify import fp32_math, init_handler, load_handler_class, logit_latencies, median_ms

FP32_MAX_ABS_DIFF = 1e-4
INT8_MIN_COSINE = 0.99
HANDLER_PATH = Path(__file__).resolve().parents[2] / "handlers" / "resnet_handler.py"


@dataclass(frozen=True)
class ResNetVerification:
    """One variant's record; written into its archive and into the family's report."""

    variant: str
    format: str
    quantized: bool
    max_abs_logit_diff: float
    min_cosine: float
    top1_agreement: float
    top5_overlap: float
    file_bytes: int
    latency_b1_ms: float
    latency_b32_ms: float
    handle_ms: dict[str, float]
    load_seconds: float
    tolerance: str
    passed: bool
    target: str = "any device"


def load_staged(staged: Staged, gpu_id: int | None = None) -> Any:
    """Initialise the real handler on a staged (unarchived) model dir."""
    handler_class = load_handler_class(HANDLER_PATH, "ResNetHandler")
    return init_handler(handler_class, staged.dir, staged.manifest, staged.model_config, gpu_id)


def verify_variant(
    staged: Staged,
    *,
    fmt: str,
    quantized: bool,
    x: torch.Tensor,
    eager_logits: torch.Tensor,
    jpegs: Sequence[bytes],
    repeats: int,
    target: str = "any device",
) -> ResNetVerification:
    t0 = time.perf_counter()
    handler = load_staged(staged)
    load_s = time.perf_counter() - t0
    with fp32_math():
        logits = torch.cat([handler.logits(c) for c in x.split(32)])
    pred, eager_pred = logits.argmax(1), eager_logits.argmax(1)
    diff = float((logits - eager_logits).abs().max())
    cosine = float(torch.nn.functional.cosine_similarity(logits, eager_logits, dim=1).min())
    top5, eager_top5 = logits.topk(5, dim=1).indices, eager_logits.topk(5, dim=1).indices
    overlap = float(
        sum(len(set(a.tolist()) & set(b.tolist())) for a, b in zip(top5, eager_top5, strict=True))
        / (5 * len(x))
    )
    if quantized:
        tolerance = f"min logit cosine >= {INT8_MIN_COSINE}"
        passed = cosine >= INT8_MIN_COSINE
    else:
        tolerance = f"max abs dlogit <= {FP32_MAX_ABS_DIFF:g}"
        passed = diff <= FP32_MAX_ABS_DIFF
    handle_ms = {}
    for b in (1, 8, 32):
        batch = [{"body": jpegs[i % len(jpegs)]} for i in range(b)]
        handle_ms[str(b)] = round(median_ms(lambda batch=batch: handler.handle(batch, None), repeats), 3)
    return ResNetVerification(
        variant=staged.variant,
        format=fmt,
        quantized=quantized,
        max_abs_logit_diff=diff,
        min_cosine=cosine,
        top1_agreement=float((pred == eager_pred).float().mean()),
        top5_overlap=overlap,
        file_bytes=staged.artefact.stat().st_size,
        **logit_latencies(handler.logits, x, repeats),
        handle_ms=handle_ms,
        load_seconds=load_s,
        tolerance=tolerance,
        passed=passed,
        target=target,
    )


def markdown(rows: Sequence[ResNetVerification], images: int) -> str:
    """The family's verification table, with what it does and does not mean."""
    head = (
        "## ResNet-18 variants vs eager\n\n"
        "PERFORMANCE workload: seeded, untrained weights with BatchNorm statistics calibrated on "
        f"real photo crops, so top-1 accuracy is meaningless and not reported. {images} held-out "
        "photo crops (scikit-learn's sample photos) are compared with the eager model's logits. "
        "Latency: medians on this machine; `handle` includes JPEG decode and preprocessing.\n\n"
        "| variant | format | built for | max abs dlogit | min cosine | top-1 agree | top-5 overlap "
        "| size (MiB) | fwd b=1 (ms) | fwd b=32 (ms) | handle b=1/8/32 (ms) | load (s) | tolerance | ok |\n"
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---|---|\n"
    )
    lines = [
        f"| {r.variant} | {r.format} | {r.target} | {r.max_abs_logit_diff:.2e} | {r.min_cosine:.5f} "
        f"| {r.top1_agreement * 100:.1f}% | {r.top5_overlap * 100:.1f}% | {r.file_bytes / 2**20:.1f} "
        f"| {r.latency_b1_ms:.1f} | {r.latency_b32_ms:.1f} "
        f"| {r.handle_ms['1']:.0f} / {r.handle_ms['8']:.0f} / {r.handle_ms['32']:.0f} | {r.load_seconds:.1f} "
        f"| {r.tolerance} | {'yes' if r.passed else 'NO'} |"
        for r in rows
    ]
    return head + "\n".join(lines) + "\n"
