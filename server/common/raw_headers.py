"""One lookup for a header in an ASGI scope's raw header list (lower-case names, as ASGI servers
deliver them), shared by the code that reads a request before Starlette would build one: the
listener's limits, token checks and the prediction fast path."""

from __future__ import annotations

from collections.abc import Iterable


def first_header(raw: Iterable[tuple[bytes, bytes]], name: bytes) -> bytes | None:
    """The value of the first `name` header (`name` lower case), as Starlette's `headers.get`
    reads it; None when there is none."""
    for key, value in raw:
        if key == name:
            return value
    return None
