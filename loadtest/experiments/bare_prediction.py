"""Mariner's own work per prediction on a protocol with no server library under it: the floor of
a prediction path that replaced uvicorn's protocol, measured, not built.

`BarePrediction` is httptools' parser on an `asyncio.Protocol` (`http_servers.BareProtocol`'s)
that answers TorchServe's `POST /predictions/{model}` with the very functions the inference
listener's fast path calls (`prediction_path.Prediction`): the route builds the request from the
body (`TorchServePredictions.request`: request id, form/JSON decode, handler headers), the
DataPlane queues it (`enqueue`: endpoint, fair-order batcher, a future), the answer comes one loop
turn after the batch (as the fast path's does), the call is recorded (`call.record`: count,
duration, OIP book, TorchServe's call metrics), the answer built (`route.answer`: the handler's
status and headers, `x-request-id`) and written head and body in one write, the drain accounting
and TorchServe's access line done. What it leaves out is what uvicorn's protocol and our limits
add: the scope and cycle, the keep-alive and head timers, the held-bytes and head-size checks,
the disconnect hook, default headers (`date`, `server`), pipelining, every error answer. So it
serves one closed-loop client per connection and nothing else; its figure against the
`mariner-listener` server (`http_servers_bench --servers bare-mariner,mariner-listener --apps
mariner`) is what a protocol of our own could save on the prediction path at most.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any

from uvicorn.protocols.http.httptools_impl import STATUS_LINE

from mariner.loadtest.experiments.http_servers import BareProtocol
from mariner.server.common.raw_headers import first_header
from mariner.server.compat.torchserve.logs.access import log_http_access
from mariner.server.contracts.types import InferResult
from mariner.server.frontend.protocols.call import Ok, checked, code_label, record
from mariner.server.frontend.protocols.prediction_routes import TorchServePredictions

if TYPE_CHECKING:
    from mariner.server.frontend.dataplane import DataPlane
    from mariner.server.frontend.protocols.torchserve.chunked import ChunkedAnswer

THREAD = "bench"


class _Path:
    """What a route reads of the fast path's `PredictionPath`."""

    def __init__(self, plane: DataPlane, max_headers: int) -> None:
        self.plane = plane
        self.max_headers = max_headers


class _Call:
    """What a route reads and keeps of the fast path's `Prediction`."""

    __slots__ = (
        "headers",
        "params",
        "path",
        "request_id",
        "scope",
        "start",
        "state",
        "streamed",
        "wall_start",
    )

    def __init__(
        self, path: _Path, params: dict[str, str], headers: list[tuple[bytes, bytes]], scope: Any
    ) -> None:
        self.path = path
        self.params = params
        self.headers = headers
        self.scope = scope
        self.request_id = ""
        self.streamed: ChunkedAnswer | None = None
        self.state: Any = None
        self.wall_start = time.time()
        self.start = time.perf_counter()

    def header(self, name: bytes) -> str | None:
        value = first_header(self.headers, name)
        return None if value is None else value.decode("latin-1")

    async def send(self, message: Any) -> None:  # pragma: no cover - no handler here streams
        raise RuntimeError("the bare prediction path answers whole answers only")


class BarePrediction(BareProtocol):
    """One connection: parse, hand over, answer (module docstring); the parser, the transport and
    a parse error's close are `BareProtocol`'s. `path` is set per server."""

    path: _Path
    route = TorchServePredictions()

    def __init__(self) -> None:
        super().__init__()
        self._loop = asyncio.get_running_loop()
        self._client: Any = None
        self._url = b""
        self._headers: list[tuple[bytes, bytes]] = []
        self._body: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self._client = transport.get_extra_info("peername")

    def on_message_begin(self) -> None:
        self._url, self._headers, self._body = b"", [], []

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers.append((name.lower(), value))

    def on_body(self, body: bytes) -> None:
        self._body.append(body)

    def on_message_complete(self) -> None:
        path = self._url.decode("latin-1")
        method = self._parser.get_method().decode("ascii")
        params = self.route.match(method, path)
        if params is None:
            assert self._transport is not None
            self._transport.write(b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n")
            return
        scope = {"path": path, "method": method, "client": self._client, "http_version": "1.1"}
        call = _Call(self.path, params, self._headers, scope)
        plane = self.path.plane
        plane.begin_call()
        request = self.route.request(call, b"".join(self._body))
        future = plane.enqueue(request, self._client, admitted=True)
        future.add_done_callback(lambda f: self._loop.call_soon(self._done, call, f))

    def _done(self, call: _Call, future: asyncio.Future[InferResult]) -> None:
        route, params = self.route, call.params
        outcome = Ok(route.value(call, checked(future.result())))  # type: ignore[arg-type]
        record(call.path.plane, route.protocol, params["model"], params.get("version"), code_label(outcome),
               call.start)  # fmt: skip
        response = route.answer(call, outcome)
        status = response.status_code
        head = [STATUS_LINE[status]]
        for name, value in response.raw_headers:
            head += (name, b": ", value, b"\r\n")
        head += (b"\r\n", response.body)
        assert self._transport is not None
        self._transport.write(b"".join(head))
        call.path.plane.end_call()
        log_http_access(THREAD, call.scope, status, call.wall_start)


def bare_prediction(plane: DataPlane, max_headers: int) -> type[BarePrediction]:
    """The protocol class of one server answering predictions from `plane`."""
    return type("BarePrediction", (BarePrediction,), {"path": _Path(plane, max_headers)})
