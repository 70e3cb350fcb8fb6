"""One handler call in a worker, and where its intermediate answers go.

A call runs the requests of one or more batches (each from the frontend connection that sent
it). When the handler sends an intermediate answer for one of its requests (TorchServe's
`send_intermediate_predict_response`), `deliver` finds the batch and position of that request
id and writes a `protocol.Partial` frame to that frontend at once, ahead of the batch's
`Result`:

- a plain handler runs on the event loop's thread with the loop hidden, so the loop cannot write
  for it before the call returns: the frame goes straight to the socket (`FrontendLink.send_now`,
  which waits for room when the frontend is behind, slowing the handler instead of buffering);
- a coroutine handler runs on the loop: the frame is written as any other (the loop flushes it
  at the handler's next await);
- from another thread of the handler's, the loop is asked to write it.

A part sent after its call returned, or naming a request the call does not hold, is dropped with
a log line: its request already has its answer, or is not this call's.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Sequence
from typing import Any

from mariner.server.core.types import InferResult
from mariner.server.workers import protocol

log = logging.getLogger("mariner.worker")


class HandlerCall:
    """The jobs of one handler call (each with the `conn` it came on, a FrontendLink, and its
    `batch`); `deliver(request_id, part)` is what the runner is given."""

    def __init__(
        self,
        jobs: Sequence[Any],
        *,
        what: str,
        loop: asyncio.AbstractEventLoop | None,
        loop_thread: int,
        loop_blocked: bool,
    ) -> None:
        self.jobs = jobs
        self.done = False
        self._what = what
        self._loop = loop
        self._loop_thread = loop_thread
        self._loop_blocked = loop_blocked
        self._routes: dict[str, tuple[Any, int]] | None = None

    def route(self, request_id: str) -> tuple[Any, int] | None:
        """The job and position of `request_id` (found on the first part; most calls send none)."""
        if self._routes is None:
            self._routes = {}
            for job in self.jobs:
                for index, req in enumerate(job.batch.requests):
                    self._routes.setdefault(req.request_id, (job, index))
        return self._routes.get(request_id)

    def deliver(self, request_id: str, part: InferResult) -> None:
        if self.done:
            log.warning("%s: an intermediate answer sent after its call returned is dropped", self._what)
            return
        found = self.route(request_id)
        if found is None:
            log.warning("%s: an intermediate answer names request %r, which is not one of its call's; "
                        "dropped", self._what, request_id[:100])  # fmt: skip
            return
        job, index = found
        conn = job.conn
        if not conn.open:
            return
        frame, refs = protocol.encode(protocol.Partial(job.batch.id, index, part))
        if self._loop_blocked and conn.send_now(frame, refs):
            return
        if threading.get_ident() == self._loop_thread:
            conn.send(frame, refs)  # behind what the transport still holds, in order
        elif self._loop is not None:
            self._loop.call_soon_threadsafe(conn.send, frame, refs)
