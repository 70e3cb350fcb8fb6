"""A TorchServe prediction answered in parts over HTTP, as TorchServe's frontend streams it.

A handler that sends intermediate answers (`send_intermediate_predict_response`) gets a chunked
HTTP answer (`Transfer-Encoding: chunked`): the first part opens the response with its status
and headers and is its first chunk, each further part is one chunk, and the final result is the
last chunk (TorchServe's RestJob). A request whose handler sends no part is answered as before,
in one piece with a Content-Length.

`ChunkedAnswer` is the request's sink (`frontend.streams`): the worker connection hands it each part
as it arrives, and a writer task (started by the first part) sends them while the request still
waits for its final result, which the endpoint hands over with `end`. What goes wrong:

- a first part with an error status is the whole answer, as TorchServe's sendError makes it;
  what follows is dropped;
- the handler failing after parts were sent, an error part then, or more than
  `frontend.streams.MAX_HELD_BYTES` of parts waiting for a client that reads slower than the handler
  writes: the answer is cut (no last chunk, the connection closed), so the client sees a
  truncated stream rather than a complete-looking one, and the server logs why;
- the client going away: the call is cancelled as any other (the request leaves the batcher's
  care once its batch ends) and the writer stops.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from mariner.server.contracts.types import InferResult
from mariner.server.frontend.protocols.torchserve.answer_check import sendable
from mariner.server.frontend.streams import MAX_HELD_BYTES, too_much_held

log = logging.getLogger("mariner.http")

# Builds the status and headers of an answer (the same as for one sent in one piece).
Head = Callable[[InferResult, str], tuple[int, Mapping[str, str]]]


def _failed(part: InferResult) -> bool:
    return not 100 <= part.status < 400


class ChunkedAnswer:
    """One /predictions request's intermediate answers, written as HTTP chunks (module docstring).

    Made for every prediction, so it costs two attributes until a first part arrives.
    """

    __slots__ = (
        "_cut",
        "_ended",
        "_final",
        "_head",
        "_held",
        "_parts",
        "_request_id",
        "_send",
        "_wake",
        "_writer",
    )
    # Set by the first part (until then only `_send`, `_request_id`, `_head` and `_writer`).
    _parts: deque[InferResult]
    _held: int
    _cut: str | None  # why the answer is cut now (what waits is dropped)
    _ended: bool  # the call ended: `_final` is the last chunk, None to cut after what waits
    _final: InferResult | None
    _wake: asyncio.Event

    def __init__(self, send: Send, request_id: str, head: Head) -> None:
        self._send = send
        self._request_id = request_id
        self._head = head
        self._writer: asyncio.Task[None] | None = None

    @property
    def started(self) -> bool:
        """A part arrived: the answer is (being) streamed, not sent in one piece."""
        return self._writer is not None

    # -- parts, from the worker connection's reader ------------------------------------------
    def partial(self, part: InferResult) -> None:
        if self._writer is None:
            self._parts = deque()
            self._held = 0
            self._cut = None
            self._ended = False
            self._final = None
            self._wake = asyncio.Event()
            self._writer = asyncio.get_running_loop().create_task(self._write(), name="chunked-answer")
        elif self._cut is not None or self._writer.done():
            return
        self._held += len(part.body)
        if self._held > MAX_HELD_BYTES:
            self._stop(too_much_held(self._held))
            return
        self._parts.append(part)
        self._wake.set()

    def _stop(self, why: str) -> None:
        if self._cut is None:
            log.warning("streamed answer to request %s cut: %s", self._request_id, why)
            self._cut = why
            self._parts.clear()
            self._held = 0
        self._wake.set()

    # -- the end, from the endpoint ----------------------------------------------------------
    def end(self, final: InferResult | None, why: str = "") -> Response:
        """The response that finishes the answer: `final` as its last chunk, or, with None (the
        call failed after parts were sent; `why` says how), the answer cut short."""
        if final is None and self._cut is None:
            log.warning("streamed answer to request %s cut after the parts sent: %s", self._request_id,
                        why or "the call failed")  # fmt: skip
        self._ended = True
        self._final = final
        self._wake.set()
        return _Finish(self)

    async def finish(self) -> None:
        """Wait until the writer is done (it never raises; a cancelled one is simply done)."""
        if self._writer is not None:
            await asyncio.wait({self._writer})

    def abandon(self) -> None:
        """The client is gone: stop writing (nothing to warn about)."""
        if self._writer is not None:
            self._cut = self._cut or "the client went away"
            self._writer.cancel()

    # -- the writer --------------------------------------------------------------------------
    async def _write(self) -> None:
        send, opened = self._send, False
        try:
            while True:
                while self._parts and self._cut is None:
                    part = self._parts.popleft()
                    self._held -= len(part.body)
                    if not opened:
                        opened = True
                        part = sendable(part, self._request_id, streamed=True)
                        await self._open(part)
                        if _failed(part):  # the whole answer, as TorchServe's sendError
                            await send({"type": "http.response.body", "body": part.body})
                            return
                    elif _failed(part):
                        self._stop(f"the handler sent an error part ({part.status}) mid-stream")
                        break
                    await send({"type": "http.response.body", "body": part.body, "more_body": True})
                if self._cut is not None:
                    return  # no last chunk: the client sees the answer cut short
                if self._ended and not self._parts:
                    if self._final is not None:
                        await send({"type": "http.response.body", "body": self._final.body})
                    return  # without a final result: cut after the parts, as above
                self._wake.clear()
                await self._wake.wait()
        except Exception:  # a failed write: the connection is gone or broken
            log.warning("writing the streamed answer to request %s failed", self._request_id, exc_info=True)

    async def _open(self, first: InferResult) -> None:
        status, headers = self._head(first, self._request_id)
        raw: list[tuple[bytes, bytes]] = [
            (k.lower().encode("latin-1"), v.encode("latin-1", errors="replace")) for k, v in headers.items()
        ]
        await self._send({"type": "http.response.start", "status": status, "headers": raw})


class _Finish(Response):
    """What the endpoint returns for a streamed answer: the writer sends the rest."""

    def __init__(self, answer: ChunkedAnswer) -> None:  # no body, no headers of its own
        self._answer = answer

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._answer.finish()


def asgi_send(request: Any) -> Send:
    """The ASGI `send` of a Starlette request: a streamed answer starts while the endpoint still
    waits for the final result, so its writer sends directly (Starlette keeps it as `_send`)."""
    send: Send = request._send
    return send
