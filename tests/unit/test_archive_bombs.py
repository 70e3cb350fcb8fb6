"""Zip and gzip bombs are refused on what they declare before a byte is written, and stopped at
the cap while streaming when their declarations lie (common/archive_budget.py)."""

from __future__ import annotations

import gzip
import io
import json
import struct
import tarfile
import time
import zipfile
from pathlib import Path

import pytest

from mariner.server.common.archive import ArchiveLimits, open_archive
from mariner.server.common.archive_budget import Budget, GzipGuard
from mariner.server.common.archive_formats import copy_directory, extract_file
from mariner.server.contracts.errors import ServingError

pytestmark = pytest.mark.unit

MIB = 1 << 20
SMALL = ArchiveLimits(max_unpacked_bytes=16 * MIB)
MANIFEST = json.dumps({"model": {"modelName": "bomb", "modelVersion": "1.0", "handler": "h.py"}})
HANDLER = "def handle(data, context):\n    return data\n"


def zip_bomb(path: Path, zeros: int = 64 * MIB, members: int = 1) -> Path:
    """A valid .mar whose `members` members are `zeros` zero bytes each, deflated (~1,000:1)."""
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("MAR-INF/MANIFEST.json", MANIFEST)
        zf.writestr("h.py", HANDLER)
        for i in range(members):
            with zf.open(f"zeros{i}.bin", "w", force_zip64=False) as f:
                for _ in range(zeros // MIB):
                    f.write(bytes(MIB))
    return path


def patch_declared_sizes(path: Path, member_prefix: str, size: int) -> None:
    """Rewrite the uncompressed size the central directory declares for members whose name
    starts with `member_prefix` (what zipfile and the declared-size check read)."""
    data = bytearray(path.read_bytes())
    at = data.find(b"PK\x01\x02")
    while at >= 0:
        name_len = struct.unpack_from("<H", data, at + 28)[0]
        name = bytes(data[at + 46 : at + 46 + name_len]).decode()
        if name.startswith(member_prefix):
            struct.pack_into("<I", data, at + 24, size)
        at = data.find(b"PK\x01\x02", at + 46)
    path.write_bytes(bytes(data))


def tgz_bomb(path: Path, zeros: int = 64 * MIB, members: int = 1) -> Path:
    """A gzip'd tar (the tgz layout) with `members` members of `zeros` zero bytes each."""
    with tarfile.open(path, "w:gz") as tf:
        small = (("bomb/MAR-INF/MANIFEST.json", MANIFEST.encode()), ("bomb/h.py", HANDLER.encode()))
        for name, data in small:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
        for i in range(members):
            info = tarfile.TarInfo(f"bomb/zeros{i}.bin")
            info.size = zeros
            tf.addfile(info, io.BytesIO(bytes(zeros)))
    return path


def tree_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file()) if root.exists() else 0


def refuse(path: Path, work: Path, limits: ArchiveLimits | None = None) -> tuple[str, float]:
    t0 = time.perf_counter()
    with pytest.raises(ServingError) as info:
        open_archive(path, work, limits=limits)
    elapsed = time.perf_counter() - t0
    assert list(work.iterdir()) == [], "a refused archive leaves no unpacked directory"
    return info.value.message, elapsed


def test_a_zip_declaring_more_than_the_cap_is_refused_before_writing(tmp_path: Path) -> None:
    bomb = zip_bomb(tmp_path / "bomb.mar")
    message, elapsed = refuse(bomb, tmp_path / "work", SMALL)
    print(f"64 MiB zip bomb ({bomb.stat().st_size} bytes) refused in {elapsed * 1000:.1f} ms")
    assert f"declares {64 * MIB} bytes unpacked, more than the limit of {16 * MIB}" in message
    with zipfile.ZipFile(bomb) as zf:  # what the check read: the central directory's sizes
        assert sum(i.file_size for i in zf.infolist()) > SMALL.max_unpacked_bytes


def test_members_each_under_the_cap_but_over_it_in_all_are_refused(tmp_path: Path) -> None:
    bomb = zip_bomb(tmp_path / "many.mar", zeros=6 * MIB, members=3)
    limits = ArchiveLimits(max_unpacked_bytes=16 * MIB, max_ratio=10_000)
    message, _ = refuse(bomb, tmp_path / "work", limits)
    assert "declare 18874" in message
    assert f"in all, more than the limit of {16 * MIB}" in message


