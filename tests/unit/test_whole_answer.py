"""`write_whole_answer` refuses exactly the headers uvicorn's `send` refuses: it checks every name
and every value with one search each, where `send` checks them one by one."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from uvicorn.protocols.http.flow_control import FlowControl
from uvicorn.protocols.http.httptools_impl import HEADER_RE, HEADER_VALUE_RE, RequestResponseCycle

from mariner.server.frontend.protocols.whole_answer import write_whole_answer


class Transport:
    def __init__(self) -> None:
        self.written: list[bytes] = []
        self.closed = False

    def write(self, data: bytes) -> None:
        self.written.append(data)

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


def cycle(transport: Transport, default_headers: list[tuple[bytes, bytes]]) -> RequestResponseCycle:
    answered: list[int] = []
    made = RequestResponseCycle(
        scope={"type": "http", "method": "POST", "path": "/predictions/m"},  # type: ignore[typeddict-item]
        transport=transport,  # type: ignore[arg-type]
        flow=FlowControl(transport),  # type: ignore[arg-type]
        logger=logging.getLogger("test"),
        access_logger=logging.getLogger("test.access"),
        access_log=False,
        default_headers=default_headers,
        message_event=asyncio.Event(),
        expect_100_continue=False,
        keep_alive=True,
        on_response=lambda: answered.append(1),
    )
    made.answered = answered  # type: ignore[attr-defined]
    return made


def uvicorn_refuses(headers: list[tuple[bytes, bytes]]) -> bool:
    return any(HEADER_RE.search(n) or HEADER_VALUE_RE.search(v) for n, v in headers)


header_bytes = st.binary(max_size=12) | st.sampled_from(
    [b"x-request-id", b"content-type", b"a b", b"v\r\n", b"\t"]
)
headers = st.lists(st.tuples(header_bytes, header_bytes), max_size=6)


@settings(max_examples=400, deadline=None)
@given(default=headers, own=headers)
def test_an_answer_is_refused_exactly_when_uvicorn_would_refuse_one_of_its_headers(
    default: list[tuple[bytes, bytes]], own: list[tuple[bytes, bytes]]
) -> None:
    transport = Transport()
    c = cycle(transport, default)
    own = [*own, (b"content-length", b"2")]
    if uvicorn_refuses([*default, *own]):
        with pytest.raises(RuntimeError, match=r"^Invalid HTTP header\.$"):
            write_whole_answer(c, 200, own, b"{}")
        assert transport.written == [], "nothing written"
        assert not c.response_complete
    else:
        write_whole_answer(c, 200, own, b"{}")
        assert len(transport.written) == 1
        assert c.response_complete
        assert c.answered == [1]  # type: ignore[attr-defined]
    assert c.response_started, "marked started before the checks, as `send` marks it"


def test_a_bad_name_and_a_bad_value_are_refused_each_on_its_own() -> None:
    good: Any = [(b"content-length", b"2")]
    for bad in ([(b"x bad", b"v")], [(b"x-ok", b"split\r\ninjected: 1")], [(b"x-ok", b"nul\x00")]):
        transport = Transport()
        with pytest.raises(RuntimeError, match="Invalid HTTP header"):
            write_whole_answer(cycle(transport, []), 200, [*bad, *good], b"{}")
        assert transport.written == [], bad
    transport = Transport()
    write_whole_answer(cycle(transport, [(b"server", b"mariner")]), 200, [(b"x-tab", b"a\tb"), *good], b"{}")
    assert transport.written == [
        b"HTTP/1.1 200 OK\r\nserver: mariner\r\nx-tab: a\tb\r\ncontent-length: 2\r\n\r\n{}"
    ]
