"""The batcher's fair order and its byte cut: callers share a model by bytes, a caller's requests
keep their order, ordinary load stays FIFO, large inputs still run, and a batch stops before its
inputs pass `max_batch_bytes`. Pure asyncio with the fake clock of test_batcher."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Hashable
from typing import Any

import pytest

from mariner.server.common.batch_policy import CALLER, MAX_BATCH_BYTES, BatchPolicy, max_batch_bytes
from mariner.server.contracts.errors import Code, ServingError
from mariner.server.contracts.types import InferResult
from mariner.server.frontend.batch_queue import REQUEST_COST_BYTES
from mariner.server.frontend.batcher import Batcher
from tests.unit.test_batcher import FakeClock, FakeRunner, echo, req, result, run, settle

pytestmark = pytest.mark.unit

MIB = 1 << 20


def submit_as(b: Batcher, caller: Hashable, rid: str, size: int = 0) -> asyncio.Task[InferResult]:
    """`rid` submitted by `caller`, as a protocol's call task submits it (CALLER set in its context)."""

    async def call() -> InferResult:
        CALLER.set(caller)
        return await b.submit(req(rid, size=size))

    return asyncio.get_running_loop().create_task(call(), name=f"submit-{rid}")


def make(runner: FakeRunner, clock: FakeClock, **policy: Any) -> Batcher:
    b = Batcher([runner], BatchPolicy(**policy), clock=clock)
    b.start()
    return b


def order(runner: FakeRunner) -> list[str]:
    return [rid for batch in runner.batches for rid in batch]


async def next_batch(runner: FakeRunner) -> None:
    """Let the held runner answer the batch it has; it holds the next one it is given."""
    runner.release()
    runner.hold()
    await settle()


async def until(runner: FakeRunner, done: Callable[[], bool]) -> None:
    """Batch after batch until `done()`, then let the runner answer the rest freely."""
    while not done():
        await next_batch(runner)
    runner.release()
    await settle()


def test_a_small_request_goes_before_another_callers_backlog_of_large_ones() -> None:
    """The held-bytes attack on one model: twelve streams keep large messages queued; a victim's
    small request used to wait behind all of them (FIFO), now behind none but the running batch."""

    async def body(clock: FakeClock) -> None:
        runner = FakeRunner()
        runner.hold()
        b = make(runner, clock, max_batch_size=32)
        attack = [submit_as(b, f"attacker{n % 3}", f"big{n}", 7 * MIB) for n in range(9)]
        await settle()
        victim = submit_as(b, "victim", "small", 200)
        await settle()
        assert runner.batches == [["big0"]]  # running when the victim came
        runner.release()
        await settle()
        assert runner.batches[1] == ["small"]  # next, and alone: no large input joins a small one
        assert result(victim) == echo("small")
        runner.hold()
        await until(runner, lambda: all(t.done() for t in attack))
        # Every large message ran, one per batch (two pass the cut), each caller in its order.
        assert sorted(order(runner)) == sorted(["small"] + [f"big{n}" for n in range(9)])
        assert all(len(batch) == 1 for batch in runner.batches)
        for caller in range(3):
            mine = [rid for rid in order(runner) if rid.startswith("big") and int(rid[3:]) % 3 == caller]
            assert mine == sorted(mine, key=lambda r: int(r[3:]))
        await b.close()

    run(body)


def test_one_callers_requests_keep_their_order_whatever_their_sizes() -> None:
    async def body(clock: FakeClock) -> None:
        runner = FakeRunner()
        runner.hold()
        b = make(runner, clock, max_batch_size=1)
        sizes = [5 * MIB, 10, 3 * MIB, 0, 1 * MIB, 7]
        tasks = [submit_as(b, "one", f"r{i}", s) for i, s in enumerate(sizes)]
        await settle()
        await until(runner, lambda: len(order(runner)) == len(sizes))
        assert order(runner) == [f"r{i}" for i in range(len(sizes))]
        assert all(t.done() for t in tasks)
        await b.close()

    run(body)


def test_requests_of_equal_size_from_many_callers_stay_in_arrival_order() -> None:
    """Ordinary load (many clients, similar requests) is served first come, first served."""

    async def body(clock: FakeClock) -> None:
        runner = FakeRunner()
        runner.hold()
        b = make(runner, clock, max_batch_size=4)
        arrivals = [(f"client{n % 5}", f"r{n}") for n in range(20)]
        for caller, rid in arrivals:
            submit_as(b, caller, rid, 300)
            await settle(2)
        await until(runner, lambda: len(order(runner)) == len(arrivals))
        assert order(runner) == [rid for _, rid in arrivals]
        await b.close()

    run(body)


