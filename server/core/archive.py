"""Open, check and unpack TorchServe model archives (.mar).

A .mar is code the server will execute, so it is treated as hostile until checked: members
with absolute paths, `..` components or symlink modes are refused, the member count and the
total unpacked size are capped (and counted while extracting, not trusted from headers), and
an optional sha256 pin refuses an archive whose digest differs. Archives are only ever read
from the model store directory; names that are URLs or escape the store are refused.

The manifest and the model-config are checked field by field (`archive_fields`), and every
file the manifest names (handler, model file, serialized file, extra files, config file) must
resolve, symlinks followed, inside the archive's own unpacked directory: a handler of
`../../elsewhere/h.py` would otherwise run code the sha256 pin never covered. Every refusal is
one ServingError(INVALID_ARGUMENT) naming the archive, the field and what is allowed.
"""

from __future__ import annotations

import hashlib
import shutil
import stat
import tempfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from mariner.server.core.archive_fields import MANIFEST, read_manifest, read_model_config
from mariner.server.core.errors import Code, ServingError

__all__ = ["MANIFEST", "UNLISTED", "ArchiveLimits", "ModelArchive", "open_archive", "resolve_in_store"]
UNLISTED = "unlisted"  # expected_sha256 value for an archive missing from the allowlist


@dataclass(frozen=True)
class ArchiveLimits:
    max_members: int = 10_000
    max_unpacked_bytes: int = 4 << 30


@dataclass(frozen=True)
class ModelArchive:
    """An unpacked, checked archive: where it lives and what its manifest and config say."""

    name: str
    version: str
    path: Path
    sha256: str
    model_dir: Path
    manifest: dict[str, Any]
    model_config: dict[str, Any] = field(default_factory=dict)

    @property
    def handler(self) -> str:
        return str(self.manifest.get("model", {}).get("handler", ""))


def resolve_in_store(store: Path, name: str) -> Path:
    """`name` (a file name such as digits.mar) as a path inside `store`; never a URL, never outside."""
    if "://" in name:
        raise ServingError(
            Code.PERMISSION_DENIED, f"archives load only from the model store, not a URL: {name!r}"
        )
    store = store.resolve()
    path = (store / name).resolve()
    if not path.is_relative_to(store):
        raise ServingError(Code.PERMISSION_DENIED, f"archive {name!r} is outside the model store {store}")
    if not path.is_file():
        raise ServingError(Code.NOT_FOUND, f"archive {name!r} not found in the model store {store}")
    return path


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _check_member(info: zipfile.ZipInfo) -> None:
    name = info.filename
    p = PurePosixPath(name)
    if name.startswith(("/", "\\")) or p.is_absolute() or (p.parts and ":" in p.parts[0]):
        raise ValueError(f"member {name!r} has an absolute path")
    if ".." in p.parts or "\\" in name:
        raise ValueError(f"member {name!r} escapes the archive ('..' or backslash)")
    mode = info.external_attr >> 16
    if stat.S_ISLNK(mode):
        raise ValueError(f"member {name!r} is a symlink")


def _extract(zf: zipfile.ZipFile, dest: Path, limits: ArchiveLimits) -> None:
    infos = zf.infolist()
    if len(infos) > limits.max_members:
        raise ValueError(f"{len(infos)} members, more than the limit of {limits.max_members}")
    for info in infos:
        _check_member(info)
    budget = limits.max_unpacked_bytes
    for info in infos:
        target = dest / info.filename
        if info.is_dir():
            target.mkdir(parents=True, exist_ok=True)
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        with zf.open(info) as src, target.open("wb") as dst:
            # Count real bytes: declared sizes in a hostile zip can lie (zip bombs).
            while chunk := src.read(1 << 20):
                budget -= len(chunk)
                if budget < 0:
                    raise ValueError(f"unpacks to more than the limit of {limits.max_unpacked_bytes} bytes")
                dst.write(chunk)


def open_archive(
    path: Path,
    work_root: Path,
    *,
    limits: ArchiveLimits | None = None,
    expected_sha256: str | None = None,
    name_override: str | None = None,
) -> ModelArchive:
    """Check and unpack `path` into a private dir under `work_root`; read manifest and config."""
    limits = limits or ArchiveLimits()
    digest = sha256_file(path)
    if expected_sha256 == UNLISTED:
        raise ServingError(
            Code.PERMISSION_DENIED,
            f"archive {path.name} (sha256 {digest}) is not in the store's allowlist (index.json); "
            "not loading it",
        )
    if expected_sha256 is not None and digest != expected_sha256.lower():
        raise ServingError(
            Code.PERMISSION_DENIED,
            f"archive {path.name} has sha256 {digest}, not the pinned {expected_sha256}",
        )
    work_root.mkdir(parents=True, exist_ok=True)
    model_dir = Path(tempfile.mkdtemp(prefix=f"{path.stem}-", dir=work_root))
    try:
        try:
            with zipfile.ZipFile(path) as zf:
                _extract(zf, model_dir, limits)
        except (zipfile.BadZipFile, ValueError, OSError) as exc:
            raise ServingError(Code.INVALID_ARGUMENT, f"archive {path.name} refused: {exc}") from exc
        manifest = read_manifest(model_dir, path.name)
        model = manifest["model"]
        config = read_model_config(model_dir, path.name, model.get("configFile"))
        return ModelArchive(
            name=name_override or str(model.get("modelName") or path.stem),
            version=str(model.get("modelVersion") or "1.0"),
            path=path,
            sha256=digest,
            model_dir=model_dir,
            manifest=manifest,
            model_config=config,
        )
    except BaseException:
        shutil.rmtree(model_dir, ignore_errors=True)
        raise
