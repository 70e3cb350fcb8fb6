"""The inference listener's HTTP protocol: uvicorn's httptools protocol with our limits
(`http_limits`), handing the predictions it can answer to the fast path (`prediction_path`) and
every other request to the Starlette app.

A prediction whose head arrives on an idle connection (not pipelined behind an answer still being
written) skips uvicorn's part of the last three parser callbacks: its scope is filled and its
cycle made here, with no asyncio.Event (`NO_WAITER`) and no ASGI extensions, and its body
collects without uvicorn's checks for an upgrade or an answer already sent (neither can be, for a
request the fast path takes); the limits' part runs as for every request. With the limits
protocol doing uvicorn's part of the first three callbacks itself, that took ~5 us of a
prediction's ~45 in-process (docs/benchmark.md). Any other request, and a pipelined prediction,
takes uvicorn's callbacks as before (a pipelined one is taken when its turn comes).
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, ClassVar, cast
from urllib.parse import unquote

import httptools
from uvicorn.protocols.http.httptools_impl import RequestResponseCycle

from mariner.server.common.http_limits import LimitedHttpToolsProtocol
from mariner.server.frontend.protocols.prediction_path import Prediction, PredictionPath


class _NoWaiter:
    """The message event of a cycle no ASGI app reads: uvicorn sets it for a `receive` that is
    never called (an asyncio.Event per request, and a set per body part, for nothing)."""

    __slots__ = ()

    def set(self) -> None:
        pass


NO_WAITER = cast(asyncio.Event, _NoWaiter())


class PredictionProtocol(LimitedHttpToolsProtocol):
    """The inference listener's protocol: predictions on the fast path, the rest to the app
    (module docstring); `prediction_path` is the listener's (set by `prediction_protocol`)."""

    prediction_path: ClassVar[PredictionPath | None] = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._waiting: Prediction | None = None  # a prediction whose body is still arriving

    def on_headers_complete(self) -> None:
        path, parser, cycle = self.prediction_path, self.parser, self.cycle
        taken = None
        if (
            path is not None
            and (cycle is None or cycle.response_complete)
            and not self._shutting
            and self.limit_concurrency is None
            and parser.get_http_version() == "1.1"
            and not parser.should_upgrade()
        ):
            scope = self.scope
            scope["method"] = parser.get_method().decode("ascii")
            url = httptools.parse_url(self.url)
            raw_path = url.path
            decoded = raw_path.decode("ascii")
            scope["path"] = self.root_path + (unquote(decoded) if "%" in decoded else decoded)
            scope["raw_path"] = self.root_path.encode("ascii") + raw_path
            scope["query_string"] = url.query or b""
            taken = path.route_of(scope, self.expect_100_continue)
        if taken is None:  # uvicorn's way (which fills the same scope again)
            super().on_headers_complete()
            return
        self._head_complete()
        self.cycle = RequestResponseCycle(
            scope=self.scope,
            transport=self.transport,
            flow=self.flow,
            logger=self.logger,
            access_logger=self.access_logger,
            access_log=self.access_log,
            default_headers=self.server_state.default_headers,
            message_event=NO_WAITER,
            expect_100_continue=False,
            keep_alive=parser.should_keep_alive(),
            on_response=self.on_response_complete,
        )
        assert path is not None  # taken only with a path
        self._waiting = Prediction(path, *taken, self, self.cycle)

    def _start_asgi_task(self, cycle: RequestResponseCycle, app: Any) -> None:
        path = self.prediction_path
        prediction = path.take(self, cycle) if path is not None and app is self.app else None
        if prediction is None:
            super()._start_asgi_task(cycle, app)
        elif cycle.more_body:
            self._waiting = prediction
        else:  # a pipelined request, its turn come with the answer before it: start on the next
            self.loop.call_soon(prediction.start)  # loop turn, not inside that answer's write

    def run(self, work: Coroutine[Any, Any, None]) -> None:
        """`work` in a task of this connection's (uvicorn's shutdown waits for them)."""
        task = self.loop.create_task(work)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def on_body(self, body: bytes) -> None:
        if self._waiting is None:
            super().on_body(body)
            return
        # No app reads it: it collects without pausing reads, bounded by its Content-Length.
        self._body_arrived(body)
        self.cycle.body += body

    def on_message_complete(self) -> None:
        prediction, self._waiting = self._waiting, None
        if prediction is None:
            super().on_message_complete()
            return
        self._message_complete()
        self.cycle.more_body = False
        if not self.cycle.disconnected:
            prediction.start()


def prediction_protocol(path: PredictionPath) -> type[PredictionProtocol]:
    """The protocol class of one inference listener, taking predictions on `path`."""
    return type("PredictionProtocol", (PredictionProtocol,), {"prediction_path": path})
