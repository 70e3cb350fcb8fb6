"""What handlers written for TorchServe do at run time, against a live `mariner serve`.

- Streamed answers: a handler calling TorchServe's own `send_intermediate_predict_response`
  gets a chunked HTTP answer (each part one chunk, read by a raw client that sees the chunk
  boundaries), one gRPC StreamPredictions message per part, parts ahead of the answer on
  StreamPredictions2, and the joined parts on unary Predictions. Parts are written while the
  handler still runs (the test releases the handler only after reading the first part), and a
  batch-mate of a streaming request gets its own answer in one piece.
- Async handlers (`async def handle`, asyncCommunication): two calls overlap in one worker,
  proved by events: the first waits for an event only the second sets.
- The path after the version reaches the handler as the `url_path` header.
- A status or header HTTP cannot carry (1xx, 600, a bad header name, CR/LF in a value) is a
  500 naming the handler's value, 204/304 go without a body, and the keep-alive connection
  answers the next request either way.
Envelopes (kserve, kservev2) have their own module: test_envelopes.py.
"""

from __future__ import annotations

import http.client
import json
import socket
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import grpc
import pytest
import requests

from mariner.server._proto.torchserve import inference_pb2, inference_pb2_grpc
from tests.integration.fault_archive import write_handler_archive
from tests.integration.test_faults import counter, wait_for
from tests.mariner_serve import MarinerServe

pytestmark = pytest.mark.integration

TIMEOUT = 60

STREAM_HANDLER = """
import json
import os
import time

from ts.handler_utils.utils import send_intermediate_predict_response


def _wait_for(path, cap_s=120.0):
    end = time.monotonic() + cap_s  # only so that a forgotten gate cannot hang the test run
    while not os.path.exists(path) and time.monotonic() < end:
        time.sleep(0.005)
    return os.path.exists(path)


def handle(data, context):
    if data is None:
        return None
    ops = []
    for row in data:
        body = row.get("body") if row.get("data") is None else row.get("data")
        if isinstance(body, (bytes, bytearray)):
            body = json.loads(body)
        ops.append(body)
    if any(op.get("op") == "block" for op in ops):
        gate = next(op["gate"] for op in ops if op.get("op") == "block")
        open(os.path.join(gate, "started"), "w").close()
        _wait_for(os.path.join(gate, "release"))
    # Parts for the streaming rows only, as TorchServe's examples send them (their request ids).
    streaming = {i: context.get_request_id(i) for i, op in enumerate(ops) if op.get("op") == "stream"}
    parts = max((op.get("parts", 0) for op in ops if op.get("op") == "stream"), default=0)
    for n in range(parts):
        send_intermediate_predict_response(
            [f"p{n}"] * len(data), streaming, "Intermediate Prediction success", 200, context
        )
        for op in ops:
            if op.get("op") == "stream" and op.get("gate") and n == 0:
                if not _wait_for(os.path.join(op["gate"], "read")):
                    return ["the first part was not read in time"] * len(data)
    return [
        "end" if op.get("op") == "stream" else json.dumps({"plain": op.get("value"), "batch": len(data)})
        for op in ops
    ]
"""

ASYNC_HANDLER = """
import asyncio
import json

from ts.handler_utils.utils import send_intermediate_predict_response


class AsyncHandler:
    def initialize(self, context):
        self.gate = None

    async def handle(self, data, context):
        if self.gate is None:
            self.gate = asyncio.Event()  # on the worker's loop, where the calls run
        answers = []
        for i, row in enumerate(data):
            op = row.get("body")
            if isinstance(op, (bytes, bytearray)):
                op = json.loads(op)
            if op == "wait":
                # Say we have started, then wait for a call that can only run beside this one.
                ids = {0: context.get_request_id(i)}
                send_intermediate_predict_response(["waiting"], ids, "", 200, context)
                try:
                    await asyncio.wait_for(self.gate.wait(), 120)
                    answers.append("released")
                except asyncio.TimeoutError:
                    answers.append("timed out: the calls did not overlap")
            elif op == "release":
                self.gate.set()
                answers.append("released the other")
            else:
                answers.append(f"header url_path={context.get_request_header(i, 'url_path')!r}")
        return answers
"""

URL_PATH_HANDLER = """
class UrlPathHandler:
    def initialize(self, context):
        self.context = context  # read in handle, as TorchServe's own test handler does

    def handle(self, data, context):
        return [self.context.get_request_header(i, "url_path") for i in range(len(data))]
"""

