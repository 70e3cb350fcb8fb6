"""Unit tests of the Batcher: pure asyncio, fake runners, no timed sleeps, no wall clock.

How these tests stay deterministic:
- Every test runs on an event loop whose `time()` is a `FakeClock`, and the same clock is given
  to the Batcher as `clock=`. Loop timers (asyncio.wait_for, asyncio.sleep) therefore only fire
  when a test advances the clock; nothing depends on how fast this machine is.
- A `FakeRunner` can be "held": its `run` then blocks on an asyncio.Event until the test releases
  it, which is how a test keeps the device busy while requests arrive.
- `settle()` yields to the loop a fixed number of times (`asyncio.sleep(0)`), enough for every
  ready task to run to its next real wait. Tests then assert on what happened, and only read
  results of tasks that are already done, so a broken batcher fails a test instead of hanging it.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mariner.server.common.batch_policy import BatchPolicy, RunnerRetired
from mariner.server.contracts.errors import Code, ServingError
from mariner.server.contracts.types import InferRequest, InferResult, WireProtocol
from mariner.server.frontend.batcher import Batcher

pytestmark = pytest.mark.unit

SETTLE_STEPS = 60  # loop iterations `settle` gives; far more than a submit -> runner.run hop needs


# -- fakes and helpers -------------------------------------------------------------------------
class FakeClock:
    """A monotonic clock that only moves when a test says so."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        assert seconds >= 0
        self.now += seconds


class FakeTimeLoop(asyncio.SelectorEventLoop):
    """An event loop whose time is the fake clock, so timers fire only when the test advances it."""

    def __init__(self, clock: FakeClock) -> None:
        super().__init__()
        self._fake_clock = clock

    def time(self) -> float:
        return self._fake_clock.now


def run(test: Callable[[FakeClock], Coroutine[Any, Any, None]], clock: FakeClock | None = None) -> None:
    """Run `test(clock)` on a FakeTimeLoop; leftover tasks are cancelled afterwards, as asyncio.run does."""
    clock = clock or FakeClock()
    with asyncio.Runner(loop_factory=lambda: FakeTimeLoop(clock)) as runner:
        runner.run(test(clock))


async def settle(steps: int = SETTLE_STEPS, *, clock: FakeClock | None = None, tick: float = 0.0) -> None:
    """Let every ready task run; with `clock` and `tick`, also move time forward a little each step."""
    for _ in range(steps):
        if clock is not None and tick:
            clock.advance(tick)
        await asyncio.sleep(0)


def echo(request_id: str, status: int = 200) -> InferResult:
    return InferResult(body=request_id.encode(), status=status)


Action = Callable[[list[str]], Awaitable[list[InferResult]] | list[InferResult]]


class FakeRunner:
    """Records each batch it is given and answers by echoing each request_id into its body.

    `hold()` makes the following calls block until `release()`; `script[n]` replaces the answer of
    the n-th call (1-based) with an action that returns results or raises.
    """

    def __init__(self, runner_id: str = "r0", *, yields: Sequence[int] = (0,)) -> None:
        self.id = runner_id
        self.batches: list[list[str]] = []
        self.data: list[list[Mapping[str, Any]]] = []
        self.running = 0
        self.script: dict[int, Action] = {}
        self._gate: asyncio.Event | None = None
        self._yields = deque(yields)

    def hold(self) -> None:
        self._gate = asyncio.Event()

    def release(self) -> None:
        assert self._gate is not None, "runner was not held"
        self._gate.set()
        self._gate = None

    async def run(self, requests: Sequence[InferRequest]) -> list[InferResult]:
        request_ids = [r.request_id for r in requests]
        self.batches.append(request_ids)
        self.data.append([r.data for r in requests])
        call = len(self.batches)
        self.running += 1
        try:
            gate = self._gate
            if gate is not None:
                await gate.wait()
            self._yields.rotate(-1)
            for _ in range(self._yields[-1]):  # vary interleavings in the property test
                await asyncio.sleep(0)
            action = self.script.get(call)
            if action is not None:
                out = action(list(request_ids))
                if asyncio.iscoroutine(out):
                    out = await out
                return out  # type: ignore[return-value]
            return [echo(rid) for rid in request_ids]
        finally:
            self.running -= 1


def req(rid: str, *, items: int = 1, deadline: float | None = None, size: int = 0) -> InferRequest:
    return InferRequest(
        model="digits",
        version="1",
        data={"body": rid},
        protocol=WireProtocol.TS_HTTP,
        request_id=rid,
        deadline=deadline,
        items=items,
        size=size,
    )


