"""Open, check and unpack TorchServe model archives: a .mar, a .tar.gz or a directory.

An archive is code the server will execute, so it is treated as hostile until checked: the
three layouts `torch-model-archiver` writes (`archive_formats`) are unpacked with the same
member checks (no absolute paths, no `..`, no symlinks out of it, member count and unpacked size
capped on what the archive declares before anything is written, then on the bytes really written,
`archive_budget`) into a private work dir, and an optional sha256 pin refuses an archive whose
digest differs. Archives are only ever read from the model store directory; names that are URLs,
escape the store or hold control characters are refused (an entry of the store that is a symlink
is followed: the store is the operator's, see `resolve_in_store`), and the name a model is served under
(given, from its manifest or from its file name) must follow the archiver's rule (`names`).

The manifest and the model-config are checked field by field (`archive_fields`), and every
file the manifest names (handler, model file, serialized file, extra files, config file) must
resolve, symlinks followed, inside the archive's own unpacked directory: a handler of
`../../elsewhere/h.py` would otherwise run code the sha256 pin never covered. Every refusal is
one ServingError(INVALID_ARGUMENT) naming the archive, the field and what is allowed.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re
import shutil
import stat
import tempfile
import zipfile
from dataclasses import dataclass, field, replace
from pathlib import Path, PurePosixPath
from typing import Any

from mariner.server.common.archive_fields import MANIFEST, check_handler, read_manifest, read_model_config
from mariner.server.common.archive_formats import (
    ArchiveLimits,
    archive_stem,
    copy_directory,
    extract_file,
    hoist_single_root,
)
from mariner.server.contracts.errors import Code, ServingError, TorchServeAnswer
from mariner.server.contracts.names import check_model_name, check_param

__all__ = [
    "MANIFEST",
    "UNLISTED",
    "ArchiveLimits",
    "ModelArchive",
    "archive_file_name",
    "is_url",
    "requirements_dir",
    "open_archive",
    "resolve_in_store",
    "store_archives",
    "unpack_file",
    "url_not_allowed",
    "with_handler",
]
UNLISTED = "unlisted"  # expected_sha256 value for an archive missing from the allowlist
# Where an archive's requirements are pip-installed (install_py_dep_per_model), inside its own
# unpacked directory; no archive may bring a member of that name, so the directory holds only
# what pip installed, and the worker puts it on sys.path only when it exists.
REQUIREMENTS_DIR = ".mariner-requirements"
_ALLOWED = "a .mar (zip), a .tar.gz or a no-archive directory holding MAR-INF/MANIFEST.json"


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


# What TorchServe's ArchiveUtils treats as a URL to download (`file?://.*|http(s)?://.*`); any
# other scheme-like prefix is no file of the store either.
_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]+://")


def is_url(name: str) -> bool:
    """Whether a register `url` is a URL (something to download), not a store entry's name."""
    return bool(_URL.match(name))


def url_not_allowed(url: str) -> ServingError:
    """TorchServe's answer to a URL that matches none of `allowed_urls` (ArchiveUtils.validateURL:
    ModelNotFoundException, 404). Mariner's default allows no remote URL at all."""
    shown = url[:200]
    return ServingError(
        Code.NOT_FOUND,
        f"registering from a URL is not allowed ({shown!r}): copy the archive into the model store "
        "and pass its file name as url",
        torchserve=TorchServeAnswer(
            404, "ModelNotFoundException", f"Given URL {shown} does not match any allowed URL(s)"
        ),
    )


def _not_found(message: str, torchserve_message: str) -> ServingError:
    return ServingError(
        Code.NOT_FOUND,
        message,
        torchserve=TorchServeAnswer(404, "ModelNotFoundException", torchserve_message),
    )


