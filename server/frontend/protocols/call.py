"""One code path for every inference call: it labels, times, counts and maps errors.

All five entry points (TorchServe gRPC Predictions/StreamPredictions, TorchServe HTTP
/predictions, OIP gRPC ModelInfer/ModelStreamInfer, OIP HTTP infer) run their work through
`run_call`. It decides, once for all of them:

- the outcome: the work's value (`Ok`), or a `Failed` with the one `ServingError` to answer
  with. A `ServingError` passes through; a handler's per-request error status (>= 400, set
  with set_response_status) becomes `handler_error`'s ServingError; anything else is logged
  with its traceback and becomes a sanitized INTERNAL (never the exception text);
- the `code` label: the HTTP status the client is answered with, or the HTTP equivalent of
  the gRPC status (`code_label`), so one bounded label set and one PromQL error-rate query
  cover every protocol and transport (`protocol` tells them apart);
- the bounded `model`/`version` labels: a served model's name and version, else "unknown";
- exactly one `mariner_requests_total` increment and one `mariner_request_duration_seconds`
  observation per call, cancelled calls included (code 499).

The adapter only translates the outcome to its wire (gRPC: `abort`; HTTP: an error response),
as KServe's single exception interceptor and TEI's one error enum do.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar

from mariner.server.common.handler_status import handler_error, is_error_status
from mariner.server.common.oip_stats import book_of
from mariner.server.contracts.errors import STATUS, CallerGone, Code, Refused, ServingError, internal
from mariner.server.contracts.types import InferRequest, InferResult, WireProtocol

if TYPE_CHECKING:
    from mariner.server.common.metrics import Metrics

log = logging.getLogger("mariner.call")

T = TypeVar("T")
Infer = Callable[[InferRequest], Awaitable[InferResult]]

CANCELLED_STATUS = STATUS[Code.CANCELLED].http
UNKNOWN = ("unknown", "unknown")


class CallPlane(Protocol):
    """The slice of the DataPlane the call path needs (the real one and test fakes provide it)."""

    metrics: Metrics

    async def infer(self, req: InferRequest) -> InferResult: ...

    def known_label(self, model: str, version: str | None) -> tuple[str, str]: ...


class _HandlerStatus(Exception):
    """Internal signal: the handler answered this request with an error status."""

    def __init__(self, result: InferResult) -> None:
        super().__init__(result.status)
        self.result = result


@dataclass(frozen=True)
class Ok(Generic[T]):
    """The call succeeded: `value` is what the adapter's work returned."""

    value: T


@dataclass(frozen=True)
class Failed:
    """The call failed: answer the client with `error`.

    `http_status` is the status an HTTP client is answered with (a gRPC client gets the gRPC
    status of `error.code`); it is also the call's `code` label. `answer` is the handler's own
    answer when the failure is an error status the handler set, for protocols that pass it on.
    """

    error: ServingError
    http_status: int
    answer: InferResult | None = None

    @property
    def cancelled(self) -> bool:
        return self.error.code is Code.CANCELLED


Outcome = Ok[T] | Failed


def code_label(outcome: Ok[T] | Failed) -> str:
    """mariner_requests_total's `code`: "200", or the HTTP status (equivalent) of the failure."""
    return "200" if isinstance(outcome, Ok) else str(outcome.http_status)


def known_labels(plane: CallPlane, model: str, version: str | None) -> tuple[str, str]:
    """Bounded label values: a served model's name and version, else "unknown"."""
    if not model:
        return UNKNOWN
    try:
        return plane.known_label(model, version)
    except Exception:  # a metrics lookup must never fail the call
        log.exception("metric label lookup failed")
        return UNKNOWN


def record(
    plane: CallPlane, protocol: WireProtocol, model: str, version: str | None, code: str, start: float
) -> None:
    """Count and time one finished call (module docstring); `start` is its perf_counter start."""
    label_model, label_version = known_labels(plane, model, version)
    count, duration = plane.metrics.call_children(label_model, label_version, protocol.value, code)
    count.inc()
    seconds = time.perf_counter() - start
    duration.observe(seconds)
    book_of(plane.metrics).record(label_model, label_version, code == "200", seconds)
    # TorchServe's names; its model_version label is the version asked for, "default" for none.
    plane.metrics.ts.record_call(label_model, label_version if version else "default", code, seconds)


def failure(exc: Exception, protocol: WireProtocol, model: str, what: str) -> Failed:
    """The `Failed` a call's exception is answered with (module docstring): a ServingError or
    a refusal as it is, the client gone as CANCELLED, anything else logged and sanitized."""
    if isinstance(exc, CallerGone):
        return Failed(
            ServingError(Code.CANCELLED, "the client went away before the answer"), CANCELLED_STATUS
        )
    if isinstance(exc, _HandlerStatus):
        error = handler_error(exc.result)
        return Failed(error, error.http_status, exc.result)
    if isinstance(exc, Refused):
        return Failed(exc.error, exc.http_status)
    if isinstance(exc, ServingError):
        return Failed(exc, exc.http_status)
    log.error("%s call for model %r failed unexpectedly", protocol.value, model, exc_info=exc)
    error = internal(what)
    return Failed(error, error.http_status)


def checked(result: InferResult) -> InferResult:
    """`result`, unless its handler answered with an error status: that ends the call (a
    `Failed` whose `answer` is the result, see `failure`)."""
    if is_error_status(result.status):
        raise _HandlerStatus(result)
    return result


async def run_call(
    plane: CallPlane,
    protocol: WireProtocol,
    model: str,
    version: str | None,
    work: Callable[[Infer], Awaitable[T]],
    *,
    infer: Infer | None = None,
    what: str = "running the inference",
) -> Ok[T] | Failed:
    """Run one inference call's `work` and record it; return what the adapter answers with.

    `work` gets the `infer` to use (`plane.infer` unless the adapter wraps it, e.g. to notice
    an HTTP client leaving); a result whose handler status is an error ends the work there and
    becomes a `Failed` with that result as its `answer`. `model`/`version` are the names the
    client asked for (they become labels only when served). `what` names the stage in a
    sanitized INTERNAL message. Asyncio cancellation is counted as 499 and re-raised.
    """
    start = time.perf_counter()
    base = infer if infer is not None else plane.infer

    async def checked_infer(req: InferRequest) -> InferResult:
        return checked(await base(req))

    outcome: Ok[T] | Failed
    try:
        outcome = Ok(await work(checked_infer))
    except asyncio.CancelledError:  # the gRPC client went away: record it, let grpc end the call
        record(plane, protocol, model, version, str(CANCELLED_STATUS), start)
        raise
    except Exception as exc:
        outcome = failure(exc, protocol, model, what)
    record(plane, protocol, model, version, code_label(outcome), start)
    return outcome
