"""One HTTP server process for the HTTP-server evaluation: uvicorn or granian over the same app.

`python -m mariner.loadtest.experiments.http_servers SERVER APP` binds a listener itself (a SO_REUSEPORT
socket on 127.0.0.1, port 0, exactly as a frontend binds it with `listeners.reuseport_listener`),
serves APP on it with SERVER on one uvloop event loop, and prints the port on stdout once it is
listening. It runs until SIGTERM. The driver (`mariner.loadtest.experiments.http_servers_bench`) measures it.

Servers:
- `uvicorn`: `listeners.uvicorn_config` + `EmbeddedUvicorn`, the frontend's own configuration
  (httptools behind our limits protocol, keep-alive timer, no lifespan, no WebSocket);
- `granian-asgi`: granian's embedded server (`granian.server.embed.Server`, ASGI without
  lifespan) handed the very socket we bound, in our own loop, one Rust runtime thread;
- `granian-rsgi`: the same embedded server with granian's native RSGI interface;
- `bare-protocol`: no server library: httptools' parser on an `asyncio.Protocol` of our own,
  the answer's bytes written from the parser's last callback (`BareProtocol`). It enforces no
  limit and serves only `raw`: it is the floor of a Python frontend on uvloop + httptools, what
  replacing uvicorn's protocol on the prediction path could reach at best;
- `bare-mariner`: the same bare protocol doing Mariner's own work per prediction with the fast
  path's functions and no uvicorn or limits under it (`bare_prediction`), serving only `mariner`:
  the floor of a prediction path on a protocol of our own;
- `mariner-listener`: the frontend's own inference listener (`inference_listener`: uvicorn with
  Mariner's protocol, predictions answered from its callbacks, TorchServe's access log), serving
  only `mariner`.

Apps:
- `raw`: a bare ASGI callable that reads the body and answers a fixed 30-byte JSON body (the
  server's own floor); under `granian-rsgi` a bare RSGI handler with the same answer;
- `floor`: a Starlette app answering POST /predictions/{model} with the same body (the
  transport floor of a Starlette app, as TRAPS.md measures it);
- `mariner`: the frontend's real inference app (`DrainAware(HttpTokenAuth(inference_app(...)))`)
  over a real DataPlane, ModelEndpoint and Batcher whose runner answers in-process, so only the
  HTTP layer differs from a frontend (no worker hop). RSGI has no such app: Mariner's app is ASGI.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import signal
import socket
import ssl
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from mariner.server.common import event_loop
from mariner.server.common.config import ServerConfig
from mariner.server.common.listeners import EmbeddedUvicorn, reuseport_listener, uvicorn_config

SERVERS = ("uvicorn", "granian-asgi", "granian-rsgi", "bare-protocol", "bare-mariner", "mariner-listener")
APPS = ("raw", "floor", "mariner")
ANSWER = b'{"label": 3, "probability": 1}'  # the fixed 30-byte JSON answer
MODEL = "digits"
HOST = "127.0.0.1"


async def _floor_predict(request: Request) -> Response:
    await request.body()
    return Response(ANSWER, media_type="application/json")


async def _floor_close(request: Request) -> Response:
    """The floor's answer with `Connection: close`, as DrainAware sets it while a frontend drains."""
    await request.body()
    return Response(ANSWER, media_type="application/json", headers={"connection": "close"})


async def _floor_slow(request: Request) -> Response:
    """An answer that takes a second: a request in flight when the server is told to stop."""
    await request.body()
    await asyncio.sleep(1.0)
    return Response(ANSWER, media_type="application/json")


def floor_app() -> Starlette:
    """The transport floor: one route, a read body, a fixed answer (plus two routes for the limit
    probes of `http_server_limits`, off the measured path)."""
    return Starlette(
        routes=[
            Route("/predictions/{model}", _floor_predict, methods=["POST"]),
            Route("/close", _floor_close, methods=["POST"]),
            Route("/slow", _floor_slow, methods=["POST"]),
        ]
    )


