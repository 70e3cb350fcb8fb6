"""Probes of the HTTP limits a frontend enforces, run against uvicorn and against granian.

Each probe starts `mariner.loadtest.experiments.http_servers SERVER floor` with short limits (2 s header,
body and keep-alive timeouts, 32 KiB head, 8 connections) and records, over a raw socket, what
the server does: the status line it answered (if any) and when the connection closed. The
findings go into bench/http-servers.md; `python -m mariner.loadtest.experiments.http_server_limits` prints
them as JSON. A probe waits at most a few seconds beyond the limit it tests, so "open" means
"still open when the probe gave up", i.e. the limit was not enforced.
"""

from __future__ import annotations

import asyncio
import json
import signal
import ssl
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Coroutine, Sequence
from pathlib import Path
from typing import Any

from mariner.loadtest.experiments.http_servers import HOST, PORT_LINE

LIMITS: dict[str, Any] = {
    "http_header_timeout_s": 2.0,
    "http_body_timeout_s": 2.0,
    "http_keep_alive_s": 2.0,
    "http_max_connections": 8,
    "http_max_header_bytes": 32 * 1024,
}
GIVE_UP_S = 6.0  # beyond every 2 s limit, with room for a slow machine
REQUEST = b"POST /predictions/digits HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"


class Server:
    """One server process with `limits`, as a context manager; `port` once it listens."""

    def __init__(self, server: str, limits: dict[str, Any]) -> None:
        cmd = [sys.executable, "-m", "mariner.loadtest.experiments.http_servers", server, "floor"]
        cmd += ["--limits", json.dumps(limits)]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(PORT_LINE):
                self.port = int(line[len(PORT_LINE) :])
                return
        raise RuntimeError(f"{server} exited before listening")

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
        self.proc.wait(10)


async def _outcome(reader: asyncio.StreamReader, t0: float, wait: float = GIVE_UP_S) -> str:
    """What the server did within `wait` seconds: its status line and/or when it closed."""
    try:
        data = await asyncio.wait_for(reader.read(65536), wait)
    except TimeoutError:
        return f"no answer, connection still open after {wait:g} s"
    except (ConnectionResetError, BrokenPipeError):
        return f"reset after {time.perf_counter() - t0:.1f} s"
    if not data:
        return f"closed without an answer after {time.perf_counter() - t0:.1f} s"
    status = data.split(b"\r\n", 1)[0].decode("latin-1")
    return f"{status!r} after {time.perf_counter() - t0:.1f} s"


async def big_head(port: int) -> str:
    reader, writer = await asyncio.open_connection(HOST, port)
    t0 = time.perf_counter()
    writer.write(REQUEST + b"X-Big: " + b"a" * 100 * 1024 + b"\r\nContent-Length: 2\r\n\r\n{}")
    return await _outcome(reader, t0)


async def big_body(port: int) -> str:
    """A 1 MiB body under the 32 KiB head cap: granian's cap is its read buffer, which must not
    bound bodies."""
    reader, writer = await asyncio.open_connection(HOST, port)
    t0 = time.perf_counter()
    body = b"1" * (1 << 20)
    writer.write(REQUEST + b"Content-Length: %d\r\n\r\n" % len(body) + body)
    return await _outcome(reader, t0)


async def head_trickle(port: int) -> str:
    """Slowloris: the request line, then one header byte every 0.5 s."""
    reader, writer = await asyncio.open_connection(HOST, port)
    t0 = time.perf_counter()
    writer.write(b"POST /predictions/digits HTTP/1.1\r\n")

    async def trickle() -> None:
        for _ in range(int(GIVE_UP_S * 2)):
            await asyncio.sleep(0.5)
            writer.write(b"x")

    task = asyncio.create_task(trickle())
    try:
        return await _outcome(reader, t0, GIVE_UP_S)
    finally:
        task.cancel()


async def silent(port: int) -> str:
    reader, _ = await asyncio.open_connection(HOST, port)
    return await _outcome(reader, time.perf_counter())


