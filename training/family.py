"""What a model family's pipeline hands back to the store builder.

The digits CNN, the sentence encoder and the image classifier each have their own pipeline
(train or load, export, verify, package); `mariner.training.pipeline` runs them in turn and
writes one `index.json` for the whole store. This is the value that crosses that boundary, so
each family can be built and tested alone while the store stays one allowlist.
"""

from __future__ import annotations

from dataclasses import dataclass
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
