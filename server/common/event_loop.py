"""The event loop every Mariner process runs on: uvloop (uvicorn[standard] brings it), else asyncio's."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def run(main: Coroutine[Any, Any, T]) -> T:
    """Run `main` to completion on a new loop and return what it returns (an exit code, mostly)."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop ships with uvicorn[standard]
        return asyncio.run(main)
    return uvloop.run(main)
