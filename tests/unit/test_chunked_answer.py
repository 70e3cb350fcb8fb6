"""The HTTP side of a streamed TorchServe answer (`torchserve/chunked.py`), with a fake ASGI send:
what it writes for each part, the end, a failure, a slow client and a client that went away."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from mariner.server.contracts.types import InferResult
from mariner.server.frontend.protocols.torchserve import chunked
from mariner.server.frontend.protocols.torchserve.chunked import ChunkedAnswer

pytestmark = pytest.mark.unit


def head(result: InferResult, request_id: str) -> tuple[int, dict[str, str]]:
    return result.status, {"x-request-id": request_id, **result.headers}


class Recorder:
    """An ASGI send that records messages; `hold()` makes it block like a client not reading."""

    def __init__(self) -> None:
        self.messages: list[dict[str, Any]] = []
        self.gate: asyncio.Event | None = None

    async def __call__(self, message: dict[str, Any]) -> None:
        if self.gate is not None:
            await self.gate.wait()
        self.messages.append(message)

    def bodies(self) -> list[tuple[bytes, bool]]:
        return [
            (m["body"], m.get("more_body", False)) for m in self.messages if m["type"] == "http.response.body"
        ]


async def finish(answer: ChunkedAnswer, final: InferResult | None, why: str = "") -> None:
    await answer.end(final, why)(scope={}, receive=None, send=None)  # type: ignore[arg-type]


def test_each_part_is_a_chunk_and_the_final_result_the_last() -> None:
    async def body() -> Recorder:
        send = Recorder()
        answer = ChunkedAnswer(send, "r1", head)
        assert not answer.started
        answer.partial(InferResult(b"p0", status=206, headers={"x-part": "1"}))
        answer.partial(InferResult(b"p1"))
        assert answer.started
        await finish(answer, InferResult(b"end", status=500))  # its status comes too late to send
        return send

    send = asyncio.run(body())
    start = send.messages[0]
    assert (start["type"], start["status"]) == ("http.response.start", 206)
    assert (b"x-part", b"1") in start["headers"]
    assert send.bodies() == [(b"p0", True), (b"p1", True), (b"end", False)]


def test_a_first_part_with_an_error_status_is_the_whole_answer() -> None:
    async def body() -> Recorder:
        send = Recorder()
        answer = ChunkedAnswer(send, "r1", head)
        answer.partial(InferResult(b"failed", status=503))
        answer.partial(InferResult(b"ignored"))
        await finish(answer, InferResult(b"end"))
        return send

    send = asyncio.run(body())
    assert send.messages[0]["status"] == 503
    assert send.bodies() == [(b"failed", False)]


@pytest.mark.parametrize(
    ("first", "named"),
    [
        (InferResult(b"p0", status=204), "the status 204 on a streamed answer"),
        (InferResult(b"p0", status=101), "the status 101"),
        (InferResult(b"p0", headers={"x-a": "1\r\nx-b: 2"}), "header 'x-a'"),
        (InferResult(b"p0", content_type="text/plain\n"), "header 'content-type'"),
    ],
)
def test_a_first_part_http_cannot_carry_opens_a_500_and_is_the_whole_answer(
    first: InferResult, named: str
) -> None:
    async def body() -> Recorder:
        send = Recorder()
        answer = ChunkedAnswer(send, "r1", head)
        answer.partial(first)
        answer.partial(InferResult(b"p1"))
        await finish(answer, InferResult(b"end"))
        return send

    send = asyncio.run(body())
    assert send.messages[0]["status"] == 500
    [(only, more)] = send.bodies()
    assert not more
    assert named.encode() in only
    assert b"p0" not in only


@pytest.mark.parametrize("how", ["failed call", "error part"])
def test_a_failure_after_parts_were_sent_cuts_the_answer(how: str) -> None:
    async def body() -> Recorder:
        send = Recorder()
        answer = ChunkedAnswer(send, "r1", head)
        answer.partial(InferResult(b"p0"))
        if how == "error part":
            answer.partial(InferResult(b"boom", status=500))
            await finish(answer, InferResult(b"end"))
        else:
            await finish(answer, None, "the worker died")
        return send

    send = asyncio.run(body())
    assert send.bodies() == [(b"p0", True)]  # no last chunk: the client sees a truncated stream


def test_a_client_reading_slower_than_the_handler_writes_is_cut_at_the_cap(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(chunked, "MAX_HELD_BYTES", 10)

    async def body() -> tuple[Recorder, ChunkedAnswer]:
        send = Recorder()
        send.gate = asyncio.Event()  # the client reads nothing
        answer = ChunkedAnswer(send, "r1", head)
        for _ in range(5):
            answer.partial(InferResult(b"12345"))
            await asyncio.sleep(0)
        assert answer._held == 0  # nothing kept once cut
        send.gate.set()
        await finish(answer, InferResult(b"end"))
        return send, answer

    send, answer = asyncio.run(body())
    assert False not in [more for _, more in send.bodies()]  # never a last chunk
    assert len(send.bodies()) <= 1  # at most the part the blocked send held


def test_a_client_that_went_away_stops_the_writer() -> None:
    async def body() -> Recorder:
        send = Recorder()
        send.gate = asyncio.Event()
        answer = ChunkedAnswer(send, "r1", head)
        answer.partial(InferResult(b"p0"))
        await asyncio.sleep(0)
        answer.abandon()
        await finish(answer, None, "the client went away")
        return send

    assert asyncio.run(body()).messages == []