WIRE_HANDLER = """
import json


def handle(data, context):
    if data is None:
        return None
    out = []
    for i, row in enumerate(data):
        ask = row.get("body")
        if isinstance(ask, (bytes, bytearray)):
            ask = json.loads(ask)
        context.set_response_status(ask.get("status", 200), "", idx=i)
        for name, value in ask.get("headers", {}).items():
            context.set_response_header(i, name, value)
        out.append(ask.get("body", "answer"))
    return out
"""


def _config(batch_size: int, delay_ms: int = 0, extra: str = "") -> str:
    return f"minWorkers: 1\nmaxWorkers: 1\nbatchSize: {batch_size}\nmaxBatchDelay: {delay_ms}\n{extra}"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MarinerServe]:
    store = tmp_path_factory.mktemp("runtime")
    archives = {
        "streamer": ("stream_handler.py", STREAM_HANDLER, _config(2)),
        "waiter": ("async_handler.py", ASYNC_HANDLER, _config(1, extra="asyncCommunication: true\n")),
        "paths": ("url_path_handler.py", URL_PATH_HANDLER, _config(2, 50)),
        "wire": ("wire_handler.py", WIRE_HANDLER, _config(1)),
    }
    for name, (handler, code, config) in archives.items():
        write_handler_archive(
            store / f"{name}.mar", name, handler, {handler: code, "model-config.yaml": config}
        )
    srv = MarinerServe(store, ",".join(f"{n}.mar" for n in archives)).start()
    try:
        yield srv
    finally:
        srv.stop()


# -- a raw HTTP/1.1 client that sees chunk boundaries ------------------------------------------
class RawResponse:
    """One HTTP/1.1 answer read off a socket: status, headers and the chunks one by one."""

    def __init__(self, url: str, path: str, body: Any) -> None:
        parts = urlsplit(url)
        self.sock = socket.create_connection((parts.hostname, parts.port), timeout=TIMEOUT)
        data = json.dumps(body).encode()
        self.sock.sendall(
            f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n".encode()
            + data
        )
        self.file = self.sock.makefile("rb")
        status_line = self.file.readline().decode()
        self.status = int(status_line.split()[1])
        self.headers: dict[str, str] = {}
        while (line := self.file.readline().decode().strip()) != "":
            key, _, value = line.partition(":")
            self.headers[key.strip().lower()] = value.strip()

    def chunk(self) -> bytes | None:
        """The next chunk's bytes, None at the last (zero-length) chunk."""
        size = int(self.file.readline().split(b";")[0], 16)
        if size == 0:
            self.file.readline()
            return None
        data = self.file.read(size)
        assert self.file.read(2) == b"\r\n"
        return data

    def rest(self) -> list[bytes]:
        out = []
        while (c := self.chunk()) is not None:
            out.append(c)
        return out

    def close(self) -> None:
        self.file.close()
        self.sock.close()


def test_each_part_is_one_chunk_written_while_the_handler_still_runs(
    server: MarinerServe, tmp_path: Path
) -> None:
    raw = RawResponse(
        server.http, "/predictions/streamer", {"op": "stream", "parts": 3, "gate": str(tmp_path)}
    )
    try:
        assert raw.status == 200
        assert raw.headers.get("transfer-encoding") == "chunked"
        assert "content-length" not in raw.headers
        first = raw.chunk()  # the handler waits for the "read" file before its next part
        assert first == b"p0"
        (tmp_path / "read").touch()
        assert raw.rest() == [b"p1", b"p2", b"end"]
    finally:
        raw.close()


def test_a_client_that_goes_away_ends_its_stream_and_the_model_serves_on(
    server: MarinerServe, tmp_path: Path
) -> None:
    before = counter(server, "mariner_requests_total", model="streamer", code="499")
    raw = RawResponse(
        server.http, "/predictions/streamer", {"op": "stream", "parts": 50, "gate": str(tmp_path)}
    )
    assert raw.chunk() == b"p0"
    raw.close()  # gone while the handler still sends
    wait_for(
        lambda: counter(server, "mariner_requests_total", model="streamer", code="499") > before,
        "the call to be counted as the client's going away",
    )
    (tmp_path / "read").touch()  # the handler sends its 49 other parts to nobody, then returns
    after = requests.post(
        f"{server.http}/predictions/streamer", json={"op": "plain", "value": 1}, timeout=TIMEOUT
    )
    assert after.json() == {"plain": 1, "batch": 1}