async def idle_keep_alive(port: int) -> str:
    """One answered request, then nothing: when does the server close the idle connection?"""
    reader, writer = await asyncio.open_connection(HOST, port)
    writer.write(REQUEST + b"Content-Length: 2\r\n\r\n{}")
    await reader.readuntil(b"\r\n\r\n")
    await reader.read(30)
    return await _outcome(reader, time.perf_counter(), GIVE_UP_S + 2)


async def body_trickle(port: int) -> str:
    """A complete head announcing 1000 bytes, then one body byte every 0.5 s."""
    reader, writer = await asyncio.open_connection(HOST, port)
    t0 = time.perf_counter()
    writer.write(REQUEST + b"Content-Length: 1000\r\n\r\n")

    async def trickle() -> None:
        for _ in range(int(GIVE_UP_S * 2)):
            await asyncio.sleep(0.5)
            writer.write(b"1")

    task = asyncio.create_task(trickle())
    try:
        return await _outcome(reader, t0)
    finally:
        task.cancel()


async def connection_cap(port: int) -> str:
    """3 x the cap of connections open at once, each sending a request: what each was answered."""
    n = 3 * int(LIMITS["http_max_connections"])
    conns = [await asyncio.open_connection(HOST, port) for _ in range(n)]
    for _, writer in conns:
        writer.write(REQUEST + b"Content-Length: 2\r\n\r\n{}")
    counts: dict[str, int] = {}
    for reader, writer in conns:
        try:
            line = (await asyncio.wait_for(reader.readline(), GIVE_UP_S)).decode().strip() or "closed"
        except (TimeoutError, ConnectionError):
            line = "no answer"
        counts[line] = counts.get(line, 0) + 1
        writer.close()
    return f"{n} connections: " + ", ".join(f"{k} x{v}" for k, v in sorted(counts.items()))


async def connection_close(port: int) -> str:
    """An answer whose app set `Connection: close` (the drain): does the server close after it?"""
    reader, writer = await asyncio.open_connection(HOST, port)
    writer.write(REQUEST.replace(b"/predictions/digits", b"/close") + b"Content-Length: 2\r\n\r\n{}")
    head = await reader.readuntil(b"\r\n\r\n")
    await reader.read(30)
    said = "says close" if b"connection: close" in head.lower() else "no Connection: close header"
    return f"answer {said}; then " + await _outcome(reader, time.perf_counter(), 3.0)


PROBES: dict[str, Callable[[int], Coroutine[Any, Any, str]]] = {
    "100 KiB head (cap 32 KiB)": big_head,
    "1 MiB body (head cap 32 KiB)": big_body,
    "header trickle (timeout 2 s)": head_trickle,
    "connection sending nothing (header timeout 2 s)": silent,
    "idle keep-alive (keep-alive 2 s)": idle_keep_alive,
    "body trickle (body timeout 2 s)": body_trickle,
    "connections over the cap (cap 8)": connection_cap,
    "app sets Connection: close (drain)": connection_close,
}


async def _graceful_stop(server: Server) -> str:
    """A request in flight (1 s) when the server is sent SIGTERM: is it answered?"""
    reader, writer = await asyncio.open_connection(HOST, server.port)
    writer.write(REQUEST.replace(b"/predictions/digits", b"/slow") + b"Content-Length: 2\r\n\r\n{}")
    await asyncio.sleep(0.3)
    t0 = time.perf_counter()
    server.proc.send_signal(signal.SIGTERM)
    return await _outcome(reader, t0)


def _self_signed(folder: Path) -> tuple[Path, Path]:
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1"]
        + ["-keyout", str(key), "-out", str(cert)],
        check=True,
        capture_output=True,
    )
    return cert, key


async def _tls(port: int) -> str:
    """A default TLS client, then a TLS 1.2 client offering only CBC suites (ours refuse those)."""
    results = []
    for label, ciphers in (("default client", None), ("TLS 1.2 CBC-only client", "AES128-SHA:AES256-SHA")):
        ctx = ssl.create_default_context()
        ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
        if ciphers:
            ctx.maximum_version = ssl.TLSVersion.TLSv1_2
            ctx.set_ciphers(ciphers)
        try:
            reader, writer = await asyncio.open_connection(HOST, port, ssl=ctx)
            writer.write(REQUEST + b"Content-Length: 2\r\n\r\n{}")
            line = (await asyncio.wait_for(reader.readline(), GIVE_UP_S)).decode().strip()
            results.append(f"{label}: {line!r} ({writer.get_extra_info('ssl_object').version()})")
            writer.close()
        except (ssl.SSLError, ConnectionError, TimeoutError) as exc:
            results.append(f"{label}: refused ({type(exc).__name__})")
    return "; ".join(results)


