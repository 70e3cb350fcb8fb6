"""TorchServe's `POST|PUT /predictions/{model}[/{version}[/{url_path}]]` answered from the HTTP
protocol's own callbacks: no task, no ASGI app, no middleware chain per prediction.

Under load a prediction's cost in the frontend was mostly the ASGI machinery around it, not the
work: a task per request, the app and three middlewares (access log, drain, tokens) each wrapping
`send` in a closure, Starlette's Request, and a coroutine resumed after its batch. Here the
protocol (`PredictionProtocol`, uvicorn's httptools protocol with our limits) takes the request
when its head is in: the body collects in uvicorn's per-request cycle as before; when it is
complete the request is decoded and handed to the batcher synchronously (`DataPlane.enqueue`), and
the batch's completion writes the answer through the cycle (uvicorn's own `send`, driven without
a task), so the bytes on the wire are uvicorn's. Building the request and the answer is shared
with the ASGI route (`torchserve.http.prediction_request`, `final_answer`), and so is the call's
accounting (`call.record`, `call.failure`), so both answer the same bytes and count the same
metrics (a test sends the same calls both ways and compares them).

Only a request this path answers exactly as the ASGI app would takes it; anything else goes to the
app (`PredictionPath.take`): a body without a Content-Length, or one the app would refuse unread
(empty, over `max_body_bytes`) or decode off the loop (`OFFLOAD_DECODE_BYTES` or more); an
`Expect: 100-continue`; proxy headers (uvicorn's middleware rewrites the client from them); a token
that does not pass (the app answers the refusal); a frontend already draining (the app refuses,
with `Connection: close`). The connection-level limits (head size and timeout, body timeout,
keep-alive, connection cap, held bytes, shutdown linger) are the protocol's and hold on both
paths. A client that goes away cancels the inference (the batcher skips it), as on the app.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine, MutableMapping
from typing import TYPE_CHECKING, Any, ClassVar, cast

from starlette.responses import Response
from uvicorn.protocols.http.httptools_impl import RequestResponseCycle

from mariner.server.common.http_common import (
    OFFLOAD_DECODE_BYTES,
    ClientGone,
    error_response,
    handler_headers,
)
from mariner.server.common.http_limits import LimitedHttpToolsProtocol
from mariner.server.common.request_ids import new_request_id
from mariner.server.common.security import Credential, authorization_header
from mariner.server.compat.torchserve.forms import decode_data
from mariner.server.compat.torchserve.logs.access import log_http_access
from mariner.server.contracts.errors import internal
from mariner.server.contracts.types import InferResult, WireProtocol
from mariner.server.frontend.protocols.call import Failed, Ok, checked, code_label, failure, record
from mariner.server.frontend.protocols.http_drain import CLOSE
from mariner.server.frontend.protocols.http_listener import prediction_params
from mariner.server.frontend.protocols.torchserve.chunked import ChunkedAnswer
from mariner.server.frontend.protocols.torchserve.http import (
    answer_head,
    final_answer,
    prediction_request,
    require_body,
)
from mariner.server.frontend.streams import STREAMS

if TYPE_CHECKING:
    from mariner.server.frontend.dataplane import DataPlane

log = logging.getLogger("mariner.http")

_PROTOCOL = WireProtocol.TS_HTTP
_METHODS = frozenset({"POST", "PUT"})
# Headers that send a request to the app: uvicorn's proxy middleware rewrites the scope from the
# first two; the others need the app's reading of the body.
_TO_THE_APP = frozenset({b"x-forwarded-for", b"x-forwarded-proto", b"transfer-encoding"})
Message = MutableMapping[str, Any]


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
        self.max_body_bytes = min(max_body_bytes, OFFLOAD_DECODE_BYTES - 1)
        self.max_headers = max_headers
        self.credential = credential if credential else None
        self.thread = thread

    def take(self, protocol: PredictionProtocol, cycle: RequestResponseCycle) -> Prediction | None:
        """The prediction this request is, when this path answers it (module docstring); None
        sends it to the app."""
        scope = cycle.scope
        if scope["method"] not in _METHODS or scope["root_path"] or cycle.waiting_for_100_continue:
            return None
        path = scope["path"]
        params = prediction_params(path.rstrip("/") if len(path) > 1 else path)
        if params is None or self.plane.draining:
            return None
        size = -1
        content_type = ""
        for name, value in scope["headers"]:
            if name == b"content-length":
                size = int(value) if value.isdigit() else -1
            elif name == b"content-type":
                content_type = content_type or value.decode("latin-1")
            elif name in _TO_THE_APP:
                return None
        if not 0 < size <= self.max_body_bytes:
            return None
        credential = self.credential
        if credential is not None and not credential.accepts(authorization_header(scope)):
            return None
        return Prediction(self, protocol, cycle, params, content_type)


class Prediction:
    """One prediction on the fast path, from its head to its answer (module docstring)."""

    __slots__ = (
        "_content_type",
        "_cycle",
        "_future",
        "_over",
        "_params",
        "_path",
        "_protocol",
        "_request_id",
        "_start",
        "_started",
        "_status",
        "_stop_watching",
        "_streamed",
        "_wall_start",
    )

    def __init__(
        self,
        path: PredictionPath,
        protocol: PredictionProtocol,
        cycle: RequestResponseCycle,
        params: dict[str, str],
        content_type: str,
    ) -> None:
        self._path = path
        self._protocol = protocol
        self._cycle = cycle
        self._params = params
        self._content_type = content_type
        self._wall_start = time.time()  # the access log's
        self._start = time.perf_counter()  # the call's duration
        self._request_id = ""
        self._future: asyncio.Future[InferResult] | None = None
        self._streamed: ChunkedAnswer | None = None
        self._started = False
        self._over = False
        self._status = 0
        # Admitted now, with its head in (as the app's drain middleware admits): the drain waits
        # for it even if its body is still arriving.
        path.plane.begin_call()
        self._stop_watching: Callable[[], None] = protocol.on_disconnect(self._client_gone)

    # -- the request ---------------------------------------------------------------------------
    def start(self) -> None:
        """The body is complete: decode it and hand the request to the batcher."""
        if self._over:  # its client left before its turn came
            return
        self._started = True
        path, params = self._path, self._params
        request_id = self._request_id = new_request_id()
        self._streamed = ChunkedAnswer(self._send, request_id, answer_head)
        try:
            body = bytes(self._cycle.body)
            self._cycle.body.clear()
            require_body(body)
            req = prediction_request(
                params["model"],
                params.get("version"),
                decode_data(self._content_type, body),
                handler_headers(
                    cast(list[tuple[bytes, bytes]], self._cycle.scope["headers"]), path.max_headers
                ),
                len(body),
                request_id,
                url_path=params.get("url_path"),
            )
            future = self._future = path.plane.enqueue(req, self._cycle.scope["client"], admitted=True)
        except Exception as exc:  # noqa: BLE001 - answered as the app answers it
            self._finish(failure(exc, _PROTOCOL, params["model"], "answering a prediction"))
            return
        STREAMS[request_id] = self._streamed
        future.add_done_callback(self._done)

    def _client_gone(self) -> None:
        if self._future is not None:
            self._future.cancel()  # the batcher skips it; `_done` records the call as cancelled
        elif not self._started:
            self._end()  # its body never came: no call to record, as on the app

    def _done(self, future: asyncio.Future[InferResult]) -> None:
        STREAMS.pop(self._request_id, None)
        outcome: Ok[InferResult] | Failed
        if future.cancelled():
            outcome = failure(ClientGone(), _PROTOCOL, self._params["model"], "answering a prediction")
        else:
            try:
                outcome = Ok(checked(future.result()))
            except Exception as exc:  # noqa: BLE001 - mapped as every call's failure is
                outcome = failure(exc, _PROTOCOL, self._params["model"], "answering a prediction")
        self._finish(outcome)

    # -- the answer ----------------------------------------------------------------------------
    def _finish(self, outcome: Ok[InferResult] | Failed) -> None:
        params = self._params
        record(
            self._path.plane,
            _PROTOCOL,
            params["model"],
            params.get("version"),
            code_label(outcome),
            self._start,
        )
        assert self._streamed is not None
        try:
            response = final_answer(outcome, self._request_id, self._streamed)
            if self._streamed.started:  # the writer sends the rest: wait for it (a task, rarely)
                self._protocol.run(self._finish_streamed())
                return
            if not self._protocol.transport.is_closing():
                self._answer(response)
        except Exception:  # a bug's net, as uvicorn's around an app
            log.exception("answering a prediction for %s failed", self._cycle.scope["path"])
            if self._cycle.response_started:
                self._protocol.transport.close()
            else:
                self._answer(error_response(internal("answering a prediction")))
        self._end()

    def _answer(self, response: Response) -> None:
        self._send_now(
            {"type": "http.response.start", "status": response.status_code, "headers": response.raw_headers}
        )
        self._send_now({"type": "http.response.body", "body": response.body})

    async def _finish_streamed(self) -> None:
        assert self._streamed is not None
        try:
            await self._streamed.finish()
            if not self._cycle.response_complete:  # cut short: the client must not wait for more
                self._protocol.transport.close()
        finally:
            self._end()

    def _message(self, message: Message) -> Message:
        """What the app's middlewares do to an answer's head: `Connection: close` while the
        frontend drains; the status noted for the access log."""
        if message["type"] == "http.response.start":
            self._status = message["status"]
            if self._path.plane.draining:
                message = {**message, "headers": [*message["headers"], CLOSE]}
        return message

    async def _send(self, message: Message) -> None:
        """The ASGI `send` of a streamed answer's writer."""
        await self._cycle.send(self._message(message))  # type: ignore[arg-type]

    def _send_now(self, message: Message) -> None:
        """uvicorn's `send`, run to its end without a task: it only suspends while the transport's
        writes are paused (a client not reading), and then a task finishes it."""
        send = self._cycle.send(self._message(message))  # type: ignore[arg-type]
        if self._cycle.flow.write_paused:
            self._protocol.run(send)
            return
        try:
            send.send(None)
        except StopIteration:
            return
        send.close()
        raise RuntimeError("uvicorn's send suspended with writes not paused")

    def _end(self) -> None:
        """The call is over (answered, or its client gone): the drain and the access log learn it."""
        if self._over:
            return
        self._over = True
        self._stop_watching()
        self._path.plane.end_call()
        if self._status:
            log_http_access(self._path.thread, self._cycle.scope, self._status, self._wall_start)


class PredictionProtocol(LimitedHttpToolsProtocol):
    """The inference listener's protocol: predictions on the fast path (module docstring), the
    rest to the app; `prediction_path` is the listener's (set by `prediction_protocol`)."""

    prediction_path: ClassVar[PredictionPath | None] = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._waiting: Prediction | None = None  # a prediction whose body is still arriving

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
        super().on_body(body)
        if self._waiting is not None:
            self.flow.resume_reading()  # no app reads it: the body is bounded by its Content-Length

    def on_message_complete(self) -> None:
        super().on_message_complete()
        prediction, self._waiting = self._waiting, None
        if prediction is not None and not self.cycle.disconnected:
            prediction.start()


def prediction_protocol(path: PredictionPath) -> type[PredictionProtocol]:
    """The protocol class of one inference listener, taking predictions on `path`."""
    return type("PredictionProtocol", (PredictionProtocol,), {"prediction_path": path})
