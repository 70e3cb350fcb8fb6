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
- from another thread of the handler's, the frame is held on the call, in order, and written by
  whichever comes first: the loop (asked with `call_soon_threadsafe`; for a coroutine handler),
  the handler's next part on the loop's thread, or `finish` when the call returns, ahead of the
  batch's `Result`. A plain handler's loop runs nothing before that `Result` is written, so a
  frame left to the loop alone would follow it, and the frontend drops a part that comes after
  its request's answer. Another thread tries `send_now` only for a frontend with no part held,
  so no part overtakes an earlier one to the same frontend.

A part sent after its call returned, or naming a request the call does not hold, is dropped with
a log line: its request already has its answer, or is not this call's. One lock orders each part
against `finish`: a part is written (or held) before the `Result`, or dropped.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Sequence
from typing import Any

from mariner.server.contracts import worker_wire as protocol
from mariner.server.contracts.types import InferResult

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
        # Parts from the handler's other threads, in the order sent: (conn, frame, refs).
        self._held: list[tuple[Any, bytes, list[protocol.ShmRef]]] = []
        # Taken by each `deliver` and by `finish`: no part passes the `done` check and is then
        # written (or held) after the call's Result, where it would be lost.
        self._lock = threading.Lock()

    def route(self, request_id: str) -> tuple[Any, int] | None:
        """The job and position of `request_id` (found on the first part; most calls send none)."""
        if self._routes is None:
            self._routes = {}
            for job in self.jobs:
                for index, req in enumerate(job.batch.requests):
                    self._routes.setdefault(req.request_id, (job, index))
        return self._routes.get(request_id)

    def deliver(self, request_id: str, part: InferResult) -> None:
        with self._lock:
            self._deliver(request_id, part)

    def _deliver(self, request_id: str, part: InferResult) -> None:
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
        on_loop = threading.get_ident() == self._loop_thread
        if on_loop:
            self._write_held()  # the parts other threads sent first go first
        elif self._loop_blocked and any(held is conn for held, _, _ in self._held):
            self._held.append((conn, frame, refs))  # behind this frontend's held parts
            return
        if self._loop_blocked and conn.send_now(frame, refs):
            return
        if on_loop:
            conn.send(frame, refs)  # behind what the transport still holds, in order
            return
        self._held.append((conn, frame, refs))
        if self._loop_blocked or self._loop is None:
            return  # no loop can write it before the call returns: `finish` writes it then
        if len(self._held) == 1:  # else a write is already asked for
            self._loop.call_soon_threadsafe(self._write_held_locked)

    def _write_held(self) -> None:
        """Write the held parts, in order (on the loop's thread, the lock held). Each leaves the
        list as it is written, so whichever of the loop's callback, the next part on the loop's
        thread or `finish` comes first writes it, and the others find nothing: written once."""
        held, self._held = self._held, []
        for conn, frame, refs in held:
            conn.send(frame, refs)  # a closed conn unlinks the part's segments

    def _write_held_locked(self) -> None:
        with self._lock:
            self._write_held()

    def finish(self) -> None:
        """The call returned (on the loop's thread): drop any later part and write the held ones,
        before the caller writes the batch's Result behind them."""
        with self._lock:
            self.done = True
            self._write_held()
