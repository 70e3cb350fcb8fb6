"""What a worker slot's failure says, to whom, and how long the slot is retried: the answer a
register or scale waiting on a slot's first start hears (`start_error`, `stopped_error`, set by
`fail_first`), the supervisor's log line for a failed start (`logged_reason`), and TorchServe's
`maxRetryTimeoutInSec` (`max_retry_s`).

Apart from `worker_pool` (which keeps the slots running) and `worker_stop` (which ends them),
since both tell a slot's waiters why it failed or stopped, in the same words.
"""

from __future__ import annotations

import asyncio
import errno
import logging

from mariner.server.contracts.errors import Code, ServingError
from mariner.server.supervisor.versions import Instance, Version
from mariner.server.supervisor.worker_process import WorkerLoadFailed

log = logging.getLogger("mariner.supervisor")

_RESOURCE_ERRNOS = frozenset({errno.EAGAIN, errno.ENOMEM, errno.EMFILE, errno.ENFILE, errno.ENOSPC})
DEFAULT_MAX_RETRY_S = 300.0  # TorchServe's maxRetryTimeoutInSec


def max_retry_s(model_config: dict[str, object]) -> float:
    """How long a failing slot is retried: the archive's `maxRetryTimeoutInSec` (an integer of
    seconds, as TorchServe reads it; 0 never retries), else TorchServe's 300 s. A value that is not
    one is TorchServe's default, with a warning naming it."""
    value = model_config.get("maxRetryTimeoutInSec")
    if value is None:
        return DEFAULT_MAX_RETRY_S
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return float(value)
    log.warning(
        "maxRetryTimeoutInSec %r is not a whole number of seconds; using %g", value, DEFAULT_MAX_RETRY_S
    )
    return DEFAULT_MAX_RETRY_S


def start_error(v: Version, exc: BaseException) -> ServingError:
    """A failed start as what a register or scale waiting on it answers: the worker's own
    ServingError as it is; a resource the machine lacks (memory, a thread, a process) as
    RESOURCE_EXHAUSTED; anything else as INTERNAL. Either names the exception."""
    if isinstance(exc, ServingError):
        return exc
    resource = (
        isinstance(exc, MemoryError)
        or (isinstance(exc, OSError) and exc.errno in _RESOURCE_ERRNOS)
        or (isinstance(exc, RuntimeError) and "thread" in str(exc))
    )
    return ServingError(
        Code.RESOURCE_EXHAUSTED if resource else Code.INTERNAL,
        f"model {v.name} version {v.version}: its worker process could not be started: "
        f"{type(exc).__name__}: {exc}",
    )


def logged_reason(v: Version, exc: BaseException) -> str:
    """What the supervisor's log says of a failed start: the error, except for a handler that
    raised while loading, whose exception and traceback are the worker's last lines of output
    (TorchServe's MODEL_LOG): the line points there instead of repeating them."""
    if isinstance(exc, WorkerLoadFailed) and exc.traceback:
        where = "the traceback is in the worker's output"
        return f"model {v.name} version {v.version}: its handler raised while loading ({where})"
    return start_error(v, exc).message


def stopped_error(inst: Instance, why: str | None = None) -> ServingError:
    """What a register or scale waiting on a slot's first start hears when the slot is stopped
    first: `why` (e.g. "model m version 1 was unregistered") and which slot."""
    return ServingError(
        Code.CANCELLED,
        f"{why or 'the model was unregistered or scaled down'} while its worker was starting "
        f"(worker slot {inst.index} was stopped before it was ready)",
    )


def fail_first(inst: Instance, err: BaseException) -> None:
    if inst.first is not None and not inst.first.done():
        inst.first.set_exception(err)


def retrieve_failure(first: asyncio.Future[None]) -> None:
    """Mark a first start's failure as seen, so asyncio does not log it as never retrieved."""
    if not first.cancelled():
        first.exception()
