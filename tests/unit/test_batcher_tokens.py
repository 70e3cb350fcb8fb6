"""Length-aware batching within a token budget: the Batcher with a token counter, the pure
grouping rule, and a worker's merge of batches from several frontends.

Same discipline as test_batcher.py (whose fake clock, loop and runner are reused): pure asyncio,
the device kept busy by a held runner while requests queue, no timed sleeps. A request's length
in tokens is written in its id ("b200" is 200 tokens long), and the fake counter reads it there.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mariner.server.common.batch_policy import BatchPolicy
from mariner.server.common.token_groups import group_by_length, padded_tokens
from mariner.server.contracts.types import InferRequest, TokenCost, WireProtocol
from mariner.server.frontend.batcher import Batcher
from tests.unit.test_batcher import FakeClock, FakeRunner, echo, result, run, settle

pytestmark = pytest.mark.unit


class FakeCounter:
    """Reads a request's length from its id's trailing digits; rows are its items."""

    def __init__(self, max_batch_tokens: int | None) -> None:
        self.max_batch_tokens = max_batch_tokens
        self.counted: list[str] = []

    def cost(self, req: InferRequest) -> TokenCost:
        self.counted.append(req.request_id)
        match = re.search(r"(\d+)$", req.request_id)
        assert match is not None
        return TokenCost(req.items, int(match.group(1)))


class RecordingObserver:
    def __init__(self) -> None:
        self.tokens: list[tuple[int, int]] = []

    def queue_depth(self, items: int) -> None:
        pass

    def batch_started(
        self, items: int, queue_waits: Sequence[float], versions: Sequence[str | None] = ()
    ) -> None:
        pass

    def batch_finished(self, seconds: float) -> None:
        pass

    def batch_tokens(self, padded: int, unpadded: int) -> None:
        self.tokens.append((padded, unpadded))


def request(rid: str, items: int = 1) -> InferRequest:
    return InferRequest("minilm", "1", {"body": rid}, WireProtocol.TS_HTTP, rid, items=items)


def length(rid: str) -> int:
    match = re.search(r"(\d+)$", rid)
    assert match is not None
    return int(match.group(1))


def make(
    runner: FakeRunner,
    clock: FakeClock,
    counter: FakeCounter | None,
    observer: RecordingObserver | None = None,
    **policy: Any,
) -> Batcher:
    b = Batcher([runner], BatchPolicy(**policy), clock=clock, tokens=counter, observer=observer)
    b.start()
    return b


async def queue_behind_a_busy_device(
    b: Batcher, runner: FakeRunner, rids: Sequence[str], items: dict[str, int] | None = None
) -> list[asyncio.Task[Any]]:
    """Keep the device busy with "busy1", then queue `rids` in order; returns every task."""
    runner.hold()
    loop = asyncio.get_running_loop()
    tasks = [loop.create_task(b.submit(request("busy1")), name="busy1")]
    await settle()
    assert runner.batches == [["busy1"]]
    for rid in rids:
        tasks.append(loop.create_task(b.submit(request(rid, (items or {}).get(rid, 1))), name=rid))
        await settle(2)
    await settle()
    return tasks


async def drain(b: Batcher, runner: FakeRunner, tasks: Sequence[asyncio.Task[Any]]) -> None:
    runner.release()
    await settle()
    for t in tasks:
        assert result(t) == echo(t.get_name())
    await b.close()


def test_mixed_lengths_are_grouped_by_length_within_the_budget() -> None:
    async def body(clock: FakeClock) -> None:
        runner = FakeRunner()
        b = make(runner, clock, FakeCounter(600), max_batch_size=8)
        tasks = await queue_behind_a_busy_device(b, runner, ["a5", "b200", "c6", "d190", "e7", "f195"])
        await drain(b, runner, tasks)
        # a (oldest) with the short ones; the long ones fill 3 x 200 = 600, the budget.
        assert runner.batches[1:] == [["a5", "c6", "e7"], ["b200", "d190", "f195"]]

    run(body)


def test_without_a_counter_the_same_queue_is_batched_in_arrival_order() -> None:
    async def body(clock: FakeClock) -> None:
        runner = FakeRunner()
        b = make(runner, clock, None, max_batch_size=3)
        tasks = await queue_behind_a_busy_device(b, runner, ["a5", "b200", "c6", "d190", "e7", "f195"])
        await drain(b, runner, tasks)
        assert runner.batches[1:] == [["a5", "b200", "c6"], ["d190", "e7", "f195"]]

    run(body)


def test_grouping_without_a_budget_still_sorts_by_length_up_to_the_batch_size() -> None:
    async def body(clock: FakeClock) -> None:
        runner = FakeRunner()
        counter = FakeCounter(None)
        b = make(runner, clock, counter, max_batch_size=3)
        tasks = await queue_behind_a_busy_device(b, runner, ["a5", "b200", "c6", "d190", "e7", "f195"])
        await drain(b, runner, tasks)
        assert runner.batches[1:] == [["a5", "c6", "e7"], ["b200", "d190", "f195"]]
        assert counter.counted == ["busy1", "a5", "b200", "c6", "d190", "e7", "f195"]  # once each

    run(body)


def test_the_oldest_request_is_always_in_the_next_batch() -> None:
    async def body(clock: FakeClock) -> None:
        runner = FakeRunner()
        b = make(runner, clock, FakeCounter(400), max_batch_size=4)
        # A long request waits behind many short ones that would group better without it.
        rids = ["long200", *[f"s{i}x5" for i in range(6)], "mid150"]
        tasks = await queue_behind_a_busy_device(b, runner, rids)
        await drain(b, runner, tasks)
        first = runner.batches[1]
        assert first[0] == "long200"
        assert padded_tokens([TokenCost(1, length(r)) for r in first]) <= 400
        assert first == ["long200", "mid150"]  # closest in length, within 2 x 200 = 400
        assert runner.batches[2:] == [["s0x5", "s1x5", "s2x5", "s3x5"], ["s4x5", "s5x5"]]

    run(body)


def test_a_single_request_over_the_budget_goes_alone_and_the_rest_follow() -> None:
    async def body(clock: FakeClock) -> None:
        runner = FakeRunner()
        b = make(runner, clock, FakeCounter(100), max_batch_size=8)
        tasks = await queue_behind_a_busy_device(b, runner, ["huge256", "t10", "u12"])
        await drain(b, runner, tasks)
        assert runner.batches[1:] == [["huge256"], ["t10", "u12"]]

    run(body)


def test_rows_count_in_the_budget_and_requests_reach_the_runner_counted() -> None:
    async def body(clock: FakeClock) -> None:
        runner = FakeRunner()
        seen: list[TokenCost | None] = []
        inner = runner.run

        async def recording(requests: Sequence[InferRequest]) -> Any:
            seen.extend(r.tokens for r in requests)
            return await inner(requests)

        runner.run = recording  # type: ignore[method-assign]
        observer = RecordingObserver()
        b = make(runner, clock, FakeCounter(100), observer, max_batch_size=8)
        # Each is 4 rows of 10 tokens (a tensor request): two fit (8 x 10 = 80), three do not.
        tasks = await queue_behind_a_busy_device(
            b, runner, ["p10", "q10", "r10"], items={"p10": 4, "q10": 4, "r10": 4}
        )
        await drain(b, runner, tasks)
        assert runner.batches[1:] == [["p10", "q10"], ["r10"]]
        assert seen[1:] == [TokenCost(4, 10)] * 3
        assert observer.tokens[1:] == [(80, 80), (40, 40)]

    run(body)


def test_padding_waste_is_reported_to_the_observer() -> None:
    async def body(clock: FakeClock) -> None:
        runner = FakeRunner()
        observer = RecordingObserver()
        b = make(runner, clock, FakeCounter(None), observer, max_batch_size=2)
        tasks = await queue_behind_a_busy_device(b, runner, ["a10", "b100"])
        await drain(b, runner, tasks)
        assert runner.batches[1:] == [["a10", "b100"]]
        assert observer.tokens[1] == (200, 110)  # padded: 2 rows x 100; alone: 10 + 100

    run(body)


def test_dead_requests_in_the_window_are_dropped_and_the_rest_keep_their_order() -> None:
    async def body(clock: FakeClock) -> None:
        runner = FakeRunner()
        b = make(runner, clock, FakeCounter(1000), max_batch_size=2)
        tasks = await queue_behind_a_busy_device(b, runner, ["a50", "b5", "c48", "d6"])
        tasks[2].cancel()  # b5 goes away while queued
        await settle()
        runner.release()
        await settle()
        assert runner.batches[1:] == [["a50", "c48"], ["d6"]]
        assert tasks[2].cancelled()
        assert b.queued_items == 0
        await b.close()

    run(body)


def test_waiting_to_fill_stops_once_the_budget_is_queued() -> None:
    async def body(clock: FakeClock) -> None:
        # Two instances: one busy, so the other waits up to max_batch_delay to fill its batch,
        # unless enough tokens are already queued to fill the budget.
        busy, idle = FakeRunner("busy"), FakeRunner("idle")
        b = Batcher([busy, idle], BatchPolicy(max_batch_size=8, max_batch_delay_s=10.0), clock=clock,
                    tokens=FakeCounter(300))  # fmt: skip
        b.start()
        busy.hold()
        idle.hold()
        loop = asyncio.get_running_loop()
        first = loop.create_task(b.submit(request("one100")))
        await settle()
        assert [*busy.batches, *idle.batches] == [["one100"]]
        a = loop.create_task(b.submit(request("a150")))
        await settle()
        assert len(busy.batches) + len(idle.batches) == 1  # waits to fill: 150 < 300 tokens queued
        c = loop.create_task(b.submit(request("c150")))
        await settle()  # 300 tokens queued: dispatched at once, the clock never moved
        assert sorted(map(tuple, [*busy.batches, *idle.batches])) == [("a150", "c150"), ("one100",)]
        busy.release()
        idle.release()
        await settle()
        assert [result(t).body for t in (first, a, c)] == [b"one100", b"a150", b"c150"]
        await b.close()

    run(body)


# -- the pure rule -----------------------------------------------------------------------------
costs_st = st.lists(
    st.tuples(st.integers(1, 4), st.integers(1, 256)).map(lambda t: TokenCost(*t)), min_size=1, max_size=40
)


@given(costs=costs_st, max_items=st.integers(1, 16), budget=st.one_of(st.none(), st.integers(1, 3000)))
@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow], deadline=None)
def test_group_by_length_keeps_the_oldest_the_batch_size_and_the_budget(
    costs: list[TokenCost], max_items: int, budget: int | None
) -> None:
    items = [c.rows for c in costs]
    chosen = group_by_length(costs, items, max_items=max_items, max_tokens=budget)
    assert chosen[0] == 0
    assert chosen == sorted(set(chosen))
    picked = [costs[i] for i in chosen]
    if len(chosen) > 1:
        assert sum(items[i] for i in chosen) <= max_items
        assert budget is None or padded_tokens(picked) <= budget
    # The batch is full: nothing left out would still fit beside what was chosen (both limits
    # only tighten as requests join, so a request that fits now would have fitted at its turn).
    for i in set(range(len(costs))) - set(chosen):
        fits_items = sum(items[j] for j in chosen) + items[i] <= max_items
        fits_tokens = budget is None or padded_tokens([*picked, costs[i]]) <= budget
        assert not (fits_items and fits_tokens)


def test_group_by_length_prefers_the_closest_lengths() -> None:
    costs = [TokenCost(1, n) for n in (50, 5, 200, 48, 60, 49)]
    assert group_by_length(costs, [1] * 6, max_items=3, max_tokens=None) == [0, 3, 5]
    assert group_by_length(costs, [1] * 6, max_items=6, max_tokens=240) == [0, 3, 4, 5]  # 4 x 60
    # 60 no longer fits (4 x 60 > 239) and is skipped; the farther 5 still fits (4 x 50).
    assert group_by_length(costs, [1] * 6, max_items=6, max_tokens=239) == [0, 1, 3, 5]
    assert group_by_length([], [], max_items=3, max_tokens=None) == []


# -- a worker merging batches from several frontends --------------------------------------------
def worker(model_config: dict[str, Any], batch_size: int = 8) -> Any:
    from mariner.server.contracts.worker_api import WorkerSpec
    from mariner.server.worker.batch_server import Worker

    spec = WorkerSpec(
        model="minilm", version="1", instance=0, generation=0, model_dir="/nonexistent",
        archive_file="minilm.mar", sha256="", manifest={}, model_config=model_config,
        batch_size=batch_size, gpu_id=None, torch_threads=None, socket_path="/nonexistent/s",
    )  # fmt: skip
    host = SimpleNamespace(placement=SimpleNamespace(gpu_id=None, device="cpu"))
    return Worker(spec, host)


def job(batch_id: int, *costs: TokenCost | None) -> Any:
    from mariner.server.contracts import worker_wire as protocol
    from mariner.server.worker.batch_server import _Job

    reqs = tuple(
        InferRequest("minilm", "1", {}, WireProtocol.TS_HTTP, f"r{batch_id}.{i}", tokens=c)
        for i, c in enumerate(costs)
    )
    return _Job(SimpleNamespace(open=True), protocol.Batch(batch_id, reqs), len(reqs))


BUDGET = {"maxBatchTokens": 100, "tokenCounter": {"tokenizer": "tokenizer.json"}}


def test_a_worker_merges_batches_only_within_the_token_budget() -> None:
    w = worker(BUDGET)
    w._jobs.extend([job(1, TokenCost(1, 40)), job(2, TokenCost(1, 45)), job(3, TokenCost(1, 10))])
    assert [j.batch.id for j in w._take()] == [1, 2]  # 2 x 45 = 90; with the third 3 x 45 > 100
    assert [j.batch.id for j in w._take()] == [3]
    w._jobs.append(job(4, TokenCost(1, 300)))  # alone over the budget: still runs
    assert [j.batch.id for j in w._take()] == [4]


def test_a_worker_without_a_budget_or_counts_merges_by_batch_size_as_before() -> None:
    plain = worker({}, batch_size=3)
    plain._jobs.extend([job(1, TokenCost(1, 256)), job(2, TokenCost(1, 256)), job(3, None, None)])
    assert [j.batch.id for j in plain._take()] == [1, 2]  # 4 items > batch size 3
    uncounted = worker(BUDGET)
    uncounted._jobs.extend([job(1, None), job(2, None)])
    assert [j.batch.id for j in uncounted._take()] == [1, 2]


@given(
    shapes=st.lists(st.tuples(st.integers(1, 3), st.integers(1, 120)), min_size=1, max_size=30),
    max_batch_size=st.integers(3, 8),
    budget=st.one_of(st.none(), st.integers(1, 400)),
    gaps=st.lists(st.integers(0, 3), min_size=1, max_size=8),
    runner_yields=st.lists(st.integers(0, 3), min_size=1, max_size=5),
)
@settings(max_examples=150, suppress_health_check=[HealthCheck.too_slow], deadline=None)
def test_property_budget_fairness_and_one_answer_each(
    shapes: list[tuple[int, int]],
    max_batch_size: int,
    budget: int | None,
    gaps: list[int],
    runner_yields: list[int],
) -> None:
    runner = FakeRunner(yields=runner_yields)
    ids = [f"q{i}x{tokens}" for i, (_, tokens) in enumerate(shapes)]
    rows = {rid: n for rid, (n, _) in zip(ids, shapes, strict=True)}

    async def body(clock: FakeClock) -> None:
        b = make(runner, clock, FakeCounter(budget), max_batch_size=max_batch_size)
        loop = asyncio.get_running_loop()
        tasks = []
        for i, rid in enumerate(ids):
            tasks.append(loop.create_task(b.submit(request(rid, rows[rid])), name=rid))
            for _ in range(gaps[i % len(gaps)]):
                await asyncio.sleep(0)
        await settle(SETTLE_STEPS_PER_REQUEST * len(ids) + 60)
        for t in tasks:
            assert result(t) == echo(t.get_name())
        await b.close()

    run(body)
    batches = runner.batches
    assert sorted(r for batch in batches for r in batch) == sorted(ids)  # each ran exactly once
    index = {rid: i for i, rid in enumerate(ids)}
    done: set[int] = set()
    for batch in batches:
        costs = [TokenCost(rows[r], length(r)) for r in batch]
        assert sum(rows[r] for r in batch) <= max_batch_size
        assert len(batch) == 1 or budget is None or padded_tokens(costs) <= budget
        # Fairness: nothing older than a batch's oldest member was still waiting when it left.
        oldest = min(index[r] for r in batch)
        assert set(range(oldest)) <= done
        done |= {index[r] for r in batch}


SETTLE_STEPS_PER_REQUEST = 10
