"""The two ways the inference listener answers TorchServe's predictions send the same bytes.

The same raw HTTP calls go to two real uvicorn listeners over one plane: one whose protocol
answers predictions itself (`frontend.protocols.prediction_path`), one that sends them through
the ASGI app. Each answer is read whole from the socket and compared byte for byte, with only the
`date` header and the request id (new per request) masked: statuses, header order, handler-set
statuses and headers, errors, chunked (streamed) answers, keep-alive and pipelined requests.
A call the fast path should take is checked to have taken it, so the comparison is never between
the app and itself.
"""

from __future__ import annotations

import asyncio
import gc
import gzip
import json
import re
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from mariner.server.contracts.types import InferRequest, InferResult
from mariner.server.frontend.protocols.http_listener import inference_app
from mariner.server.frontend.protocols.prediction_path import Prediction, PredictionPath
from mariner.server.frontend.streams import STREAMS
from tests.unit.fakes import FakePlane, digits_outputs, inference_protocol, serve_inference

pytestmark = pytest.mark.unit

MAX_BODY = 64 * 1024
LARGE_ROWS = 3200  # 21 output elements a row: over the 64 Ki encoded off the loop
TIMEOUT = 10.0


class ScriptedPlane(FakePlane):
    """A plane whose handler does what the request's `x-script` header says; it counts the
    calls the drain waits for (`begin_call` / `end_call`)."""

    calls_open = 0

    def begin_call(self) -> None:
        ScriptedPlane.calls_open += 1

    def end_call(self) -> None:
        ScriptedPlane.calls_open -= 1

    async def infer(self, req: InferRequest) -> InferResult:
        self.resolve(req.model, req.version)
        script = req.headers.get("x-script", "echo")
        if req.tensors is not None:  # an Open Inference Protocol call
            if script == "raise":
                raise RuntimeError("secret /srv/handler.py line 42")
            if script == "handler-error":
                return InferResult(body=b'{"error": "pixels out of range"}', status=422)
            if script == "large-outputs":  # over the elements encoded off the loop
                rows = np.ones((LARGE_ROWS, 64), dtype=np.float32)
                return InferResult(body=b"", tensors=digits_outputs(rows), model_version="1")
            return await super().infer(req)
        if script == "echo":
            seen = {
                "model": req.model,
                "version": req.version,
                "data": repr(req.data),
                "headers": req.headers,
            }
            return InferResult(body=json.dumps(seen, sort_keys=True).encode())
        if script == "text":
            return InferResult(body=b"three")
        if script == "status":
            return InferResult(
                body=b"a,b\n", status=201, content_type="text/csv", headers={"X-Handler": "set"}
            )
        if script == "handler-error":
            return InferResult(body=b'{"error": "pixels out of range"}', status=507)
        if script == "no-content":
            return InferResult(body=b"dropped", status=204)
        if script == "bad-header":
            return InferResult(body=b"{}", headers={"x-bad": "split\r\ninjected: 1"})
        if script == "raise":
            raise RuntimeError("secret /srv/handler.py line 42")
        if script in ("stream", "stream-error-first", "stream-then-fail"):
            sink = STREAMS[req.request_id]
            first = 500 if script == "stream-error-first" else 200
            sink.partial(InferResult(body=b"part-1 ", status=first, headers={"x-part": "1"}))
            await asyncio.sleep(0.01)
            sink.partial(InferResult(body=b"part-2 "))
            await asyncio.sleep(0.01)
            if script == "stream-then-fail":
                raise RuntimeError("the handler died mid-stream")
            return InferResult(body=b"final")
        raise AssertionError(f"unknown script {script!r}")


class CountingPath(PredictionPath):
    taken = 0

    def route_of(self, scope: Any, expects_continue: bool) -> Any:
        taken = super().route_of(scope, expects_continue)
        if taken is not None:
            CountingPath.taken += 1
        return taken


PLANE = ScriptedPlane()