def submit(batcher: Batcher, rid: str, **kw: Any) -> asyncio.Task[InferResult]:
    return asyncio.get_running_loop().create_task(batcher.submit(req(rid, **kw)), name=f"submit-{rid}")


def result(task: asyncio.Task[InferResult]) -> InferResult:
    assert task.done(), f"{task.get_name()} has no result yet"
    return task.result()


def error(task: asyncio.Task[InferResult]) -> ServingError:
    assert task.done(), f"{task.get_name()} has no outcome yet"
    assert not task.cancelled(), f"{task.get_name()} was cancelled instead of failing"
    exc = task.exception()
    assert isinstance(exc, ServingError), f"{task.get_name()} raised {exc!r}, not a ServingError"
    return exc


def rejected_at_once(batcher: Batcher, request: InferRequest) -> ServingError:
    """`submit` must raise on its first step, without suspending (and so without queueing)."""
    coro = batcher.submit(request)
    try:
        awaited = coro.send(None)
    except ServingError as exc:
        return exc
    # It was queued: withdraw it as a caller that went away would, so the failure is reported
    # instead of a dispatcher that can never place the request spinning the loop.
    if isinstance(awaited, asyncio.Future):
        awaited.cancel()
    coro.close()
    pytest.fail(f"submit({request.request_id}) was accepted instead of rejected at once")


def make(runners: Sequence[FakeRunner], clock: FakeClock, **policy: Any) -> Batcher:
    b = Batcher(runners, BatchPolicy(**policy), clock=clock)
    b.start()
    return b


# -- no idle wait ------------------------------------------------------------------------------
def test_single_request_on_idle_runner_is_dispatched_at_once() -> None:
    async def body(clock: FakeClock) -> None:
        runner = FakeRunner()
        b = make([runner], clock, max_batch_size=8, max_batch_delay_s=0)
        t = submit(b, "a")
        await settle()  # time does not move: any timer-based wait would never fire
        assert runner.batches == [["a"]]
        assert runner.data == [[{"body": "a"}]]
        assert result(t) == echo("a")
        assert b.queued_items == 0
        await b.close()

    run(body)


def test_idle_runner_is_called_before_the_next_request_arrives() -> None:
    async def body(clock: FakeClock) -> None:
        runner = FakeRunner()
        runner.hold()
        b = make([runner], clock, max_batch_size=8)
        t1 = submit(b, "a")
        await settle()
        assert runner.batches == [["a"]], "an idle runner must get the lone request, not wait for more"
        assert runner.running == 1
        t2 = submit(b, "b")
        await settle()
        assert runner.batches == [["a"]]  # runner busy: "b" waits in the queue
        assert b.queued_items == 1
        runner.release()
        await settle()
        assert runner.batches == [["a"], ["b"]]
        assert result(t1) == echo("a")
        assert result(t2) == echo("b")
        await b.close()

    run(body)


# -- batches fill while the device is busy -----------------------------------------------------
def test_arrivals_while_busy_form_the_next_batch_in_arrival_order() -> None:
    async def body(clock: FakeClock) -> None:
        runner = FakeRunner()
        runner.hold()
        b = make([runner], clock, max_batch_size=8)
        first = submit(b, "first")
        await settle()
        assert runner.batches == [["first"]]
        ids = [f"q{i}" for i in range(6)]
        tasks = []
        for rid in ids:  # arrive one by one, each fully processed before the next
            tasks.append(submit(b, rid))
            await settle()
        assert runner.batches == [["first"]]
        assert b.queued_items == len(ids)
        runner.release()
        await settle()
        assert runner.batches == [["first"], ids]
        assert runner.data[1] == [{"body": rid} for rid in ids]
        assert result(first) == echo("first")
        for rid, t in zip(ids, tasks, strict=True):
            assert result(t) == echo(rid)
        await b.close()

    run(body)


def test_batches_never_exceed_max_batch_size() -> None:
    async def body(clock: FakeClock) -> None:
        runner = FakeRunner()
        runner.hold()
        b = make([runner], clock, max_batch_size=4)
        first = submit(b, "first")
        await settle()
        ids = [f"q{i}" for i in range(10)]
        tasks = [submit(b, rid) for rid in ids]
        await settle()
        assert runner.batches == [["first"]]
        runner.release()
        await settle()
        assert runner.batches == [["first"], ids[0:4], ids[4:8], ids[8:10]]
        assert result(first) == echo("first")
        for rid, t in zip(ids, tasks, strict=True):
            assert result(t) == echo(rid)
        await b.close()

    run(body)


