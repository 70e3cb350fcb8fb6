"""The HTTP-server evaluation harness (mariner.loadtest.experiments.http_servers*): every server it compares
starts on a socket we bound, answers the fixed body under a short closed loop, and reports a
sample the comparison can use; granian's part needs granian, which is not a project dependency.

Nothing here asserts a speed: a sample must have answers, no errors and a CPU figure.
"""

from __future__ import annotations

import importlib.util
import math

import pytest

from mariner.loadtest.experiments.http_servers_bench import PAIRS, ServerProc, measure, summary

pytestmark = [pytest.mark.integration, pytest.mark.slow]

HAS_GRANIAN = importlib.util.find_spec("granian") is not None
NO_GRANIAN = "granian is not installed (an evaluation-only package: pip install granian==2.8.9)"


def _params() -> list[object]:
    needs_granian = [pytest.mark.skipif(not HAS_GRANIAN, reason=NO_GRANIAN)]
    return [
        pytest.param(
            server,
            app,
            id=f"{server}-{app}",
            marks=needs_granian if server.startswith("granian") else [],
        )
        for server, app in PAIRS
    ]


@pytest.mark.parametrize(("server", "app"), _params())
def test_a_short_closed_loop_is_answered_without_errors(server: str, app: str) -> None:
    srv = ServerProc(server, app)
    try:
        sample = measure(srv, connections=4, seconds=2.0)
    finally:
        srv.stop()
    assert sample.errors == 0, sample.first_error
    assert sample.answered > 0
    assert sample.latency.n == sample.answered
    assert math.isfinite(sample.server_cpu_us)
    assert sample.server_cpu_us > 0
    (row,) = summary([sample])
    assert row["server"] == server
    assert row["answered"] == sample.answered


@pytest.mark.skipif(not HAS_GRANIAN, reason=NO_GRANIAN)
def test_granian_embedded_serves_beside_grpc_aio_in_our_loop() -> None:
    from mariner.loadtest.experiments.http_server_limits import grpc_beside_granian
    from mariner.server.common import event_loop

    found: dict[str, object] = {}

    async def run() -> int:
        found.update(await grpc_beside_granian(calls=20))
        return 0

    assert event_loop.run(run()) == 0
    assert found["http_answered"] == found["grpc_answered"] == 20
    assert found["app_ran_on_our_loop"] is True


def test_the_summary_pairs_each_server_with_uvicorn_serving_the_same_app() -> None:
    from mariner.loadtest.closedloop import Percentiles
    from mariner.loadtest.experiments.http_servers_bench import Sample

    def sample(server: str, rps: float, cpu: float) -> Sample:
        return Sample(server, "floor", 64, int(rps), 0, 1.0, rps, cpu, 0.5, Percentiles.of([1.0, 2.0]))

    rows = summary([sample("uvicorn", 100, 50), sample("granian-asgi", 150, 40)] * 3)
    ratios = {r["server"]: (r["rps_ratio"], r["cpu_ratio"]) for r in rows}
    assert ratios == {"uvicorn": (1.0, 1.0), "granian-asgi": (1.5, 0.8)}


def _exchange(port: int, data: bytes) -> bytes:
    """`data` sent on one connection, and everything read until the server closes it."""
    import socket

    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(data)
        got = b""
        while chunk := sock.recv(65536):
            got += chunk
    return got


def test_the_bare_protocol_answers_pipelined_requests_in_order_and_honours_close() -> None:
    from mariner.loadtest.experiments.http_servers import ANSWER

    srv = ServerProc("bare-protocol", "raw")
    try:
        head = b"POST /predictions/digits HTTP/1.1\r\nHost: x\r\n"
        one = head + b"Content-Length: 2\r\n\r\n{}"
        last = head + b"Connection: close\r\nContent-Length: 2\r\n\r\n{}"
        got = _exchange(srv.port, one + one + last)  # the server closes after the third answer
        assert got.count(b"HTTP/1.1 200 OK\r\n") == 3
        assert got.endswith(ANSWER)
        assert _exchange(srv.port, b"NOT HTTP AT ALL\r\n\r\n") == b""  # a parse error closes
    finally:
        srv.stop()


def test_the_bare_prediction_path_answers_what_the_listener_answers_less_the_servers_headers() -> None:
    """What `bare-mariner` is measured against `mariner-listener` for: the same prediction work,
    so the same answer, without uvicorn's default headers (`date`, `server`)."""
    import socket

    from mariner.loadtest.experiments.http_servers import ANSWER

    request = (
        b"POST /predictions/digits HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b'Content-Length: 13\r\n\r\n{"data": [1]}'
    )

    def answer(port: int) -> tuple[bytes, dict[bytes, bytes], bytes]:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(request)
            got = b""
            while not got.endswith(ANSWER):
                chunk = sock.recv(65536)
                assert chunk, got
                got += chunk
        head, _, body = got.partition(b"\r\n\r\n")
        status, *lines = head.split(b"\r\n")
        fields = dict(line.split(b": ", 1) for line in lines)
        return status, fields, body

    servers = [ServerProc("bare-mariner", "mariner"), ServerProc("mariner-listener", "mariner")]
    try:
        (bare_status, bare, bare_body), (status, listener, body) = (answer(s.port) for s in servers)
    finally:
        for srv in servers:
            srv.stop()
    assert bare_status == status == b"HTTP/1.1 200 OK"
    assert bare_body == body == ANSWER
    assert len(bare.pop(b"x-request-id")) == len(listener.pop(b"x-request-id")) > 0
    assert {k: v for k, v in listener.items() if k not in (b"date", b"server")} == bare
