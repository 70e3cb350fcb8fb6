"""The dynamic batcher: one per model version, pure asyncio, no idle wait.

Semantics (DESIGN.md):
- Every request gets a future; the dispatcher wakes on arrival.
- When an instance is idle, whatever is queued is dispatched at once (up to max_batch_size
  items). While all instances are busy, arrivals accumulate, so the next batch is as full as
  the load makes it. `max_batch_delay` > 0 (TorchServe's maxBatchDelay) is an upper bound on
  waiting to fill a batch, measured from the oldest queued request with time.monotonic, and
  applies only while another instance of the model is computing: a model that is entirely
  idle never holds a request back. (TorchServe waits maxBatchDelay even when idle, which is
  pure added latency at low load.)
- The queue is bounded: a full queue rejects at once with RESOURCE_EXHAUSTED.
- Requests whose deadline passed, or whose caller went away (future cancelled), are dropped
  before they reach the device.
- Per-item outcomes come back per item; a whole-batch failure fails only that batch.
- A runner holds one batch at a time, or up to `runner_concurrency` for a model whose worker
  runs several calls at once (asyncCommunication): such a runner is offered batches again as
  soon as it took one, while it has room.
- With a token counter (the archive's tokenCounter, for models that pad a batch to its longest
  member), each request's cost (rows, longest row in tokens) is counted before it is queued, and
  a batch is formed by length: the oldest live request always goes first (FIFO fairness, no
  starvation), then the waiting requests whose lengths are closest to it join while the batch's
  padded tokens (total rows x longest row) stay within maxBatchTokens and its items within
  max_batch_size. A single request over the budget goes alone.
- Fair order: the queue is ordered by caller (the client's connection, `batching.CALLER`) and
  bytes, not by arrival alone (weighted fair queueing). Each request gets a finish tag: the later
  of its caller's last tag and the queue's virtual time, plus its cost (its input bytes and a
  constant per request). The virtual time moves, as each batch is taken, by the batch's cost
  divided by the callers that have requests waiting: the service each of them would have had
  if the model served them side by side. A caller's requests keep their order; callers share the
  model by bytes, so one with little queued goes before the backlog of one sending large inputs,
  and a large input still runs in its turn (no starvation). Requests of equal size from different
  callers stay in arrival order: under ordinary load the order is FIFO.
- A batch stops before its inputs pass `max_batch_bytes` (its first request goes whatever its
  size): a batch cannot be interrupted once its worker took it, so a request arriving just after
  waits at most about one such batch. It also stops at a request whose inputs are over
  LARGER_INPUT_FACTOR times its largest (and over SMALL_INPUT_BYTES): that request starts the
  next batch, so small requests do not wait for a large one's compute within their own batch.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections import deque
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, replace

from mariner.server.common.batch_policy import (
    CALLER,
    BatchObserver,
    BatchPolicy,
    BatchRunner,
    InstanceFailed,
    NullObserver,
    ReplaceRunner,
    RunnerRetired,
    TokenBudget,
)
from mariner.server.common.token_groups import group_by_length, padded_tokens
from mariner.server.contracts.errors import WORKER_DIED, Code, ServingError, internal
from mariner.server.contracts.types import InferRequest, InferResult, TokenCost, WireProtocol
from mariner.server.frontend.deadlines import DeadlineWatch
from mariner.server.frontend.streams import BATCH_PROGRESS

log = logging.getLogger("mariner.batcher")

# Protocols whose request carries no time limit of its own (TorchServe's): their deadline is the
# model's responseTimeout, which a streamed answer's parts restart.
_TIMEOUT_ONLY = frozenset({WireProtocol.TS_HTTP, WireProtocol.TS_GRPC})


# Length grouping looks at this many live requests per batch slot, from the head of the queue:
# enough choice to group by length, and a bounded cost per batch however long the queue is.
GROUPING_WINDOW_PER_SLOT = 4
_MIN_GROUPING_WINDOW = 32

# What a request costs in the fair order besides its input bytes: callers of small requests share
# by count as much as by bytes.
REQUEST_COST_BYTES = 1024
# A request whose inputs are over LARGER_INPUT_FACTOR times the largest of a batch (and over
# SMALL_INPUT_BYTES) starts the next batch instead of joining it: small requests are not made to
# wait for a large one's compute, which batching them together would not save.
LARGER_INPUT_FACTOR = 8
SMALL_INPUT_BYTES = 64 << 10


@dataclass(slots=True)
class _Pending:
    req: InferRequest
    future: asyncio.Future[InferResult]
    enqueued: float
    caller: Hashable
    tag: int  # its finish tag in the fair order (module docstring)


class Batcher:
    """Queues requests for one model version and feeds batches to its idle runners."""

    def __init__(
        self,
        runners: Sequence[BatchRunner],
        policy: BatchPolicy,
        *,
        observer: BatchObserver | None = None,
        clock: Callable[[], float] = time.monotonic,
        replace_runner: ReplaceRunner | None = None,
        tokens: TokenBudget | None = None,
    ) -> None:
        if not runners:
            raise ValueError("a batcher needs at least one runner")
        self.policy = policy
        self._runners = list(runners)
        self._observer = observer or NullObserver()
        self._clock = clock
        self._queue: deque[_Pending] = deque()
        self._queued_items = 0
        self._arrival = asyncio.Event()
        self._idle: asyncio.Queue[BatchRunner] = asyncio.Queue()
        for r in self._runners:
            self._idle.put_nowait(r)
        self._inflight: set[asyncio.Task[None]] = set()
        self._busy = 0  # batches running now; changes together with the idle-runner queue
        # Batches each runner holds now; a runner is in the idle queue (once) while it has room.
        # A runner that failed or hung leaves `_runners` at once: an entry of it still queued as
        # idle (it had room) is dropped when taken.
        self._load: dict[BatchRunner, int] = {}
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        self._running: list[list[_Pending]] = []  # the batches runners hold now
        self._deadlines = DeadlineWatch(clock, self._expire)
        self._replace_runner = replace_runner
        self._replacing: set[asyncio.Task[None]] = set()
        self._retired: set[BatchRunner] = set()
        self._tokens = tokens
        self._queued_tokens = 0  # sum of the queued requests' own padded tokens (rows x longest)
        self._window = max(_MIN_GROUPING_WINDOW, GROUPING_WINDOW_PER_SLOT * policy.max_batch_size)
        self._vtime = 0  # the fair order's virtual time (module docstring)
        self._last_tag: dict[Hashable, int] = {}  # caller -> tag of its last request queued
        self._waiting: dict[Hashable, int] = {}  # caller -> its requests in the queue

    # -- public ---------------------------------------------------------------------------
    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._dispatch_loop(), name="batcher")

    @property
    def queued_items(self) -> int:
        return self._queued_items

    @property
    def inflight_batches(self) -> int:
        return len(self._inflight)

    def add_runner(self, runner: BatchRunner) -> None:
        """Serve with one more instance (the model was scaled up)."""
        self._runners.append(runner)
        self._idle.put_nowait(runner)
        self._arrival.set()

    def retire_runner(self, runner: BatchRunner) -> None:
        """Give `runner` no more batches (the model was scaled down); a batch it runs now finishes."""
        self._retired.add(runner)

    async def submit(self, req: InferRequest) -> InferResult:
        """Queue `req` and wait for its result. Raises ServingError."""
        if self._closed:
            raise ServingError(
                Code.UNAVAILABLE, f"model {req.model} is shutting down; retry on another replica"
            )
        if req.items > self.policy.max_batch_size:
            raise ServingError(
                Code.INVALID_ARGUMENT,
                f"request has {req.items} rows; model {req.model} accepts at most "
                f"{self.policy.max_batch_size} per request (its max batch size)",
            )
        if self._queued_items + req.items > self.policy.max_queue:
            raise ServingError(
                Code.RESOURCE_EXHAUSTED,
                f"model {req.model} is overloaded: its queue holds {self._queued_items} of "
                f"{self.policy.max_queue} items; retry later",
            )
        if self._tokens is not None:
            # Counted before queueing, on the event loop: tens to hundreds of microseconds a text.
            req = replace(req, tokens=self._tokens.cost(req))
            self._queued_tokens += _own_tokens(req)
        fut: asyncio.Future[InferResult] = asyncio.get_running_loop().create_future()
        self._enqueue(req, fut, CALLER.get())
        self._queued_items += req.items
        self._observer.queue_depth(self._queued_items)
        if req.deadline is not None:
            self._deadlines.watch(req.deadline)
        self._arrival.set()
        return await fut  # a cancelled caller cancels `fut`; the dispatcher then skips it

    def _enqueue(self, req: InferRequest, fut: asyncio.Future[InferResult], caller: Hashable) -> None:
        """Queue `req` in the fair order (module docstring): after every queued request with a
        tag no later than its own, so equal tags keep their arrival order."""
        last = self._last_tag.get(caller, 0)
        tag = (last if last > self._vtime else self._vtime) + req.size + REQUEST_COST_BYTES
        self._last_tag[caller] = tag
        waiting = self._waiting
        waiting[caller] = waiting.get(caller, 0) + 1
        p = _Pending(req, fut, self._clock(), caller, tag)
        queue = self._queue
        if not queue or queue[-1].tag <= tag:  # most arrivals go last
            queue.append(p)
            return
        at = len(queue) - 1
        while at and queue[at - 1].tag > tag:
            at -= 1
        queue.insert(at, p)

    def _taken(self, batch: list[_Pending]) -> None:
        """Move the virtual time on by `batch`'s cost shared among the callers that were waiting,
        and forget the callers that cannot be behind it any more."""
        if not self._queue:  # nobody waits: every caller starts afresh
            self._vtime = 0
            self._last_tag.clear()
            return
        callers = len(self._waiting) + len({p.caller for p in batch if p.caller not in self._waiting})
        cost = sum(p.req.size for p in batch) + REQUEST_COST_BYTES * len(batch)
        self._vtime += cost // callers
        if len(self._last_tag) > 2 * len(self._waiting) + 64:
            vtime = self._vtime
            self._last_tag = {c: t for c, t in self._last_tag.items() if t > vtime or c in self._waiting}

    async def close(self, timeout: float | None = None) -> None:
        """Stop taking requests, finish queued and in-flight ones (within `timeout`), stop."""
        self._closed = True
        self._arrival.set()  # a dispatcher waiting to fill a batch dispatches it now
        deadline = None if timeout is None else self._clock() + timeout
        while self._task is not None and (self._queue or self._inflight):
            remaining = None if deadline is None else deadline - self._clock()
            if remaining is not None and remaining <= 0:
                break
            waiters = list(self._inflight) or [asyncio.ensure_future(asyncio.sleep(0.005))]
            await asyncio.wait(waiters, timeout=remaining)
        for p in self._queue:
            if not p.future.done():
                p.future.set_exception(
                    ServingError(Code.UNAVAILABLE, "server shut down before this request ran")
                )
        self._queue.clear()
        for t in list(self._replacing):
            t.cancel()
        self._deadlines.close()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    # -- deadlines ------------------------------------------------------------------------
    def _expire(self, now: float) -> float | None:
        """Answer DEADLINE_EXCEEDED to every held request whose deadline passed (queued ones
        leave the queue; a running batch goes on for its other requests); return the earliest
        deadline still held."""
        earliest: float | None = None
        kept: deque[_Pending] = deque()
        for p in self._queue:
            d = p.req.deadline
            if p.future.done() or (d is not None and d <= now):
                self._forget(p)
                if not p.future.done():
                    p.future.set_exception(_expired(p.req, self.policy.batch_timeout_s))
                continue
            kept.append(p)
            if d is not None and (earliest is None or d < earliest):
                earliest = d
        if len(kept) != len(self._queue):
            self._queue = kept
            self._observer.queue_depth(self._queued_items)
        for batch in self._running:
            for p in batch:
                d = p.req.deadline
                if d is None or p.future.done():
                    continue
                if d <= now:
                    p.future.set_exception(_expired(p.req, self.policy.batch_timeout_s, running=True))
                elif earliest is None or d < earliest:
                    earliest = d
        return earliest

    # -- dispatcher -----------------------------------------------------------------------
    def _dead(self, p: _Pending, now: float) -> bool:
        """True (and its caller answered) when `p` must not run: cancelled, past its deadline, or
        too large to ever run (submit() normally refuses that)."""
        if p.future.done():  # caller cancelled
            return True
        if p.req.deadline is not None and p.req.deadline <= now:
            p.future.set_exception(
                ServingError(Code.DEADLINE_EXCEEDED, "deadline passed while queued; the request did not run")
            )
            return True
        if p.req.items > self.policy.max_batch_size:
            p.future.set_exception(
                ServingError(
                    Code.INVALID_ARGUMENT,
                    f"request has {p.req.items} rows; max batch size is {self.policy.max_batch_size}",
                )
            )
            return True
        return False

    def _take_by_length(self, max_items: int) -> list[_Pending]:
        """The oldest live request, then the waiting ones closest to it in length, within the
        token budget and `max_items`; failing the dead ones met on the way.

        Only the first `_window` live requests are considered; those not chosen keep their
        places, so the queue stays in arrival order and the next batch starts at its head.
        """
        assert self._tokens is not None
        now = self._clock()
        window: list[_Pending] = []
        while self._queue and len(window) < self._window:
            p = self._queue.popleft()
            if self._dead(p, now):
                self._forget(p)
            else:
                window.append(p)
        if not window:
            self._observer.queue_depth(self._queued_items)
            return []
        chosen = group_by_length(
            [_cost(p.req) for p in window],
            [p.req.items for p in window],
            max_items=max_items,
            max_tokens=self._tokens.max_batch_tokens,
        )
        taken = set(chosen)
        # Not chosen: back to the head of the queue, in their arrival order.
        self._queue.extendleft(reversed([p for i, p in enumerate(window) if i not in taken]))
        batch = [window[i] for i in sorted(taken)]
        for p in batch:
            self._forget(p)
        self._observer.queue_depth(self._queued_items)
        return batch

    def _take(self, budget: int) -> list[_Pending]:
        """Pop up to `budget` items' worth of live requests within the batch byte cut, in the
        fair order, failing the dead ones."""
        batch = self._take_by_length(budget) if self._tokens is not None else self._take_in_order(budget)
        if batch:
            self._taken(batch)
        return batch

    def _take_in_order(self, budget: int) -> list[_Pending]:
        batch: list[_Pending] = []
        items = size = largest = 0
        max_bytes = self.policy.max_batch_bytes
        now = self._clock()
        while self._queue:
            p = self._queue[0]
            if self._dead(p, now):
                self._pop()
                continue
            n = p.req.size
            if items + p.req.items > budget or (
                batch and (size + n > max_bytes or n > max(SMALL_INPUT_BYTES, LARGER_INPUT_FACTOR * largest))
            ):
                break
            self._pop()
            batch.append(p)
            items += p.req.items
            size += n
            largest = max(largest, n)
        self._observer.queue_depth(self._queued_items)
        return batch

    def _pop(self) -> None:
        self._forget(self._queue.popleft())

    def _forget(self, p: _Pending) -> None:
        """Account for `p` leaving the queue (already removed from the deque)."""
        self._queued_items -= p.req.items
        waiting = self._waiting
        left = waiting[p.caller] - 1
        if left:
            waiting[p.caller] = left
        else:
            del waiting[p.caller]
        if self._tokens is not None:
            self._queued_tokens -= _own_tokens(p.req)

    def _full(self, max_items: int) -> bool:
        """Enough is queued for a full batch: `max_items` items, or the token budget's worth."""
        if self._queued_items >= max_items:
            return True
        budget = self._tokens.max_batch_tokens if self._tokens is not None else None
        return budget is not None and self._queued_tokens >= budget

    async def _wait_arrival(self, timeout: float | None) -> bool:
        self._arrival.clear()
        try:
            await asyncio.wait_for(self._arrival.wait(), timeout)
        except TimeoutError:
            return False
        return True

    async def _dispatch_loop(self) -> None:
        max_items = self.policy.max_batch_size
        while True:
            while not self._queue:
                await self._wait_arrival(None)
            runner = await self._idle.get()
            if runner in self._retired:
                self._retired.discard(runner)
                if runner in self._runners:
                    self._runners.remove(runner)
                continue
            if runner not in self._runners:  # failed or retired meanwhile, with batches in flight
                continue
            # Wait to fill only while another instance is computing: then the model is busy and
            # requests keep arriving. With every instance idle, waiting would only add latency
            # (requests that arrive during compute are batched anyway): no idle wait. Waiting
            # happens with the requests still in the queue, so deadlines, cancellations and
            # close() see them, and dead ones are dropped at the moment the batch is taken.
            if self.policy.max_batch_delay_s > 0 and self._busy and self._queue and not self._closed:
                fill_by = self._queue[0].enqueued + self.policy.max_batch_delay_s
                while (
                    not self._full(max_items)
                    and self._busy
                    and not self._closed
                    and (left := fill_by - self._clock()) > 0
                ):
                    await self._wait_arrival(left)
            batch = self._take(max_items)
            if not batch:
                self._idle.put_nowait(runner)
                continue
            self._busy += 1
            load = self._load[runner] = self._load.get(runner, 0) + 1
            if load < self.policy.runner_concurrency:
                self._idle.put_nowait(runner)  # room for another batch at once
            self._running.append(batch)  # from now on the deadline watch sees it as running
            task = asyncio.get_running_loop().create_task(self._run(runner, batch))
            self._inflight.add(task)
            task.add_done_callback(self._inflight.discard)

    def _fail(self, batch: list[_Pending], err: ServingError) -> None:
        for p in batch:
            if not p.future.done():
                p.future.set_exception(err)

    async def _run(self, runner: BatchRunner, batch: list[_Pending]) -> None:
        started = self._clock()
        broken: str | None = None  # why the runner must not be reused
        retried = False  # the runner was retired before it took the batch: queued again
        try:
            self._observer.batch_started(
                sum(p.req.items for p in batch),
                [started - p.enqueued for p in batch],
                [p.req.version for p in batch],
            )
            if self._tokens is not None:
                costs = [_cost(p.req) for p in batch]
                self._observer.batch_tokens(padded_tokens(costs), sum(c.rows * c.longest for c in costs))
            async with asyncio.timeout(self.policy.batch_timeout_s) as window:
                progress = None
                if self.policy.batch_timeout_s is not None:
                    progress = BATCH_PROGRESS.set(functools.partial(self._progress, batch, window))
                try:
                    results = await runner.run([p.req for p in batch])
                finally:
                    if progress is not None:
                        # Let go at once: the callback holds the timeout, which holds this task,
                        # whose context holds the callback (a cycle only the collector would end).
                        BATCH_PROGRESS.reset(progress)
            if len(results) != len(batch):
                log.error(
                    "runner %s returned %d results for %d requests", runner.id, len(results), len(batch)
                )
                raise internal("matching results to requests")
        except RunnerRetired:
            retried = True
            self._requeue(batch)
        except ServingError as exc:
            self._fail(batch, exc)
        except TimeoutError:
            broken = "hung"
            log.error("runner %s did not finish a batch within %s s; replacing it", runner.id,
                      self.policy.batch_timeout_s)  # fmt: skip
            self._fail(
                batch,
                ServingError(
                    Code.DEADLINE_EXCEEDED,
                    "the model did not answer within its responseTimeout "
                    f"({self.policy.batch_timeout_s:g} s); its instance is being replaced",
                    torchserve=WORKER_DIED,
                ),
            )
        except InstanceFailed as exc:
            broken = "failed"
            log.error("runner %s failed: %s; replacing it", runner.id, exc)
            self._fail(
                batch,
                exc.error
                or ServingError(
                    Code.UNAVAILABLE, "the model instance failed on this batch and is restarting"
                ),
            )
        except asyncio.CancelledError:
            # The instance (or this task) stopped mid-batch: answer the callers, then stop.
            self._fail(batch, ServingError(Code.UNAVAILABLE, "the model instance stopped before answering"))
            raise
        except Exception:
            log.exception("runner %s failed a batch of %d", runner.id, len(batch))
            self._fail(batch, internal("running the batch"))
        else:
            for p, r in zip(batch, results, strict=True):
                if not p.future.done():
                    p.future.set_result(r)
        finally:
            self._running.remove(batch)
            self._observer.batch_finished(self._clock() - started)
            # Busy count and idle queue change together, so the dispatcher never mistakes a
            # finished batch for another instance still computing.
            self._busy -= 1
            load = self._load[runner] = self._load[runner] - 1
            was_full = load == self.policy.runner_concurrency - 1  # not in the idle queue now
            if not load:
                del self._load[runner]
            if retried:
                self._retired.discard(runner)
                if runner in self._runners:
                    self._runners.remove(runner)
            elif broken is not None and self._replace_runner is not None:
                if runner in self._runners:  # the first of its batches to fail: replaced once
                    self._runners.remove(runner)
                    task = asyncio.get_running_loop().create_task(self._replace(runner, broken))
                    self._replacing.add(task)
                    task.add_done_callback(self._replacing.discard)
            elif was_full and runner in self._runners:
                self._idle.put_nowait(runner)
            self._arrival.set()

    def _progress(self, batch: list[_Pending], window: asyncio.Timeout) -> None:
        """An intermediate answer of `batch` arrived: its responseTimeout starts again, as
        TorchServe waits that long for each reply of a streaming handler; so does the deadline of
        each TorchServe request in it, whose only limit is that timeout (a gRPC client's own
        deadline is its library's to enforce: the call is cancelled at it)."""
        timeout_s = self.policy.batch_timeout_s
        if timeout_s is None:
            return
        window.reschedule(asyncio.get_running_loop().time() + timeout_s)
        until = self._clock() + timeout_s
        for p in batch:
            d = p.req.deadline
            if d is not None and d < until and p.req.protocol in _TIMEOUT_ONLY:
                p.req = p.req.with_deadline(until)

    def _requeue(self, batch: list[_Pending]) -> None:
        """Put a batch that never ran back at the head of the queue, in its order."""
        live = [p for p in batch if not p.future.done()]
        self._queue.extendleft(reversed(live))
        for p in live:
            self._queued_items += p.req.items
            self._waiting[p.caller] = self._waiting.get(p.caller, 0) + 1
            if self._tokens is not None:
                self._queued_tokens += _own_tokens(p.req)
        self._observer.queue_depth(self._queued_items)

    async def _replace(self, runner: BatchRunner, reason: str) -> None:
        assert self._replace_runner is not None
        try:
            new = await self._replace_runner(runner, reason)
        except Exception:
            log.exception("replacing runner %s failed; the model has one instance fewer", runner.id)
            return
        if new is not None and not self._closed:
            self._runners.append(new)
            self._idle.put_nowait(new)
            self._arrival.set()


def _expired(req: InferRequest, response_timeout_s: float | None, *, running: bool = False) -> ServingError:
    """A request past its deadline. One its worker was running is answered on TorchServe's
    endpoints as TorchServe answers a response timeout (500 "Worker died."); the only deadline
    TorchServe's REST API has is that timeout, and a gRPC client whose own deadline passed has
    already been told DEADLINE_EXCEEDED by its library."""
    limit = (
        f"responseTimeout {response_timeout_s:g} s or the client's" if response_timeout_s else "the client's"
    )
    return ServingError(
        Code.DEADLINE_EXCEEDED,
        f"model {req.model} did not answer within the deadline ({limit})",
        torchserve=WORKER_DIED if running else None,
    )


def _cost(req: InferRequest) -> TokenCost:
    """A queued request's cost; counted at submit, so set whenever the batcher counts tokens."""
    return req.tokens if req.tokens is not None else TokenCost(req.items, 1)


def _own_tokens(req: InferRequest) -> int:
    c = _cost(req)
    return c.rows * c.longest
