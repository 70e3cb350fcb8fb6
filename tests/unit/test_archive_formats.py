"""The .tar.gz and no-archive directory layouts pass the same member checks as a .mar."""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest

from mariner.server.common.archive import (
    UNLISTED,
    ArchiveLimits,
    archive_file_name,
    open_archive,
    resolve_in_store,
    store_archives,
)
from mariner.server.contracts.errors import Code, ServingError

pytestmark = pytest.mark.unit

MANIFEST = {"model": {"modelName": "toy", "modelVersion": "2.0", "handler": "toy_handler.py"}}
FILES = {
    "MAR-INF/MANIFEST.json": json.dumps(MANIFEST).encode(),
    "toy_handler.py": b"def handle(data, context):\n    return data\n",
    "weights.bin": b"\0" * 10,
}


def _add(tf: tarfile.TarFile, name: str, data: bytes = b"", **attrs: object) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    for key, value in attrs.items():
        setattr(info, key, value)
    tf.addfile(info, io.BytesIO(data) if data else None)


def make_tgz(path: Path, *, root: str | None = "toy", extra: tuple[tuple[str, dict], ...] = ()) -> Path:
    """What `torch-model-archiver --archive-format tgz` writes: every member under `root/`."""
    prefix = f"{root}/" if root else ""
    with tarfile.open(path, "w:gz") as tf:
        for name, data in FILES.items():
            _add(tf, prefix + name, data)
        for name, attrs in extra:
            _add(tf, name, **attrs)
    return path


def make_dir(path: Path) -> Path:
    """What `--archive-format no-archive` writes."""
    for name, data in FILES.items():
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_bytes(data)
    return path


def refused(path: Path, work: Path, **kwargs: object) -> ServingError:
    with pytest.raises(ServingError) as info:
        open_archive(path, work, **kwargs)  # type: ignore[arg-type]
    assert path.name in info.value.message
    assert not work.exists() or list(work.iterdir()) == [], "a refused archive leaves nothing unpacked"
    return info.value


def test_a_tgz_is_unpacked_from_under_its_top_directory(tmp_path: Path) -> None:
    tgz = make_tgz(tmp_path / "toy.tar.gz")
    a = open_archive(tgz, tmp_path / "work")
    assert (a.name, a.version, a.handler) == ("toy", "2.0", "toy_handler.py")
    assert (a.model_dir / "weights.bin").read_bytes() == b"\0" * 10
    assert a.model_dir.parent == tmp_path / "work"
    assert a.sha256 == __import__("hashlib").sha256(tgz.read_bytes()).hexdigest()


def test_a_tgz_without_a_top_directory_is_read_as_it_is(tmp_path: Path) -> None:
    a = open_archive(make_tgz(tmp_path / "flat.tgz", root=None), tmp_path / "work")
    assert (a.model_dir / "MAR-INF" / "MANIFEST.json").is_file()


@pytest.mark.parametrize(
    ("member", "attrs", "says"),
    [
        ("toy/../../evil.py", {}, "escapes"),
        ("/etc/evil.py", {}, "absolute"),
        ("toy/link.py", {"type": tarfile.SYMTYPE, "linkname": "/etc/passwd"}, "symlink"),
        ("toy/hard.py", {"type": tarfile.LNKTYPE, "linkname": "toy/toy_handler.py"}, "hard link"),
        ("toy/dev", {"type": tarfile.CHRTYPE}, "only files and directories"),
    ],
)
def test_hostile_tar_members_are_refused(tmp_path: Path, member: str, attrs: dict, says: str) -> None:
    err = refused(make_tgz(tmp_path / "bad.tar.gz", extra=((member, attrs),)), tmp_path / "work")
    assert err.code is Code.INVALID_ARGUMENT
    assert says in err.message
    assert not (tmp_path / "evil.py").exists()


def test_tar_member_count_and_unpacked_size_are_capped(tmp_path: Path) -> None:
    tgz = make_tgz(tmp_path / "toy.tar.gz")
    assert "members" in refused(tgz, tmp_path / "w1", limits=ArchiveLimits(max_members=2)).message
    err = refused(tgz, tmp_path / "w2", limits=ArchiveLimits(max_unpacked_bytes=40))
    assert "bytes" in err.message


def test_a_file_that_is_neither_zip_nor_tgz_is_refused_saying_what_is_allowed(tmp_path: Path) -> None:
    junk = tmp_path / "junk.tar.gz"
    junk.write_bytes(b"not an archive at all")
    assert "allowed: a .mar (zip), a .tar.gz" in refused(junk, tmp_path / "w1").message
    broken = tmp_path / "broken.tar.gz"
    broken.write_bytes(make_tgz(tmp_path / "ok.tar.gz").read_bytes()[:200])
    assert "gzip'd tar" in refused(broken, tmp_path / "w2").message


def test_a_directory_is_copied_not_served_in_place(tmp_path: Path) -> None:
    src = make_dir(tmp_path / "store" / "toy")
    a = open_archive(src, tmp_path / "work")
    assert (a.name, a.version) == ("toy", "2.0")
    assert a.model_dir.parent == tmp_path / "work"
    (src / "toy_handler.py").write_text("raise SystemExit('edited in the store')\n")
    assert (a.model_dir / "toy_handler.py").read_bytes() == FILES["toy_handler.py"]


