"""The HTTP connection-limit layer driven without sockets (a fake transport), its settings, and the
credentials that never reach handler code. Real-socket attacks are in tests/integration."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Coroutine
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from starlette.requests import Request
from uvicorn.server import ServerState

from mariner.server.common.config import ServerConfig
from mariner.server.common.config_loading import load_config
from mariner.server.common.held_bytes import HeldBytes, HeldLimits
from mariner.server.common.http_common import request_headers
from mariner.server.common.http_limits import STALE_HEAD_S, HttpLimits, LimitedHttpToolsProtocol
from mariner.server.common.listeners import uvicorn_config
from mariner.server.frontend.protocols.torchserve.grpc_request import request_headers as grpc_request_headers


class FakeTransport(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.written = b""
        self.closed = False

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.written += bytes(data)

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


async def ok_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


def connection(
    cfg: ServerConfig, state: ServerState | None = None, config: uvicorn.Config | None = None
) -> tuple[LimitedHttpToolsProtocol, FakeTransport]:
    """A connection to a listener made from `cfg` (or to `config`'s, which several may share)."""
    if config is None:
        config = uvicorn_config(ok_app, "127.0.0.1", 0, cfg)
        config.load()
    proto = config.http_protocol_class(  # type: ignore[call-arg]
        config=config, server_state=state or ServerState(), app_state={}, _loop=asyncio.get_running_loop()
    )
    assert isinstance(proto, LimitedHttpToolsProtocol)
    transport = FakeTransport()
    proto.connection_made(transport)
    return proto, transport


def in_loop(fn: Callable[[], Coroutine[Any, Any, None]]) -> Callable[[], None]:
    """A plain test that runs the coroutine `fn` on a fresh event loop."""

    def test() -> None:
        asyncio.run(fn())

    test.__name__ = fn.__name__
    test.__doc__ = fn.__doc__
    return test


async def settle(transport: FakeTransport) -> None:
    """Let the ASGI task the protocol started run to its response (event-gated, bounded)."""
    for _ in range(1000):
        if transport.written:
            return
        await asyncio.sleep(0)


def test_limits_refuse_settings_that_are_not_positive() -> None:
    with pytest.raises(ValueError, match="http_max_connections must be positive"):
        HttpLimits(max_connections=0)
    with pytest.raises(ValueError, match="http_header_timeout_s must be positive"):
        HttpLimits(header_timeout_s=-1.0)


def test_limits_are_flags_environment_and_config_file_keys(tmp_path: Path) -> None:
    assert ServerConfig().http_max_header_bytes == 32 * 1024, "nginx's 4 x 8 KiB"
    file = tmp_path / "mariner.yaml"
    file.write_text("http_max_connections: 64\nhttp_body_timeout_s: 7.5\n")
    cfg = load_config(
        ["--config-file", str(file), "--http-header-timeout-s", "3", "--http-max-header-bytes", "4096"],
        env={"MARINER_HTTP_KEEP_ALIVE_S": "2.5"},
    )
    assert (cfg.http_max_connections, cfg.http_body_timeout_s) == (64, 7.5)
    assert (cfg.http_header_timeout_s, cfg.http_max_header_bytes, cfg.http_keep_alive_s) == (3.0, 4096, 2.5)
    with pytest.raises(ValueError, match="http_header_timeout_s must be positive"):
        load_config(["--http-header-timeout-s", "0"], env={})


def test_every_listener_gets_the_limits_and_no_websocket_upgrade() -> None:
    cfg = replace(ServerConfig(), http_max_connections=7, http_keep_alive_s=2.5)
    config = uvicorn_config(ok_app, "127.0.0.1", 0, cfg)
    assert isinstance(config.http, type)
    assert issubclass(config.http, LimitedHttpToolsProtocol)
    assert config.http.limits.max_connections == 7
    assert config.timeout_keep_alive == 2.5
    assert config.ws == "none"
    with pytest.raises(ValueError, match="http_body_timeout_s"):
        uvicorn_config(ok_app, "127.0.0.1", 0, replace(cfg, http_body_timeout_s=0.0))


@in_loop
async def test_a_head_trickled_in_small_reads_is_counted_across_them() -> None:
    cfg = replace(ServerConfig(), http_max_header_bytes=1024)
    proto, transport = connection(cfg)
    proto.data_received(b"GET / HTTP/1.1\r\nX-Pad: ")
    for _ in range(40):  # 1.2 KiB of one header value, never ended
        if transport.closed:
            break
        proto.data_received(b"a" * 30)
    assert transport.closed
    assert transport.written.startswith(b"HTTP/1.1 431 ")
    proto.connection_lost(None)


@in_loop
async def test_heads_within_the_cap_pass_across_reads_and_keep_alive_requests() -> None:
    cfg = replace(ServerConfig(), http_max_header_bytes=1024)
    proto, transport = connection(cfg)
    head = b"GET / HTTP/1.1\r\nHost: t\r\nX-Pad: " + b"a" * 900 + b"\r\n\r\n"
    for _ in range(3):  # each request's head is counted on its own, not the connection's total
        for i in range(0, len(head), 7):
            proto.data_received(head[i : i + 7])
        await settle(transport)
        assert transport.written.startswith(b"HTTP/1.1 200 "), transport.written[:100]
        transport.written = b""
    assert not transport.closed
    proto.connection_lost(None)


@in_loop
async def test_a_connection_beyond_the_cap_is_answered_503_and_never_counted() -> None:
    cfg = replace(ServerConfig(), http_max_connections=1)
    state = ServerState()
    first, first_transport = connection(cfg, state)
    extra, extra_transport = connection(cfg, state)
    assert extra_transport.written.startswith(b"HTTP/1.1 503 ")
    assert b"retry-after: " in extra_transport.written
    assert len(state.connections) == 1
    extra.data_received(b"GET / HTTP/1.1\r\n\r\n")
    assert extra_transport.closed, "closed once its request is read"
    extra.connection_lost(None)
    assert not first_transport.closed
    first.connection_lost(None)
    assert len(state.connections) == 0
    _, again = connection(cfg, state)
    assert not again.written, "a slot freed is a slot available"


@in_loop
async def test_on_a_full_listener_a_stale_unproven_connection_gives_its_slot_to_a_new_one() -> None:
    cfg = replace(ServerConfig(), http_max_connections=2)
    state = ServerState()
    listener = uvicorn_config(ok_app, "127.0.0.1", 0, cfg)
    listener.load()
    connect = functools.partial(connection, config=listener)
    served, served_transport = connect(cfg, state)
    served.data_received(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")  # a real client: a complete head
    trickler, trickler_transport = connect(cfg, state)
    trickler.data_received(b"GET /pi")  # half a request line, then nothing
    early, early_transport = connect(cfg, state)
    assert early_transport.written.startswith(b"HTTP/1.1 503 "), "within the grace nobody is evicted"
    early.connection_lost(None)
    type(trickler).unproven[trickler] -= STALE_HEAD_S  # as if the trickler had waited the grace
    fresh, fresh_transport = connect(cfg, state)
    assert not fresh_transport.written, "the new connection is served"
    assert trickler_transport.closed
    assert trickler_transport.written.startswith(b"HTTP/1.1 408 "), "it had sent something: told why"
    assert not served_transport.closed, "a connection that completed a request keeps its slot"
    trickler.connection_lost(None)
    # Only unproven connections are evicted: with the new one proven too, a fourth is refused.
    fresh.data_received(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    last, last_transport = connect(cfg, state)
    assert last_transport.written.startswith(b"HTTP/1.1 503 ")
    for proto in (served, fresh, last):
        proto.connection_lost(None)
    await asyncio.sleep(0)


async def _settle(transport: FakeTransport, cap: int = 2_000) -> None:
    for _ in range(cap):  # bounded: the app's task and the timers need a few loop turns
        if transport.closed:
            return
        await asyncio.sleep(0.002)


@in_loop
async def test_a_keep_alive_connection_closes_once_idle_for_the_keep_alive_after_its_last_answer() -> None:
    """One timer per connection, not one per answer: when it fires on a connection answered since
    it was armed, it waits out the rest of the idle time instead of closing."""
    keep = 1.0
    proto, transport = connection(replace(ServerConfig(), http_keep_alive_s=keep))
    loop = asyncio.get_running_loop()
    last_answer = loop.time()
    end = last_answer + 2 * keep  # in use for twice the keep-alive, a request every tenth of it
    while loop.time() < end:
        transport.written = b""
        proto.data_received(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        await settle(transport)
        assert transport.written.startswith(b"HTTP/1.1 200 "), transport.written[:60]
        last_answer = loop.time()
        assert not transport.closed, "a connection in use is not closed as idle"
        await asyncio.sleep(keep / 10)
    await _settle(transport)
    assert transport.closed, "closed once idle for the keep-alive"
    assert loop.time() - last_answer >= keep - 0.01, "not before it had been idle that long"
    proto.connection_lost(None)


@in_loop
async def test_at_shutdown_an_idle_keep_alive_connection_answers_a_request_already_sent() -> None:
    cfg = replace(ServerConfig(), http_keep_alive_s=600.0)
    proto, transport = connection(cfg)
    proto.data_received(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    for _ in range(100):
        if transport.written.endswith(b"ok"):
            break
        await asyncio.sleep(0.002)
    transport.written = b""
    proto.shutdown()  # idle: uvicorn would close it here, resetting a request on its way
    assert not transport.closed
    proto.data_received(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")  # it was on its way
    await _settle(transport)
    assert transport.written.startswith(b"HTTP/1.1 200 "), transport.written[:60]
    assert b"connection: close" in transport.written.lower()
    assert transport.closed, "closed once that answer is written"
    proto.connection_lost(None)


@in_loop
async def test_at_shutdown_an_idle_connection_with_nothing_on_its_way_closes_after_the_linger() -> None:
    proto, transport = connection(replace(ServerConfig(), http_keep_alive_s=600.0))
    proto.data_received(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    await asyncio.sleep(0.01)
    proto.shutdown()
    assert not transport.closed
    await _settle(transport)
    assert transport.closed
    proto.connection_lost(None)


@in_loop
async def test_held_body_bytes_are_counted_as_they_arrive_and_released_with_the_answer() -> None:
    held = HeldBytes(HeldLimits(limit=100, stream_limit=10))
    listener = uvicorn_config(ok_app, "127.0.0.1", 0, ServerConfig(), held=held)
    listener.load()
    proto, transport = connection(ServerConfig(), config=listener)
    proto.data_received(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 30\r\n\r\n0123456789")
    assert held.held == 10, "what arrived, not what was promised"
    await asyncio.sleep(0.01)  # ok_app answers without reading the body
    assert transport.written.endswith(b"ok")
    assert held.held == 0, "released with the answer"
    proto.data_received(b"x" * 20)  # the rest of that body, after its answer: dropped, not counted
    assert held.held == 0
    held.add(90)  # others hold 90 of 100: a body of 30 cannot fit and is refused unread
    proto.data_received(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 30\r\n\r\n")
    assert b"HTTP/1.1 503 " in transport.written
    assert b"retry-after: 1" in transport.written
    assert b"frontend_max_held_mb" in transport.written
    assert transport.closed
    proto.connection_lost(None)
    assert held.held == 90


@in_loop
async def test_timers_end_a_stalled_head_with_408_and_an_unused_connection_silently() -> None:
    cfg = replace(ServerConfig(), http_header_timeout_s=0.01)
    stalled, stalled_transport = connection(cfg)
    stalled.data_received(b"GET /pi")
    unused, unused_transport = connection(cfg)
    for _ in range(10_000):  # bounded: each turn sleeps a little, the timers are 10 ms
        if stalled_transport.closed and unused_transport.closed:
            break
        await asyncio.sleep(0.005)
    assert stalled_transport.written.startswith(b"HTTP/1.1 408 ")
    assert unused_transport.closed
    assert unused_transport.written == b""
    stalled.connection_lost(None)
    unused.connection_lost(None)


def test_credentials_never_reach_handlers_over_http_or_grpc() -> None:
    scope = {
        "type": "http",
        "headers": [
            (b"authorization", b"Bearer secret"),
            (b"proxy-authorization", b"Basic c2VjcmV0"),
            (b"x-request-id", b"r1"),
        ],
    }
    assert request_headers(Request(scope), 100) == {"x-request-id": "r1"}
    metadata = [("authorization", "Bearer secret"), ("x-request-id", "r1")]
    assert grpc_request_headers(metadata) == {"x-request-id": "r1"}


def test_a_client_cannot_send_the_server_set_explain_or_describe_switches() -> None:
    """TorchServe-style handlers take their explain/describe path on these headers; only the
    server's explanation and describe routes may set them."""
    scope = {
        "type": "http",
        "headers": [(b"explain", b"True"), (b"describe", b"True"), (b"x-request-id", b"r1")],
    }
    assert request_headers(Request(scope), 100) == {"x-request-id": "r1"}
    metadata = [("explain", "True"), ("describe", "True"), ("x-request-id", "r1")]
    assert grpc_request_headers(metadata) == {"x-request-id": "r1"}