def test_items_count_as_batch_slots() -> None:
    async def body(clock: FakeClock) -> None:
        runner = FakeRunner()
        runner.hold()
        b = make([runner], clock, max_batch_size=4)
        first = submit(b, "first")
        await settle()
        sizes = {"x3": 3, "y1": 1, "z2": 2, "w4": 4, "v1": 1}
        tasks = {rid: submit(b, rid, items=n) for rid, n in sizes.items()}
        await settle()
        assert b.queued_items == sum(sizes.values())
        runner.release()
        await settle()
        # FIFO, packed by items: 3+1 | 2 (the 4 after it does not fit) | 4 | 1
        assert runner.batches == [["first"], ["x3", "y1"], ["z2"], ["w4"], ["v1"]]
        for batch in runner.batches[1:]:
            assert sum(sizes[rid] for rid in batch) <= 4
        assert result(first) == echo("first")
        for rid, t in tasks.items():
            assert result(t) == echo(rid)
        assert b.queued_items == 0
        await b.close()

    run(body)


def test_request_with_exactly_max_batch_size_items_is_accepted() -> None:
    async def body(clock: FakeClock) -> None:
        runner = FakeRunner()
        b = make([runner], clock, max_batch_size=4)
        t = submit(b, "full", items=4)
        await settle()
        assert runner.batches == [["full"]]
        assert result(t) == echo("full")
        await b.close()

    run(body)


def test_request_larger_than_max_batch_size_is_rejected_naming_the_limit() -> None:
    async def body(clock: FakeClock) -> None:
        runner = FakeRunner()
        # Not started yet: were the request queued, a running dispatcher could never fit it.
        b = Batcher([runner], BatchPolicy(max_batch_size=4), clock=clock)
        err = rejected_at_once(b, req("big", items=5))
        assert err.code is Code.INVALID_ARGUMENT
        assert "at most 4" in err.message
        assert "5" in err.message
        assert b.queued_items == 0
        b.start()
        await settle()
        assert runner.batches == []
        t = submit(b, "ok", items=4)  # the batcher still serves
        await settle()
        assert result(t) == echo("ok")
        await b.close()

    run(body)


# -- bounded queue -----------------------------------------------------------------------------
def test_full_queue_rejects_at_once_and_accepted_requests_complete() -> None:
    async def body(clock: FakeClock) -> None:
        runner = FakeRunner()
        runner.hold()
        b = make([runner], clock, max_batch_size=8, max_queue=3)
        first = submit(b, "first")  # dispatched at once: in flight, not queued
        await settle()
        assert runner.batches == [["first"]]
        queued = [submit(b, "b"), submit(b, "c", items=2)]
        await settle()
        assert b.queued_items == 3

        err = rejected_at_once(b, req("d"))
        assert err.code is Code.RESOURCE_EXHAUSTED
        assert "3" in err.message
        assert b.queued_items == 3

        runner.release()
        await settle()
        assert runner.batches == [["first"], ["b", "c"]]
        assert result(first) == echo("first")
        assert [result(t) for t in queued] == [echo("b"), echo("c")]
        assert b.queued_items == 0

        later = submit(b, "later", items=3)  # room again once the queue drained
        await settle()
        assert result(later) == echo("later")
        await b.close()

    run(body)


def test_queue_limit_counts_items_not_requests() -> None:
    async def body(clock: FakeClock) -> None:
        runner = FakeRunner()
        runner.hold()
        b = make([runner], clock, max_batch_size=4, max_queue=4)
        first = submit(b, "first")
        await settle()
        queued = submit(b, "q", items=3)
        await settle()
        assert rejected_at_once(b, req("two", items=2)).code is Code.RESOURCE_EXHAUSTED  # 3 + 2 > 4
        fits = submit(b, "one", items=1)  # 3 + 1 == 4 fits
        await settle()
        assert b.queued_items == 4
        runner.release()
        await settle()
        assert runner.batches == [["first"], ["q", "one"]]
        assert result(first) == echo("first")
        assert result(queued) == echo("q")
        assert result(fits) == echo("one")
        await b.close()

    run(body)


