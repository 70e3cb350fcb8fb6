"""Build the model store: train -> export -> quantize -> verify -> package -> index.

`python -m mariner.training.pipeline` (what `make models` runs) builds three model families:
the digits CNN (trained here), the all-MiniLM-L6-v2 sentence encoder (weights from a package)
and a ResNet-18 image classifier. It writes `model_store/*.mar`, one `model_store/index.json`
for all of them (each archive's sha256, size and verification record: the allowlist
`--pin-index` serves from) and the verification tables under `model_store/report/`
(`variants.md`/`variants.png` for digits, `<family>.md` for the others). It exits non-zero if
any variant is outside its tolerance or the eager digits model misses the accuracy target.

The default store holds every digits variant and the quick-to-build variants of the other two
(what `make test` needs); `--full` (`make models-full`) adds their slow exports (AOTInductor,
compiled, PT2E int8), which take minutes on a 2-core machine.
"""

from __future__ import annotations

import argparse
import importlib
import json
import platform
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from mariner.training import package, report
from mariner.training.data import load_splits, to_model_input
from mariner.training.export import Artefact, export_all, load_eager, model_kwargs
from mariner.training.family import FamilyBuild, print_verdict
from mariner.training.train import TrainConfig, train
from mariner.training.verify import Verification, verify_variant

MIN_TEST_ACCURACY = 0.98
QUANTIZED = {"int8_dynamic", "int8_pt2e"}
# The families built beside digits, each by `mariner.training.<name>.pipeline.build`; the
# archive-name prefixes below are the ones this builder owns in the store.
FAMILIES = ("minilm", "resnet")
OWNED_PREFIXES = ("digits_", "minilm_", "resnet18_")


def build(
    store: Path,
    work: Path,
    *,
    retrain: bool = False,
    batch_size: int = 32,
    max_batch_delay_ms: int = 5,
    repeats: int = 50,
    full: bool = False,
    families: tuple[str, ...] = FAMILIES,
) -> tuple[list[Verification], list[FamilyBuild]]:
    t_start = time.perf_counter()
    best = work / "train" / "best.pt"
    if retrain or not best.exists():
        train(TrainConfig(), work / "train", progress=None)
    splits = load_splits(seed=TrainConfig().seed)
    model, ck = load_eager(best)
    with torch.inference_mode():
        eager_logits = model(to_model_input(splits.test.x, splits.norm))

    calibration = to_model_input(splits.train.x, splits.norm)
    artefacts, ck = export_all(best, work / "artefacts", calibration)
    norm = ck["norm"]

    rows: list[Verification] = []
    entries: list[dict[str, Any]] = []
    for art in artefacts:
        staged = package.stage(
            art, work=work / "stage", norm=norm, model_kwargs=model_kwargs(ck), batch_size=batch_size,
            max_batch_delay_ms=max_batch_delay_ms,
        )  # fmt: skip
        rec, entry = _verify_and_archive(
            art, staged, store, splits=splits, eager_logits=eager_logits, repeats=repeats
        )
        rows.append(rec)
        entries.append(entry)
        print_verdict(art.variant, rec.tolerance, rec.passed, (13, 28))

    rdir = store / "report"
    rdir.mkdir(parents=True, exist_ok=True)
    (rdir / "variants.md").write_text(report.markdown_table(rows))
    report.write_chart(rows, rdir / "variants.png")

    built: list[FamilyBuild] = []
    for family in families:
        print(f"family {family} ({'full' if full else 'default'} store)", flush=True)
        module = importlib.import_module(f"mariner.training.{family}.pipeline")
        fb: FamilyBuild = module.build(
            store, work, full=full, batch_size=batch_size, max_batch_delay_ms=max_batch_delay_ms
        )
        (rdir / f"{fb.family}.md").write_text(fb.report_markdown)
        entries.extend(fb.entries)
        built.append(fb)

    _write_index(store, entries, ck, time.perf_counter() - t_start, full=full)
    _remove_stale(store, {e["file"] for e in entries})
    return rows, built


