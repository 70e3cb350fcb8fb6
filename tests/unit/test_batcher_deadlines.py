"""The batcher's one deadline timer: a request is answered DEADLINE_EXCEEDED when its deadline
passes, whether it is queued or its batch is running, with no timer per request.

Same fake-time loop as test_batcher: timers fire only when a test advances the clock and yields.
"""

from __future__ import annotations

import asyncio

import pytest

from mariner.server.contracts.errors import WORKER_DIED, Code
from tests.unit.test_batcher import FakeClock, FakeRunner, echo, error, make, result, run, settle, submit

pytestmark = pytest.mark.unit


def test_a_queued_request_is_answered_when_its_deadline_passes_not_when_the_runner_frees() -> None:
    async def body(clock: FakeClock) -> None:
        runner = FakeRunner()
        runner.hold()
        b = make([runner], clock, max_batch_size=8)
        first = submit(b, "first")
        await settle()
        late = submit(b, "late", deadline=clock.now + 2)
        keep = submit(b, "keep", deadline=clock.now + 50)
        await settle()
        clock.advance(2.5)
        await settle()
        assert error(late).code is Code.DEADLINE_EXCEEDED  # answered while the runner is still held
        assert "did not answer within the deadline" in error(late).message
        assert not keep.done()
        assert not first.done()
        assert b.queued_items == 1
        runner.release()
        await settle()
        assert runner.batches == [["first"], ["keep"]]
        assert result(keep) == echo("keep")
        await b.close()

    run(body)


def test_a_running_request_past_its_deadline_is_answered_and_its_batch_mates_are_not() -> None:
    async def body(clock: FakeClock) -> None:
        runner = FakeRunner()
        runner.hold()
        b = make([runner], clock, max_batch_size=8)
        short = submit(b, "short", deadline=clock.now + 1)
        await settle()  # "short" is in the running batch, held
        assert runner.batches == [["short"]]
        clock.advance(1.5)
        await settle()
        assert error(short).code is Code.DEADLINE_EXCEEDED
        runner.release()
        await settle()
        mate = submit(b, "mate", deadline=clock.now + 100)
        await settle()
        assert result(mate) == echo("mate")
        await b.close()

    run(body)


def test_the_timer_moves_to_the_earliest_deadline_left_and_catches_each_in_turn() -> None:
    async def body(clock: FakeClock) -> None:
        runner = FakeRunner()
        runner.hold()
        b = make([runner], clock, max_batch_size=1)
        first = submit(b, "first")
        await settle()
        t0 = clock.now
        c = submit(b, "c", deadline=t0 + 30)
        a = submit(b, "a", deadline=t0 + 10)  # earlier than the one the timer was set for
        bb = submit(b, "b", deadline=t0 + 20)
        await settle()
        for step, due in ((10.5, a), (10.0, bb), (10.0, c)):
            clock.advance(step)
            await settle()
            assert error(due).code is Code.DEADLINE_EXCEEDED
        assert not first.done()
        assert b.queued_items == 0
        runner.release()
        await settle()
        assert runner.batches == [["first"]]
        await b.close()

    run(body)


def test_close_leaves_no_deadline_timer_behind() -> None:
    async def body(clock: FakeClock) -> None:
        runner = FakeRunner()
        b = make([runner], clock, max_batch_size=8)
        t = submit(b, "x", deadline=clock.now + 100)
        await settle()
        assert result(t) == echo("x")
        await b.close()
        loop = asyncio.get_running_loop()
        assert not [h for h in getattr(loop, "_scheduled", []) if not h.cancelled()]

    run(body)


class StreamingRunner(FakeRunner):
    """A runner whose batch sends intermediate answers: it keeps the batch's BATCH_PROGRESS (set
    by the batcher in the task that runs it), as the worker connection does."""

    def __init__(self) -> None:
        super().__init__()
        self.progress: list[object] = []

    async def run(self, requests):  # type: ignore[no-untyped-def]
        from mariner.server.frontend.streams import BATCH_PROGRESS

        self.progress.append(BATCH_PROGRESS.get())
        return await super().run(requests)


def test_each_intermediate_answer_restarts_the_response_timeout_of_its_batch() -> None:
    async def body(clock: FakeClock) -> None:
        runner = StreamingRunner()
        runner.hold()
        b = make([runner], clock, max_batch_size=8, batch_timeout_s=10)
        # TorchServe requests carry no deadline: the batch's responseTimeout is their only limit.
        streamed = submit(b, "streamed")
        await settle()
        (progress,) = runner.progress
        assert callable(progress)
        for _ in range(3):  # 24 s in all, a part every 8 s: never 10 s without one
            clock.advance(8)
            await settle()
            progress()
            await settle()
        assert not streamed.done()
        runner.release()
        await settle()
        assert result(streamed) == echo("streamed")
        # Without parts the timeout holds as before.
        runner.hold()
        silent = submit(b, "silent")
        await settle()
        clock.advance(10.5)
        await settle()
        assert error(silent).code is Code.DEADLINE_EXCEEDED
        assert error(silent).torchserve == WORKER_DIED, "TorchServe's answer to a response timeout"
        runner.release()
        await b.close()

    run(body)
