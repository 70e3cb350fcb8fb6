"""The benchmark's HTTP/1.1 client connection (`mariner.loadtest.closedloop` drives it)."""

from __future__ import annotations

import asyncio
import contextlib


class HttpConnection:
    """One HTTP/1.1 keep-alive connection on asyncio streams: the leanest client Python has.

    requests/aiohttp/httpx would cost more CPU per call than the server under test on a small
    machine; this writes one pre-built request head and parses just enough of the answer
    (status, Content-Length or chunked body).
    """

    def __init__(self, host: str, port: int, path: str, content_type: str = "application/json") -> None:
        self.host, self.port = host, port
        self.head = (
            f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: {content_type}\r\nContent-Length: "
        ).encode()
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def connect(self) -> None:
        self.reader, self.writer = await asyncio.open_connection(self.host, self.port)

    async def post(self, body: bytes) -> tuple[int, bytes]:
        fresh = self.writer is None or self.reader is None
        if fresh:
            await self.connect()
        try:
            return await self._exchange(body)
        except (asyncio.IncompleteReadError, ConnectionResetError, BrokenPipeError) as exc:
            if fresh or getattr(exc, "partial", b""):
                raise
            # The server closed this idle keep-alive connection (its keep-alive timer, e.g. while
            # the clients waited at the barrier) before reading the request: reconnect and send
            # again, as every HTTP client does with a stale pooled connection.
            await self.close()
            await self.connect()
            return await self._exchange(body)

    async def _exchange(self, body: bytes) -> tuple[int, bytes]:
        assert self.reader is not None
        assert self.writer is not None
        self.writer.write(self.head + str(len(body)).encode() + b"\r\n\r\n" + body)
        head = await self.reader.readuntil(b"\r\n\r\n")
        lines = head.split(b"\r\n")
        status = int(lines[0].split(b" ", 2)[1])
        length, chunked, close = None, False, False
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            name = name.strip().lower()
            if name == b"content-length":
                length = int(value)
            elif name == b"transfer-encoding" and b"chunked" in value.lower():
                chunked = True
            elif name == b"connection" and b"close" in value.lower():
                close = True
        if chunked:
            parts = []
            while True:
                size = int((await self.reader.readuntil(b"\r\n")).split(b";")[0], 16)
                chunk = await self.reader.readexactly(size + 2)
                if size == 0:
                    break
                parts.append(chunk[:-2])
            data = b"".join(parts)
        else:
            data = await self.reader.readexactly(length or 0)
        if close:
            await self.close()
        return status, data

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            with contextlib.suppress(OSError):
                await self.writer.wait_closed()
        self.reader = self.writer = None
