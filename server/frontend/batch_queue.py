"""The requests a batcher holds, queued or in a running batch, and what becomes of them without
a runner: the fair order they wait in, the batch each dispatch takes from the queue, and the
answer each gets when it is dead (cancelled, or past its deadline) before it is answered.

Kept apart from the dispatcher (`batcher.py`: runners, waiting to fill a batch, running it,
replacing a broken runner) because all of this is bookkeeping of the held requests, done on the
event loop without awaiting; `Batcher` is a `BatchQueue` with runners.

Semantics (DESIGN.md):
- Requests whose deadline passed, or whose caller went away (future cancelled), are dropped
  before they reach the device.
- With a token counter (the archive's tokenCounter, for models that pad a batch to its longest
  member), each request's cost (rows, longest row in tokens) is counted before it is queued, and
  a batch is formed by length: the oldest live request always goes first (FIFO fairness, no
  starvation), then the waiting requests whose lengths are closest to it join while the batch's
  padded tokens (total rows x longest row) stay within maxBatchTokens and its items within
  max_batch_size. A single request over the budget goes alone.
- Fair order: the queue is ordered by caller (the client's connection, `batch_policy.CALLER`) and
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
from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass

from mariner.server.common.batch_policy import BatchObserver, BatchPolicy, TokenBudget
from mariner.server.common.token_groups import group_by_length
from mariner.server.contracts.errors import Code, ServingError
from mariner.server.contracts.types import TORCHSERVE_PROTOCOLS, InferRequest, InferResult, TokenCost
from mariner.server.frontend.deadlines import DeadlineWatch

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
class Pending:
    """A request the batcher holds until it is answered: queued, or in a batch a runner holds."""

    req: InferRequest
    future: asyncio.Future[InferResult]
    enqueued: float
    caller: Hashable
    tag: int  # its finish tag in the fair order (module docstring)


class BatchQueue:
    """The requests one model version's batcher holds: queued in the fair order, or in a batch
    a runner holds now (`Batcher` adds the runners)."""

    def __init__(
        self,
        policy: BatchPolicy,
        observer: BatchObserver,
        clock: Callable[[], float],
        tokens: TokenBudget | None,
    ) -> None:
        self.policy = policy
        self._observer = observer
        self._clock = clock
        self._queue: deque[Pending] = deque()
        self._queued_items = 0
        # Items of batches sent to a busy runner that have not started (pipelined, `Batcher`):
        # out of this queue, but still waiting to run, so the depth gauge counts them.
        self._behind_items = 0
        self._running: list[list[Pending]] = []  # the batches runners hold now
        self._deadlines = DeadlineWatch(clock, self._expire)
        self._tokens = tokens
        self._queued_tokens = 0  # sum of the queued requests' own padded tokens (rows x longest)
        self._window = max(_MIN_GROUPING_WINDOW, GROUPING_WINDOW_PER_SLOT * policy.max_batch_size)
        self._vtime = 0  # the fair order's virtual time (module docstring)
        self._last_tag: dict[Hashable, int] = {}  # caller -> tag of its last request queued
        self._waiting: dict[Hashable, int] = {}  # caller -> its requests in the queue

    @property
    def queued_items(self) -> int:
        """Items waiting to run: here, or in a pipelined batch sent behind the one computing and
        not yet started. The queue bound, the depth gauge and describe's pendingRequests all count
        these, so pipelining never lets more wait than max_queue (TorchServe's job_queue_size)."""
        return self._queued_items + self._behind_items

    def _report_depth(self) -> None:
        self._observer.queue_depth(self.queued_items)

    # -- the fair order -------------------------------------------------------------------
    def _enqueue(self, req: InferRequest, fut: asyncio.Future[InferResult], caller: Hashable) -> None:
        """Queue `req` in the fair order (module docstring): after every queued request with a
        tag no later than its own, so equal tags keep their arrival order."""
        last = self._last_tag.get(caller, 0)
        tag = (last if last > self._vtime else self._vtime) + req.size + REQUEST_COST_BYTES
        self._last_tag[caller] = tag
        waiting = self._waiting
        waiting[caller] = waiting.get(caller, 0) + 1
        p = Pending(req, fut, self._clock(), caller, tag)
        queue = self._queue
        if not queue or queue[-1].tag <= tag:  # most arrivals go last
            queue.append(p)
            return
        at = len(queue) - 1
        while at and queue[at - 1].tag > tag:
            at -= 1
        queue.insert(at, p)

    def _taken(self, batch: list[Pending]) -> None:
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

    # -- deadlines ------------------------------------------------------------------------
    def _expire(self, now: float) -> float | None:
        """Answer DEADLINE_EXCEEDED to every held request whose deadline passed (queued ones
        leave the queue; a running batch goes on for its other requests); return the earliest
        deadline still held."""
        earliest: float | None = None
        kept: deque[Pending] = deque()
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
            self._report_depth()
        for batch in self._running:
            for p in batch:
                d = p.req.deadline
                if d is None or p.future.done():
                    continue
                if d <= now:
                    p.future.set_exception(_expired(p.req, self.policy.batch_timeout_s))
                elif earliest is None or d < earliest:
                    earliest = d
        return earliest

    # -- taking batches -------------------------------------------------------------------
    def _dead(self, p: Pending, now: float) -> bool:
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

    def _take_by_length(self, max_items: int) -> list[Pending]:
        """The oldest live request, then the waiting ones closest to it in length, within the
        token budget and `max_items`; failing the dead ones met on the way.

        Only the first `_window` live requests are considered; those not chosen keep their
        places, so the queue stays in arrival order and the next batch starts at its head.
        """
        assert self._tokens is not None
        now = self._clock()
        window: list[Pending] = []
        while self._queue and len(window) < self._window:
            p = self._queue.popleft()
            if self._dead(p, now):
                self._forget(p)
            else:
                window.append(p)
        if not window:
            self._report_depth()
            return []
        chosen = group_by_length(
            [cost_of(p.req) for p in window],
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
        self._report_depth()
        return batch

    def _take(self, budget: int) -> list[Pending]:
        """Pop up to `budget` items' worth of live requests within the batch byte cut, in the
        fair order, failing the dead ones."""
        batch = self._take_by_length(budget) if self._tokens is not None else self._take_in_order(budget)
        if batch:
            self._taken(batch)
        return batch

    def _take_in_order(self, budget: int) -> list[Pending]:
        batch: list[Pending] = []
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
        self._report_depth()
        return batch

    def _pop(self) -> None:
        self._forget(self._queue.popleft())

    def _forget(self, p: Pending) -> None:
        """Account for `p` leaving the queue (already removed from the deque)."""
        self._queued_items -= p.req.items
        waiting = self._waiting
        left = waiting[p.caller] - 1
        if left:
            waiting[p.caller] = left
        else:
            del waiting[p.caller]
        if self._tokens is not None:
            self._queued_tokens -= own_tokens(p.req)

    def _full(self, max_items: int) -> bool:
        """Enough is queued for a full batch: `max_items` items, or the token budget's worth."""
        if self._queued_items >= max_items:
            return True
        budget = self._tokens.max_batch_tokens if self._tokens is not None else None
        return budget is not None and self._queued_tokens >= budget

    def _requeue(self, batch: list[Pending]) -> None:
        """Put a batch that never ran back at the head of the queue, in its order."""
        live = [p for p in batch if not p.future.done()]
        self._queue.extendleft(reversed(live))
        for p in live:
            self._queued_items += p.req.items
            self._waiting[p.caller] = self._waiting.get(p.caller, 0) + 1
            if self._tokens is not None:
                self._queued_tokens += own_tokens(p.req)
        self._report_depth()


def _expired(req: InferRequest, response_timeout_s: float | None) -> ServingError:
    """A request past its deadline, queued or running. A TorchServe request has no deadline but
    its gRPC client's, who has already been told DEADLINE_EXCEEDED by its library; its batch past
    responseTimeout is the batch timeout's to answer (500 "Worker died.", in batcher.py)."""
    limit = (
        f"responseTimeout {response_timeout_s:g} s or the client's"
        if response_timeout_s and req.protocol not in TORCHSERVE_PROTOCOLS
        else "the client's"
    )
    return ServingError(
        Code.DEADLINE_EXCEEDED, f"model {req.model} did not answer within the deadline ({limit})"
    )


def cost_of(req: InferRequest) -> TokenCost:
    """A queued request's cost; counted at submit, so set whenever the batcher counts tokens."""
    return req.tokens if req.tokens is not None else TokenCost(req.items, 1)


def own_tokens(req: InferRequest) -> int:
    """A queued request's padded tokens on its own: its rows x its longest row."""
    c = cost_of(req)
    return c.rows * c.longest
