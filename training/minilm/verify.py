"""Verify each staged MiniLM variant through the serving handler, as a server loads it.

Two comparisons, both on real English (the held-out sentences of `mariner.training.text_data`):
- eager vs sentence-transformers' own `SentenceTransformer(local dir).encode()`: the oracle for
  "our one-module encoder, tokenizer rules and pooling are all-MiniLM-L6-v2", max abs diff
  <= 1e-5. A few texts longer than maxLength are added so truncation is checked too.
- every other variant vs the eager handler's vectors: cosine >= 0.9999 (fp32 artefacts: the
  same math in another runtime) or >= 0.99 (int8).
Latency is the handler's per-batch time (tokenize + forward + split) at batch 1, 8 and 32.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mariner.training.package import Staged
from mariner.training.verify import init_handler, load_handler_class, median_ms

FP32_MIN_COSINE = 0.9999
INT8_MIN_COSINE = 0.99
ORACLE_MAX_ABS_DIFF = 1e-5
HANDLER_PATH = Path(__file__).resolve().parents[2] / "handlers" / "minilm_handler.py"


@dataclass(frozen=True)
class Verification:
    """One variant's record; written into its archive, the store index and the report."""

    variant: str
    format: str
    target: str
    quantized: bool
    cosine_min: float
    cosine_mean: float
    max_abs_diff: float  # vs the eager handler (0 for eager itself)
    oracle_max_abs_diff: float | None  # eager only: vs sentence-transformers' encode()
    file_bytes: int
    latency_b1_ms: float | None  # None when not measured (repeats=0: tests skip timing)
    latency_b8_ms: float | None
    latency_b32_ms: float | None
    load_seconds: float
    tolerance: str
    passed: bool

    def record(self, export_seconds: float) -> dict[str, Any]:
        return {**asdict(self), "export_seconds": round(export_seconds, 3)}


def load_handler(model_dir: Path, manifest: dict[str, Any], model_config: dict[str, Any]) -> Any:
    """The real handler initialised on a staged (unarchived) model dir, on the CPU."""
    return init_handler(load_handler_class(HANDLER_PATH, "MiniLMHandler"), model_dir, manifest, model_config)


def oracle_embeddings(weights_dir: Path, texts: list[str]) -> np.ndarray:
    """sentence-transformers' encode() from the local model dir (never the hub)."""
    from mariner.server.worker.torchvision_ops import ensure_torchvision_importable

    ensure_torchvision_importable()  # sentence-transformers imports transformers, which imports torchvision
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(weights_dir), device="cpu", local_files_only=True)
    return np.asarray(model.encode(texts, batch_size=32, convert_to_numpy=True), dtype=np.float32)


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    num = (a.astype(np.float64) * b).sum(axis=1)
    return num / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


def batch_latency_ms(handler: Any, texts: list[str], batch: int, repeats: int) -> float | None:
    """Median time of `handler.handle` for one batch of `batch` one-text requests."""
    if repeats <= 0:
        return None
    rows = [{"body": texts[i % len(texts)]} for i in range(batch)]
    return median_ms(lambda: handler.handle(rows, None), repeats)


def verify_variant(
    staged: Staged,
    *,
    fmt: str,
    target: str,
    quantized: bool,
    texts: list[str],
    reference: np.ndarray | None,
    oracle: np.ndarray | None = None,
    oracle_texts: list[str] | None = None,
    repeats: int = 10,
) -> tuple[Verification, np.ndarray]:
    """Verify one staged variant; returns its record and its vectors for `texts`.

    `reference` is the eager handler's vectors (None when this is the eager variant, which is
    checked against `oracle`, sentence-transformers' vectors for `oracle_texts`, instead).
    """
    t0 = time.perf_counter()
    handler = load_handler(staged.dir, staged.manifest, staged.model_config)
    load_s = time.perf_counter() - t0
    vectors = handler.embed(texts)
    oracle_diff: float | None = None
    if reference is None:
        if oracle is None or oracle_texts is None:
            raise ValueError("the eager variant is verified against sentence-transformers' vectors")
        oracle_diff = float(np.abs(handler.embed(oracle_texts) - oracle).max())
        reference = vectors
    cos = cosines(vectors, reference)
    diff = float(np.abs(vectors - reference).max())
    floor = INT8_MIN_COSINE if quantized else FP32_MIN_COSINE
    tolerance = f"cosine >= {floor:g}"
    passed = float(cos.min()) >= floor
    if oracle_diff is not None:
        tolerance += f", vs sentence-transformers <= {ORACLE_MAX_ABS_DIFF:g}"
        passed = passed and oracle_diff <= ORACLE_MAX_ABS_DIFF
    rec = Verification(
        variant=staged.variant,
        format=fmt,
        target=target,
        quantized=quantized,
        cosine_min=float(cos.min()),
        cosine_mean=float(cos.mean()),
        max_abs_diff=diff,
        oracle_max_abs_diff=oracle_diff,
        file_bytes=staged.artefact.stat().st_size,
        latency_b1_ms=batch_latency_ms(handler, texts, 1, repeats),
        latency_b8_ms=batch_latency_ms(handler, texts, 8, repeats),
        latency_b32_ms=batch_latency_ms(handler, texts, 32, repeats),
        load_seconds=load_s,
        tolerance=tolerance,
        passed=passed,
    )
    return rec, vectors


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _oracle(r: Verification) -> str:
    return "-" if r.oracle_max_abs_diff is None else f"{r.oracle_max_abs_diff:.2e}"


def markdown_table(rows: list[Verification]) -> str:
    head = (
        "| variant | format | built for | cosine min | cosine mean | max abs diff vs eager "
        "| vs sentence-transformers | size (MiB) | p50 b=1 (ms) | p50 b=8 (ms) | p50 b=32 (ms) "
        "| tolerance | ok |\n"
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---|\n"
    )
    lines = [
        f"| {r.variant} | {r.format} | {r.target} | {r.cosine_min:.6f} | {r.cosine_mean:.6f} "
        f"| {r.max_abs_diff:.2e} | {_oracle(r)} | {r.file_bytes / 2**20:.1f} "
        f"| {_ms(r.latency_b1_ms)} | {_ms(r.latency_b8_ms)} | {_ms(r.latency_b32_ms)} "
        f"| {r.tolerance} | {'yes' if r.passed else 'NO'} |"
        for r in rows
    ]
    note = (
        "\nHeld-out sentences from scikit-learn's dataset descriptions; latency is the handler's "
        "per-batch time (tokenize + forward) on this machine's CPU, one text per request.\n"
    )
    return "## all-MiniLM-L6-v2 variants\n\n" + head + "\n".join(lines) + "\n" + note
