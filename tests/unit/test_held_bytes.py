"""A frontend's budget of held request bytes (common.held_bytes): what fits, what is refused
and how, and the heap given back after a burst."""

from __future__ import annotations

import asyncio

import pytest

from mariner.server.common import held_bytes
from mariner.server.common.held_bytes import MIB, HeldBytes, HeldLimits
from mariner.server.contracts.errors import Code

pytestmark = pytest.mark.unit


def test_unary_calls_fit_until_the_budget_and_the_largest_runs_alone() -> None:
    held = HeldBytes(HeldLimits(limit=100, stream_limit=10))
    assert held.take(60)
    assert held.take(40)
    assert not held.take(1)
    assert held.refused == 1
    assert held.held == 100, "a refusal holds nothing"
    held.release(100)
    assert held.take(500), "alone, a call larger than the budget still runs (max_request_bytes caps it)"
    err = held.refusal(7 * MIB)
    assert err.code is Code.RESOURCE_EXHAUSTED
    assert "7340032 bytes do not fit" in err.message
    assert "frontend_max_held_mb" in err.message


def test_limits_are_checked() -> None:
    with pytest.raises(ValueError, match="per-stream budget"):
        HeldLimits(limit=10, stream_limit=20)
    with pytest.raises(ValueError, match="per-stream budget"):
        HeldLimits(limit=10, stream_limit=0)


def test_the_heap_is_trimmed_once_after_a_burst_falls(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    monkeypatch.setattr(held_bytes, "_TRIM", lambda: calls.append(1))
    monkeypatch.setattr(held_bytes, "TRIM_DELAY_S", 0.01)

    async def main() -> None:
        held = HeldBytes(HeldLimits(limit=512 * MIB, stream_limit=16 * MIB))
        held.add(10 * MIB)
        held.release(10 * MIB)
        await asyncio.sleep(0.1)
        assert calls == [], "a small load is never trimmed"
        for _ in range(8):
            held.add(10 * MIB)
        for _ in range(8):
            held.release(10 * MIB)
        await asyncio.sleep(0.1)
        assert calls == [1], "trimmed once, after the burst fell"
        assert held.trims == 1
        held.add(MIB)
        held.release(MIB)
        await asyncio.sleep(0.1)
        assert calls == [1], "no burst since: no second trim"

    asyncio.run(main())
