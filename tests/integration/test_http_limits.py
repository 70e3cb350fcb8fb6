"""Connection limits of the HTTP listeners, each attack reproduced at a bounded scale against a real
server on port 0: oversized heads, slow heads and bodies, idle keep-alive, too many connections,
unauthenticated bodies, and TLS without AEAD.

Nothing here depends on the machine's speed: waits are polls or blocking reads with generous
bounds, and the short timeouts are only ever waited for, never raced against.
"""

from __future__ import annotations

import socket
import ssl
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

from mariner.server import protogen
from mariner.server.common.http_limits import STALE_HEAD_S
from tests.integration.test_security import _self_signed
from tests.mariner_serve import MarinerServe

pytestmark = pytest.mark.integration

TOKEN = "limits-inference-token"
LIVE = b"GET /v2/health/live HTTP/1.1\r\nHost: t\r\n\r\n"
WAIT = 120.0  # upper bound for anything we wait on; a pass never takes it


@pytest.fixture(scope="module")
def patient(model_store: Path) -> Iterator[MarinerServe]:
    """Long timeouts, a cap of 4 connections per listener, tokens on."""
    srv = MarinerServe(
        model_store,
        "digits_onnx.mar",
        inference_token=TOKEN,
        http_max_connections=4,
        http_header_timeout_s=600.0,
        http_body_timeout_s=600.0,
        http_keep_alive_s=600.0,
    ).start(settle=False)
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def hasty(model_store: Path) -> Iterator[MarinerServe]:
    """Short timeouts (1 s), no tokens."""
    srv = MarinerServe(
        model_store,
        "digits_onnx.mar",
        http_header_timeout_s=1.0,
        http_body_timeout_s=1.0,
        http_keep_alive_s=1.0,
    ).start(settle=False)
    try:
        yield srv
    finally:
        srv.stop()


def connect(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=WAIT)
    sock.settimeout(WAIT)
    return sock


def read_until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (a reset counts as closed)."""
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except ConnectionResetError:
        pass
    return data


def read_response(sock: socket.socket) -> bytes:
    """One response with a content-length body; the connection stays as the server leaves it."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"closed before a whole response head: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(
        int(v) for k, _, v in (h.partition(b": ") for h in head.split(b"\r\n")) if k == b"content-length"
    )
    while len(body) < length:
        body += sock.recv(65536)
    return data


def send_until_refused(sock: socket.socket, total: int) -> int:
    """Send up to `total` bytes of header value in 4 KiB writes; how many went before the server
    ended the connection."""
    sent = 0
    try:
        while sent < total:
            sock.sendall(b"a" * 4096)
            sent += 4096
    except OSError:  # EPIPE or ECONNRESET: the server closed
        pass
    return sent


def status(response: bytes) -> int:
    return int(response.split(b" ", 2)[1])