async def raw_asgi(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """The bare ASGI floor: no framework, the body read, the fixed answer (the server's own cost)."""
    if scope["type"] != "http":
        return
    more = True
    while more:
        more = (await receive()).get("more_body", False)
    await send({"type": "http.response.start", "status": 200, "headers": RAW_HEADERS})
    await send({"type": "http.response.body", "body": ANSWER})


RAW_HEADERS = [(b"content-type", b"application/json"), (b"content-length", str(len(ANSWER)).encode())]


class FloorRsgi:
    """The RSGI floor: read the body, answer the fixed bytes (granian's leanest Python path)."""

    _headers = [("content-type", "application/json")]

    async def __rsgi__(self, scope: Any, proto: Any) -> None:
        if scope.proto != "http":
            return
        await proto()  # the whole body
        proto.response_bytes(200, self._headers, ANSWER)


class BareProtocol(asyncio.Protocol):
    """httptools on an asyncio Protocol and nothing else: keep-alive, bodies by Content-Length,
    the fixed answer (head and body in one write) from the parser's message-complete callback."""

    _answer = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (
        len(ANSWER),
        ANSWER,
    )

    def __init__(self) -> None:
        import httptools

        self._errors = (httptools.HttpParserError,)
        self._parser = httptools.HttpRequestParser(self)
        self._transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        try:
            self._parser.feed_data(data)
        except self._errors:
            assert self._transport is not None
            self._transport.close()

    def on_message_complete(self) -> None:
        assert self._transport is not None
        self._transport.write(self._answer)
        if not self._parser.should_keep_alive():
            self._transport.close()


async def _serve_bare(
    sock: socket.socket, stop: asyncio.Event, protocol: Callable[[], asyncio.Protocol] = BareProtocol
) -> None:
    server = await asyncio.get_running_loop().create_server(protocol, sock=sock)
    _announce(sock.getsockname()[1])
    await stop.wait()
    server.close()
    await server.wait_closed()


def answering_plane(cfg: ServerConfig) -> Any:
    """A real DataPlane, ModelEndpoint and Batcher whose one model answers in-process."""
    from mariner.server.common.metrics import Metrics, MetricsConfig
    from mariner.server.common.model_settings import ModelSettings
    from mariner.server.contracts.types import InferRequest, InferResult, ModelState
    from mariner.server.contracts.worker_api import ModelEntry
    from mariner.server.frontend.dataplane import DataPlane
    from mariner.server.frontend.endpoint import ModelEndpoint

    class Answering:
        """A BatchRunner that answers every request of a batch with the fixed body at once."""

        id = f"{MODEL}-inprocess-0"

        async def run(self, requests: Sequence[InferRequest]) -> list[InferResult]:
            return [InferResult(body=ANSWER, model_version="1.0") for _ in requests]

    metrics = Metrics(MetricsConfig(slo_seconds=cfg.slo_ms / 1e3))
    plane = DataPlane(metrics)
    settings = ModelSettings(batch_size=8, max_batch_delay_ms=0.0)
    entry = ModelEntry(MODEL, "1.0", f"{MODEL}.mar", "ab" * 32, ".", {}, {}, settings, True, True)
    endpoint = ModelEndpoint(entry, metrics)
    plane.install_endpoint(endpoint)
    plane.set_default(MODEL, "1.0")
    endpoint._start_batcher([Answering()])  # noqa: SLF001 - an in-process runner instead of a worker's connection
    endpoint.state = ModelState.READY
    return plane


def mariner_app(cfg: ServerConfig) -> Any:
    """The frontend's inference app (the ASGI routes) over `answering_plane`."""
    from mariner.server.common.security import HttpTokenAuth, load_tokens
    from mariner.server.frontend.protocols.http_drain import DrainAware
    from mariner.server.frontend.protocols.http_listener import inference_app

    plane = answering_plane(cfg)
    app = inference_app(plane, max_body_bytes=cfg.max_request_bytes)
    return DrainAware(HttpTokenAuth(app, load_tokens(None, None)), plane)


def mariner_listener(cfg: ServerConfig, port: int) -> Any:
    """The frontend's own inference listener (`inference_listener`: its protocol, predictions on
    the callback path, the access log) over `answering_plane`: uvicorn's settings."""
    from mariner.server.common.listeners import listener_auth
    from mariner.server.common.security import load_tokens
    from mariner.server.frontend.protocols.http_inference import inference_listener

    auth = listener_auth(load_tokens(None, None), None)
    return inference_listener(answering_plane(cfg), cfg, auth, port=port, thread="bench", held=None)


def bare_mariner(cfg: ServerConfig) -> Callable[[], asyncio.Protocol]:
    """Mariner's prediction work on the bare protocol (`bare_prediction`) over `answering_plane`."""
    from mariner.loadtest.experiments.bare_prediction import bare_prediction
    from mariner.server.common.http_common import DEFAULT_MAX_HEADERS

    return bare_prediction(answering_plane(cfg), DEFAULT_MAX_HEADERS)


async def _serve_uvicorn(config: Any, sock: socket.socket, stop: asyncio.Event) -> None:
    port = sock.getsockname()[1]
    server = EmbeddedUvicorn(config)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        if task.done():
            task.result()
        await asyncio.sleep(0.005)
    _announce(port)
    await stop.wait()
    server.should_exit = True
    await task


def granian_server(target: Any, interface: str, sock: socket.socket, **options: Any) -> Any:
    """granian's embedded server serving on `sock`, a socket we bound (granian does not bind).

    granian has no public option for a listening socket it did not create; its Rust worker
    takes a `SocketHolder` built from a descriptor (as its own Windows path does), so the
    shared-socket hook is replaced to hand it ours. `options` go to the Server as they are.
    """
    from granian._granian import SocketHolder
    from granian.constants import Interfaces
    from granian.server.embed import Server

    class OnOurSocket(Server):
        def _init_shared_socket(self) -> None:
            # The stub omits the constructor's arguments: (fd, is_uds, backlog).
            holder: Any = SocketHolder(sock.fileno(), False, 2048)  # type: ignore[call-arg]
            fd: Any = sock.fileno()
            self._ssp, self._shd, self._sfd = None, holder, fd

    host, port = sock.getsockname()[:2]
    kind = Interfaces.RSGI if interface == "rsgi" else Interfaces.ASGINL
    options.setdefault("log_level", "warning")
    return OnOurSocket(target, address=host, port=port, interface=kind, websockets=False, **options)


def granian_options(cfg: ServerConfig) -> dict[str, Any]:
    """The nearest granian 2.8 settings to our HTTP limits (see bench/http-servers.md).

    Header timeout: `header_read_timeout` (ms, at most 60 s). Header bytes: hyper's read buffer
    (`max_buffer_size`, at least 8 KiB), which bounds the head. Keep-alive: on or off, no idle
    time. No body timeout and no connection cap exist; `backpressure` bounds requests being
    processed, not connections. TLS: rustls from the PEM files (TLS 1.2 minimum, as ours).
    """
    from granian.constants import SSLProtocols
    from granian.http import HTTP1Settings

    http1 = HTTP1Settings(
        header_read_timeout=min(60_000, int(cfg.http_header_timeout_s * 1000)),
        keep_alive=True,
        max_buffer_size=max(8192, cfg.http_max_header_bytes),
    )
    options: dict[str, Any] = {"http": "1", "http1_settings": http1, "runtime_threads": 1}
    if cfg.tls_cert_file is not None:
        options |= {
            "ssl_cert": cfg.tls_cert_file,
            "ssl_key": cfg.tls_key_file,
            "ssl_protocol_min": SSLProtocols.tls12,
        }
        if cfg.tls_client_ca_file is not None:
            options |= {"ssl_ca": cfg.tls_client_ca_file, "ssl_client_verify": True}
    return options


async def _serve_granian(
    app: Any, interface: str, sock: socket.socket, stop: asyncio.Event, cfg: ServerConfig
) -> None:
    server = granian_server(app, interface, sock, **granian_options(cfg))
    task = asyncio.create_task(server.serve())
    await wait_serving(sock.getsockname()[1], task, cfg.tls_cert_file is not None)
    _announce(sock.getsockname()[1])
    await stop.wait()
    server.stop()
    await task


async def wait_serving(port: int, task: asyncio.Task[None], tls: bool) -> None:
    """granian says nothing when its worker serves, and our socket accepts before it does: poll
    with a request until one is answered (a readiness poll, never a fixed sleep)."""
    context = None
    if tls:
        context = ssl.create_default_context()
        context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    request = f"POST /predictions/{MODEL} HTTP/1.1\r\nHost: {HOST}\r\nContent-Length: 2\r\n\r\n{{}}"
    while True:
        if task.done():
            task.result()
            raise RuntimeError("granian stopped during start-up")
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection(HOST, port, ssl=context), 0.5)
        except (OSError, TimeoutError):
            await asyncio.sleep(0.01)
            continue
        try:
            writer.write(request.encode())
            await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 0.5)
            return
        except (OSError, TimeoutError, asyncio.IncompleteReadError):
            await asyncio.sleep(0.01)
        finally:
            writer.close()


