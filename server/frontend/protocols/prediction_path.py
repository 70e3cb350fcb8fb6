"""Inference calls answered from the HTTP protocol's own callbacks: no task, no ASGI app, no
middleware chain per call. TorchServe's `POST|PUT /predictions/{model}[/{version}[/{url_path}]]`
and the Open Inference Protocol's `POST /v2/models/{model}[/versions/{version}]/infer` take it
(`prediction_routes`); every other request goes to the Starlette app.

Under load a prediction's cost in the frontend was mostly the ASGI machinery around it, not the
work: a task per request, the app and three middlewares (access log, drain, tokens) each wrapping
`send` in a closure, Starlette's Request, and a coroutine resumed after its batch. Here the
listener's protocol (`prediction_protocol`: uvicorn's httptools protocol with our limits) takes the
request when its head is in: the body collects in the request's cycle; when it is complete the
route builds the request and it is handed to the batcher synchronously (`DataPlane.enqueue`), and
the batch's completion writes the answer: the bytes uvicorn's `send` would write, head and body
in one write, then the cycle's end as `send` ends it (keep-alive or close, the next pipelined
request: `whole_answer`). A call ends holding no reference back to
itself, so it is freed when it ends, not by the cyclic collector (`_end`). The request and the
answer are built by the functions the Starlette routes use, and the call is recorded by the same
functions (`call.record`, `call.failure`), so both ways answer the same bytes and count the same
metrics (tests/unit/test_prediction_paths.py sends the same calls both ways and compares them).

Only a request this path answers exactly as the app would takes it; anything else goes to the
app (`PredictionPath.take`, `Route.accepts`): a body without a Content-Length, or one the app would
refuse unread (empty, over `max_body_bytes`) or decode off the loop (`OFFLOAD_DECODE_BYTES` or
more); an `Expect: 100-continue`; proxy headers (uvicorn's middleware rewrites the client from
them); a token that does not pass (the app answers the refusal); a frontend already draining (the
app refuses, with `Connection: close`); a compressed OIP body or a model answered through
TorchServe's envelope. The connection-level limits (head size and timeout, body timeout,
keep-alive, connection cap, held bytes, shutdown linger) are the protocol's and hold on both
paths. A client that goes away cancels the inference (the batcher skips it), as on the app.
Tasks remain only where the app would also leave the loop's turn: a streamed answer's writer, OIP
outputs large enough to be encoded on a worker thread, and an answer sent through uvicorn's `send`
(a client that is not reading, uvicorn's own `--access-log`, an answer without a Content-Length).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine, Mapping, MutableMapping
from typing import TYPE_CHECKING, Any, cast

from starlette.responses import Response
from uvicorn.protocols.http.httptools_impl import RequestResponseCycle

from mariner.server.common.http_common import OFFLOAD_DECODE_BYTES, ClientGone, trimmed_path
from mariner.server.common.http_limits import nothing_to_stop
from mariner.server.common.raw_headers import first_header
from mariner.server.common.security import Credential, authorization_header
from mariner.server.compat.torchserve.logs.access import log_http_access
from mariner.server.contracts.errors import internal
from mariner.server.contracts.types import InferResult
from mariner.server.frontend.protocols.call import Failed, Ok, checked, code_label, failure, record
from mariner.server.frontend.protocols.http_drain import CLOSE
from mariner.server.frontend.protocols.prediction_routes import OipInfer, Route, TorchServePredictions
from mariner.server.frontend.protocols.whole_answer import write_whole_answer
from mariner.server.frontend.streams import STREAMS

if TYPE_CHECKING:
    from mariner.server.frontend.dataplane import DataPlane
    from mariner.server.frontend.protocols.prediction_protocol import PredictionProtocol
    from mariner.server.frontend.protocols.torchserve.chunked import ChunkedAnswer

log = logging.getLogger("mariner.http")

# Headers that send a request to the app: uvicorn's proxy middleware rewrites the scope from the
# first two; the others need the app's reading of the body.
_TO_THE_APP = frozenset({b"x-forwarded-for", b"x-forwarded-proto", b"transfer-encoding"})
Message = MutableMapping[str, Any]
Headers = list[tuple[bytes, bytes]]


class PredictionPath:
    """What the fast path needs of its frontend: the DataPlane, the app's limits, the listener's
    credential (None when nothing is required) and the access log's thread name."""

    def __init__(
        self,
        plane: DataPlane,
        *,
        max_body_bytes: int,
        max_headers: int,
        credential: Credential | None,
        thread: str,
    ) -> None:
        self.plane = plane
        self.max_headers = max_headers
        self.credential = credential if credential else None
        self.thread = thread
        # Bodies the app would decode off the loop, or refuse unread, go to the app.
        self._max_taken = min(max_body_bytes, OFFLOAD_DECODE_BYTES - 1)
        self.routes: tuple[Route, ...] = (TorchServePredictions(), OipInfer(max_body_bytes))

    def take(self, protocol: PredictionProtocol, cycle: RequestResponseCycle) -> Prediction | None:
        """The call this request is, when this path answers it (module docstring); None sends it
        to the app."""
        taken = self.route_of(cycle.scope, cycle.waiting_for_100_continue)
        return None if taken is None else Prediction(self, *taken, protocol, cycle)

    def route_of(
        self, scope: Mapping[str, Any], expects_continue: bool
    ) -> tuple[Route, dict[str, str]] | None:
        """The route and parameters of the request `scope` describes, when this path answers it
        (module docstring); None sends it to the app."""
        if scope["root_path"] or expects_continue or self.plane.draining:
            return None
        path, method = trimmed_path(scope["path"]), scope["method"]  # as the app reads it
        for route in self.routes:
            params = route.match(method, path)
            if params is not None:
                break
        else:
            return None
        headers = cast(Headers, scope["headers"])
        size = -1
        for name, value in headers:
            if name == b"content-length":
                size = int(value) if value.isdigit() else -1
            elif name in _TO_THE_APP:
                return None
        if not 0 < size <= self._max_taken or not route.accepts(self.plane, params, headers):
            return None
        credential = self.credential
        if credential is not None and not credential.accepts(authorization_header(scope)):
            return None
        return route, params