@pytest.fixture(scope="module")
def listeners(monkeypatch_module: pytest.MonkeyPatch) -> Iterator[dict[str, int]]:
    """Ports of the two listeners ("fast", "app") over one scripted plane."""
    monkeypatch_module.setattr(
        "mariner.server.frontend.protocols.prediction_path.PredictionPath", CountingPath
    )
    plane = PLANE
    ports: dict[str, int] = {}
    with (
        serve_inference(
            plane, inference_app(plane, max_body_bytes=MAX_BODY), "fast", max_body_bytes=MAX_BODY
        ) as fast,  # type: ignore[arg-type]
        serve_inference(
            plane, inference_app(plane, max_body_bytes=MAX_BODY), "app", max_body_bytes=MAX_BODY
        ) as app,  # type: ignore[arg-type]
    ):
        ports["fast"] = int(fast.rsplit(":", 1)[1])
        ports["app"] = int(app.rsplit(":", 1)[1])
        yield ports


@pytest.fixture(scope="module")
def monkeypatch_module() -> Iterator[pytest.MonkeyPatch]:
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def exchange(port: int, raw: bytes) -> bytes:
    """Send `raw` on a fresh connection and read until the server closes it (the last request
    of every call asks for `Connection: close`, or the server closes after an error)."""
    with socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT) as sock:
        sock.sendall(raw)
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


_MASKS = (
    (re.compile(rb"\r\ndate: [^\r]*"), b"\r\ndate: <date>"),
    (re.compile(rb"\r\nx-request-id: [0-9a-zA-Z-]+"), b"\r\nx-request-id: <id>"),
)


def masked(answer: bytes) -> bytes:
    for pattern, mask in _MASKS:
        answer = pattern.sub(mask, answer)
    return answer


def post(path: str, body: bytes, *, script: str = "echo", close: bool = True, extra: bytes = b"") -> bytes:
    head = (
        f"POST {path} HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\nX-Script: {script}\r\n"
        f"Content-Length: {len(body)}\r\n"
    ).encode()
    return head + extra + (b"Connection: close\r\n" if close else b"") + b"\r\n" + body


