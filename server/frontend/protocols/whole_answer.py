"""An HTTP answer known whole (status, headers, body) written as uvicorn's `send` would write it,
in one write, and its request-response cycle ended as `send` ends it.

uvicorn's `send` writes an answer's head and its body apart: two send(2) calls, and two TCP
segments the client may wake for (the listeners set TCP_NODELAY). It also costs a coroutine and
two ASGI message dicts per answer. The prediction fast path (`prediction_path`) knows its answer
whole when it writes it, so it writes it here: the same bytes (the status line, the cycle's
default headers then the answer's, names lower-cased, each checked as uvicorn checks them,
`connection: close` added when the connection will not be kept), then what `send` does when a
body is complete: the cycle is marked complete, a connection not kept alive is closed, and the
protocol is told (`on_response`: the keep-alive timer or the next pipelined request).
tests/unit/test_prediction_paths.py compares the bytes with the app's, which uvicorn's `send` writes.
"""

from __future__ import annotations

from uvicorn.protocols.http.httptools_impl import (
    HEADER_RE,
    HEADER_VALUE_RE,
    STATUS_LINE,
    RequestResponseCycle,
)


def write_whole_answer(
    cycle: RequestResponseCycle, status: int, headers: list[tuple[bytes, bytes]], body: bytes | memoryview
) -> None:
    """Write the answer of `cycle` (module docstring). `headers` must carry a Content-Length
    matching `body`; the request must not be a HEAD (the fast path takes POST and PUT only).
    An unsendable header raises RuntimeError with nothing written, as `send` does."""
    cycle.response_started = True  # before the checks, as `send` marks it
    all_headers = [*cycle.default_headers, *headers]
    # uvicorn's two checks per header, as one search each over every name and every value: both
    # patterns are single-character classes, so the joined bytes match exactly when one does.
    if HEADER_RE.search(b"".join([n for n, _ in all_headers])) or HEADER_VALUE_RE.search(
        b"".join([v for _, v in all_headers])
    ):
        raise RuntimeError("Invalid HTTP header.")
    content: list[bytes | memoryview] = [STATUS_LINE[status]]
    closes = False
    for name, value in all_headers:
        name = name.lower()
        if name == b"connection" and b"close" in [t.lower().strip() for t in value.split(b",")]:
            cycle.keep_alive = False
            closes = True
        content += (name, b": ", value, b"\r\n")
    if not cycle.keep_alive and not closes:
        content.append(b"connection: close\r\n")
    content += (b"\r\n", body)
    transport = cycle.transport
    transport.write(b"".join(content))
    cycle.response_complete = True
    cycle.message_event.set()
    if not cycle.keep_alive:
        transport.close()
    cycle.on_response()