def test_torchserves_own_streaming_test_reads_four_chunks(server: MarinerServe) -> None:
    """What TorchServe's test_send_intermediate_prediction_response checks, with requests."""
    for stream, chunks in ((True, 4), (False, 1)):
        resp = requests.post(
            f"{server.http}/predictions/streamer",
            json={"op": "stream", "parts": 3},
            stream=stream,
            timeout=TIMEOUT,
        )
        assert resp.status_code == 200
        assert resp.headers["Transfer-Encoding"] == "chunked"
        got = [c for c in resp.iter_content(chunk_size=None) if c]
        assert len(got) == chunks
        assert b"".join(got) == b"p0p1p2end"


def test_a_batch_mate_of_a_streaming_request_gets_its_own_answer_whole(
    server: MarinerServe, tmp_path: Path
) -> None:
    gate = tmp_path / "gate"
    gate.mkdir()
    with ThreadPoolExecutor(3) as pool:
        # A blocker holds the worker, so the two requests after it meet in one handler call.
        blocker = pool.submit(
            requests.post,
            f"{server.http}/predictions/streamer",
            json={"op": "block", "gate": str(gate)},
            timeout=TIMEOUT,
        )
        wait_for((gate / "started").exists, "the blocker runs")
        streaming = pool.submit(_read_all, server.http, {"op": "stream", "parts": 2})
        plain = pool.submit(
            requests.post,
            f"{server.http}/predictions/streamer",
            json={"op": "plain", "value": 7},
            timeout=TIMEOUT,
        )
        wait_for(lambda: counter(server, "mariner_queue_depth", model="streamer") >= 2, "both queue")
        (gate / "release").touch()
        assert blocker.result().status_code == 200
        mate = plain.result()
        chunks = streaming.result()
    assert mate.status_code == 200
    assert mate.json() == {"plain": 7, "batch": 2}  # one handler call held both
    assert "transfer-encoding" not in mate.headers
    assert mate.headers["content-length"]
    assert chunks == [b"p0", b"p1", b"end"]


def _read_all(url: str, body: Any) -> list[bytes]:
    raw = RawResponse(url, "/predictions/streamer", body)
    try:
        return raw.rest()
    finally:
        raw.close()


def test_grpc_streams_each_part_as_a_message(server: MarinerServe) -> None:
    request = inference_pb2.PredictionsRequest(
        model_name="streamer", input={"body": json.dumps({"op": "stream", "parts": 3}).encode()}
    )
    with grpc.insecure_channel(server.grpc_target) as ch:
        stub = inference_pb2_grpc.InferenceAPIsServiceStub(ch)
        streamed = [m.prediction for m in stub.StreamPredictions(request, timeout=TIMEOUT)]
        assert streamed == [b"p0", b"p1", b"p2", b"end"]
        # Unary: one answer, the parts joined in front of the final body (what HTTP reads whole).
        assert stub.Predictions(request, timeout=TIMEOUT).prediction == b"p0p1p2end"
        plain = inference_pb2.PredictionsRequest(model_name="streamer", input={"body": b'{"op": "plain"}'})
        assert [json.loads(m.prediction) for m in stub.StreamPredictions(plain, timeout=TIMEOUT)] == [
            {"plain": None, "batch": 1}
        ]
        seq = inference_pb2.PredictionsRequest(
            model_name="streamer",
            sequence_id="s1",
            input={"body": json.dumps({"op": "stream", "parts": 2}).encode()},
        )
        answers = list(stub.StreamPredictions2(iter([seq]), timeout=TIMEOUT))
    assert [(a.prediction, a.sequence_id) for a in answers] == [(b"p0", "s1"), (b"p1", "s1"), (b"end", "s1")]


# -- async handlers ----------------------------------------------------------------------------
def test_calls_of_an_async_handler_overlap_in_one_worker(server: MarinerServe) -> None:
    raw = RawResponse(server.http, "/predictions/waiter", "wait")
    try:
        assert raw.chunk() == b"waiting"  # its call runs, waiting for the next one's event
        other = requests.post(f"{server.http}/predictions/waiter", json="release", timeout=TIMEOUT)
        assert (other.status_code, other.text) == (200, "released the other")
        assert raw.rest() == [b"released"]
    finally:
        raw.close()


# -- the path after the version ----------------------------------------------------------------
def test_the_path_after_the_version_reaches_the_handler(server: MarinerServe) -> None:
    def post(path: str) -> requests.Response:
        return requests.post(f"{server.http}{path}", json={"prompt": "hi"}, timeout=TIMEOUT)

    with ThreadPoolExecutor(2) as pool:  # batched together (batchSize 2): each keeps its own
        answers = list(
            pool.map(
                post, ["/predictions/paths/1.0/v1/chat/completion", "/predictions/paths/1.0/v1/completion"]
            )
        )
    assert [a.text for a in answers] == ["v1/chat/completion", "v1/completion"]
    assert post("/predictions/paths/1.0/v1/models/").text == "v1/models"  # trailing slashes dropped
    assert post("/predictions/paths").text == ""  # every prediction carries it, empty
    assert post("/predictions/paths/1.0").text == ""
    explained = requests.post(f"{server.http}/explanations/paths/1.0/a/b", json={}, timeout=TIMEOUT)
    assert explained.text == "a/b"
    sent_by_client = requests.post(
        f"{server.http}/predictions/paths", json={}, headers={"url_path": "forged"}, timeout=TIMEOUT
    )
    assert sent_by_client.text == ""  # the server sets it, as TorchServe does