def _store_entry(store: Path, name: str) -> Path:
    """`name` as a path under `store`, judged on the name alone (no symlink is followed here):
    relative with no `..` component, or absolute under the store's directory."""
    if not name:
        raise _not_found("parameter url is empty: name an archive of the model store", "empty url")
    if ".." in PurePosixPath(name).parts:
        raise _not_found(
            f"archive {name!r}: '..' is not allowed in url; name an entry of the model store {store}",
            f"Relative path is not allowed in url: {name[:200]}",
        )
    root = Path(os.path.abspath(store))
    path = Path(os.path.normpath(root / name))
    if Path(name).is_absolute():
        real = store.resolve()
        if path.is_relative_to(real) and not path.is_relative_to(root):
            path = root / path.relative_to(real)  # the store reached through its resolved path
    if not path.is_relative_to(root) or path == root:
        raise _not_found(
            f"archive {name!r} is outside the model store {root}: name an entry of the store",
            f"Model not found at: {name[:200]}",
        )
    return path


def resolve_in_store(store: Path, name: str) -> Path:
    """`name` (a file such as digits.mar or digits.tar.gz, or a no-archive directory) as the path
    of an entry of `store`; never a URL, never `..` or an absolute path elsewhere, never a name
    with a control character (a NUL made pathlib raise) or longer than a path can be.

    The store directory is the operator's trust boundary: an entry of it that is a symlink (what
    TorchServe's own test harness makes, and every Kubernetes ConfigMap, Secret or projected
    volume is: a tree of symlinks) is served, wherever it points. Its target is then opened and
    checked as any archive (size caps, member checks, the sha256 pin). The path returned is the
    entry's own, so the model's url names the entry, not its target."""
    check_param("url", name)
    if is_url(name):
        raise url_not_allowed(name)
    path = _store_entry(store, name)
    try:
        found = path.is_file() or path.is_dir()
    except OSError as exc:  # ENAMETOOLONG and the like: no such archive can exist
        raise ServingError(
            Code.INVALID_ARGUMENT,
            f"archive {name!r} cannot be a file in the model store ({exc.strerror}); "
            "allowed: the file name of an archive in the store",
        ) from None
    if not found:
        raise _not_found(
            f"archive {name!r} not found in the model store {store}", f"Model not found at: {name[:200]}"
        )
    return path


def requirements_dir(model_dir: Path) -> Path:
    """The directory an archive's requirements are installed into (see REQUIREMENTS_DIR)."""
    return model_dir / REQUIREMENTS_DIR


def store_archives(store: Path) -> list[str]:
    """What `models=all` loads, as TorchServe's start-up does: every `.mar` and `.tar.gz` file
    and every directory that holds an archive's manifest (itself or its only subdirectory),
    hidden entries left out. A directory without a manifest is not an archive and is skipped
    (TorchServe tries it and logs a failure)."""
    names = []
    for p in sorted(store.iterdir()) if store.is_dir() else []:
        if p.name.startswith("."):
            continue
        archive_file = p.is_file() and p.name.endswith((".mar", ".tar.gz"))
        if archive_file or (p.is_dir() and (hoist_single_root(p) / MANIFEST).is_file()):
            names.append(p.name)
    return names


def archive_file_name(store: Path, item: str) -> str:
    """A `models` entry given without `name=`: `digits.mar`, `digits.tar.gz` or a directory as
    it is; a bare `digits` is `digits.mar` unless the store has an entry of exactly that name."""
    if item.endswith(".mar") or (store / item).exists():
        return item
    return f"{item}.mar"


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _check_pin(path: Path, digest: str, expected_sha256: str | None) -> None:
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


