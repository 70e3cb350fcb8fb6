"""The HTTP drain middleware on a real DataPlane: responses started while draining carry
`Connection: close`, a request admitted before the drain is waited for until it ends, and a
response whose app already says close is not given the header twice."""

from __future__ import annotations

import asyncio
from typing import Any

from mariner.server.frontend.dataplane import DataPlane
from mariner.server.frontend.protocols.http_drain import DrainAware
from tests.unit.fakes import QuietMetrics


def _app(release: asyncio.Event | None = None, headers: list[tuple[bytes, bytes]] | None = None) -> Any:
    async def app(scope: Any, receive: Any, send: Any) -> None:
        if release is not None:
            await release.wait()
        await send({"type": "http.response.start", "status": 200, "headers": list(headers or [])})
        await send({"type": "http.response.body", "body": b"ok"})

    return app


async def _call(app: Any) -> list[dict[str, Any]]:
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await app({"type": "http", "path": "/", "headers": []}, receive, send)
    return sent


def _connection(sent: list[dict[str, Any]]) -> list[bytes]:
    return [v for k, v in sent[0]["headers"] if k == b"connection"]


def test_responses_while_draining_close_the_connection_and_admitted_calls_are_waited_for() -> None:
    async def main() -> None:
        dp = DataPlane(QuietMetrics())
        assert _connection(await _call(DrainAware(_app(), dp))) == []
        release = asyncio.Event()
        admitted = asyncio.create_task(_call(DrainAware(_app(release), dp)))
        await asyncio.sleep(0)  # the request is admitted and waits in the app
        dp.start_draining()
        waiting = asyncio.create_task(dp.wait_idle(30))
        await asyncio.sleep(0)
        assert not waiting.done(), "the drain did not wait for a call admitted before it"
        release.set()
        assert _connection(await admitted) == [b"close"]
        assert await waiting
        refused = await _call(DrainAware(_app(headers=[(b"connection", b"close")]), dp))
        assert _connection(refused) == [b"close"]

    asyncio.run(main())