# -- expired and cancelled requests ------------------------------------------------------------
def test_expired_requests_never_reach_the_runner() -> None:
    async def body(clock: FakeClock) -> None:
        runner = FakeRunner()
        runner.hold()
        b = make([runner], clock, max_batch_size=8)
        first = submit(b, "first")
        await settle()
        t0 = clock.now
        late = submit(b, "late", deadline=t0 + 5)  # will be exactly due at dispatch
        keep = submit(b, "keep")
        early = submit(b, "early", deadline=t0 + 1)
        fine = submit(b, "fine", deadline=t0 + 6)
        await settle()
        clock.advance(5)
        runner.release()
        await settle()
        assert runner.batches == [["first"], ["keep", "fine"]]
        for t in (late, early):
            assert error(t).code is Code.DEADLINE_EXCEEDED
        assert result(first) == echo("first")
        assert result(keep) == echo("keep")
        assert result(fine) == echo("fine")
        assert b.queued_items == 0
        await b.close()

    run(body)


def test_request_already_expired_on_arrival_does_not_run() -> None:
    async def body(clock: FakeClock) -> None:
        runner = FakeRunner()
        b = make([runner], clock, max_batch_size=8)
        t = submit(b, "dead", deadline=clock.now)
        await settle()
        assert error(t).code is Code.DEADLINE_EXCEEDED
        assert runner.batches == []
        ok = submit(b, "ok")
        await settle()
        assert runner.batches == [["ok"]]
        assert result(ok) == echo("ok")
        await b.close()

    run(body)


def test_cancelled_requests_never_reach_the_runner() -> None:
    async def body(clock: FakeClock) -> None:
        runner = FakeRunner()
        runner.hold()
        b = make([runner], clock, max_batch_size=8)
        first = submit(b, "first")
        await settle()
        gone = submit(b, "gone")
        keep = submit(b, "keep")
        gone2 = submit(b, "gone2")
        await settle()
        gone.cancel()
        gone2.cancel()
        await settle()
        assert gone.cancelled()
        assert gone2.cancelled()
        runner.release()
        await settle()
        assert runner.batches == [["first"], ["keep"]]
        assert result(keep) == echo("keep")
        assert result(first) == echo("first")
        assert b.queued_items == 0
        await b.close()

    run(body)


def test_batch_of_only_dead_requests_is_not_run_and_the_runner_stays_usable() -> None:
    async def body(clock: FakeClock) -> None:
        runner = FakeRunner()
        runner.hold()
        b = make([runner], clock, max_batch_size=8)
        first = submit(b, "first")
        await settle()
        gone = submit(b, "gone")
        late = submit(b, "late", deadline=clock.now + 1)
        await settle()
        gone.cancel()
        clock.advance(1)
        await settle()
        runner.release()
        await settle()
        assert runner.batches == [["first"]]  # no empty batch reached the runner
        assert gone.cancelled()
        assert error(late).code is Code.DEADLINE_EXCEEDED
        after = submit(b, "after")
        await settle()
        assert runner.batches == [["first"], ["after"]]
        assert result(after) == echo("after")
        assert result(first) == echo("first")
        await b.close()

    run(body)


# -- per-item results and whole-batch failures -------------------------------------------------
async def _queue_behind_busy_runner(b: Batcher, runner: FakeRunner, ids: Sequence[str]) -> list[asyncio.Task]:
    """Hold the runner with a batch of its own, queue `ids` behind it, then release: one batch of ids."""
    runner.hold()
    primer = submit(b, f"primer-{len(runner.batches)}")
    await settle()
    tasks = [submit(b, rid) for rid in ids]
    await settle()
    runner.release()
    await settle()
    assert result(primer).status == 200
    assert runner.batches[-1] == list(ids)
    return tasks


def test_per_item_status_reaches_only_its_caller() -> None:
    async def body(clock: FakeClock) -> None:
        runner = FakeRunner()
        b = make([runner], clock, max_batch_size=8)
        runner.script[2] = lambda ids: [echo(rid, 400 if rid == "bad" else 200) for rid in ids]
        a, bad, c = await _queue_behind_busy_runner(b, runner, ["a", "bad", "c"])
        assert result(a) == echo("a", 200)
        assert result(bad) == echo("bad", 400)
        assert result(c) == echo("c", 200)
        await b.close()

    run(body)


def test_runner_serving_error_fails_only_that_batch() -> None:
    async def body(clock: FakeClock) -> None:
        runner = FakeRunner()
        b = make([runner], clock, max_batch_size=8)
        boom = ServingError(Code.INVALID_ARGUMENT, "handler rejected the batch: bad input")

        def fail(ids: list[str]) -> list[InferResult]:
            raise boom

        runner.script[2] = fail
        x, y = await _queue_behind_busy_runner(b, runner, ["x", "y"])
        for t in (x, y):
            err = error(t)
            assert err.code is Code.INVALID_ARGUMENT
            assert err.message == boom.message
        nxt = submit(b, "next")
        await settle()
        assert runner.batches[-1] == ["next"]
        assert result(nxt) == echo("next")
        await b.close()

    run(body)


