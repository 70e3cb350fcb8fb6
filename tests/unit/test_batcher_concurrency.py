"""A runner that holds several batches at once (a model with asyncCommunication: its worker runs
calls side by side): the batcher offers it batches while it has room, and a failed or retired
one is let go once, whatever it still holds. Pure asyncio with the fake clock of test_batcher."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from mariner.server.common.batch_policy import BatchPolicy, BatchRunner, InstanceFailed
from mariner.server.contracts.errors import Code
from mariner.server.frontend.batcher import Batcher
from tests.unit.test_batcher import FakeClock, FakeRunner, error, result, run, settle, submit

pytestmark = pytest.mark.unit


def make(runners: Sequence[FakeRunner], clock: FakeClock, concurrency: int, **kw: object) -> Batcher:
    b = Batcher(
        runners,
        BatchPolicy(max_batch_size=1, runner_concurrency=concurrency),
        clock=clock,
        **kw,  # type: ignore[arg-type]
    )
    b.start()
    return b


def test_a_runner_with_room_takes_batches_until_it_is_full() -> None:
    async def body(clock: FakeClock) -> None:
        runner = FakeRunner()
        runner.hold()
        b = make([runner], clock, concurrency=3)
        tasks = [submit(b, f"r{i}") for i in range(5)]
        await settle()
        assert (runner.batches, runner.running) == ([["r0"], ["r1"], ["r2"]], 3)
        assert b.queued_items == 2
        runner.release()
        await settle()
        assert runner.batches == [["r0"], ["r1"], ["r2"], ["r3"], ["r4"]]
        assert [result(t).body for t in tasks] == [b"r0", b"r1", b"r2", b"r3", b"r4"]
        await b.close()

    run(body)


def test_one_batch_at_a_time_is_the_default() -> None:
    async def body(clock: FakeClock) -> None:
        runner = FakeRunner()
        runner.hold()
        b = make([runner], clock, concurrency=1)
        tasks = [submit(b, f"r{i}") for i in range(2)]
        await settle()
        assert runner.batches == [["r0"]]
        runner.release()
        await settle()
        assert [result(t).body for t in tasks] == [b"r0", b"r1"]
        await b.close()

    run(body)


def test_a_failed_runner_holding_several_batches_is_replaced_once_and_never_offered_again() -> None:
    async def body(clock: FakeClock) -> None:
        broken, spare = FakeRunner("broken"), FakeRunner("spare")
        broken.hold()
        replaced: list[str] = []

        async def replace(old: BatchRunner, reason: str) -> BatchRunner | None:
            replaced.append(f"{old.id}:{reason}")
            return spare

        def fail(ids: list[str]) -> list[object]:
            raise InstanceFailed("worker died")

        broken.script = {1: fail, 2: fail}
        b = make([broken], clock, concurrency=4, replace_runner=replace)
        first = [submit(b, "a"), submit(b, "b")]
        await settle()
        assert broken.running == 2
        broken.release()
        await settle()
        assert replaced == ["broken:failed"]
        assert [error(t).code for t in first] == [Code.UNAVAILABLE, Code.UNAVAILABLE]
        later = [submit(b, "c"), submit(b, "d")]
        await settle()
        assert [result(t).body for t in later] == [b"c", b"d"]
        assert broken.batches == [["a"], ["b"]]  # nothing more after it failed
        assert spare.batches == [["c"], ["d"]]
        await b.close()

    run(body)


def test_a_retired_runner_finishes_what_it_holds_and_gets_nothing_more() -> None:
    async def body(clock: FakeClock) -> None:
        old, new = FakeRunner("old"), FakeRunner("new")
        old.hold()
        b = make([old], clock, concurrency=4)
        held = [submit(b, "a"), submit(b, "b")]
        await settle()
        b.add_runner(new)
        b.retire_runner(old)
        old.release()
        await settle()
        assert [result(t).body for t in held] == [b"a", b"b"]
        later = [submit(b, f"c{i}") for i in range(3)]
        await settle()
        assert [result(t).body for t in later] == [b"c0", b"c1", b"c2"]
        assert old.batches == [["a"], ["b"]]
        await b.close()

    run(body)
