"""Archive checks: hostile .mar files are refused before anything is unpacked or imported."""

from __future__ import annotations

import hashlib
import json
import os
import stat
import zipfile
from pathlib import Path

import pytest

from mariner.server.common.archive import ArchiveLimits, open_archive, resolve_in_store
from mariner.server.common.archive_fields import handler_file, inside
from mariner.server.contracts.errors import Code, ServingError

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


def sha256_of(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


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
    big = make_mar(tmp_path / "big.mar", [("zeros.bin", b"\0" * 200_000)])
    # Refused on the size its central directory declares, before a byte is written.
    with pytest.raises(ServingError, match="declares 200000 bytes unpacked, more than the limit of 100000"):
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
    assert resolve_in_store(store, str(store / "toy.mar")) == store / "toy.mar"  # absolute, inside
    # Refused as TorchServe answers them: ModelNotFoundException (404), never a file elsewhere.
    for name, says in (
        ("https://example.com/toy.mar", "does not match any allowed URL(s)"),
        ("file:///etc/passwd", "does not match any allowed URL(s)"),
        ("../outside.mar", "Relative path is not allowed in url"),
        ("sub/../../outside.mar", "Relative path is not allowed in url"),
        (str(tmp_path / "outside.mar"), "Model not found at"),
        ("missing.mar", "Model not found at"),
        ("", "empty url"),
    ):
        with pytest.raises(ServingError) as info:
            resolve_in_store(store, name)
        assert info.value.code is Code.NOT_FOUND, name
        assert info.value.torchserve is not None
        assert info.value.torchserve.type == "ModelNotFoundException"
        assert says in info.value.torchserve.message, name


def test_a_symlinked_store_entry_is_served_from_its_target(tmp_path: Path) -> None:
    """The store is the operator's: TorchServe's harness (marsgen) symlinks archives into it, and
    Kubernetes ConfigMap/Secret volumes are trees of symlinks (`x.mar -> ..data/x.mar`). The
    entry is served under its own name; its target is checked as any archive."""
    elsewhere = tmp_path / "built"
    elsewhere.mkdir()
    make_mar(elsewhere / "toy-1.mar")
    store = tmp_path / "store"
    (store / "..2026_01_01").mkdir(parents=True)
    (store / "..2026_01_01" / "toy.mar").symlink_to(elsewhere / "toy-1.mar")
    (store / "..data").symlink_to("..2026_01_01")
    (store / "toy.mar").symlink_to("..data/toy.mar")  # a ConfigMap volume's layout
    (store / "direct.mar").symlink_to(elsewhere / "toy-1.mar")  # marsgen's layout
    for name in ("toy.mar", "direct.mar"):
        path = resolve_in_store(store, name)
        assert path == store / name, "the entry, not its target, names the model"
        archive = open_archive(path, tmp_path / "work", expected_sha256=sha256_of(elsewhere / "toy-1.mar"))
        assert archive.path.name == name
        assert (archive.model_dir / "MAR-INF" / "MANIFEST.json").is_file()
    with pytest.raises(ServingError) as info:  # the pin still covers the target's bytes
        open_archive(store / "toy.mar", tmp_path / "work", expected_sha256="0" * 64)
    assert info.value.code is Code.PERMISSION_DENIED


def test_a_symlinked_entry_is_still_checked_as_an_archive(tmp_path: Path) -> None:
    store = tmp_path / "store"
    store.mkdir()
    (tmp_path / "passwd").write_text("root:x:0:0\n")
    (store / "evil.mar").symlink_to(tmp_path / "passwd")
    os.mkfifo(tmp_path / "fifo")
    (store / "fifo.mar").symlink_to(tmp_path / "fifo")
    (store / "dangling.mar").symlink_to(tmp_path / "nothing.mar")
    with pytest.raises(ServingError) as info:
        open_archive(resolve_in_store(store, "evil.mar"), tmp_path / "work")
    assert info.value.code is Code.INVALID_ARGUMENT
    assert "refused" in info.value.message
    with pytest.raises(ServingError) as info:  # a FIFO is neither file nor directory: never opened
        resolve_in_store(store, "fifo.mar")
    assert info.value.code is Code.NOT_FOUND
    with pytest.raises(ServingError) as info:  # swapped for a FIFO after the name was resolved
        open_archive(store / "fifo.mar", tmp_path / "work")
    assert "not a regular file" in info.value.message
    with pytest.raises(ServingError) as info:
        resolve_in_store(store, "dangling.mar")
    assert info.value.code is Code.NOT_FOUND
    assert list((tmp_path / "work").iterdir()) == []


def _manifest(**model: object) -> dict:
    return {"model": {**MANIFEST["model"], **model}}


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("handler", "../evil.py"),
        ("handler", "../../../../../../../../tmp/evil.py:handle"),
        ("handler", "/tmp/evil.py"),
        ("handler", "sub/../../evil"),
        ("serializedFile", "../weights.bin"),
        ("modelFile", "/etc/passwd"),
        ("requirementsFile", "../../requirements.txt"),
        ("extraFiles", "helper.py,../../outside.py"),
        ("extraFiles", ["helper.py", "/abs/outside.py"]),
        ("configFile", "../model-config.yaml"),
    ],
)
def test_a_file_named_outside_the_archive_is_refused(tmp_path: Path, field: str, value: object) -> None:
    mar = make_mar(tmp_path / "esc.mar", manifest=_manifest(**{field: value}))
    with pytest.raises(ServingError) as info:
        open_archive(mar, tmp_path / "work")
    assert info.value.code is Code.INVALID_ARGUMENT
    assert "esc.mar" in info.value.message
    assert f"model.{field}" in info.value.message or field in info.value.message
    assert "outside the archive" in info.value.message or "missing" in info.value.message
    assert not any((tmp_path / "work").iterdir()), "a refused archive leaves nothing unpacked"


