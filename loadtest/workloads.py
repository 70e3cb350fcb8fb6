"""What the benchmark sends each model family and how it checks the answers: one place per family.

The side-by-side benchmark (`mariner.loadtest.bench`), its raw ceiling (`mariner.loadtest.ceiling`)
and the closed-loop clients (`mariner.loadtest.closedloop`) all take their payloads and answer
checks from here, so the raw handler, Mariner and TorchServe see the same bytes and an answer that
is not a real prediction counts as an error on every path.

Families are told apart by the archive's model name (`digits_*`, `minilm_*`, `resnet18_*`, the
store's naming contract). Payloads are real data, never constants (a constant lets every cache on
the way look better than real traffic does):

- digits: the 270 held-out test digits as the README's JSON list of 64 intensities;
- minilm: English texts from `mariner.training.text_data.mixed_length`, whose word-piece counts
  spread over 5..200 (length-aware batching only shows on mixed lengths), sent as UTF-8
  `text/plain`; answer `{"embedding": [384 floats]}` of unit norm;
- resnet18: JPEG crops of the two photos scikit-learn ships, scaled to varied sizes
  (`mariner.training.image_data.encoded_set`), sent as `image/jpeg`; answer
  `{"topk": [5 x {"label", "index", "probability"}]}`, probabilities falling.

Over TorchServe's gRPC `Predictions` the same bytes go in the `data` input (no content type there:
the handler receives the bytes, as it would from TorchServe).
"""

from __future__ import annotations

import json
import math
import statistics
import zipfile
from dataclasses import dataclass
from pathlib import Path

FAMILIES = ("digits", "minilm", "resnet18")
EMBEDDING_DIM = 384
NORM_TOLERANCE = 1e-2  # reduced-precision variants (int8, bf16 autocast) still normalise to ~1e-3
TOP_K = 5
TEXTS = 512  # distinct texts in turn: enough that every batch mixes lengths
IMAGES = 48  # distinct JPEGs in turn (each is 10-80 KB; every client process gets a copy)
SEED = 20261130


class AnswerError(ValueError):
    """An answer that is not the model's prediction for the family (counted as an error)."""


@dataclass(frozen=True)
class Workload:
    """The bodies a benchmark sends in turn, with their HTTP content type and family."""

    family: str
    content_type: str
    bodies: tuple[bytes, ...]
    description: str  # one line for the report: what the payloads are


def family_of(model: str) -> str:
    """The family of an archive's model name (`minilm_onnx` -> `minilm`); ValueError if unknown."""
    for family in FAMILIES:
        if model == family or model.startswith(f"{family}_"):
            return family
    raise ValueError(f"no benchmark workload for model {model!r}; model names start with one of {FAMILIES}")


def content_type(family: str) -> str:
    return {
        "digits": "application/json",
        "minilm": "text/plain; charset=utf-8",
        "resnet18": "image/jpeg",
    }[family]


def workload(family: str, *, seed: int = SEED) -> Workload:
    """The payloads of one family (the data modules import torch or scikit-learn: call this before
    any clock starts, once, and pass the bytes on)."""
    if family == "digits":
        from mariner.loadtest.payloads import test_digit_bodies

        bodies = test_digit_bodies()
        what = f"the {len(bodies)} test-set digits in turn (JSON list of 64 intensities)"
    elif family == "minilm":
        from mariner.training.text_data import mixed_length

        bodies = tuple(t.encode() for t in mixed_length(TEXTS, seed))
        what = (
            f"{len(bodies)} English texts in turn (`text_data.mixed_length({TEXTS}, {seed})`, "
            "word pieces 5..200), UTF-8 text/plain"
        )
    elif family == "resnet18":
        from mariner.training.image_data import encoded_set

        bodies = tuple(encoded_set(IMAGES, seed, "jpeg"))
        kib = statistics.median(len(b) for b in bodies) / 1024
        what = (
            f"{len(bodies)} JPEG crops of scikit-learn's two sample photos in turn "
            f"(`image_data.encoded_set({IMAGES}, {seed})`, ~160..640 px a side, median {kib:.0f} KiB)"
        )
    else:
        raise ValueError(f"unknown family {family!r}; choose from {FAMILIES}")
    return Workload(family, content_type(family), bodies, what)


