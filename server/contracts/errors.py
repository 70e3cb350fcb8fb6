"""One error type for the whole server, mapped to gRPC and HTTP status in exactly one place.

Transports never invent status codes: they catch `ServingError` and ask this table. Anything
else that escapes is turned into INTERNAL with a sanitized message (never a traceback, never
gRPC UNKNOWN).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import NoReturn

import grpc


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
    grpc: grpc.StatusCode
    http: int


STATUS: dict[Code, StatusPair] = {
    Code.INVALID_ARGUMENT: StatusPair(grpc.StatusCode.INVALID_ARGUMENT, 400),
    Code.NOT_FOUND: StatusPair(grpc.StatusCode.NOT_FOUND, 404),
    Code.UNAVAILABLE: StatusPair(grpc.StatusCode.UNAVAILABLE, 503),
    Code.RESOURCE_EXHAUSTED: StatusPair(grpc.StatusCode.RESOURCE_EXHAUSTED, 503),
    Code.DEADLINE_EXCEEDED: StatusPair(grpc.StatusCode.DEADLINE_EXCEEDED, 504),
    Code.UNAUTHENTICATED: StatusPair(grpc.StatusCode.UNAUTHENTICATED, 401),
    Code.UNIMPLEMENTED: StatusPair(grpc.StatusCode.UNIMPLEMENTED, 501),
    Code.PERMISSION_DENIED: StatusPair(grpc.StatusCode.PERMISSION_DENIED, 403),
    Code.ALREADY_EXISTS: StatusPair(grpc.StatusCode.ALREADY_EXISTS, 409),
    Code.CANCELLED: StatusPair(grpc.StatusCode.CANCELLED, 499),
    Code.INTERNAL: StatusPair(grpc.StatusCode.INTERNAL, 500),
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
    def grpc_status(self) -> grpc.StatusCode:
        return STATUS[self.code].grpc

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


_TS_GRPC = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    403: grpc.StatusCode.PERMISSION_DENIED,
    404: grpc.StatusCode.NOT_FOUND,
    409: grpc.StatusCode.ABORTED,
    413: grpc.StatusCode.RESOURCE_EXHAUSTED,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    416: grpc.StatusCode.OUT_OF_RANGE,
    499: grpc.StatusCode.CANCELLED,
    504: grpc.StatusCode.DEADLINE_EXCEEDED,
    501: grpc.StatusCode.UNIMPLEMENTED,
    503: grpc.StatusCode.UNAVAILABLE,
}


def torchserve_grpc(answer: TorchServeAnswer) -> tuple[grpc.StatusCode, str]:
    """A TorchServe answer as its gRPC frontend sends it (`GRPCUtils.getGRPCStatusCode`, the
    description augmented with the exception's Java class name on a second line)."""
    status = _TS_GRPC.get(
        answer.status, grpc.StatusCode.OK if 200 <= answer.status < 300 else grpc.StatusCode.INTERNAL
    )
    return status, f"{answer.message}\norg.pytorch.serve.http.{answer.type}"


def internal(what: str) -> ServingError:
    """Sanitized INTERNAL: names the stage that failed, never the exception text or traceback."""
    return ServingError(Code.INTERNAL, f"internal error while {what}; see the server log")


def as_serving_error(exc: BaseException, what: str) -> ServingError:
    return exc if isinstance(exc, ServingError) else internal(what)


async def abort(context: grpc.aio.ServicerContext, error: ServingError, details: str = "") -> NoReturn:
    """End a gRPC call with `error`'s status (`details` replaces its message when given).

    Typed NoReturn: grpc.aio's `context.abort` always raises, so callers need no dead code after it.
    """
    await context.abort(error.grpc_status, details or error.message)
    raise AssertionError("grpc.aio's ServicerContext.abort returned instead of raising")


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
