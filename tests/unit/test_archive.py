"""Archive checks: hostile .mar files are refused before anything is unpacked or imported."""

from __future__ import annotations

import json
import stat
import zipfile
from pathlib import Path

import pytest

from mariner.server.core.archive import ArchiveLimits, open_archive, resolve_in_store
from mariner.server.core.errors import Code, ServingError

pytestmark = pytest.mark.unit

MANIFEST = {
    "model": {
        "modelName": "toy",
        "modelVersion": "2.0",
        "handler": "toy_handler.py",
        "serializedFile": "weights.bin",
        "configFile": "model-config.yaml",
    }
}


def make_mar(
    path: Path, extra: list[tuple[zipfile.ZipInfo | str, bytes]] = (), manifest: dict | None = None
) -> Path:
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("MAR-INF/MANIFEST.json", json.dumps(manifest or MANIFEST))
        zf.writestr("toy_handler.py", "def handle(data, context):\n    return data\n")
        zf.writestr("weights.bin", b"\0" * 10)
        zf.writestr("model-config.yaml", "batchSize: 4\nmaxBatchDelay: 7\nhandler:\n  format: x\n")
        for name, data in extra:
            zf.writestr(name, data)
    return path


def test_a_clean_archive_is_unpacked_with_manifest_and_config(tmp_path: Path) -> None:
    mar = make_mar(tmp_path / "toy.mar")
    a = open_archive(mar, tmp_path / "work")
    assert (a.name, a.version, a.handler) == ("toy", "2.0", "toy_handler.py")
    assert a.model_config["batchSize"] == 4
    assert (a.model_dir / "weights.bin").read_bytes() == b"\0" * 10
    assert a.model_dir.is_relative_to(tmp_path / "work")
    assert len(a.sha256) == 64


@pytest.mark.parametrize(
    "member", ["/etc/evil.py", "../evil.py", "a/../../evil.py", "C:/evil.py", "a\\..\\evil.py"]
)
def test_escaping_member_names_are_refused(tmp_path: Path, member: str) -> None:
    mar = make_mar(tmp_path / "bad.mar", [(member, b"x")])
    with pytest.raises(ServingError) as info:
        open_archive(mar, tmp_path / "work")
    assert info.value.code is Code.INVALID_ARGUMENT
    assert "bad.mar" in info.value.message
    assert not any((tmp_path / "work").iterdir()), "a refused archive leaves nothing unpacked"


def test_symlink_members_are_refused(tmp_path: Path) -> None:
    link = zipfile.ZipInfo("link.py")
    link.external_attr = (stat.S_IFLNK | 0o777) << 16
    mar = make_mar(tmp_path / "bad.mar", [(link, b"/etc/passwd")])
    with pytest.raises(ServingError, match="symlink"):
        open_archive(mar, tmp_path / "work")


def test_member_count_and_unpacked_size_are_capped(tmp_path: Path) -> None:
    many = make_mar(tmp_path / "many.mar", [(f"f{i}.txt", b"x") for i in range(20)])
    with pytest.raises(ServingError, match="members"):
        open_archive(many, tmp_path / "work", limits=ArchiveLimits(max_members=10))
    big = make_mar(tmp_path / "big.mar", [("zeros.bin", b"\0" * 200_000)])  # compresses to ~200 bytes
    with pytest.raises(ServingError, match="unpacks to more"):
        open_archive(big, tmp_path / "work", limits=ArchiveLimits(max_unpacked_bytes=100_000))


def test_sha256_pin_refuses_a_different_archive(tmp_path: Path) -> None:
    mar = make_mar(tmp_path / "toy.mar")
    with pytest.raises(ServingError) as info:
        open_archive(mar, tmp_path / "work", expected_sha256="0" * 64)
    assert info.value.code is Code.PERMISSION_DENIED
    assert "pinned" in info.value.message
    good = open_archive(mar, tmp_path / "work2", expected_sha256=open_archive(mar, tmp_path / "w3").sha256)
    assert good.name == "toy"


def test_missing_manifest_or_handler_is_refused(tmp_path: Path) -> None:
    with zipfile.ZipFile(tmp_path / "nomanifest.mar", "w") as zf:
        zf.writestr("x.py", "")
    with pytest.raises(ServingError, match="MANIFEST"):
        open_archive(tmp_path / "nomanifest.mar", tmp_path / "work")
    no_handler = make_mar(tmp_path / "nohandler.mar", manifest={"model": {"modelName": "x"}})
    with pytest.raises(ServingError, match="handler"):
        open_archive(no_handler, tmp_path / "work")
    (tmp_path / "notzip.mar").write_bytes(b"not a zip")
    with pytest.raises(ServingError, match="refused"):
        open_archive(tmp_path / "notzip.mar", tmp_path / "work")


def test_archives_resolve_only_inside_the_store(tmp_path: Path) -> None:
    store = tmp_path / "store"
    store.mkdir()
    make_mar(store / "toy.mar")
    make_mar(tmp_path / "outside.mar")
    assert resolve_in_store(store, "toy.mar") == (store / "toy.mar").resolve()
    for name, code in (
        ("https://example.com/toy.mar", Code.PERMISSION_DENIED),
        ("../outside.mar", Code.PERMISSION_DENIED),
        (str(tmp_path / "outside.mar"), Code.PERMISSION_DENIED),
        ("missing.mar", Code.NOT_FOUND),
    ):
        with pytest.raises(ServingError) as info:
            resolve_in_store(store, name)
        assert info.value.code is code, name
