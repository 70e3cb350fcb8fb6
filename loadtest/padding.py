"""A MiniLM archive rewritten to batch blind to length: the other side of the length-aware comparison.

A sentence encoder's cost grows with the padded tokens of a batch (rows x longest row). The
archives as built pad each batch to its longest text and carry a token budget
(`maxBatchTokens`, `tokenCounter`) so that Mariner's batcher groups texts of similar length; the
question the benchmark answers is what that buys. The baseline is the same archive, same files,
same weights, with its model-config rewritten to `padding: max_length` (every text padded to
`maxLength`) and without the token budget: batches of `batchSize` texts in arrival order, as a
length-blind server forms them. The copy goes in a store of its own under build/, never into the
model store.
"""

from __future__ import annotations

import json
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

BUDGET_KEYS = ("maxBatchTokens", "tokenCounter")
MANIFEST = "MAR-INF/MANIFEST.json"


@dataclass(frozen=True)
class Rewritten:
    """The rewritten archive and, per changed key, what it was and what it is now."""

    path: Path
    changes: tuple[str, ...]


def config_name(zf: zipfile.ZipFile) -> str:
    """The archive's model-config member, as its manifest names it (default model-config.yaml)."""
    manifest = json.loads(zf.read(MANIFEST))
    return str(manifest.get("model", {}).get("configFile") or "model-config.yaml")


def pad_to_max(config: dict[str, Any]) -> tuple[dict[str, Any], tuple[str, ...]]:
    """The config with handler padding `max_length` and no token budget; and what changed."""
    out = {k: v for k, v in config.items() if k not in BUDGET_KEYS}
    changes = [f"`{k}: {json.dumps(config[k])}` removed" for k in BUDGET_KEYS if k in config]
    handler = dict(config.get("handler") or {})
    before = handler.get("padding")
    handler["padding"] = "max_length"
    out["handler"] = handler
    if before != "max_length":
        changes.insert(0, f"`handler.padding: {before}` -> `max_length`")
    return out, tuple(changes)


def rewrite_archive(src: Path, dest_store: Path) -> Rewritten:
    """Copy `src` into `dest_store` (same file name, same members, same order and compression),
    with its model-config rewritten by `pad_to_max`."""
    dest_store.mkdir(parents=True, exist_ok=True)
    dest = dest_store / src.name
    with zipfile.ZipFile(src) as zin:
        name = config_name(zin)
        config = yaml.safe_load(zin.read(name)) or {}
        new_config, changes = pad_to_max(config)
        tmp = dest.with_suffix(".mar.tmp")
        with zipfile.ZipFile(tmp, "w") as zout:
            for info in zin.infolist():
                data = zin.read(info)
                if info.filename == name:
                    data = yaml.safe_dump(new_config, sort_keys=False).encode()
                zout.writestr(info, data, compress_type=info.compress_type)
    tmp.replace(dest)
    return Rewritten(dest, changes)
