"""One frontend's connection as a worker sees it: an `asyncio.Protocol` on the worker's socket.

Frames are split and decoded in `data_received` itself (`protocol.FrameSplitter`), not by a
reading task: the worker runs its handler on the event loop's thread, so between two batches it
gives the loop one turn, and in that turn every frame the socket held becomes a job. A reading
task would only be woken in that turn and read in the next, one batch late.

An intermediate answer is sent while the handler runs, when the loop cannot write for it:
`send_now` writes it to the socket before returning (waiting for room when the frontend reads
slower than the handler sends, which slows the handler down instead of buffering for it).
"""

from __future__ import annotations

import asyncio
import logging
import os
import select
import threading
from collections.abc import Callable
from typing import Any, cast

from mariner.server.contracts import worker_wire as protocol
from mariner.server.contracts.peer import PeerRefused, check_peer

log = logging.getLogger("mariner.worker")


class FrontendLink(asyncio.Protocol):
    """Calls `on_message(link, msg)` for each message a frontend sends and `on_lost(link)` once
    when the connection ends; `send` writes a result frame (asyncio buffers it: the frontend
    always reads). A connection whose peer is not ours is closed before any frame is read."""

    def __init__(
        self,
        what: str,
        on_message: Callable[[FrontendLink, Any], None],
        on_lost: Callable[[FrontendLink], None],
    ) -> None:
        self.what = what
        self.open = False
        self.closed = asyncio.Event()
        self.sent = protocol.SentSegments()
        self._on_message = on_message
        self._on_lost = on_lost
        self._splitter = protocol.FrameSplitter()
        self._transport: asyncio.Transport | None = None
        self._fd = -1
        self._direct = threading.Lock()  # send_now's writes, from the handler's threads

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        try:
            check_peer(transport.get_extra_info("socket"), what=self.what)
        except PeerRefused as exc:
            log.error("%s: refusing a connection: %s", self.what, exc)
            self.close()
            return
        sock = transport.get_extra_info("socket")
        self._fd = sock.fileno() if sock is not None else -1
        self.open = True

    def data_received(self, data: bytes) -> None:
        if not self.open:
            return
        try:
            messages = self._splitter.feed(data)
        except protocol.FrameError as exc:
            log.error("%s: dropping a connection that sent a bad frame: %s", self.what, exc)
            self.close()
            return
        for msg in messages:
            if not self.open:
                return
            self._on_message(self, msg)

    def eof_received(self) -> bool:
        return False  # the frontend closed its side: close ours (connection_lost follows)

    def connection_lost(self, exc: Exception | None) -> None:
        self.close()

    def send(self, frame: bytes, refs: list[protocol.ShmRef]) -> None:
        if not self.open or self._transport is None:
            protocol.unlink_segments(r.name for r in refs)
            return
        self.sent.add(refs)
        self._transport.write(frame)

    def send_now(self, frame: bytes, refs: list[protocol.ShmRef]) -> bool:
        """Write `frame` to the socket before returning, waiting for room if the frontend is
        behind: for a sender the event loop cannot serve now (the handler runs on its thread).
        False, and nothing written, when the transport still holds earlier frames unsent: the
        caller then queues it behind them (`send`) to keep the order."""
        transport = self._transport
        if not self.open or transport is None or self._fd < 0:
            protocol.unlink_segments(r.name for r in refs)
            return True
        with self._direct:
            if transport.get_write_buffer_size():
                return False
            self.sent.add(refs)
            view = memoryview(frame)
            poller: Any = None
            while view and self.open:
                try:
                    view = view[os.write(self._fd, view) :]
                except BlockingIOError:
                    if poller is None:
                        poller = select.poll()
                        poller.register(self._fd, select.POLLOUT)
                    poller.poll(1000)
                except OSError:  # the frontend is gone: the loop sees it once the handler returns
                    return True
        return True

    def end(self) -> None:
        """End the connection from this side once what is buffered is sent (the frontend then
        reads to the end and closes; `closed` is set when it has)."""
        if self.open and self._transport is not None and self._transport.can_write_eof():
            self._transport.write_eof()

    def close(self) -> None:
        if self.closed.is_set():
            return
        self.open = False
        self.closed.set()
        if self._transport is not None:
            self._transport.close()
        self.sent.release()  # results the frontend will never read
        self._on_lost(self)
