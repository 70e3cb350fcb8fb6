"""Shared-memory segments: where the worker wire's big buffers travel (`worker_wire.py`).

A sender creates and fills one segment per buffer; the frame's header names them (`ShmRef`); the
receiver copies each out and unlinks it (`take_segment`); a sender unlinks what it sent on a
connection that closed (`SentSegments`). Apart from the frames because this module keeps a
segment's life from creation to unlink and never sees a message, while `worker_wire` decides which
buffers leave the pickle, names their segments and says when a frame may be written.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from multiprocessing import resource_tracker, shared_memory

log = logging.getLogger("mariner.worker")


@dataclass(frozen=True)
class ShmRef:
    """One segment as a frame's header names it: its name and how many bytes it holds."""

    name: str
    size: int


def _untrack(name: str) -> None:  # `name` as SharedMemory keeps it: with its leading "/"
    # The creator hands the segment to the peer, which unlinks it: this process's resource
    # tracker must not unlink it (or warn about it) when this process exits.
    with contextlib.suppress(Exception):
        resource_tracker.unregister(name, "shared_memory")


def _view(shm: shared_memory.SharedMemory) -> memoryview:
    """The segment's bytes (typeshed types `buf` Optional: it is None only after close())."""
    buf = shm.buf
    if buf is None:
        raise RuntimeError(f"shared memory {shm.name} is already closed")
    return buf


def _fill(name: str, view: memoryview) -> None:
    """Create segment `name` holding `view`. Written with pwrite, which copies in the kernel with
    the GIL released, so a thread can fill segments while the event loop goes on
    (`worker_wire.write_message`)."""
    shm = shared_memory.SharedMemory(name=name, create=True, size=max(1, view.nbytes))
    try:
        _untrack(shm._name)  # type: ignore[attr-defined]  # private: the name with its leading "/"
        fd: int = shm._fd  # type: ignore[attr-defined]  # private: the segment's descriptor
        done = 0
        while done < view.nbytes:
            done += os.pwrite(fd, view[done:], done)
    finally:
        shm.close()


def fill_segments(fills: Sequence[tuple[str, memoryview]]) -> None:
    """Create and fill each (name, bytes) segment a frame names, on the calling thread."""
    for name, view in fills:
        _fill(name, view)


def take_segment(ref: ShmRef) -> bytearray:
    """The receiver's half: copy segment `ref` out and unlink it."""
    shm = shared_memory.SharedMemory(name=ref.name)
    try:
        return bytearray(_view(shm)[: ref.size])
    finally:
        shm.close()
        shm.unlink()  # also drops the tracker registration the attach made


def unlink_segments(names: Iterable[str]) -> int:
    """Unlink segments this process sent but the peer may never read; returns how many existed."""
    gone = 0
    for name in names:
        try:
            shm = shared_memory.SharedMemory(name=name)
        except FileNotFoundError:
            continue
        shm.close()
        shm.unlink()
        gone += 1
    return gone


class SentSegments:
    """The shared-memory segments one side sent on one connection and the peer may not have read
    yet. Pruned as the peer unlinks them; what is left when the connection ends is unlinked."""

    def __init__(self) -> None:
        self._names: set[str] = set()

    def add(self, refs: Sequence[ShmRef]) -> None:
        if not refs:
            return
        self._names.update(r.name for r in refs)
        if len(self._names) > 64:
            self._names = {n for n in self._names if os.path.exists(f"/dev/shm/{n}")}

    def discard(self, refs: Sequence[ShmRef]) -> None:
        self._names.difference_update(r.name for r in refs)

    def release(self) -> int:
        names, self._names = self._names, set()
        return unlink_segments(names)


async def fill_segments_off_loop(fills: Sequence[tuple[str, memoryview]]) -> None:
    """`fill_segments` in a thread, off the event loop; a cancelled caller leaves no segment
    behind (what the thread goes on creating is unlinked once it is done)."""
    filled = asyncio.get_running_loop().run_in_executor(None, fill_segments, fills)
    try:
        await asyncio.shield(filled)
    except asyncio.CancelledError:
        # The thread goes on creating segments; unlink them once it is done, as nobody reads them.
        filled.add_done_callback(functools.partial(_unlink_filled, fills))
        raise


def _unlink_filled(fills: Sequence[tuple[str, memoryview]], filled: asyncio.Future[None]) -> None:
    if not filled.cancelled() and filled.exception() is not None:
        log.debug("filling shared memory failed after its call was cancelled: %s", filled.exception())
    unlink_segments(name for name, _ in fills)
