"""What a model family's pipeline hands back to the store builder.

The digits CNN, the sentence encoder and the image classifier each have their own pipeline
(train or load, export, verify, package); `mariner.training.pipeline` runs them in turn and
writes one `index.json` for the whole store. This is the value that crosses that boundary, so
each family can be built and tested alone while the store stays one allowlist.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class FamilyBuild:
    """One family's archives, as index.json entries, and its verification table.

    `entries` use the index schema: model, version, file, sha256, bytes, format, device,
    verification (a dict with at least `passed`). `failed` names the variants outside their
    tolerance; the store build exits non-zero when any family reports one.
    """

    family: str
    entries: tuple[dict[str, Any], ...]
    report_markdown: str
    failed: tuple[str, ...] = ()

    @classmethod
    def of(
        cls, family: str, entries: list[dict[str, Any]], report_markdown: str, rows: list[Any]
    ) -> FamilyBuild:
        """The build of `family` from its verification rows (each with `variant` and `passed`)."""
        failed = tuple(r.variant for r in rows if not r.passed)
        return cls(family=family, entries=tuple(entries), report_markdown=report_markdown, failed=failed)


def index_entry(
    mar: Path, *, model: str, version: str, fmt: str, device: str, verification: dict[str, Any]
) -> dict[str, Any]:
    """An archive's index.json entry: the allowlist's sha256 and size beside its verification."""
    from mariner.server.common.archive import sha256_file

    return {
        "model": model,
        "version": version,
        "file": mar.name,
        "sha256": sha256_file(mar),
        "bytes": mar.stat().st_size,
        "format": fmt,
        "device": device,
        "verification": verification,
    }


def print_verdict(name: str, tolerance: str, passed: bool, widths: tuple[int, int]) -> None:
    """One variant's line in the build log: its name, its tolerance and whether it held."""
    print(
        f"  {name:<{widths[0]}} {tolerance:<{widths[1]}} {'ok' if passed else 'OUT OF TOLERANCE'}", flush=True
    )


def family_main(
    build: Callable[..., FamilyBuild], *, doc: str | None, label: str, full_help: str, repeats: int,
    argv: list[str] | None = None,
) -> int:  # fmt: skip
    """`python -m mariner.training.<family>.pipeline`: one family's archives into a store, alone."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--store", type=Path, default=Path("model_store"))
    p.add_argument("--work", type=Path, default=Path("build"))
    p.add_argument("--full", action="store_true", help=full_help)
    p.add_argument("--batch-size", type=int, default=32, help="batchSize in every model-config")
    p.add_argument("--max-batch-delay", type=int, default=5, help="maxBatchDelay (ms) in every model-config")
    p.add_argument("--repeats", type=int, default=repeats, help="timed runs per latency median")
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    fb = build(
        args.store, args.work, full=args.full, batch_size=args.batch_size,
        max_batch_delay_ms=args.max_batch_delay, repeats=args.repeats,
    )  # fmt: skip
    print(fb.report_markdown)
    print(f"{label} archives built in {time.perf_counter() - t0:.1f} s -> {args.store}")
    if fb.failed:
        print(f"variants out of tolerance: {', '.join(fb.failed)}", file=sys.stderr)
        return 1
    return 0
