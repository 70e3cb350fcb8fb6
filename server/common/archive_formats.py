"""The three layouts `torch-model-archiver` writes, unpacked with one set of member checks.

`--archive-format default` writes a zip (`x.mar`), `tgz` a gzip'd tar (`x.tar.gz`) whose members
all sit under one top directory (`x/MAR-INF/MANIFEST.json`), and `no-archive` a plain directory
(`x/MAR-INF/MANIFEST.json`). TorchServe loads each from its model store; so does Mariner, and
every layout passes the same checks before a byte of it lands in the private work dir:

* a member's name is relative, has no `..` component and no backslash;
* a member is a regular file or a directory: a tar's symlinks, hard links and devices are
  refused, and a directory's symlinks are followed only when they resolve to a file inside it;
* the member count and the unpacked bytes are capped: first on what a zip's central directory
  and each tar header declare, before anything is written, then counted while copying, since
  headers lie (`archive_budget`, which also stops zip and gzip bombs on their compression ratio);
* the digest the sha256 pin is checked against is taken from the very bytes unpacked.

A directory is copied, never served in place: whoever can write to the store must not be able
to change the code of a model already running. Its digest (`directory_digest_line`) is the
sha256 of `sha256sum`'s output over its files in byte order of their paths, which a user can
reproduce with coreutils (docs/torchserve-archives.md) to write the store's index.json.
"""

from __future__ import annotations

import gzip
import hashlib
import os
import stat
import tarfile
import zipfile
import zlib
from pathlib import Path, PurePosixPath
from typing import IO

from mariner.server.common.archive_budget import ArchiveLimits, Budget, GzipGuard, check_zip_declared

__all__ = ["ArchiveLimits", "Budget", "archive_stem", "copy_directory", "extract_file", "hoist_single_root"]

_GZIP_MAGIC = b"\x1f\x8b"
TGZ_SUFFIXES = (".tar.gz", ".tgz")


def archive_stem(path: Path) -> str:
    """The model name an archive file gives when its manifest names none: `x.mar`, `x.tar.gz`, `x/`."""
    for suffix in TGZ_SUFFIXES:
        if path.name.endswith(suffix):
            return path.name[: -len(suffix)]
    return path.name if path.is_dir() else path.stem


def check_name(name: str) -> PurePosixPath:
    """A member name as a relative path that stays inside the archive, or ValueError."""
    p = PurePosixPath(name)
    if name.startswith(("/", "\\")) or p.is_absolute() or (p.parts and ":" in p.parts[0]):
        raise ValueError(f"member {name!r} has an absolute path")
    if ".." in p.parts or "\\" in name:
        raise ValueError(f"member {name!r} escapes the archive ('..' or backslash)")
    if "\n" in name or "\0" in name:
        raise ValueError(f"member {name!r} has a newline or NUL in its name")
    return p


# -- files: .mar (zip) and .tar.gz ------------------------------------------------------------
def extract_file(f: IO[bytes], dest: Path, limits: ArchiveLimits) -> None:
    """Unpack an open archive file (zip or gzip'd tar, told apart by their first bytes) into
    `dest`; ValueError, OSError, zipfile/tarfile errors say what was refused."""
    magic = f.read(2)
    f.seek(0)
    if magic == _GZIP_MAGIC:
        _extract_tar(f, dest, limits)
    else:
        _extract_zip(f, dest, limits)


def _extract_zip(f: IO[bytes], dest: Path, limits: ArchiveLimits) -> None:
    with zipfile.ZipFile(f) as zf:
        infos = zf.infolist()
        if len(infos) > limits.max_members:
            raise ValueError(f"{len(infos)} members, more than the limit of {limits.max_members}")
        for info in infos:
            check_name(info.filename)
            if stat.S_ISLNK(info.external_attr >> 16):
                raise ValueError(f"member {info.filename!r} is a symlink")
        check_zip_declared(infos, limits)  # before a byte is written
        budget = Budget(limits)
        for info in infos:
            target = dest / info.filename
            if info.is_dir():
                target.mkdir(parents=True, exist_ok=True)
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            with zf.open(info) as src, target.open("wb") as dst:
                budget.copy(src, dst, name=info.filename, declared=info.file_size)