def test_a_large_request_is_not_starved_by_a_caller_of_small_ones() -> None:
    """Fair by bytes: a request of S bytes waits for about S bytes' worth of another caller's
    small ones (each costs REQUEST_COST_BYTES at least), never for all of them."""

    async def body(clock: FakeClock) -> None:
        runner = FakeRunner()
        runner.hold()
        b = make(runner, clock, max_batch_size=1)
        submit_as(b, "small", "s0", 0)  # runs at once and holds the runner
        await settle()
        big = submit_as(b, "large", "big", 10 * REQUEST_COST_BYTES)
        smalls = [submit_as(b, "small", f"s{i}", 0) for i in range(1, 40)]
        await settle()
        await until(runner, big.done)
        before = order(runner).index("big")
        assert 8 <= before <= 12, order(runner)  # 10 of the small caller's, give or take the rounding
        assert all(t.done() for t in smalls)
        await b.close()

    run(body)


def test_a_batch_stops_before_its_bytes_pass_the_cut_and_an_oversized_request_goes_alone() -> None:
    async def body(clock: FakeClock) -> None:
        runner = FakeRunner()
        runner.hold()
        b = make(runner, clock, max_batch_size=32, max_batch_bytes=100)
        submit_as(b, "c", "first", 1)
        await settle()
        for rid, size in [("a", 40), ("b", 40), ("c", 40), ("huge", 500), ("d", 10)]:
            submit_as(b, "c", rid, size)
        await settle()
        await until(runner, lambda: len(runner.batches) == 5)
        assert runner.batches == [["first"], ["a", "b"], ["c"], ["huge"], ["d"]]
        await b.close()

    run(body)


def test_a_much_larger_input_starts_the_next_batch_and_similar_ones_batch_together() -> None:
    """Small requests are not made to wait for a large one's compute; inputs of similar size,
    large or small, still fill a batch."""

    async def body(clock: FakeClock) -> None:
        runner = FakeRunner()
        runner.hold()
        b = make(runner, clock, max_batch_size=32, max_batch_bytes=64 * MIB)
        submit_as(b, "c", "first", 1)
        await settle()
        sizes = [("s1", 300), ("s2", 60_000), ("img1", 600_000), ("img2", 500_000), ("img3", 600_000)]
        sizes += [("s3", 200), ("huge", 9 * MIB), ("s4", 100)]
        for rid, size in sizes:
            submit_as(b, "c", rid, size)
        await settle()
        await until(runner, lambda: len(runner.batches) == 4)
        # 60 KB joins 300 B (under SMALL_INPUT_BYTES); 600 KB is more than 8x 60 KB; the small
        # s3 joins the images; 9 MiB is more than 8x 600 KB; s4 joins the 9 MiB one.
        assert runner.batches == [["first"], ["s1", "s2"], ["img1", "img2", "img3", "s3"], ["huge", "s4"]]
        await b.close()

    run(body)


def test_callers_tags_are_forgotten_once_their_requests_ran() -> None:
    """A server sees a caller per connection: what the fair order keeps of them must not grow with
    every connection ever made."""

    async def body(clock: FakeClock) -> None:
        runner = FakeRunner()
        b = make(runner, clock, max_batch_size=8)
        for n in range(500):
            t = submit_as(b, ("127.0.0.1", 40000 + n), f"r{n}", 100)
            await settle(4)
            assert t.done()
        assert len(b._last_tag) <= 1  # noqa: SLF001 - the bound is the point of the test
        await b.close()

    run(body)


def test_the_archive_may_set_the_byte_cut_and_a_bad_value_is_refused_by_name() -> None:
    assert max_batch_bytes({}, "m.mar") == MAX_BATCH_BYTES
    assert max_batch_bytes({"maxBatchBytes": 64 << 20}, "m.mar") == 64 << 20
    assert max_batch_bytes({"maxBatchBytes": "1024"}, "m.mar") == 1024
    for bad in (0, -5, "lots", True, 1.5, [1]):
        with pytest.raises(ServingError) as err:
            max_batch_bytes({"maxBatchBytes": bad}, "m.mar")
        assert err.value.code is Code.INVALID_ARGUMENT
        assert "maxBatchBytes must be" in err.value.message
        assert "m.mar" in err.value.message
