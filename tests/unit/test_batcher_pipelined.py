"""A runner that computes one batch at a time, pipelined (`BatchPolicy.pipelined`): a full batch
is sent to it meanwhile and starts the moment the batch ahead ends; a partial one waits for it
(what arrives during a long batch runs together after it); the batch behind counts its
responseTimeout, queue wait and compute time from its start, and as queued until then (against
max_queue and in the queue depth gauge); an instance that fails on the batch ahead leaves the
batch behind to the next instance. Pure asyncio with the fake clock of test_batcher; the runner
models a worker (one batch computing, the next waiting in its socket)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest

from mariner.server.common.batch_policy import BatchPolicy, BatchRunner, InstanceFailed, ReplaceRunner
from mariner.server.contracts.errors import Code
from mariner.server.contracts.types import InferRequest, InferResult
from mariner.server.frontend.batcher import Batcher
from tests.unit.test_batcher import FakeClock, echo, error, rejected_at_once, req, result, run, settle, submit

pytestmark = pytest.mark.unit


class SerialRunner:
    """Takes every batch sent to it, computes one at a time in the order sent, each until the test
    calls `finish()` (or `fail()`: the instance dies, failing what it holds, as a worker's lost
    connection fails every batch in flight)."""

    def __init__(self, runner_id: str = "serial") -> None:
        self.id = runner_id
        self.sent: list[list[str]] = []
        self.started: list[list[str]] = []
        self._turn = asyncio.Lock()
        self._done: asyncio.Future[None] | None = None
        self._dead = asyncio.get_running_loop().create_future()

    async def run(self, requests: Sequence[InferRequest]) -> list[InferResult]:
        ids = [r.request_id for r in requests]
        self.sent.append(ids)
        dead = asyncio.ensure_future(asyncio.shield(self._dead))
        turn = asyncio.ensure_future(self._turn.acquire())
        try:
            await asyncio.wait([turn, dead], return_when=asyncio.FIRST_COMPLETED)
            if dead.done():
                raise InstanceFailed(f"{self.id} died")
            self.started.append(ids)
            self._done = asyncio.get_running_loop().create_future()
            await asyncio.wait([self._done, dead], return_when=asyncio.FIRST_COMPLETED)
            if not self._done.done():
                raise InstanceFailed(f"{self.id} died")
            return [echo(i) for i in ids]
        finally:
            dead.cancel()
            if turn.done() and not turn.cancelled():
                self._turn.release()
            else:
                turn.cancel()

    def finish(self) -> None:
        assert self._done is not None, "no batch has started"
        assert not self._done.done(), "no batch is computing"
        self._done.set_result(None)

    def fail(self) -> None:
        self._dead.set_result(None)


class Books:
    """The observer's view: each batch's items and queue waits when it starts, its seconds when it ends."""

    def __init__(self) -> None:
        self.started: list[tuple[int, list[float]]] = []
        self.finished: list[float] = []
        self.depth = 0

    def queue_depth(self, items: int) -> None:
        self.depth = items

    def batch_started(
        self, items: int, queue_waits: Sequence[float], versions: Sequence[str | None] = ()
    ) -> None:
        self.started.append((items, list(queue_waits)))

    def batch_finished(self, seconds: float) -> None:
        self.finished.append(seconds)

    def batch_tokens(self, padded: int, unpadded: int) -> None:
        pass


def make(
    runners: Sequence[BatchRunner],
    clock: FakeClock,
    *,
    pipelined: bool = True,
    max_batch_size: int = 2,
    observer: Books | None = None,
    batch_timeout_s: float | None = None,
    replace_runner: ReplaceRunner | None = None,
    max_queue: int = 1024,
) -> Batcher:
    policy = BatchPolicy(
        max_batch_size=max_batch_size,
        pipelined=pipelined,
        batch_timeout_s=batch_timeout_s,
        max_queue=max_queue,
    )
    b = Batcher(runners, policy, clock=clock, observer=observer, replace_runner=replace_runner)
    b.start()
    return b


async def one_computing_and_a_full_batch_behind(
    b: Batcher,
) -> tuple[asyncio.Task[InferResult], list[asyncio.Task[InferResult]]]:
    """r0 sent alone to the idle runner, then r1 and r2 (a full batch of 2) sent behind it."""
    first = submit(b, "r0")
    await settle()
    behind = [submit(b, "r1"), submit(b, "r2")]
    await settle()
    return first, behind


def test_a_full_batch_goes_to_the_busy_runner_and_starts_when_the_batch_ahead_ends() -> None:
    async def body(clock: FakeClock) -> None:
        runner = SerialRunner()
        b = make([runner], clock, max_batch_size=3)
        first = submit(b, "r0")  # the runner is idle: sent at once, alone (no idle wait)
        await settle()
        partial = [submit(b, "r1"), submit(b, "r2")]
        await settle()
        assert runner.sent == [["r0"]], "a partial batch waits for the runner: it may still fill"
        partial.append(submit(b, "r3"))
        await settle()
        assert runner.sent == [["r0"], ["r1", "r2", "r3"]], "a full one goes while the runner computes"
        assert runner.started == [["r0"]]
        runner.finish()
        await settle()
        assert result(first) == echo("r0")
        assert runner.started == [["r0"], ["r1", "r2", "r3"]]
        assert not any(t.done() for t in partial)
        runner.finish()
        await settle()
        assert [result(t) for t in partial] == [echo("r1"), echo("r2"), echo("r3")]
        await b.close()

    run(body)


def test_what_arrives_during_a_long_batch_runs_together_after_it() -> None:
    async def body(clock: FakeClock) -> None:
        runner = SerialRunner()
        b = make([runner], clock, max_batch_size=4)
        first = submit(b, "slow")
        await settle()
        later = []
        for i in range(3):  # one by one while the first computes
            later.append(submit(b, f"r{i}"))
            await settle()
        assert runner.sent == [["slow"]]
        runner.finish()
        await settle()
        assert runner.sent == [["slow"], ["r0", "r1", "r2"]]
        runner.finish()
        await settle()
        assert result(first) == echo("slow")
        assert [result(t) for t in later] == [echo(f"r{i}") for i in range(3)]
        await b.close()

    run(body)


def test_never_more_than_one_batch_waits_behind_the_one_computing() -> None:
    async def body(clock: FakeClock) -> None:
        runner = SerialRunner()
        b = make([runner], clock)
        tasks = [submit(b, "r0")]
        await settle()
        tasks += [submit(b, f"r{i}") for i in range(1, 7)]
        await settle()
        assert runner.sent == [["r0"], ["r1", "r2"]]
        assert b.queued_items == 6, "the batch sent behind has not started: its items still wait"
        for _ in range(4):
            runner.finish()
            await settle()
        assert runner.sent == [["r0"], ["r1", "r2"], ["r3", "r4"], ["r5", "r6"]]
        assert [result(t) for t in tasks] == [echo(f"r{i}") for i in range(7)]
        await b.close()

    run(body)


def test_a_batch_sent_behind_counts_against_the_queue_bound_until_it_starts() -> None:
    async def body(clock: FakeClock) -> None:
        runner = SerialRunner()
        books = Books()
        b = make([runner], clock, max_queue=3, observer=books)
        first = submit(b, "r0")
        await settle()
        behind = [submit(b, "r1"), submit(b, "r2")]
        await settle()
        assert runner.sent == [["r0"], ["r1", "r2"]]
        assert (b.queued_items, books.depth) == (2, 2)
        queued = submit(b, "r3")  # 2 waiting behind + 1 here: the bound of 3
        await settle()
        err = rejected_at_once(b, req("r4"))
        assert err.code is Code.RESOURCE_EXHAUSTED
        assert "holds 3 of 3 items" in err.message, err.message
        runner.finish()  # the batch behind starts: its items no longer wait
        await settle()
        assert (b.queued_items, books.depth) == (1, 1)
        room = submit(b, "r4")
        await settle()
        assert b.queued_items == 2
        for _ in range(2):
            runner.finish()
            await settle()
        assert [result(t) for t in [first, *behind, queued, room]] == [echo(f"r{i}") for i in range(5)]
        await b.close()

    run(body)


def test_without_pipelining_a_full_batch_waits_for_the_runner() -> None:
    async def body(clock: FakeClock) -> None:
        runner = SerialRunner()
        b = make([runner], clock, pipelined=False)
        tasks = [submit(b, "r0")]
        await settle()
        tasks += [submit(b, "r1"), submit(b, "r2")]
        await settle()
        assert runner.sent == [["r0"]]
        runner.finish()
        await settle()
        assert runner.sent == [["r0"], ["r1", "r2"]]
        runner.finish()
        await settle()
        assert [result(t) for t in tasks] == [echo("r0"), echo("r1"), echo("r2")]
        await b.close()

    run(body)


def test_an_idle_runner_is_given_the_batch_before_a_busy_one() -> None:
    async def body(clock: FakeClock) -> None:
        busy, idle = SerialRunner("busy"), SerialRunner("idle")
        b = make([busy, idle], clock)
        tasks = [submit(b, "r0")]
        await settle()
        tasks += [submit(b, f"r{i}") for i in range(1, 5)]
        await settle()
        assert (busy.sent, idle.sent) == ([["r0"], ["r3", "r4"]], [["r1", "r2"]])
        for runner in (busy, idle, busy):
            runner.finish()
            await settle()
        assert [result(t) for t in tasks] == [echo(f"r{i}") for i in range(5)]
        await b.close()

    run(body)


def test_the_batch_behind_counts_its_response_timeout_queue_wait_and_time_from_its_start() -> None:
    async def body(clock: FakeClock) -> None:
        runner = SerialRunner()
        books = Books()
        b = make([runner], clock, observer=books, batch_timeout_s=10)
        first = submit(b, "r0")
        await settle()
        clock.advance(1)
        behind = [submit(b, "r1"), submit(b, "r2")]
        await settle()
        assert len(runner.sent) == 2
        assert books.depth == 2, "sent but not started: still counted as waiting"
        clock.advance(8)  # the first batch computes 9 s in all, within its 10
        await settle()
        runner.finish()
        await settle()
        assert books.depth == 0
        clock.advance(8)  # the batch behind: 17 s since it was sent, 8 since it started
        await settle()
        assert not any(t.done() for t in behind), "its timeout counts from its start"
        runner.finish()
        await settle()
        assert result(first) == echo("r0")
        assert [result(t) for t in behind] == [echo("r1"), echo("r2")]
        assert books.started == [(1, [0.0]), (2, [8.0, 8.0])]  # waited 8 s behind the first
        assert books.finished == [9.0, 8.0]
        await b.close()

    run(body)


def test_a_batch_behind_past_its_response_timeout_fails_as_hung() -> None:
    async def body(clock: FakeClock) -> None:
        runner = SerialRunner()
        b = make([runner], clock, batch_timeout_s=10)
        first, behind = await one_computing_and_a_full_batch_behind(b)
        runner.finish()
        await settle()
        assert result(first) == echo("r0")
        clock.advance(10.5)
        await settle()
        assert [error(t).code for t in behind] == [Code.DEADLINE_EXCEEDED] * 2
        await b.close()

    run(body)


def test_the_batch_behind_a_batch_its_instance_failed_on_runs_on_the_next_instance() -> None:
    async def body(clock: FakeClock) -> None:
        broken, spare = SerialRunner("broken"), SerialRunner("spare")
        replaced: list[str] = []

        async def replace(old: BatchRunner, reason: str) -> BatchRunner | None:
            replaced.append(f"{old.id}:{reason}")
            return spare

        b = make([broken], clock, replace_runner=replace)
        first, behind = await one_computing_and_a_full_batch_behind(b)
        assert broken.sent == [["r0"], ["r1", "r2"]]
        broken.fail()
        await settle()
        assert error(first).code is Code.UNAVAILABLE  # the batch it died on fails
        assert replaced == ["broken:failed"]
        assert spare.sent == [["r1", "r2"]], "the batch behind never ran: it goes to the next instance"
        spare.finish()
        await settle()
        assert [result(t) for t in behind] == [echo("r1"), echo("r2")]
        await b.close()

    run(body)


def test_a_batch_its_instance_failed_on_after_the_batch_ahead_was_answered_fails() -> None:
    async def body(clock: FakeClock) -> None:
        broken, spare = SerialRunner("broken"), SerialRunner("spare")

        async def replace(old: BatchRunner, reason: str) -> BatchRunner | None:
            return spare

        b = make([broken], clock, replace_runner=replace)
        first, behind = await one_computing_and_a_full_batch_behind(b)
        broken.finish()
        await settle()
        assert broken.started == [["r0"], ["r1", "r2"]]
        broken.fail()  # it died on this batch, which may be why: not run again
        await settle()
        assert result(first) == echo("r0")
        assert [error(t).code for t in behind] == [Code.UNAVAILABLE] * 2
        assert spare.sent == []
        await b.close()

    run(body)
