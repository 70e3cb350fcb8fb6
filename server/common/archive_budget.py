"""How much an archive may unpack to, checked twice: on what it declares, then on what it writes.

A zip bomb made a register write 4 GiB before the streamed byte count refused it (21 s of disk
and a victim model's throughput falling from ~140 to 10-40 req/s), so a zip is refused on its
central directory before a byte is written: any member's declared size or their sum over
`max_unpacked_bytes`, or a member (or the whole archive) that inflates more than `max_ratio`
times its compressed size once past `ratio_grace_bytes`. Declared sizes can lie, so every copy
still counts the bytes it really writes, per member and in total, and stops at the cap.

A gzip'd tar declares nothing up front: each tar header's size is checked before its data is
written, and the gzip stream is read through `GzipGuard`, which counts compressed bytes in and
decompressed bytes out and stops as soon as the ratio or the cap is passed, so a tgz bomb
costs at most `ratio_grace_bytes` of work, never the whole cap.

Every refusal is a ValueError saying what the archive declared or produced and the limit.
"""

from __future__ import annotations

import gzip
import hashlib
import zipfile
from dataclasses import dataclass
from typing import IO, cast

__all__ = ["ArchiveLimits", "Budget", "GzipGuard", "check_zip_declared"]

_CHUNK = 1 << 20
# A tar stream carries a 512-byte header and up to 511 bytes of padding per member, and two
# zero blocks (plus up to a 10 KiB record) at its end, on top of the members' bytes.
_TAR_OVERHEAD_PER_MEMBER = 1024
_TAR_OVERHEAD_END = 20 * 512


@dataclass(frozen=True)
class ArchiveLimits:
    """Caps on one archive. `max_ratio` (unpacked bytes per compressed byte) applies once a
    member, or the archive in all, unpacks to more than `ratio_grace_bytes`: model weights
    compress about 1.1:1 and text about 10:1, while deflate's best on zeros is ~1,030:1."""

    max_members: int = 10_000
    max_unpacked_bytes: int = 4 << 30
    max_ratio: int = 100
    ratio_grace_bytes: int = 16 << 20


class Budget:
    """What is left of the member count and the unpacked bytes; ValueError once either runs out."""

    def __init__(self, limits: ArchiveLimits) -> None:
        self._limits = limits
        self.members = 0
        self.bytes_left = limits.max_unpacked_bytes

    def member(self) -> None:
        self.members += 1
        if self.members > self._limits.max_members:
            raise ValueError(f"more than the limit of {self._limits.max_members} members")

    def declared(self, name: str, size: int) -> None:
        """Refuse a member whose declared size does not fit in what is left, before writing it."""
        if size > self.bytes_left:
            cap = self._limits.max_unpacked_bytes
            raise ValueError(
                f"member {name!r} declares {size} bytes, more than the {self.bytes_left} left of the "
                f"limit of {cap} unpacked bytes"
            )

    def copy(
        self,
        src: IO[bytes],
        dst: IO[bytes],
        digest: hashlib._Hash | None = None,
        *,
        name: str = "",
        declared: int | None = None,
    ) -> None:
        """Copy `src` to `dst`, counting the real bytes: declared sizes in a hostile archive can
        lie, so the total cap and the member's own declared size are checked on every chunk."""
        written = 0
        while chunk := src.read(_CHUNK):
            written += len(chunk)
            self.bytes_left -= len(chunk)
            if self.bytes_left < 0:
                raise ValueError(
                    f"member {name!r} unpacks past the limit of {self._limits.max_unpacked_bytes} bytes"
                )
            if declared is not None and written > declared:
                raise ValueError(f"member {name!r} unpacks to more than the {declared} bytes it declares")
            if digest is not None:
                digest.update(chunk)
            dst.write(chunk)


def _ratio_problem(limits: ArchiveLimits, unpacked: int, compressed: int) -> str | None:
    if unpacked <= limits.ratio_grace_bytes or unpacked <= limits.max_ratio * max(compressed, 1):
        return None
    return (
        f"{unpacked} bytes from {compressed} compressed (about {unpacked // max(compressed, 1)}:1), more "
        f"than the limit of {limits.max_ratio}:1 beyond {limits.ratio_grace_bytes} bytes"
    )


def check_zip_declared(infos: list[zipfile.ZipInfo], limits: ArchiveLimits) -> None:
    """Refuse a zip on its central directory alone: a member or the sum of members declaring
    more than the cap, or inflating past the ratio (see the module docstring)."""
    cap = limits.max_unpacked_bytes
    for info in infos:
        if info.file_size > cap:
            raise ValueError(
                f"member {info.filename!r} declares {info.file_size} bytes unpacked, more than the "
                f"limit of {cap} bytes"
            )
        problem = _ratio_problem(limits, info.file_size, info.compress_size)
        if problem is not None:
            raise ValueError(f"member {info.filename!r} declares {problem} (a zip bomb?)")
    total = sum(i.file_size for i in infos)
    if total > cap:
        raise ValueError(f"its members declare {total} bytes unpacked in all, more than the limit of {cap}")
    problem = _ratio_problem(limits, total, sum(i.compress_size for i in infos))
    if problem is not None:
        raise ValueError(f"its members declare {problem} in all (a zip bomb?)")


class _Counted:
    """A raw file read through a count of the bytes taken from it."""

    def __init__(self, f: IO[bytes]) -> None:
        self._f = f
        self.count = 0

    def read(self, n: int = -1) -> bytes:
        data = self._f.read(n)
        self.count += len(data)
        return data


class GzipGuard:
    """The decompressed bytes of a gzip stream, stopped (ValueError) once they pass the cap on a
    tar stream of the archive's limits, or the ratio to the compressed bytes read so far."""

    def __init__(self, f: IO[bytes], limits: ArchiveLimits) -> None:
        self._raw = _Counted(f)
        self._gz = gzip.GzipFile(fileobj=cast(IO[bytes], self._raw), mode="rb")
        self._limits = limits
        overhead = _TAR_OVERHEAD_PER_MEMBER * (limits.max_members + 1) + _TAR_OVERHEAD_END
        self.cap = limits.max_unpacked_bytes + overhead
        self.out = 0

    def read(self, n: int = -1) -> bytes:
        # Never one unbounded read: a bomb must be stopped within a chunk of its cap.
        data = self._gz.read(_CHUNK if n < 0 else min(n, _CHUNK))
        self.out += len(data)
        if self.out > self.cap:
            raise ValueError(
                f"its gzip stream decompresses past {self.cap} bytes (the limit of "
                f"{self._limits.max_unpacked_bytes} unpacked bytes plus tar headers)"
            )
        problem = _ratio_problem(self._limits, self.out, self._raw.count)
        if problem is not None:
            raise ValueError(f"its gzip stream decompresses to {problem} (a gzip bomb?)")
        return data

    def close(self) -> None:
        self._gz.close()