def test_a_zip_bomb_under_the_cap_is_refused_on_its_ratio(tmp_path: Path) -> None:
    bomb = zip_bomb(tmp_path / "bomb.mar")
    message, elapsed = refuse(bomb, tmp_path / "work")  # default limits: a 4 GiB cap
    print(f"64 MiB zip bomb refused on its ratio in {elapsed * 1000:.1f} ms")
    assert "(about 10" in message
    assert "more than the limit of 100:1" in message
    assert "zip bomb" in message
    # Many members, each under the grace, are refused on the whole archive's ratio.
    spread = zip_bomb(tmp_path / "spread.mar", zeros=8 * MIB, members=4)
    message, _ = refuse(spread, tmp_path / "work2")
    assert "in all (a zip bomb?)" in message


def test_a_declared_size_that_lies_is_stopped_while_streaming(tmp_path: Path) -> None:
    bomb = zip_bomb(tmp_path / "liar.mar", zeros=8 * MIB)
    patch_declared_sizes(bomb, "zeros", 1000)  # declares 1,000 bytes, holds 8 MiB
    dest = tmp_path / "dest"
    dest.mkdir()
    with bomb.open("rb") as f, pytest.raises((ValueError, zipfile.BadZipFile)):
        extract_file(f, dest, ArchiveLimits())
    assert tree_bytes(dest) <= 1000 + len(MANIFEST) + len(HANDLER), "no more than declared is written"
    message, _ = refuse(bomb, tmp_path / "work")
    assert "liar.mar refused" in message


def test_budget_copy_stops_at_the_declared_size_and_at_the_cap() -> None:
    out = io.BytesIO()
    with pytest.raises(ValueError, match="more than the 1000 bytes it declares"):
        Budget(ArchiveLimits()).copy(io.BytesIO(bytes(5 * MIB)), out, name="m", declared=1000)
    assert out.tell() == 0, "the chunk past the declared size is not written"
    out = io.BytesIO()
    with pytest.raises(ValueError, match="past the limit of 3145728 bytes"):
        Budget(ArchiveLimits(max_unpacked_bytes=3 * MIB)).copy(io.BytesIO(bytes(8 * MIB)), out, name="m")
    assert out.tell() <= 3 * MIB


def test_a_tgz_member_declaring_more_than_the_cap_is_refused_before_writing(tmp_path: Path) -> None:
    bomb = tgz_bomb(tmp_path / "bomb.tar.gz")
    message, elapsed = refuse(bomb, tmp_path / "work", SMALL)
    print(f"64 MiB tgz bomb refused on its tar header in {elapsed * 1000:.1f} ms")
    assert f"'bomb/zeros0.bin' declares {64 * MIB} bytes" in message
    assert f"limit of {16 * MIB} unpacked bytes" in message


def test_a_tgz_bomb_under_the_cap_is_stopped_on_its_gzip_ratio(tmp_path: Path) -> None:
    bomb = tgz_bomb(tmp_path / "bomb.tar.gz", zeros=256 * MIB)
    dest = tmp_path / "dest"
    dest.mkdir()
    t0 = time.perf_counter()
    with bomb.open("rb") as f, pytest.raises(ValueError, match="gzip bomb") as info:
        extract_file(f, dest, ArchiveLimits())
    elapsed = time.perf_counter() - t0
    written = tree_bytes(dest)
    print(f"256 MiB tgz bomb stopped after {written} bytes written in {elapsed * 1000:.1f} ms: {info.value}")
    assert written <= ArchiveLimits().ratio_grace_bytes + 2 * MIB


def test_the_gzip_stream_is_capped_whatever_the_ratio(tmp_path: Path) -> None:
    limits = ArchiveLimits(max_unpacked_bytes=MIB, max_members=1, max_ratio=10**9)
    guard = GzipGuard(io.BytesIO(gzip.compress(bytes(64 * MIB))), limits)
    read = 0

    def drain() -> None:
        nonlocal read
        while chunk := guard.read(10240):
            read += len(chunk)

    with pytest.raises(ValueError, match="decompresses past"):
        drain()
    assert MIB < guard.cap < MIB + 16 * 1024, "the cap is the bytes plus tar headers"
    assert read <= guard.cap, "nothing past the cap is handed on"


def test_a_directory_file_over_what_is_left_is_refused_before_copying(tmp_path: Path) -> None:
    src = tmp_path / "src"
    (src / "MAR-INF").mkdir(parents=True)
    (src / "MAR-INF" / "MANIFEST.json").write_text(MANIFEST)
    with (src / "big.bin").open("wb") as f:
        f.truncate(64 * MIB)  # sparse: its size, not its blocks, is what counts
    dest = tmp_path / "dest"
    dest.mkdir()
    with pytest.raises(ValueError, match=f"'big.bin' declares {64 * MIB} bytes"):
        copy_directory(src, dest, SMALL)
    assert not (dest / "big.bin").exists()