class Prediction:
    """One call on the fast path, from its head to its answer (module docstring). Its route
    reads `params`, `headers`, `header()` and `path`, and keeps what it needs for the answer in
    `request_id`, `streamed` and `state`."""

    __slots__ = (
        "_cycle",
        "_future",
        "_over",
        "_protocol",
        "_route",
        "_start",
        "_status",
        "_stop_watching",
        "_wall_start",
        "headers",
        "params",
        "path",
        "request_id",
        "state",
        "streamed",
    )

    def __init__(
        self,
        path: PredictionPath,
        route: Route,
        params: dict[str, str],
        protocol: PredictionProtocol,
        cycle: RequestResponseCycle,
    ) -> None:
        self.path = path
        self.params = params
        self.headers = cast(Headers, cycle.scope["headers"])
        self.request_id = ""
        self.streamed: ChunkedAnswer | None = None  # where a handler's intermediate answers go
        self.state: Any = None
        self._route = route
        self._protocol = protocol
        self._cycle = cycle
        self._wall_start = time.time()  # the access log's
        self._start = time.perf_counter()  # the call's duration
        self._future: asyncio.Future[InferResult] | None = None
        self._over = False
        self._status = 0
        # Admitted now, with its head in (as the app's drain middleware admits): the drain waits
        # for it even if its body is still arriving.
        path.plane.begin_call()
        self._stop_watching: Callable[[], None] = protocol.on_disconnect(self._client_gone)

    def header(self, name: bytes) -> str | None:
        """The request's first `name` header (lower case), as Starlette's `headers.get` reads it."""
        value = first_header(self.headers, name)
        return None if value is None else value.decode("latin-1")

    # -- the request ---------------------------------------------------------------------------
    def start(self) -> None:
        """The body is complete: decode it and hand the request to the batcher."""
        if self._over:  # its client left before its turn came
            return
        try:
            body = bytes(self._cycle.body)
            self._cycle.body.clear()
            req = self._route.request(self, body)
            future = self.path.plane.enqueue(req, self._cycle.scope["client"], admitted=True)
        except Exception as exc:  # noqa: BLE001 - answered as the app answers it
            self._finish(self._failure(exc))
            return
        self._future = future
        if self.streamed is not None:
            STREAMS[self.request_id] = self.streamed
        future.add_done_callback(self._answer_next_turn)

    def _failure(self, exc: Exception) -> Failed:
        return failure(exc, self._route.protocol, self.params["model"], self._route.what)

    def _client_gone(self) -> None:
        if self._future is not None:
            self._future.cancel()  # the batcher skips it; `_done` records the call as cancelled
        else:  # its body never came (a start that failed has ended the call): nothing to record
            self._end()

    def _answer_next_turn(self, future: asyncio.Future[InferResult]) -> None:
        """Answer on the loop turn after the result came, not on the turn it came.

        A batch's results arrive together, and the batcher starts the next batch in a task of
        its own, whose first step (sending it to the worker) runs on the next turn. Answered on
        the turn the results came, all of the batch's answers were written before that step, and
        the worker sat idle meanwhile: at 64 HTTP clients the frontend and the worker took turns
        (1.05 cores of server in all, against 1.25 on the ASGI path) and throughput fell below the
        ASGI path's, whose answers are written by tasks that run after the batcher's. One turn
        later the next batch is sent first (docs/benchmark.md has the figures).
        """
        self._protocol.loop.call_soon(self._done, future)

    def _done(self, future: asyncio.Future[InferResult]) -> None:
        if self.streamed is not None:
            STREAMS.pop(self.request_id, None)
        if future.cancelled():
            self._finish(self._failure(ClientGone()))
            return
        try:
            value = self._route.value(self, checked(future.result()))
        except Exception as exc:  # noqa: BLE001 - mapped as every call's failure is
            self._finish(self._failure(exc))
            return
        if isinstance(value, Coroutine):  # work that belongs off the loop (large outputs)
            self._protocol.run(self._finish_later(value))
            return
        self._finish(Ok(value))

    async def _finish_later(self, value: Coroutine[Any, Any, Any]) -> None:
        try:
            outcome: Ok[Any] | Failed = Ok(await value)
        except Exception as exc:  # noqa: BLE001 - mapped as every call's failure is
            outcome = self._failure(exc)
        self._finish(outcome)

    # -- the answer ----------------------------------------------------------------------------
    def _finish(self, outcome: Ok[Any] | Failed) -> None:
        route, params = self._route, self.params
        record(
            self.path.plane,
            route.protocol,
            params["model"],
            params.get("version"),
            code_label(outcome),
            self._start,
        )
        try:
            response = route.answer(self, outcome)
            if self.streamed is not None and self.streamed.started:  # its writer sends the rest
                self._protocol.run(self._finish_streamed(self.streamed))
                return
            if not self._protocol.transport.is_closing():
                self._answer(response)
        except Exception:  # a bug's net, as uvicorn's around an app
            log.exception("answering %s failed", self._cycle.scope["path"])
            self._answer_bug(route)
        self._end()

    def _answer_bug(self, route: Route) -> None:
        """A 500 when nothing of the answer was sent, else the connection closes (the client
        must not wait for the rest); if even the 500 fails, the connection closes too."""
        try:
            if not self._cycle.response_started:
                error = internal(route.what)
                self._answer(route.answer(self, Failed(error, error.http_status)))
                return
        except Exception:  # noqa: BLE001 - the call must still end
            log.exception("answering the failure of %s failed", self._cycle.scope["path"])
        self._protocol.transport.close()

    def _answer(self, response: Response) -> None:
        """Write `response` (`write_whole_answer`). A client not reading (writes paused), uvicorn's own
        access log (`--access-log`) and an answer without a Content-Length (a 204 or 1xx) go
        through uvicorn's `send` instead, in a task."""
        headers = response.raw_headers
        cycle = self._cycle
        if cycle.flow.write_paused or cycle.access_log or first_header(headers, b"content-length") is None:
            # The head's status and `Connection: close` are settled now: the call ends (for the
            # drain and the access log) when this returns, before the task writes.
            start = self._message(
                {"type": "http.response.start", "status": response.status_code, "headers": headers}
            )
            self._protocol.run(self._send_later(start, {"type": "http.response.body", "body": response.body}))
            return
        status = response.status_code
        write_whole_answer(cycle, status, self._head(status, headers), response.body)

    async def _send_later(self, start: Message, body: Message) -> None:
        await self._cycle.send(start)  # type: ignore[arg-type]
        await self._cycle.send(body)  # type: ignore[arg-type]

    async def _finish_streamed(self, streamed: ChunkedAnswer) -> None:
        try:
            await streamed.finish()
            if not self._cycle.response_complete:  # cut short: the client must not wait for more
                self._protocol.transport.close()
        finally:
            self._end()

    def _head(self, status: int, headers: Headers) -> Headers:
        """What the app's middlewares do to an answer's head: the status noted for the access
        log; `Connection: close` while the frontend drains."""
        self._status = status
        return [*headers, CLOSE] if self.path.plane.draining else headers

    def _message(self, message: Message) -> Message:
        """`_head` on an ASGI message (a streamed answer's, or one sent through uvicorn's `send`)."""
        if message["type"] != "http.response.start":
            return message
        return {**message, "headers": self._head(message["status"], message["headers"])}

    async def send(self, message: Message) -> None:
        """The ASGI `send` of a streamed answer's writer."""
        await self._cycle.send(self._message(message))  # type: ignore[arg-type]

    def _end(self) -> None:
        """The call is over (answered, or its client gone): the drain and the access log learn it."""
        if self._over:
            return
        self._over = True
        self._stop_watching()
        # Without these two references a call is freed as soon as it ends: its disconnect hook
        # and its streamed answer (a `send` bound to the call) each point back at it, and a
        # call left in a reference cycle waits for the cyclic GC, which at 64 clients cost the
        # frontend ~10 us a request (docs/benchmark.md).
        self._stop_watching = nothing_to_stop
        self.streamed = None
        self.path.plane.end_call()
        if self._status:
            log_http_access(self.path.thread, self._cycle.scope, self._status, self._wall_start)