def test_a_directory_digest_is_sha256sum_of_its_sorted_files(tmp_path: Path) -> None:
    """The documented recipe (docs/torchserve-archives.md) gives the digest index.json pins."""
    src = make_dir(tmp_path / "toy")
    (src / "sub").mkdir()
    (src / "sub" / "b.txt").write_text("b")
    os.symlink("weights.bin", src / "alias.bin")  # a link to a file inside: counted as that file
    recipe = "find -L . -type f -printf '%P\\0' | LC_ALL=C sort -z | xargs -0 sha256sum | sha256sum"
    expected = subprocess.run(
        ["sh", "-c", recipe], cwd=src, capture_output=True, text=True, check=True
    ).stdout.split()[0]
    a = open_archive(src, tmp_path / "work")
    assert a.sha256 == expected
    assert (a.model_dir / "alias.bin").read_bytes() == FILES["weights.bin"]
    assert not (a.model_dir / "alias.bin").is_symlink()
    open_archive(src, tmp_path / "work2", expected_sha256=expected.upper())
    assert "not the pinned" in refused(src, tmp_path / "w3", expected_sha256="0" * 64).message
    assert "allowlist" in refused(src, tmp_path / "w4", expected_sha256=UNLISTED).message


@pytest.mark.parametrize(
    ("make_link", "says"),
    [
        (lambda d, outside: os.symlink(outside, d / "evil.py"), "outside the archive directory"),
        (lambda d, outside: os.symlink("../..", d / "up"), "outside the archive directory"),
        (lambda d, outside: os.symlink("MAR-INF", d / "loop"), "to a directory or to nothing"),
        (lambda d, outside: os.symlink("missing.py", d / "dangling.py"), "to a directory or to nothing"),
        (lambda d, outside: os.mkfifo(d / "pipe"), "not a regular file"),
    ],
)
def test_a_directory_with_an_escaping_link_or_special_file_is_refused(
    tmp_path: Path, make_link: object, says: str
) -> None:
    outside = tmp_path / "secret.py"
    outside.write_text("print('outside')\n")
    src = make_dir(tmp_path / "store" / "toy")
    make_link(src, outside)  # type: ignore[operator]
    err = refused(src, tmp_path / "work")
    assert err.code is Code.INVALID_ARGUMENT
    assert says in err.message


def test_directory_member_count_and_size_are_capped(tmp_path: Path) -> None:
    src = make_dir(tmp_path / "toy")
    assert "members" in refused(src, tmp_path / "w1", limits=ArchiveLimits(max_members=3)).message
    assert "bytes" in refused(src, tmp_path / "w2", limits=ArchiveLimits(max_unpacked_bytes=40)).message


def test_a_directory_wrapped_in_one_more_directory_is_read_from_inside(tmp_path: Path) -> None:
    """TorchServe's rule for a store directory whose only entry is a directory (an unpacked tgz)."""
    make_dir(tmp_path / "outer" / "toy")
    a = open_archive(tmp_path / "outer", tmp_path / "work")
    assert (a.model_dir / "MAR-INF" / "MANIFEST.json").is_file()
    assert a.model_dir.parent == tmp_path / "work"
    shutil.rmtree(a.model_dir)
    assert list((tmp_path / "work").iterdir()) == []


def test_the_store_resolves_directories_and_tgz_but_not_itself(tmp_path: Path) -> None:
    store = tmp_path / "store"
    make_dir(store / "toy")
    make_tgz(store / "toy.tar.gz")
    assert resolve_in_store(store, "toy") == (store / "toy").resolve()
    assert resolve_in_store(store, "toy.tar.gz") == (store / "toy.tar.gz").resolve()
    for name in (".", "", "toy/.."):
        with pytest.raises(ServingError) as info:
            resolve_in_store(store, name)
        # TorchServe's ModelNotFoundException (404): the store itself is no archive
        assert info.value.code is Code.NOT_FOUND


def test_an_archive_may_not_bring_the_directory_requirements_are_installed_into(tmp_path: Path) -> None:
    src = make_dir(tmp_path / "toy")
    (src / ".mariner-requirements").mkdir()
    (src / ".mariner-requirements" / "numpy.py").write_text("raise SystemExit\n")
    assert "reserved" in refused(src, tmp_path / "work").message


def test_models_all_finds_every_layout_and_bare_names_find_directories(tmp_path: Path) -> None:
    store = tmp_path / "store"
    make_dir(store / "plain")
    make_dir(store / "wrapped" / "inner")
    make_tgz(store / "toy.tar.gz")
    (store / "toy.mar").write_bytes(b"PK")
    (store / "notes").mkdir()  # no manifest: not an archive
    (store / "index.json").write_text("{}")
    (store / ".hidden.mar").write_bytes(b"PK")
    assert store_archives(store) == ["plain", "toy.mar", "toy.tar.gz", "wrapped"]
    assert archive_file_name(store, "plain") == "plain"
    assert archive_file_name(store, "toy.tar.gz") == "toy.tar.gz"
    assert archive_file_name(store, "digits") == "digits.mar"
