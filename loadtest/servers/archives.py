"""The archives a server is asked to load: what TorchServe (and Mariner) registers each one as."""

from __future__ import annotations

import json
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from mariner.loadtest.servers.process import ServerError


@dataclass(frozen=True)
class ArchiveInfo:
    """What TorchServe will call a model, read from the archive's MAR-INF/MANIFEST.json."""

    name: str
    version: str
    file: str  # file name inside the model store, e.g. "digits_onnx.mar"


def read_archive(path: Path) -> ArchiveInfo:
    """Name and version from the manifest, which is what TorchServe registers the model under."""
    try:
        with zipfile.ZipFile(path) as zf:
            manifest = json.loads(zf.read("MAR-INF/MANIFEST.json"))
    except (OSError, KeyError, zipfile.BadZipFile, json.JSONDecodeError) as exc:
        raise ServerError(f"{path} is not a readable .mar archive with a manifest: {exc}") from exc
    model = manifest.get("model") or {}
    return ArchiveInfo(
        name=str(model.get("modelName") or path.stem),
        version=str(model.get("modelVersion") or "1.0"),
        file=path.name,
    )


def resolve_models(model_store: Path, models: str | Sequence[str]) -> list[ArchiveInfo]:
    """Archives for `models`: 'all', comma-separated names, or a list (names with or without .mar)."""
    if isinstance(models, str):
        wanted = [m.strip() for m in models.split(",") if m.strip()]
    else:
        wanted = [str(m).strip() for m in models]
    if not wanted:
        raise ServerError("no models given: pass 'all' or archive names")
    if wanted == ["all"]:
        paths = sorted(model_store.glob("*.mar"))
        if not paths:
            raise ServerError(f"no .mar archives in {model_store} (run `make models`)")
    else:
        paths = []
        for name in wanted:
            path = model_store / (name if name.endswith(".mar") else f"{name}.mar")
            if not path.is_file():
                have = ", ".join(p.stem for p in sorted(model_store.glob("*.mar"))) or "none"
                raise ServerError(f"archive {path} not found; archives in the store: {have}")
            paths.append(path)
    return [read_archive(p) for p in paths]