# ==================================================================================================
# Answer checks (run by the clients on every answer, and by the raw ceiling on its first batch)
# ==================================================================================================
def _json(answer: bytes) -> object:
    try:
        return json.loads(answer)
    except ValueError:
        raise AnswerError(f"not JSON: {answer[:120]!r}") from None


def _check_embedding(vec: object) -> None:
    if not isinstance(vec, list) or len(vec) != EMBEDDING_DIM:
        n = len(vec) if isinstance(vec, list) else type(vec).__name__
        raise AnswerError(f"embedding has {n} values, not {EMBEDDING_DIM}")
    norm = math.sqrt(math.fsum(float(x) * float(x) for x in vec))
    if abs(norm - 1.0) > NORM_TOLERANCE:
        raise AnswerError(f"embedding norm {norm:.4f} is not 1 (within {NORM_TOLERANCE})")


def check_minilm(answer: bytes) -> None:
    doc = _json(answer)
    if isinstance(doc, dict) and "embedding" in doc:
        _check_embedding(doc["embedding"])
    elif isinstance(doc, dict) and isinstance(doc.get("embeddings"), list) and doc["embeddings"]:
        for vec in doc["embeddings"]:
            _check_embedding(vec)
    else:
        raise AnswerError(f"not an embedding answer: {answer[:120]!r}")


def check_resnet18(answer: bytes) -> None:
    doc = _json(answer)
    top = doc.get("topk") if isinstance(doc, dict) else None
    if not isinstance(top, list) or len(top) != TOP_K:
        raise AnswerError(f"not a top-{TOP_K} answer: {answer[:120]!r}")
    last = math.inf
    for entry in top:
        ok = (
            isinstance(entry, dict)
            and isinstance(entry.get("label"), str)
            and isinstance(entry.get("index"), int)
            and isinstance(entry.get("probability"), int | float)
        )
        if not ok:
            raise AnswerError(f"top-k entry is not {{label, index, probability}}: {entry!r:.120}")
        p = float(entry["probability"])
        if not (0.0 <= p <= 1.0 + 1e-6 and p <= last + 1e-6):
            raise AnswerError(f"top-k probabilities are not falling values in [0, 1]: {answer[:160]!r}")
        last = p


def check_digits(answer: bytes) -> None:
    if b'"label"' not in answer:
        raise AnswerError(f"not a prediction: {answer[:120]!r}")


CHECKS = {"digits": check_digits, "minilm": check_minilm, "resnet18": check_resnet18}


def check_answer(family: str, answer: bytes) -> None:
    """Raise AnswerError unless `answer` is a valid prediction of the family's model."""
    CHECKS[family](answer)


# ==================================================================================================
# Describing the payloads (the report says what lengths the texts really had)
# ==================================================================================================
def word_piece_counts(archive: Path, bodies: tuple[bytes, ...], max_length: int = 512) -> list[int] | None:
    """Word pieces per text (with [CLS]/[SEP]) by the archive's own tokenizer.json; None when the
    archive has none or `tokenizers` is missing."""
    try:
        from tokenizers import Tokenizer

        with zipfile.ZipFile(archive) as zf:
            name = next((n for n in zf.namelist() if n.rsplit("/", 1)[-1] == "tokenizer.json"), None)
            if name is None:
                return None
            tok = Tokenizer.from_str(zf.read(name).decode())
    except Exception:  # noqa: BLE001 - a description only: no tokenizer means no line in the report
        return None
    tok.no_truncation()
    tok.no_padding()
    return [min(len(e.ids), max_length) for e in tok.encode_batch([b.decode() for b in bodies])]


def length_summary(counts: list[int]) -> str:
    """min / median / mean / max of word-piece counts, for the report."""
    s = sorted(counts)
    return (
        f"word pieces per text: min {s[0]}, median {statistics.median(s):g}, "
        f"mean {statistics.fmean(s):.0f}, max {s[-1]} ({len(s)} texts)"
    )
