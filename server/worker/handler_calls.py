"""How `ModelHost`'s batch logic reaches the handler: one call at a time, synchronously or awaited.

The batch logic (explanations apart from predictions, a tensor request's rows in chunks, the
out-of-memory split and retry) is written once, as a generator that yields a `HandlerCall` each
time it needs the handler and receives the call's `Outcome`. Two drivers run it:

- `drive` calls the handler on the calling thread and returns the batch's results (a worker
  serving a plain `handle`; a coroutine it returns is run to completion by the caller's `call`);
- `drive_async` awaits each call on the running event loop, so a worker serving a coroutine
  handler (`async def handle`) runs several batches at once, as TorchServe's async worker does.

A failed call's exception travels into the generator in a box that the generator empties when
it raises it there: once the generator's `except` block ends, nothing refers to the failed call's
frames, so the out-of-memory split frees their tensors before it retries.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable, Generator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class HandlerCall:
    """One call of the handler: its batch (one dict per request) and the Context to pass."""

    data: Sequence[Mapping[str, Any]]
    context: Any


class Outcome:
    """What a handler call did: returned a value, or raised (boxed, see the module docstring)."""

    __slots__ = ("_box", "_value")

    def __init__(self, value: Any = None, error: BaseException | None = None) -> None:
        self._value = value
        self._box = [error] if error is not None else None

    def unwrap(self) -> Any:
        """The value, or raise the exception (taken out of the box, so only the raise holds it)."""
        if self._box:
            raise self._box.pop()
        return self._value


Steps = Generator[HandlerCall, Outcome, T]


class _Done(Exception):
    def __init__(self, value: Any) -> None:
        self.value = value


def _next_call(steps: Steps[Any], outcome: Outcome | None) -> HandlerCall:
    """The next call `steps` asks for, given the last one's outcome; _Done with its result."""
    try:
        return steps.send(outcome) if outcome is not None else next(steps)
    except StopIteration as done:
        raise _Done(done.value) from None


def drive(steps: Steps[T], call: Callable[[HandlerCall], Any]) -> T:
    """Run `steps`, making each handler call with `call` on this thread."""
    outcome: Outcome | None = None
    try:
        while True:
            request = _next_call(steps, outcome)
            try:
                outcome = Outcome(call(request))
            except BaseException as exc:  # noqa: BLE001 - the batch logic decides what each one means
                outcome = Outcome(error=exc)
    except _Done as done:
        return done.value


async def drive_async(steps: Steps[T], call: Callable[[HandlerCall], Any]) -> T:
    """Run `steps` on the running loop, awaiting what `call` returns when it is awaitable.
    Cancelling the task that drives it (the worker stopping) is not a handler failure: it
    propagates; a CancelledError the handler raised on its own is one."""
    outcome: Outcome | None = None
    try:
        while True:
            request = _next_call(steps, outcome)
            try:
                value = call(request)
                if inspect.isawaitable(value):
                    value = await value
                outcome = Outcome(value)
            except asyncio.CancelledError as exc:
                task = asyncio.current_task()
                if task is not None and task.cancelling():
                    steps.close()
                    raise
                outcome = Outcome(error=exc)
            except BaseException as exc:  # noqa: BLE001 - the batch logic decides what each one means
                outcome = Outcome(error=exc)
    except _Done as done:
        return done.value


def run_awaitable(loop: asyncio.AbstractEventLoop, value: Awaitable[Any]) -> Any:
    """A coroutine (or other awaitable) a synchronously called handler returned, run to its end
    on `loop` (a private loop: the caller's thread runs none while the handler is called)."""
    return loop.run_until_complete(asyncio.ensure_future(value, loop=loop))