@pytest.mark.parametrize(
    "handler", ["toy_handler", "toy_handler:handle", "toy_handler.py:handle", "a.b.c:fn"]
)
def test_a_handler_given_as_a_module_name_is_not_a_path(tmp_path: Path, handler: str) -> None:
    a = open_archive(make_mar(tmp_path / "toy.mar", manifest=_manifest(handler=handler)), tmp_path / "work")
    assert a.handler == handler


def test_a_symlink_out_of_the_archive_dir_counts_as_outside(tmp_path: Path) -> None:
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (tmp_path / "secret.py").write_text("x = 1\n")
    (model_dir / "link.py").symlink_to(tmp_path / "secret.py")
    (model_dir / "real.py").write_text("")
    assert inside(model_dir, "real.py") == (model_dir / "real.py").resolve()
    assert inside(model_dir, "link.py") is None
    assert handler_file("pkg.mod:fn") == "pkg.mod.py"
    assert handler_file("h.py:fn") == "h.py"


@pytest.mark.parametrize(
    ("raw", "says"),
    [
        (b"{not json", "is not valid JSON (Expecting property name enclosed in double quotes at line 1"),
        (b"\xff\xfe", "is not UTF-8 text"),
        (b"[1, 2]", "must be a JSON object, got list"),
        (b'{"model": "toy"}', 'must have a "model" object'),
        (b'{"model": {"handler": 3}}', "model.handler must be a string, got 3"),
        (b'{"model": {"handler": ""}}', "names no handler"),
        (b'{"model": {"handler": "h.py", "modelName": "a/b"}}', "model.modelName 'a/b' is not allowed"),
        (
            b'{"model": {"handler": "h.py", "modelVersion": true}}',
            "model.modelVersion must be a string or a number",
        ),
        (b'{"model": {"handler": "h.py", "serializedFile": ["w"]}}', "model.serializedFile must be a string"),
        (b'{"model": {"handler": "h.py", "extraFiles": 7}}', "model.extraFiles must be a comma-separated"),
    ],
)
def test_a_malformed_manifest_is_refused_saying_what_is_wrong(tmp_path: Path, raw: bytes, says: str) -> None:
    with zipfile.ZipFile(tmp_path / "bad.mar", "w") as zf:
        zf.writestr("MAR-INF/MANIFEST.json", raw)
        zf.writestr("h.py", "")
    with pytest.raises(ServingError) as info:
        open_archive(tmp_path / "bad.mar", tmp_path / "work")
    assert info.value.code is Code.INVALID_ARGUMENT
    assert info.value.message.startswith("archive bad.mar: ")
    assert says in info.value.message


def test_a_numeric_model_version_is_read_as_text(tmp_path: Path) -> None:
    a = open_archive(make_mar(tmp_path / "toy.mar", manifest=_manifest(modelVersion=2)), tmp_path / "work")
    assert a.version == "2"


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("batchSize: [1\n", "is not valid YAML"),
        ("- 1\n- 2\n", "model-config is not a mapping (got list)"),
        ("1: 2\n", "model-config keys must be strings, got 1"),
    ],
)
def test_a_malformed_model_config_is_refused_saying_what_is_wrong(
    tmp_path: Path, text: str, says: str
) -> None:
    manifest = _manifest(configFile="c.yaml")
    mar = make_mar(tmp_path / "bad.mar", [("c.yaml", text.encode())], manifest=manifest)
    with pytest.raises(ServingError) as info:
        open_archive(mar, tmp_path / "work")
    assert info.value.code is Code.INVALID_ARGUMENT
    assert "bad.mar" in info.value.message
    assert says in info.value.message
