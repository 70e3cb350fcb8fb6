"""Admission of HTTP calls and `Connection: close` while a frontend drains (ASGI middleware).

Every request is admitted when its head is in (DataPlane.admit, in the request's own task), so
a request whose body is still arriving when the drain begins is still answered, and the drain
waits for it (begin_call / end_call). Every response started while draining, the 503s of calls
refused and the answers of calls accepted before, carries `Connection: close`: uvicorn then
closes the keep-alive connection after the response, so a client learns to go elsewhere from
the answer itself, instead of finding its next request on a connection the server is closing
(a connection reset).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any, Protocol

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

CLOSE = (b"connection", b"close")


class DrainPlane(Protocol):
    """What the middleware needs from the DataPlane."""

    draining: bool

    def admit(self) -> bool: ...

    def begin_call(self) -> None: ...

    def end_call(self) -> None: ...


class DrainAware:
    """ASGI middleware: admission of each request, and `Connection: close` while draining."""

    def __init__(self, app: Any, plane: DrainPlane) -> None:  # any ASGI app
        self.app = app
        self.plane = plane

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        plane = self.plane
        admitted = plane.admit()
        if admitted:
            plane.begin_call()

        async def sending(message: Message) -> None:
            if message["type"] == "http.response.start" and plane.draining:
                headers = list(message.get("headers", ()))
                if not any(k.lower() == b"connection" and v.lower() == b"close" for k, v in headers):
                    headers.append(CLOSE)
                message = {**message, "headers": headers}
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            if admitted:
                plane.end_call()