def probe(server: str) -> dict[str, str]:
    """Every probe against `server`; each on a fresh server process (a probe may break one)."""
    found: dict[str, str] = {}
    for name, fn in PROBES.items():
        with Server(server, LIMITS) as srv:
            found[name] = asyncio.run(fn(srv.port))
    # granian has one timer for a head and for an idle keep-alive connection: set them apart.
    with Server(server, LIMITS | {"http_keep_alive_s": 1.0, "http_header_timeout_s": 4.0}) as srv:
        found["idle keep-alive (keep-alive 1 s, header timeout 4 s)"] = asyncio.run(idle_keep_alive(srv.port))
    with Server(server, LIMITS) as srv:
        found["request in flight at SIGTERM (1 s)"] = asyncio.run(_graceful_stop(srv))
    with tempfile.TemporaryDirectory() as tmp:
        cert, key = _self_signed(Path(tmp))
        with Server(server, {"tls_cert_file": str(cert), "tls_key_file": str(key)}) as srv:
            found["TLS with our settings"] = asyncio.run(_tls(srv.port))
    return found


async def grpc_beside_granian(calls: int = 200) -> dict[str, Any]:
    """granian's embedded server and a grpc.aio server in one event loop (a frontend's shape):
    HTTP posts and gRPC health checks at the same time, and on which loop the app ran."""
    import grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    from mariner.loadtest.experiments.http_servers import (
        ANSWER,
        MODEL,
        floor_app,
        granian_options,
        granian_server,
        wait_serving,
    )
    from mariner.loadtest.http_connection import HttpConnection
    from mariner.server.common.config import ServerConfig
    from mariner.server.common.listeners import reuseport_listener

    loop = asyncio.get_running_loop()
    loops: set[int] = set()
    app = floor_app()

    async def recording(scope: Any, receive: Any, send: Any) -> None:
        loops.add(id(asyncio.get_running_loop()))
        await app(scope, receive, send)

    rpc = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), rpc)
    grpc_port = rpc.add_insecure_port(f"{HOST}:0")
    await rpc.start()
    sock = reuseport_listener(HOST, 0)
    http = granian_server(recording, "asgi", sock, **granian_options(ServerConfig()))
    task = asyncio.create_task(http.serve())
    await wait_serving(sock.getsockname()[1], task, tls=False)

    async def posts() -> int:
        conn = HttpConnection(HOST, sock.getsockname()[1], f"/predictions/{MODEL}")
        ok = sum([(await conn.post(b"{}")) == (200, ANSWER) for _ in range(calls)])
        await conn.close()
        return ok

    async def checks() -> int:
        async with grpc.aio.insecure_channel(f"{HOST}:{grpc_port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            serving = health_pb2.HealthCheckResponse.SERVING
            return sum(
                [(await stub.Check(health_pb2.HealthCheckRequest())).status == serving for _ in range(calls)]
            )

    http_ok, grpc_ok = await asyncio.gather(posts(), checks())
    http.stop()
    await asyncio.wait_for(task, 10)
    await rpc.stop(0)
    return {
        "http_answered": http_ok,
        "grpc_answered": grpc_ok,
        "of": calls,
        "app_ran_on_our_loop": loops == {id(loop)},
        "loop": type(loop).__module__,
    }


def main(argv: Sequence[str] | None = None) -> int:
    from mariner.server.common import event_loop

    servers = list(argv) if argv else ["uvicorn", "granian-asgi"]
    found: dict[str, Any] = {s: probe(s) for s in servers}
    beside: dict[str, Any] = {}

    async def run() -> int:
        beside.update(await grpc_beside_granian())
        return 0

    event_loop.run(run())
    found["granian embedded beside grpc.aio"] = beside
    print(json.dumps(found, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
