"""Client-side errors: one exception family for both transports, carrying the server's status.

A caller should not need to know whether a call went over gRPC or HTTP to handle its failure,
so both clients raise `MarinerError` subclasses chosen by the canonical (gRPC) status name, and
keep the HTTP status and the server's own message for the log line. The mapping mirrors the
server's one table (server/errors.py) read backwards; 503 is ambiguous there (UNAVAILABLE and
RESOURCE_EXHAUSTED both use it), so the HTTP client disambiguates with the error body's `type`
or the Retry-After header, and treats both as retryable anyway.
"""

from __future__ import annotations

import enum


class Status(enum.Enum):
    """Canonical status names (gRPC's), the one vocabulary both clients report in."""

    INVALID_ARGUMENT = "INVALID_ARGUMENT"
    NOT_FOUND = "NOT_FOUND"
    UNAVAILABLE = "UNAVAILABLE"
    RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"
    DEADLINE_EXCEEDED = "DEADLINE_EXCEEDED"
    UNAUTHENTICATED = "UNAUTHENTICATED"
    PERMISSION_DENIED = "PERMISSION_DENIED"
    UNIMPLEMENTED = "UNIMPLEMENTED"
    CANCELLED = "CANCELLED"
    INTERNAL = "INTERNAL"
    UNKNOWN = "UNKNOWN"


# Statuses worth another attempt: the server (or the path to it) is briefly unable, not the
# request wrong. Everything else fails at once.
RETRYABLE: frozenset[Status] = frozenset({Status.UNAVAILABLE, Status.RESOURCE_EXHAUSTED})

_FROM_HTTP: dict[int, Status] = {
    400: Status.INVALID_ARGUMENT,
    401: Status.UNAUTHENTICATED,
    403: Status.PERMISSION_DENIED,
    404: Status.NOT_FOUND,
    405: Status.UNIMPLEMENTED,
    408: Status.DEADLINE_EXCEEDED,
    413: Status.INVALID_ARGUMENT,
    415: Status.INVALID_ARGUMENT,
    422: Status.INVALID_ARGUMENT,
    429: Status.RESOURCE_EXHAUSTED,
    499: Status.CANCELLED,
    500: Status.INTERNAL,
    501: Status.UNIMPLEMENTED,
    502: Status.UNAVAILABLE,
    503: Status.UNAVAILABLE,
    504: Status.DEADLINE_EXCEEDED,
}


def status_from_http(code: int, type_hint: str | None = None) -> Status:
    """The canonical status for an HTTP answer; `type_hint` is the body's `type` when it names one."""
    if type_hint:
        try:
            return Status[type_hint.upper()]
        except KeyError:
            pass
    known = _FROM_HTTP.get(code)
    if known is not None:
        return known
    return Status.INTERNAL if code >= 500 else Status.INVALID_ARGUMENT


def status_from_grpc_name(name: str) -> Status:
    try:
        return Status[name]
    except KeyError:
        return Status.UNKNOWN


class MarinerError(Exception):
    """A call failed: `status` (canonical), the server's `message`, and where it happened.

    `http_status` is set for HTTP answers (None for gRPC and for failures before an answer);
    `attempts` is how many tries the client made, so "gave up after retries" is visible;
    `retry_after_s` is the server's Retry-After hint when it sent one.
    """

    def __init__(
        self,
        status: Status,
        message: str,
        *,
        transport: str,
        http_status: int | None = None,
        attempts: int = 1,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.transport = transport
        self.http_status = http_status
        self.attempts = attempts
        # The server's Retry-After hint in seconds (HTTP), a floor for the next backoff.
        self.retry_after_s: float | None = None

    @property
    def retryable(self) -> bool:
        return self.status in RETRYABLE

    def __str__(self) -> str:
        code = self.status.name if self.http_status is None else f"{self.status.name}/{self.http_status}"
        tries = f" (gave up after {self.attempts} attempts)" if self.attempts > 1 else ""
        return f"{code} over {self.transport}: {self.message}{tries}"


class InvalidArgumentError(MarinerError):
    """The request was wrong (shape, datatype, payload); resending it unchanged will not help."""


class NotFoundError(MarinerError):
    """No such model or version on the server."""


class UnavailableError(MarinerError):
    """Server unreachable, starting, draining or the model not ready; retried with backoff."""


class ResourceExhaustedError(MarinerError):
    """The server's queue for the model is full (overloaded); retried with backoff."""


class DeadlineExceededError(MarinerError):
    """The call's deadline passed, on the client or on the server, before an answer came."""


class UnauthenticatedError(MarinerError):
    """Missing or bad token."""


_CLASSES: dict[Status, type[MarinerError]] = {
    Status.INVALID_ARGUMENT: InvalidArgumentError,
    Status.NOT_FOUND: NotFoundError,
    Status.UNAVAILABLE: UnavailableError,
    Status.RESOURCE_EXHAUSTED: ResourceExhaustedError,
    Status.DEADLINE_EXCEEDED: DeadlineExceededError,
    Status.UNAUTHENTICATED: UnauthenticatedError,
}


def make_error(
    status: Status, message: str, *, transport: str, http_status: int | None = None
) -> MarinerError:
    """The most specific `MarinerError` subclass for `status`."""
    cls = _CLASSES.get(status, MarinerError)
    return cls(status, message, transport=transport, http_status=http_status)