def test_runner_crash_is_internal_and_sanitized_and_only_that_batch_fails() -> None:
    secret = "secret-token-4711 at /opt/models/weights.pt"

    async def body(clock: FakeClock) -> None:
        runner = FakeRunner()
        b = make([runner], clock, max_batch_size=8)

        async def crash(ids: list[str]) -> list[InferResult]:
            await asyncio.sleep(0)
            raise RuntimeError(secret)

        runner.script[2] = crash
        x, y = await _queue_behind_busy_runner(b, runner, ["x", "y"])
        for t in (x, y):
            err = error(t)
            assert err.code is Code.INTERNAL
            assert secret not in err.message
            assert "4711" not in err.message
            assert "RuntimeError" not in err.message
            assert "Traceback" not in err.message
            assert err.message  # still says something
        nxt = submit(b, "next")
        await settle()
        assert runner.batches[-1] == ["next"]
        assert result(nxt) == echo("next")
        await b.close()

    run(body)


def test_runner_raising_cancelled_error_still_answers_its_batch() -> None:
    async def body(clock: FakeClock) -> None:
        runner = FakeRunner()
        b = make([runner], clock, max_batch_size=8)

        def cancelled(ids: list[str]) -> list[InferResult]:
            raise asyncio.CancelledError  # e.g. an executor shut down under the runner

        runner.script[2] = cancelled
        (x,) = await _queue_behind_busy_runner(b, runner, ["x"])
        assert x.done(), "the request whose batch was cancelled under it never got an answer"
        assert error(x).code in (Code.UNAVAILABLE, Code.INTERNAL)
        nxt = submit(b, "next")
        await settle()
        assert result(nxt) == echo("next")
        await b.close()

    run(body)


@pytest.mark.parametrize("count", [0, 1, 3], ids=["none", "too-few", "too-many"])
def test_wrong_result_count_fails_the_batch_as_internal_and_serving_continues(count: int) -> None:
    async def body(clock: FakeClock) -> None:
        runner = FakeRunner()
        b = make([runner], clock, max_batch_size=8)
        runner.script[2] = lambda ids: [echo(f"r{i}") for i in range(count)]
        x, y = await _queue_behind_busy_runner(b, runner, ["x", "y"])
        for t in (x, y):
            assert error(t).code is Code.INTERNAL
        nxt = submit(b, "next")
        await settle()
        assert runner.batches[-1] == ["next"]
        assert result(nxt) == echo("next")
        await b.close()

    run(body)


# -- several runners ---------------------------------------------------------------------------
def test_two_runners_run_two_batches_at_once() -> None:
    async def body(clock: FakeClock) -> None:
        r1, r2 = FakeRunner("r1"), FakeRunner("r2")
        r1.hold()
        r2.hold()
        b = make([r1, r2], clock, max_batch_size=8)
        a = submit(b, "a")
        await settle()
        bb = submit(b, "b")
        await settle()
        assert (r1.running, r2.running) == (1, 1), "both runners must be busy at the same time"
        assert sorted([*r1.batches, *r2.batches]) == [["a"], ["b"]]
        assert b.inflight_batches == 2
        c = submit(b, "c")  # both busy: queued
        d = submit(b, "d")
        await settle()
        assert b.queued_items == 2
        busy_with_b = r1 if r1.batches == [["b"]] else r2
        other = r2 if busy_with_b is r1 else r1
        busy_with_b.release()  # the first runner to free up takes the queued batch
        await settle()
        assert busy_with_b.batches == [["b"], ["c", "d"]]
        assert other.running == 1
        assert not a.done()
        assert [result(t) for t in (bb, c, d)] == [echo("b"), echo("c"), echo("d")]
        other.release()
        await settle()
        assert result(a) == echo("a")
        await b.close()

    run(body)