def test_a_bad_path_after_the_version_is_refused(server: MarinerServe) -> None:
    resp = requests.post(f"{server.http}/predictions/paths/1.0/a%01b", json={}, timeout=TIMEOUT)
    assert resp.status_code == 400
    assert "control characters" in resp.json()["message"]
    newline = requests.post(f"{server.http}/predictions/paths/1.0/a%0Ab", json={}, timeout=TIMEOUT)
    assert newline.status_code == 404  # no route takes a newline
    long = "x/" * 1500
    resp = requests.post(f"{server.http}/predictions/paths/1.0/{long}", json={}, timeout=TIMEOUT)
    assert resp.status_code == 400
    assert "at most 2048" in resp.json()["message"]
    unknown = requests.post(f"{server.http}/predictions/paths/9.9/v1/chat", json={}, timeout=TIMEOUT)
    assert unknown.status_code == 404


# -- what a handler may put on the wire --------------------------------------------------------
@pytest.mark.parametrize(
    ("ask", "named"),
    [
        ({"status": 100}, "the status 100"),
        ({"status": 101}, "the status 101"),
        ({"status": 103}, "the status 103"),
        ({"status": 600}, "the status 600"),
        ({"headers": {"bad name": "v"}}, "the header name 'bad name'"),
        ({"headers": {"x-split": "a\r\nset-cookie: planted=1"}}, "header 'x-split'"),
        ({"headers": {"x-nul": "a\u0000b"}}, "header 'x-nul'"),
        ({"headers": {"content-type": "text/plain\r\nx-planted: 1"}}, "header 'content-type'"),
    ],
)
def test_an_answer_http_cannot_carry_is_a_500_and_the_connection_serves_on(
    server: MarinerServe, ask: dict[str, Any], named: str
) -> None:
    conn = http.client.HTTPConnection(urlsplit(server.http).netloc, timeout=TIMEOUT)
    try:
        status, headers, body = _post(conn, {**ask, "body": "secret handler body"})
        assert status == 500
        doc = json.loads(body)
        assert doc["type"] == "InternalServerException"
        assert named in doc["message"]
        assert "planted" not in {k.lower() for k in headers}
        assert "x-planted" not in {k.lower() for k in headers}
        status, _, body = _post(conn, {"body": "next"})  # on the same connection
        assert (status, body) == (200, b"next")
    finally:
        conn.close()
    wait_for(lambda: named in server.log_text(), "the log line naming the handler's value")


@pytest.mark.parametrize("status", [204, 304])
def test_a_no_body_status_is_sent_without_the_body_and_the_connection_serves_on(
    server: MarinerServe, status: int
) -> None:
    sock = socket.create_connection(("127.0.0.1", urlsplit(server.http).port), timeout=TIMEOUT)
    try:
        reader = sock.makefile("rb")
        for ask in ({"status": status, "body": "must not be sent"}, {"body": "next"}):
            data = json.dumps(ask).encode()
            sock.sendall(
                b"POST /predictions/wire HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                + f"Content-Length: {len(data)}\r\n\r\n".encode()
                + data
            )
            line = reader.readline()
            head = {}
            while (h := reader.readline().strip()) != b"":
                key, _, value = h.partition(b":")
                head[key.strip().lower()] = value.strip()
            if ask.get("status") == status:
                assert line.split()[1] == str(status).encode()
                assert b"transfer-encoding" not in head
                assert head.get(b"content-length", b"0") == b"0"
            else:  # had the 204's body been written, it would be read here as the status line
                assert line.startswith(b"HTTP/1.1 200"), line
                assert reader.read(int(head[b"content-length"])) == b"next"
    finally:
        sock.close()


def _post(conn: http.client.HTTPConnection, ask: dict[str, Any]) -> tuple[int, Any, bytes]:
    conn.request(
        "POST", "/predictions/wire", body=json.dumps(ask), headers={"Content-Type": "application/json"}
    )
    resp = conn.getresponse()
    return resp.status, dict(resp.getheaders()), resp.read()
