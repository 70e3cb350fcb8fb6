"""The errors a handler's failure becomes, answered on TorchServe's endpoints as TorchServe's
worker answers them (`ts/service.py` `Service.predict`) and on the others in our own words.

TorchServe's worker turns a handler's failure into one status and message for the whole batch:

- `PredictionException(message, error_code)` (from `ts.utils.util`): that status and message;
- `MemoryError`, or any exception whose text says "CUDA": 507 "Out of resources";
- any other exception: 503 "Prediction failed";
- a result that is not a list: 503 "Invalid model predict output";
- a list of the wrong length: 503 "number of batch response mismatched".

Its frontend sends those as `{"code": status, "type": "InternalServerException", "message": ...}`
and maps a 413 to 507. Our own message (which names the exception type and points at the log)
is what the Open Inference Protocol and KServe endpoints answer, with the status of our code.
"""

from __future__ import annotations

from typing import Any

from mariner.server.contracts.errors import (
    HANDLER_EXCEPTION,
    Code,
    ServingError,
    TorchServeAnswer,
    code_for_status,
)

__all__ = ["bad_output", "handler_failed", "out_of_resources", "prediction_exception"]

_TS_ENTITY_TOO_LARGE = 413  # TorchServe's frontend answers this one as 507
_TS_INSUFFICIENT_STORAGE = 507


def _is_prediction_exception(exc: BaseException) -> bool:
    """TorchServe's `PredictionException`, recognised by name so that handlers importing it from
    `ts.utils.util` (or defining their own of that name, as some examples do) are understood."""
    return any(cls.__name__ == "PredictionException" for cls in type(exc).__mro__) and hasattr(
        exc, "error_code"
    )


def prediction_exception(exc: BaseException) -> ServingError | None:
    """`raise PredictionException("message", 513)` as the error the client is answered with;
    None when `exc` is not one."""
    if not _is_prediction_exception(exc):
        return None
    try:
        status = int(getattr(exc, "error_code", 500))
    except (TypeError, ValueError):
        status = 500
    if not 100 <= status <= 599:
        status = 500
    raw = getattr(exc, "message", None) or (exc.args[0] if exc.args else "")
    message = str(raw)[:1000]
    ts_status = _TS_INSUFFICIENT_STORAGE if status == _TS_ENTITY_TOO_LARGE else status
    return ServingError(
        code_for_status(status),
        message or f"the model's handler raised PredictionException with status {status}",
        torchserve=TorchServeAnswer(ts_status, HANDLER_EXCEPTION, message),
    )


def handler_failed(kind: str | None) -> ServingError:
    """Any other exception from the handler (`kind`: its type's name, None when the exception is
    gone): the batch fails, the instance goes on."""
    named = f" ({kind})" if kind else ""
    return ServingError(
        Code.INTERNAL,
        f"the model's handler failed on this batch{named}; see the server log",
        torchserve=TorchServeAnswer(503, HANDLER_EXCEPTION, "Prediction failed"),
    )


def out_of_resources(message: str) -> ServingError:
    """Out of memory on a request that cannot be split further."""
    return ServingError(
        Code.RESOURCE_EXHAUSTED,
        message,
        torchserve=TorchServeAnswer(_TS_INSUFFICIENT_STORAGE, HANDLER_EXCEPTION, "Out of resources"),
    )


def bad_output(outputs: Any, expected: int) -> ServingError:
    """The handler returned something other than one result per request."""
    if not isinstance(outputs, list):
        ours = f"the model's handler returned {type(outputs).__name__}, not a list of {expected} results"
        theirs = "Invalid model predict output"
    else:
        ours = f"the model's handler returned {len(outputs)} results for a batch of {expected}"
        theirs = "number of batch response mismatched"
    return ServingError(Code.INTERNAL, ours, torchserve=TorchServeAnswer(503, HANDLER_EXCEPTION, theirs))