PORT_LINE = "listening on port "


def _announce(port: int) -> None:
    # A marked line: granian logs to stdout too.
    print(f"{PORT_LINE}{port}", flush=True)


async def serve(server: str, app_name: str, cfg: ServerConfig) -> int:
    """Serve `app_name` with `server` under `cfg`'s HTTP limits until SIGTERM or SIGINT."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    sock = reuseport_listener(HOST, 0)
    if server == "bare-protocol":
        if app_name != "raw":
            raise SystemExit("bare-protocol serves only the raw app: it has no ASGI")
        await _serve_bare(sock, stop)
        return 0
    if server == "granian-rsgi":
        if app_name != "raw":
            raise SystemExit("granian-rsgi serves only the raw app: Starlette and Mariner's app are ASGI")
        await _serve_granian(FloorRsgi(), "rsgi", sock, stop, cfg)
        return 0
    if server == "bare-mariner":
        if app_name != "mariner":
            raise SystemExit("bare-mariner serves only the mariner app: it is Mariner's prediction path")
        await _serve_bare(sock, stop, bare_mariner(cfg))
        return 0
    port = sock.getsockname()[1]
    if server == "mariner-listener":
        if app_name != "mariner":
            raise SystemExit("mariner-listener serves only the mariner app: it is the frontend's listener")
        await _serve_uvicorn(mariner_listener(cfg, port), sock, stop)
        return 0
    app = {"raw": lambda: raw_asgi, "floor": floor_app, "mariner": lambda: mariner_app(cfg)}[app_name]()
    if server == "uvicorn":
        await _serve_uvicorn(uvicorn_config(app, HOST, port, cfg), sock, stop)
    else:
        await _serve_granian(app, "asgi", sock, stop, cfg)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mariner.loadtest.experiments.http_servers")
    parser.add_argument("server", choices=SERVERS)
    parser.add_argument("app", choices=APPS)
    parser.add_argument("--limits", default="{}", help="JSON: ServerConfig http_*/tls_* fields to change")
    args = parser.parse_args(argv)
    changes = json.loads(args.limits)
    for name in ("tls_cert_file", "tls_key_file", "tls_client_ca_file"):
        if changes.get(name) is not None:
            changes[name] = Path(changes[name])
    cfg = dataclasses.replace(ServerConfig(), **changes)
    return event_loop.run(serve(args.server, args.app, cfg))


if __name__ == "__main__":
    sys.exit(main())