def poll(predicate: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def open_connections(srv: MarinerServe) -> int:
    return srv.open_connections()


def test_oversized_request_heads_are_refused_431_and_closed(patient: MarinerServe) -> None:
    port = patient.ports.inference
    with connect(port) as ok:  # 16 KiB of headers is within the 32 KiB default
        ok.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: t\r\nX-Pad: " + b"a" * 16384 + b"\r\n\r\n")
        assert status(read_response(ok)) == 200
    with connect(port) as many:  # 64 KiB in many headers, sent at once
        many.sendall(
            b"GET /ping HTTP/1.1\r\nHost: t\r\n" + (b"X-Pad: " + b"a" * 8000 + b"\r\n") * 8 + b"\r\n"
        )
        answer = read_until_closed(many)
    assert status(answer) == 431, answer[:200]
    assert b"http_max_header_bytes" in answer
    with connect(port) as one:  # one endless header value, trickled: httptools would buffer it all
        one.sendall(b"GET /ping HTTP/1.1\r\nHost: t\r\nX-Pad: ")
        sent = send_until_refused(one, 16 << 20)
        assert sent < 16 << 20, "the server answers and closes mid-way: the client cannot finish"
        answer = read_until_closed(one)
    assert answer == b"" or status(answer) == 431, answer[:200]  # a reset may eat the answer itself


def test_a_half_request_line_is_answered_408_once_the_header_timeout_passes(hasty: MarinerServe) -> None:
    with connect(hasty.ports.inference) as slow:
        slow.sendall(b"GET /pi")
        answer = read_until_closed(slow)
    assert status(answer) == 408, answer[:200]
    assert b"request headers not received within 1 s" in answer


def test_a_connection_that_never_sends_is_closed_without_an_answer(hasty: MarinerServe) -> None:
    with connect(hasty.ports.inference) as silent:
        assert read_until_closed(silent) == b""


def test_a_trickled_body_is_answered_408_once_the_body_timeout_passes(hasty: MarinerServe) -> None:
    with connect(hasty.ports.inference) as slow:
        slow.sendall(
            b"POST /predictions/digits_onnx HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
            b"Content-Length: 1000\r\n\r\n[0.0, "
        )
        answer = read_until_closed(slow)
    assert status(answer) == 408, answer[:200]
    assert b"request body not received within 1 s" in answer


def test_an_idle_keep_alive_connection_is_closed(hasty: MarinerServe) -> None:
    with connect(hasty.ports.inference) as idle:
        idle.sendall(LIVE)
        assert status(read_response(idle)) == 200
        assert read_until_closed(idle) == b"", "nothing more is sent, the connection just ends"
    poll(lambda: open_connections(hasty) == 0, "the server forgets the closed connection")


def test_a_keep_alive_connection_idle_after_a_prediction_is_closed(hasty: MarinerServe) -> None:
    """Predictions are answered from the protocol's callbacks, not an ASGI task: the keep-alive
    timer still starts when the answer is complete."""
    body = b"[" + b", ".join([b"0.0"] * 64) + b"]"
    predict = (
        b"POST /predictions/digits_onnx HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    with connect(hasty.ports.inference) as idle:
        for _ in range(2):  # answered, and the connection kept for the next one
            idle.sendall(predict)
            answer = read_response(idle)
            assert b"\r\nx-request-id: " in answer, answer[:300]
        assert read_until_closed(idle) == b"", "nothing more is sent, the connection just ends"
    poll(lambda: open_connections(hasty) == 0, "the server forgets the closed connection")


def test_connections_beyond_the_cap_get_503_and_grpc_still_answers(patient: MarinerServe) -> None:
    port = patient.ports.inference
    poll(lambda: open_connections(patient) == 0, "no connection left over from other tests")
    held = [connect(port) for _ in range(4)]
    for sock in held:  # clients that use their connections (keep-alive): they keep their slots
        sock.sendall(LIVE)
        assert status(read_response(sock)) == 200
    try:
        poll(lambda: open_connections(patient) == 4, "the server accepted all four")
        with connect(port) as extra:
            extra.sendall(LIVE)
            answer = read_until_closed(extra)
        assert status(answer) == 503, answer[:200]
        assert b"http_max_connections=4" in answer
        assert b"retry-after:" in answer.lower()
        assert open_connections(patient) == 4, "the refused connection was never counted"
        # The flooded HTTP listener leaves the process able to answer gRPC.
        protogen.generate()
        from mariner.server._proto.inference import grpc_service_pb2 as pb
        from mariner.server._proto.inference import grpc_service_pb2_grpc as pbg

        with grpc.insecure_channel(patient.grpc_target) as channel:
            reply = pbg.GRPCInferenceServiceStub(channel).ServerLive(
                pb.ServerLiveRequest(), timeout=WAIT, metadata=[("authorization", f"Bearer {TOKEN}")]
            )
        assert reply.live
    finally:
        for sock in held:
            sock.close()
    poll(lambda: open_connections(patient) == 0, "the held connections are gone")
    with connect(port) as fresh:
        fresh.sendall(LIVE)
        assert status(read_response(fresh)) == 200


def test_a_flood_of_trickled_heads_gives_its_slots_to_a_fresh_client(patient: MarinerServe) -> None:
    """The review's slow-head flood, at the cap of 4: connections that trickle a request line and
    never finish it held every slot for the whole header timeout (600 s here); once they have
    had STALE_HEAD_S, a fresh client takes the oldest one's slot and is served."""
    port = patient.ports.inference
    poll(lambda: open_connections(patient) == 0, "no connection left over from other tests")
    flood = [connect(port) for _ in range(4)]
    fresh: list[socket.socket] = []
    try:
        for sock in flood:
            sock.sendall(b"GET /v2/health/li")
        poll(lambda: open_connections(patient) == 4, "the flood holds every slot")
        time.sleep(STALE_HEAD_S + 0.2)
        for _ in range(3):  # three fresh clients, each staying connected, each served
            fresh.append(connect(port))
            fresh[-1].sendall(LIVE)
            assert status(read_response(fresh[-1])) == 200
        evicted = [read_until_closed(sock) for sock in flood[:3]]  # the oldest three, each told why
        assert all(status(a) == 408 for a in evicted), evicted
        assert all(b"slot went to another" in a for a in evicted)
    finally:
        for sock in [*flood, *fresh]:
            sock.close()


def test_an_unauthenticated_body_is_refused_on_the_headers_and_never_read(patient: MarinerServe) -> None:
    with connect(patient.ports.inference) as sock:
        # Headers only: the 8 MiB body is announced, never sent, so a server waiting for it hangs.
        sock.sendall(
            b"POST /predictions/digits_onnx HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
            b"Content-Length: 8388608\r\n\r\n"
        )
        answer = read_until_closed(sock)
    assert status(answer) == 401, answer[:200]
    assert b"connection: close" in answer.lower()


def test_http_tls_accepts_only_aead_suites(model_store: Path, tmp_path: Path) -> None:
    cert, key = _self_signed(tmp_path, "server")
    srv = MarinerServe(model_store, "digits_onnx.mar", tls_cert_file=cert, tls_key_file=key).start(
        settle=False
    )

    def handshake(ciphers: str, newest: ssl.TLSVersion) -> str:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.load_verify_locations(str(cert))
        ctx.maximum_version = newest
        ctx.set_ciphers(ciphers)
        with ctx.wrap_socket(connect(srv.ports.inference), server_hostname="localhost") as tls:
            tls.sendall(LIVE)
            assert status(read_response(tls)) == 200
            return tls.cipher()[0]

    try:
        for cbc in ("ECDHE-RSA-AES128-SHA256", "ECDHE-RSA-AES256-SHA384", "ECDHE-RSA-AES128-SHA"):
            with pytest.raises((ssl.SSLError, ConnectionError)):
                handshake(cbc, ssl.TLSVersion.TLSv1_2)
        for aead in ("ECDHE-RSA-AES128-GCM-SHA256", "ECDHE-RSA-CHACHA20-POLY1305"):
            assert handshake(aead, ssl.TLSVersion.TLSv1_2) == aead
        assert handshake("DEFAULT", ssl.TLSVersion.TLSv1_3).startswith("TLS_")
    finally:
        srv.stop()