def test_a_batch_given_to_a_runner_retired_meanwhile_runs_on_another_and_fails_nothing() -> None:
    """Scale-down: the dispatcher held a runner whose worker was retired before it took the batch.
    Nothing of the batch ran, so it goes back to the head of the queue, in order, for another
    runner; the retired runner is never given a batch again."""

    def retired(_: list[str]) -> list[InferResult]:
        raise RunnerRetired("worker r2 was retired before it took the batch")

    async def body(clock: FakeClock) -> None:
        r1, r2 = FakeRunner("r1"), FakeRunner("r2")
        r1.hold()
        b = make([r1, r2], clock, max_batch_size=8)
        a = submit(b, "a")
        await settle()
        assert r1.batches == [["a"]], "the held runner took the first request"
        other = r2
        other.script[1] = retired
        bb, c = submit(b, "b"), submit(b, "c")
        await settle()
        assert other.batches == [["b", "c"]]  # offered once, refused unrun
        assert not bb.done(), "a retired runner's batch must not fail"
        assert not c.done()
        assert b.queued_items == 2
        r1.release()
        await settle()
        assert r1.batches == [["a"], ["b", "c"]]
        assert [result(t) for t in (a, bb, c)] == [echo("a"), echo("b"), echo("c")]
        d = submit(b, "d")
        await settle()
        assert result(d) == echo("d")
        assert other.batches == [["b", "c"]], "the retired runner is out of the rotation"
        await b.close()

    run(body)


# -- max_batch_delay_s > 0 ---------------------------------------------------------------------
# The delay is an upper bound on waiting to fill a batch, measured from the oldest request, and
# applies only while another instance of the model is computing; an idle model never waits.
async def _one_runner_busy(clock: FakeClock, **policy: Any) -> tuple[Batcher, FakeRunner, FakeRunner]:
    """Two runners; the first is held computing a primer batch, the second is idle."""
    busy, free = FakeRunner("busy"), FakeRunner("free")
    busy.hold()
    b = make([busy, free], clock, **policy)
    submit(b, "primer")
    await settle()
    assert busy.batches == [["primer"]]
    assert busy.running == 1
    return b, busy, free


def test_delay_waits_to_fill_and_dispatches_as_soon_as_full() -> None:
    async def body(clock: FakeClock) -> None:
        b, busy, free = await _one_runner_busy(clock, max_batch_size=3, max_batch_delay_s=10.0)
        a = submit(b, "a")
        await settle()
        assert free.batches == [], "with a delay and the model busy, a lone request waits for company"
        clock.advance(4)
        await settle()
        bb = submit(b, "b")
        await settle()
        assert free.batches == []
        t_before = clock.now
        c = submit(b, "c")
        await settle()
        assert clock.now == t_before  # dispatched without any time passing: the batch was full
        assert free.batches == [["a", "b", "c"]]
        assert [result(t) for t in (a, bb, c)] == [echo("a"), echo("b"), echo("c")]
        busy.release()
        await b.close()

    run(body)


def test_delay_dispatches_a_partial_batch_when_the_delay_runs_out() -> None:
    async def body(clock: FakeClock) -> None:
        b, busy, free = await _one_runner_busy(clock, max_batch_size=4, max_batch_delay_s=10.0)
        a = submit(b, "a")
        await settle()
        clock.advance(6)
        bb = submit(b, "b")  # the delay counts from the oldest request, "a"
        await settle()
        clock.advance(3.5)  # 9.5 s after "a"
        await settle()
        assert free.batches == []
        clock.advance(0.5)  # 10 s after "a"
        await settle()
        assert free.batches == [["a", "b"]]
        assert [result(t) for t in (a, bb)] == [echo("a"), echo("b")]
        busy.release()
        await b.close()

    run(body)


def test_delay_stops_waiting_when_the_next_request_does_not_fit() -> None:
    async def body(clock: FakeClock) -> None:
        b, busy, free = await _one_runner_busy(clock, max_batch_size=4, max_batch_delay_s=10.0)
        a = submit(b, "a", items=2)
        await settle()
        assert free.batches == []
        big = submit(b, "big", items=3)  # 2 + 3 > 4: waiting longer cannot help "a"
        await settle()
        assert free.batches[0] == ["a"]
        assert result(a) == echo("a")
        clock.advance(10)  # "big" waits for its own fill window
        await settle()
        assert free.batches == [["a"], ["big"]]
        assert result(big) == echo("big")
        busy.release()
        await b.close()

    run(body)


def test_delay_is_measured_from_the_oldest_queued_request() -> None:
    async def body(clock: FakeClock) -> None:
        b, busy, free = await _one_runner_busy(clock, max_batch_size=4, max_batch_delay_s=10.0)
        free.hold()
        primer2 = submit(b, "primer2", items=4)  # a full batch goes at once
        await settle()
        assert free.batches == [["primer2"]]  # both instances computing now
        a = submit(b, "a")
        await settle()
        clock.advance(6)
        bb = submit(b, "b")
        await settle()
        free.release()  # "free" frees up 6 s after "a" arrived, "busy" still computes
        await settle()
        assert free.batches == [["primer2"]]
        clock.advance(3.5)
        await settle()
        assert free.batches == [["primer2"]]
        clock.advance(0.5)  # 10 s after "a", not 10 s after "b" or after the runner freed up
        await settle()
        assert free.batches == [["primer2"], ["a", "b"]]
        assert [result(t) for t in (primer2, a, bb)] == [echo("primer2"), echo("a"), echo("b")]
        busy.release()
        await b.close()

    run(body)


