"""One error type for the whole server, mapped to gRPC and HTTP status in exactly one place.

The table names gRPC statuses without importing grpc (`common.grpc_status` makes them grpc's),
so a worker, which speaks no gRPC, needs no grpc.

Transports never invent status codes: they catch `ServingError` and ask this table. Anything
else that escapes is turned into INTERNAL with a sanitized message (never a traceback, never
gRPC UNKNOWN).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Code(enum.Enum):
    INVALID_ARGUMENT = "invalid_argument"
    NOT_FOUND = "not_found"
    UNAVAILABLE = "unavailable"
    RESOURCE_EXHAUSTED = "resource_exhausted"
    DEADLINE_EXCEEDED = "deadline_exceeded"
    UNAUTHENTICATED = "unauthenticated"
    UNIMPLEMENTED = "unimplemented"
    PERMISSION_DENIED = "permission_denied"
    ALREADY_EXISTS = "already_exists"  # TorchServe's 409 for a model version registered twice
    CANCELLED = "cancelled"
    INTERNAL = "internal"


@dataclass(frozen=True)
class TorchServeAnswer:
    """How stock TorchServe's own endpoints answer a failure: HTTP status, the exception type
    its error body names (`{"code", "type", "message"}`), and its message.

    Set on a ServingError where TorchServe answers differently from our code table: a handler's
    `PredictionException(message, code)`, a handler that raised ("Prediction failed", 503),
    out of memory ("Out of resources", 507). Elsewhere `torchserve_answer` derives it from the code.
    """

    status: int
    type: str
    message: str


@dataclass(frozen=True)
class StatusPair:
    grpc: str  # the grpc.StatusCode's name (common.grpc_status.grpc_code turns it into one)
    http: int


STATUS: dict[Code, StatusPair] = {
    Code.INVALID_ARGUMENT: StatusPair("INVALID_ARGUMENT", 400),
    Code.NOT_FOUND: StatusPair("NOT_FOUND", 404),
    Code.UNAVAILABLE: StatusPair("UNAVAILABLE", 503),
    Code.RESOURCE_EXHAUSTED: StatusPair("RESOURCE_EXHAUSTED", 503),
    Code.DEADLINE_EXCEEDED: StatusPair("DEADLINE_EXCEEDED", 504),
    Code.UNAUTHENTICATED: StatusPair("UNAUTHENTICATED", 401),
    Code.UNIMPLEMENTED: StatusPair("UNIMPLEMENTED", 501),
    Code.PERMISSION_DENIED: StatusPair("PERMISSION_DENIED", 403),
    Code.ALREADY_EXISTS: StatusPair("ALREADY_EXISTS", 409),
    Code.CANCELLED: StatusPair("CANCELLED", 499),
    Code.INTERNAL: StatusPair("INTERNAL", 500),
}

# TorchServe's exception class names (its error bodies' `type`) for each code.
TORCHSERVE_TYPES: dict[Code, str] = {
    Code.INVALID_ARGUMENT: "BadRequestException",
    Code.NOT_FOUND: "ModelNotFoundException",
    Code.UNAVAILABLE: "ServiceUnavailableException",
    Code.RESOURCE_EXHAUSTED: "ServiceUnavailableException",
    Code.DEADLINE_EXCEEDED: "InternalServerException",
    Code.UNAUTHENTICATED: "InvalidKeyException",
    Code.UNIMPLEMENTED: "MethodNotAllowedException",
    Code.PERMISSION_DENIED: "ModelException",
    Code.ALREADY_EXISTS: "ConflictStatusException",
    Code.CANCELLED: "InternalServerException",
    Code.INTERNAL: "InternalServerException",
}
# A failure inside the handler, on TorchServe's endpoints (its worker's `sendError`).
HANDLER_EXCEPTION = "InternalServerException"
# A batch past its responseTimeout on TorchServe's endpoints: its WorkerThread kills the worker
# and answers the batch's requests 500 "Worker died." (REST; gRPC INTERNAL with that text).
WORKER_DIED = TorchServeAnswer(500, HANDLER_EXCEPTION, "Worker died.")

# Seconds a client should wait before retrying an overloaded endpoint (HTTP Retry-After).
RETRY_AFTER_SECONDS = 1

_HTTP_TO_CODE = {
    400: Code.INVALID_ARGUMENT,
    404: Code.NOT_FOUND,
    413: Code.INVALID_ARGUMENT,
    415: Code.INVALID_ARGUMENT,
    422: Code.INVALID_ARGUMENT,
    429: Code.RESOURCE_EXHAUSTED,
    501: Code.UNIMPLEMENTED,
    503: Code.UNAVAILABLE,
    504: Code.DEADLINE_EXCEEDED,
}


class ServingError(Exception):
    """A failure with a code from `Code` and a message that says what was wrong and what is allowed."""

    def __init__(self, code: Code, message: str, *, torchserve: TorchServeAnswer | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.torchserve = torchserve

    @property
    def http_status(self) -> int:
        return STATUS[self.code].http

    @classmethod
    def from_http_status(cls, status: int, message: str) -> ServingError:
        """A handler's per-item status (e.g. 400 from set_response_status) as a ServingError."""
        return cls(code_for_status(status), message)


def code_for_status(status: int) -> Code:
    """The code of an HTTP status a handler chose (set_response_status, PredictionException)."""
    return _HTTP_TO_CODE.get(status, Code.INTERNAL if status >= 500 else Code.INVALID_ARGUMENT)


def torchserve_answer(err: ServingError) -> TorchServeAnswer:
    """`err` as TorchServe's endpoints answer it: its own answer where it has one, else ours
    (status from `STATUS`, TorchServe's exception name for the code, our message)."""
    if err.torchserve is not None:
        return err.torchserve
    return TorchServeAnswer(STATUS[err.code].http, TORCHSERVE_TYPES[err.code], err.message)


def internal(what: str) -> ServingError:
    """Sanitized INTERNAL: names the stage that failed, never the exception text or traceback."""
    return ServingError(Code.INTERNAL, f"internal error while {what}; see the server log")


def as_serving_error(exc: BaseException, what: str) -> ServingError:
    return exc if isinstance(exc, ServingError) else internal(what)


class CallerGone(Exception):
    """The client went away before its answer (an HTTP disconnect): counted as 499.

    gRPC reports the same event as asyncio cancellation, which the call path records and re-raises.
    """


class Refused(Exception):
    """A transport refuses the request with an HTTP status outside the Code table (413).

    The call is counted under that status; `error` is what the client is told.
    """

    def __init__(self, error: ServingError, http_status: int) -> None:
        super().__init__(error.message)
        self.error = error
        self.http_status = http_status