def _remove_stale(store: Path, written: set[str]) -> None:
    """Archives of our families that this build did not write (a full build's slow variants,
    then a default rebuild) are deleted: the store serves `--models all`, and an archive left
    outside index.json would be served unverified or refused under `--pin-index`."""
    for mar in store.glob("*.mar"):
        if mar.name.startswith(OWNED_PREFIXES) and mar.name not in written:
            print(f"  removing {mar.name}: not part of this build", flush=True)
            mar.unlink()


def _verify_and_archive(
    art: Artefact,
    staged: package.Staged,
    store: Path,
    *,
    splits: Any,
    eager_logits: torch.Tensor,
    repeats: int,
) -> tuple[Verification, dict[str, Any]]:
    """A staged variant verified against the eager model, then archived into `store` with its
    record; the record and the archive's index entry."""
    rec = verify_variant(
        variant=art.variant,
        fmt=art.format,
        quantized=art.variant in QUANTIZED,
        model_dir=staged.dir,
        artefact=staged.artefact,
        manifest=staged.manifest,
        model_config=staged.model_config,
        test_pixels=splits.test.x,
        test_labels=splits.test.y,
        eager_logits=eager_logits,
        repeats=repeats,
        target=art.target,
    )
    record = {**asdict(rec), "export_seconds": round(art.seconds, 3)}
    return rec, package.archive_variant(staged, record, store, fmt=art.format, device=art.device)


def _write_index(
    store: Path, entries: list[dict[str, Any]], ck: dict[str, Any], seconds: float, *, full: bool
) -> None:
    index = {
        "schema": 1,
        "default_model": "digits_torchscript",
        "full": full,
        "built_with": {
            "torch": torch.__version__,
            "python": platform.python_version(),
            "machine": platform.machine(),
            "build_seconds": round(seconds, 1),
        },
        "training": {"epoch": ck["epoch"], "val": ck["val"], "config": ck["config"]},
        "archives": entries,
    }
    (store / "index.json").write_text(json.dumps(index, indent=2) + "\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--store", type=Path, default=Path("model_store"))
    p.add_argument("--work", type=Path, default=Path("build"))
    p.add_argument("--retrain", action="store_true", help="train even if WORK/train/best.pt exists")
    p.add_argument("--batch-size", type=int, default=32, help="batchSize in every model-config")
    p.add_argument("--max-batch-delay", type=int, default=5, help="maxBatchDelay (ms) in every model-config")
    p.add_argument("--repeats", type=int, default=50, help="timed runs per latency median")
    p.add_argument("--full", action="store_true", help="also the slow variants of minilm and resnet18")
    p.add_argument(
        "--families", default=",".join(FAMILIES),
        help=f"families built beside digits, comma-separated (default: {','.join(FAMILIES)}; '' for none)",
    )  # fmt: skip
    args = p.parse_args(argv)
    families = tuple(f for f in args.families.split(",") if f)
    unknown = sorted(set(families) - set(FAMILIES))
    if unknown:
        p.error(f"unknown families {unknown}; known: {', '.join(FAMILIES)}")
    t0 = time.perf_counter()
    rows, built = build(
        args.store, args.work, retrain=args.retrain, batch_size=args.batch_size,
        max_batch_delay_ms=args.max_batch_delay, repeats=args.repeats, full=args.full, families=families,
    )  # fmt: skip
    print(report.markdown_table(rows))
    for fb in built:
        print(fb.report_markdown)
    print(f"model store built in {time.perf_counter() - t0:.1f} s -> {args.store}")
    eager_acc = rows[0].eager_accuracy
    failed = [r.variant for r in rows if not r.passed]
    failed += [f"{fb.family}:{v}" for fb in built for v in fb.failed]
    if eager_acc < MIN_TEST_ACCURACY:
        print(f"eager test accuracy {eager_acc:.4f} is below the {MIN_TEST_ACCURACY} target", file=sys.stderr)
        return 1
    if failed:
        print(f"variants out of tolerance: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