def _extract_tar(f: IO[bytes], dest: Path, limits: ArchiveLimits) -> None:
    """Stream the tar (`r|`: members are read once, in order, never seeked to by a header's
    offset) out of a guarded gzip stream (`GzipGuard`: capped, ratio-checked) and write only
    regular files and directories, each checked, its declared size too, before it is written."""
    budget = Budget(limits)
    guard = GzipGuard(f, limits)
    try:
        with tarfile.open(fileobj=guard, mode="r|") as tf:  # type: ignore[call-overload]
            for member in tf:
                budget.member()
                check_name(member.name)
                if member.isdir():
                    (dest / member.name).mkdir(parents=True, exist_ok=True)
                    continue
                if not member.isreg():
                    kind = (
                        "a symlink" if member.issym() else "a hard link" if member.islnk() else "not a file"
                    )
                    raise ValueError(
                        f"member {member.name!r} is {kind}; only files and directories are allowed"
                    )
                budget.declared(member.name, member.size)
                target = dest / member.name
                target.parent.mkdir(parents=True, exist_ok=True)
                src = tf.extractfile(member)
                if src is None:  # pragma: no cover - isreg() members always have data
                    raise ValueError(f"member {member.name!r} has no data")
                with src, target.open("wb") as dst:
                    budget.copy(src, dst, name=member.name, declared=member.size)
    except (tarfile.TarError, EOFError, zlib.error, gzip.BadGzipFile) as exc:
        raise ValueError(f"not a readable gzip'd tar ({exc})") from exc
    finally:
        guard.close()


def hoist_single_root(dest: Path) -> Path:
    """The directory holding the archive's files: `dest` itself, or (as TorchServe does for a
    tgz and a directory) its only child when that is a directory and `dest` has no MAR-INF."""
    children = list(dest.iterdir())
    if (dest / "MAR-INF").is_dir() or len(children) != 1 or not children[0].is_dir():
        return dest
    return children[0]


# -- directories (--archive-format no-archive) ------------------------------------------------
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK  # a FIFO must not block the open


class _DirectoryCopy:
    """One directory archive copied with its checks, walked through directory descriptors.

    Each directory is opened (`O_NOFOLLOW`) relative to its already opened parent and each file
    relative to its directory, so a directory swapped for a symlink while the copy runs is
    refused, never followed out of the archive. Symlinks are the one place a path is resolved:
    the link's target must be a regular file inside the archive directory."""

    def __init__(self, root: Path, dest: Path, limits: ArchiveLimits) -> None:
        self.root = root
        self.dest = dest
        self.budget = Budget(limits)
        self.files: list[tuple[bytes, str]] = []  # (name as bytes, sha256 of its content)

    def walk(self, dir_fd: int, rel_dir: str) -> None:
        for name in sorted(os.listdir(dir_fd)):
            rel = f"{rel_dir}/{name}" if rel_dir else name
            self.budget.member()
            check_name(rel)
            mode = os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode
            if stat.S_ISDIR(mode):
                (self.dest / rel).mkdir(parents=True, exist_ok=True)
                child = _open(name, _DIR_FLAGS, dir_fd, rel)
                try:
                    self.walk(child, rel)
                finally:
                    os.close(child)
            elif stat.S_ISLNK(mode):
                self.copy(_open(str(self._link_target(rel)), _FILE_FLAGS, None, rel), rel)
            else:
                self.copy(_open(name, _FILE_FLAGS, dir_fd, rel), rel)

    def _link_target(self, rel: str) -> Path:
        resolved = (self.root / rel).resolve()
        if not resolved.is_relative_to(self.root):
            raise ValueError(f"member {rel!r} is a symlink to {resolved}, outside the archive directory")
        if not resolved.is_file():
            raise ValueError(
                f"member {rel!r} is a symlink to a directory or to nothing; "
                "only symlinks to files inside the archive directory are allowed"
            )
        return resolved

    def copy(self, fd: int, rel: str) -> None:
        with os.fdopen(fd, "rb") as src:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise ValueError(
                    f"member {rel!r} is not a regular file; only files and directories are allowed"
                )
            self.budget.declared(rel, os.fstat(fd).st_size)  # before copying a byte
            digest = hashlib.sha256()
            target = self.dest / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            with target.open("wb") as dst:
                self.budget.copy(src, dst, digest, name=rel)
        self.files.append((os.fsencode(rel), digest.hexdigest()))

    def digest(self) -> str:
        listing = b"".join(sha.encode() + b"  " + name + b"\n" for name, sha in sorted(self.files))
        return hashlib.sha256(listing).hexdigest()


def _open(name: str, flags: int, dir_fd: int | None, rel: str) -> int:
    try:
        return os.open(name, flags, dir_fd=dir_fd)
    except OSError as exc:  # ELOOP: a symlink where a file or directory was listed
        raise ValueError(f"member {rel!r} cannot be opened as a file or directory ({exc.strerror})") from exc


def copy_directory(src_root: Path, dest: Path, limits: ArchiveLimits) -> str:
    """Copy a directory archive into `dest` with the member checks; return its digest: the
    sha256 of `sha256sum`'s lines for its files, sorted by their relative paths' bytes.

    A symlink is copied as the file it resolves to when that file is inside `src_root`; one that
    resolves outside, to a directory, or to nothing is refused, as is anything that is not a
    regular file or a directory (a FIFO, a socket, a device)."""
    root = src_root.resolve()
    walker = _DirectoryCopy(root, dest, limits)
    root_fd = _open(str(root), _DIR_FLAGS, None, ".")
    try:
        walker.walk(root_fd, "")
    finally:
        os.close(root_fd)
    return walker.digest()