BODY = b'{"pixels": [0, 1, 2]}'
_PIXELS = {"name": "pixels", "datatype": "FP32", "shape": [1, 64], "data": [float(i % 17) for i in range(64)]}
OIP = json.dumps({"inputs": [_PIXELS]}).encode()
OIP_WITH_OUTPUTS = json.dumps(
    {
        "id": "call-7",
        "inputs": [_PIXELS],
        "outputs": [{"name": "label"}, {"name": "logits", "parameters": {"binary_data": True}}],
    }
).encode()
_HEAD = json.dumps(
    {
        "inputs": [
            {"name": "pixels", "datatype": "FP32", "shape": [1, 64], "parameters": {"binary_data_size": 256}}
        ],
        "parameters": {"binary_data_output": True},
    }
).encode()
OIP_HEAD = len(_HEAD)
OIP_BINARY = _HEAD + np.arange(64, dtype=np.float32).tobytes()
CALLS: dict[str, tuple[bytes, int]] = {  # name: (raw request bytes, predictions the fast path takes)
    "json": (post("/predictions/digits", BODY), 1),
    "version": (post("/predictions/digits/1", BODY), 1),
    "url path": (post("/predictions/digits/1/v1/chat/completions", BODY), 1),
    "trailing slash": (post("/predictions/digits/", BODY), 1),
    "put": (post("/predictions/digits", BODY).replace(b"POST", b"PUT", 1), 1),
    "text body": (post("/predictions/digits", b"plain words").replace(b"application/json", b"text/plain"), 1),
    "form": (
        post(
            "/predictions/digits",
            b'--XX\r\nContent-Disposition: form-data; name="data"\r\n\r\nabc\r\n--XX--\r\n',
        ).replace(b"application/json", b"multipart/form-data; boundary=XX"),
        1,
    ),
    "plain answer": (post("/predictions/digits", BODY, script="text"), 1),
    "handler status and headers": (post("/predictions/digits", BODY, script="status"), 1),
    "handler error status": (post("/predictions/digits", BODY, script="handler-error"), 1),
    "204 drops its body": (post("/predictions/digits", BODY, script="no-content"), 1),
    "unsendable header": (post("/predictions/digits", BODY, script="bad-header"), 1),
    "handler raises": (post("/predictions/digits", BODY, script="raise"), 1),
    "streamed": (post("/predictions/digits", BODY, script="stream"), 1),
    "streamed, error first": (post("/predictions/digits", BODY, script="stream-error-first"), 1),
    "streamed, then fails": (post("/predictions/digits", BODY, script="stream-then-fail"), 1),
    "malformed json": (post("/predictions/digits", b'{"pixels": [1,'), 1),
    "unknown model": (post("/predictions/nope", BODY), 1),
    "unknown version": (post("/predictions/digits/9", BODY), 1),
    "control characters in url path": (post("/predictions/digits/1/a%01b", BODY), 1),
    "many headers": (
        post("/predictions/digits", BODY, extra=b"".join(b"X-H%d: v\r\n" % i for i in range(150))),
        1,
    ),
    "http/1.0": (post("/predictions/digits", BODY, close=False).replace(b"HTTP/1.1", b"HTTP/1.0", 1), 1),
    "keep-alive then close": (
        post("/predictions/digits", BODY, close=False) + post("/predictions/digits/1", BODY),
        2,
    ),
    "pipelined three": (
        post("/predictions/digits", BODY, close=False, script="text")
        + post("/predictions/digits", BODY, close=False, script="status")
        + post("/predictions/digits", BODY),
        3,
    ),
    "oip json": (post("/v2/models/digits/infer", OIP), 1),
    "oip versioned, id, outputs": (post("/v2/models/digits/versions/1/infer", OIP_WITH_OUTPUTS), 1),
    "oip binary in and out": (
        post(
            "/v2/models/digits/infer", OIP_BINARY, extra=b"Inference-Header-Content-Length: %d\r\n" % OIP_HEAD
        ),
        1,
    ),
    "oip handler raises": (post("/v2/models/digits/infer", OIP, script="raise"), 1),
    "oip large outputs": (post("/v2/models/digits/infer", OIP, script="large-outputs"), 1),
    "oip handler error status": (post("/v2/models/digits/infer", OIP, script="handler-error"), 1),
    "oip bad json": (post("/v2/models/digits/infer", b'{"inputs": ['), 1),
    "oip wrong shape": (post("/v2/models/digits/infer", OIP.replace(b"[1, 64]", b"[1, 63]")), 1),
    "oip unknown model": (post("/v2/models/nope/infer", OIP), 1),
    "oip bad header length": (
        post("/v2/models/digits/infer", OIP, extra=b"Inference-Header-Content-Length: 99999\r\n"),
        1,
    ),
    "oip trailing slash": (post("/v2/models/digits/infer/", OIP), 1),
    # Sent to the app by both listeners (the fast path's module docstring): compared all the same.
    "oip gzip": (
        post("/v2/models/digits/infer", gzip.compress(OIP), extra=b"Content-Encoding: gzip\r\n"),
        0,
    ),
    "oip put": (post("/v2/models/digits/infer", OIP).replace(b"POST", b"PUT", 1), 0),
    "empty body": (post("/predictions/digits", b""), 0),
    "over the body limit": (post("/predictions/digits", b"1" * (MAX_BODY + 1)), 0),
    "chunked body": (
        b"POST /predictions/digits HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n"
        b"Connection: close\r\n\r\n5\r\n[1,2]\r\n0\r\n\r\n",
        0,
    ),
    "explanation": (post("/explanations/digits", BODY), 0),
    "get is not a prediction": (post("/predictions/digits", BODY).replace(b"POST", b"GET", 1), 0),
}


@pytest.mark.parametrize("name", list(CALLS))
def test_both_ways_answer_the_same_bytes(listeners: dict[str, int], name: str) -> None:
    raw, fast_takes = CALLS[name]
    before = CountingPath.taken
    fast = exchange(listeners["fast"], raw)
    assert CountingPath.taken - before == fast_takes, "the fast path took what it should, and only that"
    app = exchange(listeners["app"], raw)
    assert app.startswith(b"HTTP/1.1 "), app[:200]
    assert masked(fast) == masked(app)