def test_delay_stops_waiting_when_the_model_becomes_idle() -> None:
    async def body(clock: FakeClock) -> None:
        b, busy, free = await _one_runner_busy(clock, max_batch_size=4, max_batch_delay_s=10.0)
        a = submit(b, "a")
        await settle()
        assert free.batches == []
        assert busy.batches == [["primer"]]
        busy.release()  # nothing computes any more: waiting would only add latency
        await settle()  # no time passes
        assert [batch for r in (busy, free) for batch in r.batches if batch != ["primer"]] == [["a"]]
        assert result(a) == echo("a")
        await b.close()

    run(body)


@pytest.mark.parametrize("n_runners", [1, 2])
def test_delay_never_holds_back_a_request_when_the_model_is_idle(n_runners: int) -> None:
    async def body(clock: FakeClock) -> None:
        runners = [FakeRunner(f"r{i}") for i in range(n_runners)]
        b = make(runners, clock, max_batch_size=4, max_batch_delay_s=10.0)
        a = submit(b, "a")
        await settle()  # time does not move
        assert [batch for r in runners for batch in r.batches] == [["a"]]
        assert result(a) == echo("a")
        await b.close()

    run(body)


def test_delay_single_runner_does_not_wait_after_its_batch_finishes() -> None:
    async def body(clock: FakeClock) -> None:
        runner = FakeRunner()
        runner.hold()
        b = make([runner], clock, max_batch_size=4, max_batch_delay_s=10.0)
        first = submit(b, "first")  # idle model: dispatched at once
        await settle()
        assert runner.batches == [["first"]]
        queued = submit(b, "queued")
        await settle()
        runner.release()
        await settle()  # no time passes; nothing is computing any more
        assert result(first) == echo("first")
        assert b.inflight_batches == 0
        assert runner.batches == [["first"], ["queued"]], "an idle model held a request back"
        assert result(queued) == echo("queued")
        await b.close()

    run(body)


def test_delay_request_expiring_while_the_batch_fills_does_not_run() -> None:
    async def body(clock: FakeClock) -> None:
        b, busy, free = await _one_runner_busy(clock, max_batch_size=3, max_batch_delay_s=10.0)
        late = submit(b, "late", deadline=clock.now + 5)
        await settle()
        clock.advance(6)  # "late" is past its deadline, the batch is still filling
        await settle()
        tasks = [submit(b, "b"), submit(b, "c"), submit(b, "d")]
        await settle()
        clock.advance(10)  # let any partial batch go
        await settle()
        assert "late" not in [rid for batch in free.batches for rid in batch]
        assert error(late).code is Code.DEADLINE_EXCEEDED
        assert [result(t) for t in tasks] == [echo("b"), echo("c"), echo("d")]
        busy.release()
        await b.close()

    run(body)


def test_delay_request_cancelled_while_the_batch_fills_does_not_run() -> None:
    async def body(clock: FakeClock) -> None:
        b, busy, free = await _one_runner_busy(clock, max_batch_size=3, max_batch_delay_s=10.0)
        gone = submit(b, "gone")
        await settle()
        gone.cancel()
        await settle()
        tasks = [submit(b, "b"), submit(b, "c"), submit(b, "d")]
        await settle()
        clock.advance(10)
        await settle()
        assert "gone" not in [rid for batch in free.batches for rid in batch]
        assert [result(t) for t in tasks] == [echo("b"), echo("c"), echo("d")]
        busy.release()
        await b.close()

    run(body)


# -- close() -----------------------------------------------------------------------------------
def test_close_rejects_new_requests_and_finishes_inflight_and_queued_ones() -> None:
    async def body(clock: FakeClock) -> None:
        runner = FakeRunner()
        runner.hold()
        b = make([runner], clock, max_batch_size=2)
        inflight = submit(b, "inflight")
        await settle()
        queued = [submit(b, f"q{i}") for i in range(3)]
        await settle()
        closing = asyncio.get_running_loop().create_task(b.close())
        await settle()
        assert not closing.done(), "close() must wait for in-flight and queued requests"

        assert rejected_at_once(b, req("too-late")).code is Code.UNAVAILABLE

        runner.release()
        # Time moves a little each step so that close()'s own polling (if any) can proceed.
        await settle(200, clock=clock, tick=0.01)
        assert closing.done()
        closing.result()
        assert runner.batches == [["inflight"], ["q0", "q1"], ["q2"]]
        assert result(inflight) == echo("inflight")
        assert [result(t) for t in queued] == [echo("q0"), echo("q1"), echo("q2")]
        assert runner.batches[-1] == ["q2"]  # "too-late" never ran

    run(body)


