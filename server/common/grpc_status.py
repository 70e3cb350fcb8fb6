"""The one error table (`contracts.errors`) as gRPC answers it: each Code's grpc.StatusCode,
TorchServe's gRPC statuses, and the end of a call with a ServingError. Kept out of contracts so
that the worker and the value types need no grpc."""

from __future__ import annotations

from typing import NoReturn

import grpc

from mariner.server.contracts.errors import STATUS, Code, ServingError, TorchServeAnswer

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


async def abort(context: grpc.aio.ServicerContext, error: ServingError, details: str = "") -> NoReturn:
    """End a gRPC call with `error`'s status (`details` replaces its message when given).

    Typed NoReturn: grpc.aio's `context.abort` always raises, so callers need no dead code after it.
    """
    await context.abort(grpc_code(error.code), details or error.message)
    raise AssertionError("grpc.aio's ServicerContext.abort returned instead of raising")


def grpc_code(code: Code) -> grpc.StatusCode:
    """The gRPC status of `code`, from the one table (`contracts.errors.STATUS`)."""
    return _GRPC[code]


_GRPC: dict[Code, grpc.StatusCode] = {code: grpc.StatusCode[pair.grpc] for code, pair in STATUS.items()}