def test_a_prediction_answer_is_what_the_handler_said(listeners: dict[str, int]) -> None:
    """The comparison above would pass if both ways were wrong alike: one answer checked whole."""
    answer = exchange(listeners["fast"], post("/predictions/digits", BODY, script="status"))
    head, _, body = answer.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    assert lines[0] == b"HTTP/1.1 201 Created"
    assert masked(head).split(b"\r\n")[1:] == [
        b"date: <date>",
        b"server: uvicorn",
        b"x-request-id: <id>",
        b"x-handler: set",
        b"content-type: text/csv",
        b"content-length: 4",
        b"connection: close",
    ]
    assert body == b"a,b\n"


def test_the_fast_path_cancels_an_inference_whose_client_left(listeners: dict[str, int]) -> None:
    started, cancelled = threading.Event(), threading.Event()
    plane_infer = ScriptedPlane.infer

    async def hang(self: ScriptedPlane, req: InferRequest) -> InferResult:
        if req.headers.get("x-script") != "hang":
            return await plane_infer(self, req)
        started.set()
        try:
            await asyncio.sleep(TIMEOUT)
        except asyncio.CancelledError:
            cancelled.set()
            raise
        raise AssertionError("not cancelled")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ScriptedPlane, "infer", hang)
        sock = socket.create_connection(("127.0.0.1", listeners["fast"]), timeout=TIMEOUT)
        sock.sendall(post("/predictions/digits", BODY, script="hang"))
        assert started.wait(TIMEOUT)
        sock.close()
        assert cancelled.wait(TIMEOUT), "the inference kept running for a client that left"


def wait_for(condition: Any, what: str) -> None:
    deadline = time.monotonic() + TIMEOUT
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.005)


def test_a_prediction_admitted_before_the_drain_is_answered_and_closes_the_connection(
    listeners: dict[str, int],
) -> None:
    """Admitted with its head, as the app's drain middleware admits: its body may come after the
    drain began, it is still answered, with `Connection: close`; the drain waits for it."""
    raw = post("/predictions/digits", BODY, close=False)
    head, body = raw[: -len(BODY)], raw[-len(BODY) :]
    before = CountingPath.taken
    with socket.create_connection(("127.0.0.1", listeners["fast"]), timeout=TIMEOUT) as sock:
        sock.sendall(head)
        wait_for(lambda: CountingPath.taken > before, "the fast path took the head")
        assert ScriptedPlane.calls_open == 1, "admitted: the drain waits for it"
        PLANE.draining = True
        try:
            sock.sendall(body)
            answer = b""
            while chunk := sock.recv(65536):
                answer += chunk
        finally:
            PLANE.draining = False
    assert answer.startswith(b"HTTP/1.1 200 OK\r\n"), answer[:200]
    assert b"\r\nconnection: close\r\n" in answer.partition(b"\r\n\r\n")[0] + b"\r\n"
    wait_for(lambda: ScriptedPlane.calls_open == 0, "the call ended for the drain")


def test_a_client_gone_before_its_body_ends_its_call_without_an_inference(listeners: dict[str, int]) -> None:
    raw = post("/predictions/digits", BODY, script="raise")
    before = CountingPath.taken
    errors_before = PLANE.samples("mariner_requests_total", protocol="torchserve-http", code="500")
    with socket.create_connection(("127.0.0.1", listeners["fast"]), timeout=TIMEOUT) as sock:
        sock.sendall(raw[: -len(BODY)])
        wait_for(lambda: CountingPath.taken > before, "the fast path took the head")
    wait_for(lambda: ScriptedPlane.calls_open == 0, "the call ended when its client left")
    errors = PLANE.samples("mariner_requests_total", protocol="torchserve-http", code="500")
    assert errors == errors_before, "nothing was inferred or counted for a request whose body never came"