def unpack_file(
    path: Path, dest: Path, limits: ArchiveLimits, expected_sha256: str | None, *, not_regular: str
) -> str:
    """Unpack the regular file `path` into `dest` under `limits` and return its sha256, the pin
    (`expected_sha256`, None for none) checked against the bytes read before anything is written.

    Shared by model archives and workflow archives (`workflow_archive`) so that both take the same
    care: the file is hashed and unpacked through one open descriptor, so a file replaced between
    the two cannot pass the pin with one content and unpack another; it is opened O_NONBLOCK, so a
    store entry (or a symlink's target) that is a FIFO cannot block the open; and anything but a
    regular file is refused, with ValueError(`not_regular`), before a byte is read."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError(not_regular)
        h = hashlib.sha256()
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
        digest = h.hexdigest()
        _check_pin(path, digest, expected_sha256)
        f.seek(0)
        extract_file(f, dest, limits)
    return digest


def _unpack(path: Path, dest: Path, limits: ArchiveLimits, expected_sha256: str | None) -> str:
    """Unpack `path` into `dest` and return its digest, the pin checked against the bytes read.

    A file goes through `unpack_file` (hashed and unpacked through one descriptor); a directory's
    digest is taken while it is copied (`archive_formats.copy_directory`)."""
    if path.is_dir():
        digest = copy_directory(path, dest, limits)
        _check_pin(path, digest, expected_sha256)
        return digest
    return unpack_file(
        path,
        dest,
        limits,
        expected_sha256,
        not_regular=f"{path.name} is not a regular file or a directory; allowed: {_ALLOWED}",
    )


def _settle(staging: Path) -> Path:
    """The unpacked files' directory: `staging`, or its only subdirectory moved into its place
    (a tgz's top directory, a directory archive wrapped in one more), so `model_dir` always is
    the one directory to remove."""
    root = hoist_single_root(staging)
    if root == staging:
        return staging
    moved = staging.with_name(staging.name + "-m")
    root.rename(moved)
    staging.rmdir()
    return moved


def _model_name(path: Path, name_override: str | None, manifest_name: Any) -> str:
    """The name the archive is served under: the one given (register's model_name, a `models=`
    entry's `name=`), else its manifest's (checked by `archive_fields`), else its file name's
    stem; each must be a name TorchServe's archiver would write (`names.check_model_name`)."""
    if name_override:
        return name_override  # checked before unpacking (open_archive)
    if manifest_name:
        return str(manifest_name)
    return check_model_name(archive_stem(path), f"archive {path.name}: the model name from its file name")


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
    if name_override:
        check_model_name(name_override, f"archive {path.name}: model name")
    work_root.mkdir(parents=True, exist_ok=True)
    model_dir = Path(tempfile.mkdtemp(prefix=f"{archive_stem(path)}-", dir=work_root))
    try:
        try:
            digest = _unpack(path, model_dir, limits, expected_sha256)
            model_dir = _settle(model_dir)
            if requirements_dir(model_dir).exists():
                raise ValueError(
                    f"member {REQUIREMENTS_DIR!r} is reserved for the requirements Mariner installs"
                )
        except (zipfile.BadZipFile, ValueError, OSError) as exc:
            if isinstance(exc, zipfile.BadZipFile):
                exc = ValueError(f"{exc}; allowed: {_ALLOWED}")
            raise ServingError(Code.INVALID_ARGUMENT, f"archive {path.name} refused: {exc}") from exc
        manifest = read_manifest(model_dir, path.name)
        model = manifest["model"]
        config = read_model_config(model_dir, path.name, model.get("configFile"))
        return ModelArchive(
            name=_model_name(path, name_override, model.get("modelName")),
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


def with_handler(archive: ModelArchive, handler: str) -> ModelArchive:
    """`archive` with `handler` instead of its manifest's (TorchServe's register `handler=`
    overrides the manifest), checked by the rule the manifest's handler passed: a module name or
    a file inside the archive, never a path out of it (INVALID_ARGUMENT naming it)."""
    check_param("handler", handler)
    check_handler(archive.path.name, archive.model_dir, handler)
    model = {**archive.manifest.get("model", {}), "handler": handler}
    return replace(archive, manifest={**archive.manifest, "model": model})


def with_envelope(archive: ModelArchive, envelope: str | None) -> ModelArchive:
    """`archive` with the server's `service_envelope` recorded as its manifest's `model.envelope`
    (TorchServe's frontend sets it on every model it registers; the worker reads it there)."""
    if not envelope:
        return archive
    manifest = dict(archive.manifest)
    manifest["model"] = {**manifest.get("model", {}), "envelope": envelope}
    return dataclasses.replace(archive, manifest=manifest)
