"""The dynamic batcher: one per model version, pure asyncio, no idle wait.

This module is the dispatcher: its runners (added, retired, replaced when broken), when a batch
leaves (at once, or after waiting to fill it) and running it, with what each outcome answers.
The requests it holds, their fair order, how a batch is cut from the queue and the answer to
those that die waiting are `batch_queue.BatchQueue`'s, which `Batcher` extends.

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
- Per-item outcomes come back per item; a whole-batch failure fails only that batch.
- A runner computes one batch at a time, or up to `runner_concurrency` for a model whose worker
  runs several calls at once (asyncCommunication): such a runner is offered batches again as
  soon as it took one, while it has room.
- Pipelined (`BatchPolicy.pipelined`): while every runner is busy and a full batch waits, it is
  sent to the runner whose batch went first, to start the moment that batch ends; never more
  than one waits behind another. Otherwise the worker sat idle from the end of each batch until
  its results had crossed to the frontend and the next batch had crossed back, which under load
  is a loop turn of the frontend reading its clients (~30% of the worker's time at 64 HTTP
  clients). Only a full batch goes early, since waiting cannot make it fuller: one sent with
  less would take only what had arrived, and what arrives after it (during a long batch, most
  of it) would wait one batch more. Its responseTimeout, its queue wait and its compute time
  count from the end of the batch ahead, when it starts; until then its items count as queued
  (against max_queue, in the depth gauge the HPA scales on, in pendingRequests), so pipelining
  never lets more wait than the queue bound allows. If the instance fails on the batch ahead,
  the one behind never started and is queued again, as a batch still in the queue would be.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import replace

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
from mariner.server.common.token_groups import padded_tokens
from mariner.server.contracts.errors import WORKER_DIED, Code, ServingError, internal
from mariner.server.contracts.types import InferRequest, InferResult
from mariner.server.frontend.batch_queue import BatchQueue, Pending, cost_of, own_tokens
from mariner.server.frontend.streams import BATCH_PROGRESS

log = logging.getLogger("mariner.batcher")


class Batcher(BatchQueue):
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
        super().__init__(policy, observer or NullObserver(), clock, tokens)
        self._runners = list(runners)
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
        # Per runner of one batch at a time: when its last batch was sent, and a future that
        # ends with that batch (True if the instance failed or hung on it): a batch pipelined
        # behind it starts then.
        self._tail: dict[BatchRunner, tuple[float, asyncio.Future[bool]]] = {}
        self._task: asyncio.Task[None] | None = None
        # The loop it dispatches on, kept from `start`: CPython 3.11's `get_running_loop` makes a
        # getpid system call each time, and `enqueue` runs once per request.
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False
        self._replace_runner = replace_runner
        self._replacing: set[asyncio.Task[None]] = set()
        self._retired: set[BatchRunner] = set()

    # -- public ---------------------------------------------------------------------------
    def start(self) -> None:
        if self._task is None:
            self._loop = asyncio.get_running_loop()
            self._task = self._loop.create_task(self._dispatch_loop(), name="batcher")

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
        return await self.enqueue(req, CALLER.get())  # a cancelled caller cancels the future: skipped

    def enqueue(self, req: InferRequest, caller: Hashable) -> asyncio.Future[InferResult]:
        """Queue `req` for `caller` (its fair-order key) and return the future of its result;
        refusals raise ServingError at once. Synchronous, so that a transport can hand a request
        over from its own callbacks (`frontend.protocols.prediction_path`); cancelling the future
        withdraws the request (the dispatcher skips it)."""
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
        if (waiting := self.queued_items) + req.items > self.policy.max_queue:
            raise ServingError(
                Code.RESOURCE_EXHAUSTED,
                f"model {req.model} is overloaded: its queue holds {waiting} of "
                f"{self.policy.max_queue} items; retry later",
            )
        if self._tokens is not None:
            # Counted before queueing, on the event loop: tens to hundreds of microseconds a text.
            req = replace(req, tokens=self._tokens.cost(req))
            self._queued_tokens += own_tokens(req)
        fut: asyncio.Future[InferResult] = (self._loop or asyncio.get_running_loop()).create_future()
        self._enqueue(req, fut, caller)
        self._queued_items += req.items
        self._report_depth()
        if req.deadline is not None:
            self._deadlines.watch(req.deadline)
        self._arrival.set()
        return fut

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

    # -- dispatcher -----------------------------------------------------------------------
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
            runner = await self._next_runner(max_items)
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
            ahead = ended = None
            if self.policy.pipelines:
                ahead = self._tail[runner][1] if load > 1 else None
                ended = asyncio.get_running_loop().create_future()
                self._tail[runner] = (self._clock(), ended)
                if ahead is not None:  # waits behind: still counted in the queue's depth
                    self._behind_items += sum(p.req.items for p in batch)
                    self._report_depth()
            task = asyncio.get_running_loop().create_task(self._run(runner, batch, ahead, ended))
            self._inflight.add(task)
            task.add_done_callback(self._inflight.discard)

    async def _next_runner(self, max_items: int) -> BatchRunner:
        """An idle runner; or, while none is idle and a full batch waits, the busy runner whose
        batch was sent first, to take the next one behind it (pipelined: module docstring)."""
        while self._idle.empty():
            if self._full(max_items) and (behind := self._runner_to_pipeline()) is not None:
                return behind
            await self._wait_arrival(None)  # a runner freed or added, or a request arrived
        return self._idle.get_nowait()

    def _runner_to_pipeline(self) -> BatchRunner | None:
        if not self.policy.pipelines:
            return None
        computing = [r for r in self._runners if self._load.get(r) == 1 and r not in self._retired]
        return min(computing, key=lambda r: self._tail[r][0], default=None)

    def _fail(self, batch: list[Pending], err: ServingError) -> None:
        for p in batch:
            if not p.future.done():
                p.future.set_exception(err)

    async def _run(
        self,
        runner: BatchRunner,
        batch: list[Pending],
        ahead: asyncio.Future[bool] | None = None,
        ended: asyncio.Future[bool] | None = None,
    ) -> None:
        """Run `batch` on `runner`; pipelined behind `ahead` (the batch before it on that runner),
        it starts when `ahead` ends; `ended` ends with it (module docstring)."""
        started: float | None = None
        broken: str | None = None  # why the runner must not be reused
        retried = False  # the runner was retired before it took the batch: queued again
        window: asyncio.Timeout | None = None
        timeout_s = self.policy.batch_timeout_s

        def start(_: object = None) -> None:
            nonlocal started
            if started is not None:
                return
            started = now = self._clock()
            items = sum(p.req.items for p in batch)
            if ahead is not None:
                self._behind_items -= items
                self._report_depth()
            self._observer.batch_started(
                items,
                [now - p.enqueued for p in batch],
                [p.req.version for p in batch],
            )
            if self._tokens is not None:
                costs = [cost_of(p.req) for p in batch]
                self._observer.batch_tokens(padded_tokens(costs), sum(c.rows * c.longest for c in costs))
            if window is not None and timeout_s is not None:
                window.reschedule(asyncio.get_running_loop().time() + timeout_s)

        try:
            async with asyncio.timeout(None) as window:
                if ahead is None or ahead.done():
                    start()
                else:
                    ahead.add_done_callback(start)
                progress = None
                if self.policy.batch_timeout_s is not None:
                    progress = BATCH_PROGRESS.set(functools.partial(self._progress, window))
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
        except InstanceFailed as exc:
            broken = "failed"
            if ahead is not None and ahead.done() and ahead.result():
                self._requeue(batch)  # it never started: the instance failed on the batch ahead
            else:
                log.error("runner %s failed: %s; replacing it", runner.id, exc)
                self._fail(
                    batch,
                    exc.error
                    or ServingError(
                        Code.UNAVAILABLE, "the model instance failed on this batch and is restarting"
                    ),
                )
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
            window = None  # over: a start from now on must not reschedule it
            if ahead is not None:
                ahead.remove_done_callback(start)
            start()  # a batch that never started still ends once in the observer's books
            if ended is not None:
                ended.set_result(broken is not None)
                if self._tail.get(runner, (0, None))[1] is ended:
                    del self._tail[runner]
            self._running.remove(batch)
            assert started is not None  # set by start() above
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

    def _progress(self, window: asyncio.Timeout) -> None:
        """An intermediate answer of the batch arrived: its responseTimeout starts again, as
        TorchServe waits that long for each reply of a streaming handler. The requests' own
        deadlines stay: TorchServe's carry none but a gRPC client's (its library's to enforce),
        and an OIP or KServe one is the answer time its client was promised."""
        timeout_s = self.policy.batch_timeout_s
        if timeout_s is not None:
            window.reschedule(asyncio.get_running_loop().time() + timeout_s)

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