class RecordingTransport:
    """A socket transport's surface for uvicorn's protocol that records what is done to it."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, bytes]] = []

    def write(self, data: bytes) -> None:
        self.calls.append(("write", bytes(data)))

    def close(self) -> None:
        self.calls.append(("close", b""))

    def is_closing(self) -> bool:
        return ("close", b"") in self.calls

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"peername": ("127.0.0.1", 50000), "sockname": ("127.0.0.1", 8080)}.get(name, default)

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


async def _answered(transport: RecordingTransport, count: int, end: bytes = b"three") -> None:
    deadline = time.monotonic() + TIMEOUT
    while sum(1 for kind, data in transport.calls if kind == "write" and data.endswith(end)) < count:
        assert time.monotonic() < deadline, transport.calls
        await asyncio.sleep(0.001)


async def _fast_protocol(*, access_log: bool = False) -> tuple[Any, RecordingTransport]:
    from uvicorn.config import Config
    from uvicorn.server import ServerState

    config = Config(
        inference_app(PLANE, max_body_bytes=MAX_BODY),
        http=inference_protocol(PLANE, "fast", max_body_bytes=MAX_BODY),
        log_level="warning",
        lifespan="off",
        access_log=access_log,
    )
    config.load()
    loop = asyncio.get_running_loop()
    protocol = config.http_protocol_class(config=config, server_state=ServerState(), app_state={}, _loop=loop)
    transport = RecordingTransport()
    protocol.connection_made(transport)
    return protocol, transport


def test_an_answer_is_one_write_and_a_closing_answer_closes_after_it() -> None:
    asyncio.run(_one_write())


async def _one_write() -> None:
    protocol, transport = await _fast_protocol()
    protocol.data_received(post("/predictions/digits", BODY, script="text", close=False))
    await _answered(transport, 1)
    assert [kind for kind, _ in transport.calls] == ["write"], "head and body in one write"
    head, _, body = transport.calls[0][1].partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 OK\r\n")
    assert body == b"three"

    protocol.data_received(post("/predictions/digits", BODY, script="text"))
    await _answered(transport, 2)
    assert [kind for kind, _ in transport.calls] == ["write", "write", "close"], transport.calls
    assert b"\r\nconnection: close\r\n" in transport.calls[1][1]
    protocol.connection_lost(None)


def test_an_answer_to_a_client_not_reading_waits_for_its_writes_to_resume() -> None:
    asyncio.run(_paused_writes())


async def _paused_writes() -> None:
    protocol, transport = await _fast_protocol()
    protocol.pause_writing()  # what the transport calls when its buffer is over the high mark
    protocol.data_received(post("/predictions/digits", BODY, script="text", close=False))
    await asyncio.sleep(0.05)
    assert transport.calls == [], "nothing written while writes are paused"
    protocol.resume_writing()
    await _answered(transport, 1)
    answer = b"".join(data for _, data in transport.calls)
    assert answer.startswith(b"HTTP/1.1 200 OK\r\n")
    assert answer.endswith(b"\r\n\r\nthree")
    protocol.connection_lost(None)


def test_with_uvicorns_access_log_on_an_answer_goes_through_its_send() -> None:
    """`--access-log` asks uvicorn to log each answer, which its `send` does: the fast path
    answers through it then, the same bytes in two writes."""

    async def answers(access_log: bool) -> list[bytes]:
        protocol, transport = await _fast_protocol(access_log=access_log)
        protocol.data_received(post("/predictions/digits", BODY, script="text", close=False))
        await _answered(transport, 1)
        protocol.connection_lost(None)
        return [data for kind, data in transport.calls if kind == "write"]

    logged, quiet = asyncio.run(answers(True)), asyncio.run(answers(False))
    assert len(logged) == 2, "head and body, as uvicorn's send writes them"
    assert masked(b"".join(logged)) == masked(b"".join(quiet))


def test_a_call_is_freed_when_it_ends_not_by_the_cyclic_gc() -> None:
    """A call in a reference cycle outlives its answer until a cyclic collection, and at 64
    clients those collections cost the frontend ~10 us a request (docs/benchmark.md): plain,
    streamed and abandoned calls all leave nothing for the collector."""

    async def main() -> list[Prediction]:
        protocol, transport = await _fast_protocol()
        gc.collect()
        gc.disable()
        try:
            for n in range(1, 4):
                protocol.data_received(post("/predictions/digits", BODY, script="text", close=False))
                await _answered(transport, n)
            protocol.data_received(post("/predictions/digits", BODY, script="stream", close=False))
            await _answered(transport, 1, end=b"0\r\n\r\n")
            gone, gone_transport = await _fast_protocol()
            gone.data_received(post("/predictions/digits", BODY, close=False)[:-3])  # body unfinished
            gone.connection_lost(None)
            await asyncio.sleep(0.01)
            gc.set_debug(gc.DEBUG_SAVEALL)
            gc.collect()
            return [o for o in gc.garbage if isinstance(o, Prediction)]
        finally:
            gc.set_debug(0)
            gc.garbage.clear()
            gc.enable()

    assert asyncio.run(main()) == []


def test_every_way_an_answer_is_written_logs_its_access_line_with_its_status() -> None:
    """TorchServe's access line is written when the call ends: for an answer written at once, one
    sent through uvicorn's `send` (a 204 has no Content-Length) and one waiting for a client that
    is not reading, with the status the client gets."""
    from mariner.server.compat.torchserve.logs import emit
    from mariner.server.compat.torchserve.logs.records import Kind, Record

    records: list[Record] = []

    async def main() -> None:
        protocol, transport = await _fast_protocol()
        protocol.data_received(post("/predictions/digits", BODY, script="text", close=False))
        await _answered(transport, 1)
        protocol.data_received(post("/predictions/digits", BODY, script="no-content", close=False))
        await _answered(transport, 1, end=b"\r\n\r\n")
        protocol.pause_writing()
        protocol.data_received(post("/predictions/digits", BODY, script="text", close=False))
        await asyncio.sleep(0.05)
        protocol.resume_writing()
        await _answered(transport, 2)
        protocol.connection_lost(None)

    previous = emit.current()
    emit.set_target(emit.to_records(records.append))
    try:
        asyncio.run(main())
    finally:
        emit.set_target(previous)
    access = [r.message for r in records if r.kind == Kind.ACCESS]
    assert [line.split('" ')[1].split()[0] for line in access] == ["200", "204", "200"], access


def test_an_answer_that_cannot_be_built_closes_the_connection_and_still_ends_the_call(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The bug net: when building the answer fails, and building the 500 fails too, the client
    is not left waiting and the drain is not left counting a call that will never end."""
    from mariner.server.frontend.protocols.prediction_routes import TorchServePredictions

    def broken(self: Any, call: Any, outcome: Any) -> Any:
        raise RuntimeError("answer builder bug")

    monkeypatch.setattr(TorchServePredictions, "answer", broken)
    open_before = ScriptedPlane.calls_open

    async def main() -> RecordingTransport:
        protocol, transport = await _fast_protocol()
        protocol.data_received(post("/predictions/digits", BODY, script="text", close=False))
        deadline = time.monotonic() + TIMEOUT
        while not transport.is_closing():
            assert time.monotonic() < deadline, transport.calls
            await asyncio.sleep(0.001)
        protocol.connection_lost(None)
        return transport

    transport = asyncio.run(main())
    assert transport.calls, "the connection closed"
    assert all(kind == "close" for kind, _ in transport.calls), "nothing half-written"
    assert ScriptedPlane.calls_open == open_before, "the call ended for the drain"


def test_large_oip_outputs_are_encoded_off_the_loop_on_both_ways(
    listeners: dict[str, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    from mariner.server.frontend.protocols.oip import http as oip_http
    from mariner.server.frontend.protocols.oip import rest_codec

    threads: list[str] = []
    real = rest_codec.encode_response

    def recording(*args: Any) -> Any:
        threads.append(threading.current_thread().name)
        return real(*args)

    monkeypatch.setattr(rest_codec, "encode_response", recording)
    monkeypatch.setattr(oip_http, "encode_response", recording)
    for way in ("fast", "app"):
        answer = exchange(listeners[way], post("/v2/models/digits/infer", OIP, script="large-outputs"))
        assert answer.startswith(b"HTTP/1.1 200 OK\r\n"), answer[:200]
        assert len(json.loads(answer.partition(b"\r\n\r\n")[2])["outputs"][2]["data"]) == LARGE_ROWS
    assert len(threads) == 2
    assert all(name.startswith("AnyIO worker thread") for name in threads), threads