def test_close_on_idle_batcher_returns_and_submit_is_unavailable() -> None:
    async def body(clock: FakeClock) -> None:
        runner = FakeRunner()
        b = make([runner], clock)
        ok = submit(b, "ok")
        await settle()
        assert result(ok) == echo("ok")
        closing = asyncio.get_running_loop().create_task(b.close())
        await settle()
        assert closing.done()
        assert rejected_at_once(b, req("late")).code is Code.UNAVAILABLE
        assert runner.batches == [["ok"]]

    run(body)


def test_close_while_a_batch_is_filling_still_answers_it() -> None:
    async def body(clock: FakeClock) -> None:
        b, busy, free = await _one_runner_busy(clock, max_batch_size=4, max_batch_delay_s=10.0)
        a = submit(b, "a")
        await settle()
        assert free.batches == []  # "a" is held, filling
        closing = asyncio.get_running_loop().create_task(b.close())
        await settle()  # no time passes: a closing batcher has no reason to wait for company
        assert free.batches == [["a"]]
        assert result(a) == echo("a")
        assert not closing.done()  # "busy" still computes its batch
        busy.release()
        await settle(200, clock=clock, tick=0.01)  # time moves in case close() polls
        assert closing.done()
        closing.result()

    run(body)


# -- property: every request answered once, with its own result, batches within the limit -----
@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    sizes=st.lists(st.integers(min_value=1, max_value=4), min_size=1, max_size=30),
    max_batch_size=st.integers(min_value=1, max_value=6),
    n_runners=st.integers(min_value=1, max_value=3),
    gaps=st.lists(st.integers(min_value=0, max_value=3), min_size=1, max_size=8),
    runner_yields=st.lists(st.integers(min_value=0, max_value=3), min_size=1, max_size=5),
)
def test_property_every_request_gets_exactly_its_own_result(
    sizes: list[int], max_batch_size: int, n_runners: int, gaps: list[int], runner_yields: list[int]
) -> None:
    runners = [FakeRunner(f"r{i}", yields=runner_yields) for i in range(n_runners)]
    order: list[list[str]] = []  # every batch, in the order runners were called
    for r in runners:
        original = r.run

        async def recording(requests, _orig=original):  # type: ignore[no-untyped-def]
            order.append([r.request_id for r in requests])
            return await _orig(requests)

        r.run = recording  # type: ignore[method-assign]
    ids = [f"req{i}" for i in range(len(sizes))]
    items = dict(zip(ids, sizes, strict=True))
    outcomes: dict[str, InferResult | BaseException] = {}

    async def one(b: Batcher, rid: str) -> None:
        outcomes[rid] = await b.submit(req(rid, items=items[rid]))

    async def body(clock: FakeClock) -> None:
        b = make(runners, clock, max_batch_size=max_batch_size)
        tasks = []
        for i, rid in enumerate(ids):
            if items[rid] > max_batch_size:  # must never be queued: no batch could take it
                outcomes[rid] = rejected_at_once(b, req(rid, items=items[rid]))
            else:
                tasks.append(asyncio.get_running_loop().create_task(one(b, rid)))
            for _ in range(gaps[i % len(gaps)]):
                await asyncio.sleep(0)
        await settle(SETTLE_STEPS + 10 * len(ids))
        assert all(t.done() for t in tasks), "some request never got an answer"
        for t in tasks:
            t.result()
        await b.close()

    run(body)

    accepted = [rid for rid in ids if items[rid] <= max_batch_size]
    assert set(outcomes) == set(ids)
    for rid in ids:
        out = outcomes[rid]
        if items[rid] > max_batch_size:
            assert isinstance(out, ServingError)
            assert out.code is Code.INVALID_ARGUMENT
        else:
            assert isinstance(out, InferResult), f"{rid}: {out!r}"
            assert out.body == rid.encode()
            assert out.status == 200
    dispatched = [rid for batch in order for rid in batch]
    assert sorted(dispatched) == sorted(accepted), "each accepted request runs exactly once"
    assert dispatched == accepted, "batches are taken in arrival order"
    for batch in order:
        assert batch, "no empty batch reaches a runner"
        assert sum(items[rid] for rid in batch) <= max_batch_size
