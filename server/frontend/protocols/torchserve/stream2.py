"""TorchServe's `StreamPredictions2` rules, as its 0.12 frontend applies them to each request.

From TorchServe's `InferenceImpl.streamPredictions2`/`prediction`/`sendErrorResponse` and
`GRPCJob.sendError` (STREAMPREDICT2): every failure is answered in the stream as a
`PredictionResponse` whose `status` (google.rpc.Status) carries a code, a message and one
`google.rpc.ErrorInfo` detail naming TorchServe's exception; the stream stays open.

- An empty `sequence_id` without input `ts_request_sequence_start`="true": INTERNAL,
  "Parameter sequenceId is required.", reason "BadRequestException.()".
- An empty `model_name`: INTERNAL, "Parameter model_name is required.", same reason.
- An unknown model or version: INTERNAL with TorchServe's not-found message, reason the Java
  class (`org.pytorch.serve.archive.model.ModelNotFoundException`).
- A handler's failure: the gRPC code of TorchServe's status for it, its message, reason
  `org.pytorch.serve.http.InternalServerException`.
- Otherwise the request runs with the headers TorchServe adds: `ts_request_sequence_id` (the
  client's id, or a generated `ts-seq-<uuid>` with `ts_request_sequence_start`="true" when the
  id is empty and the input says start), and `ts_request_sequence_end`="true".

TorchServe 0.12 reads the start and end flags with `ByteString.toString()` (a description
such as `<ByteString@1b2c size=4 contents="true">`, never the text), so there an empty id is
refused even with start "true", and the end header is "true" on every request. Mariner sets
the end header the same way (a handler sees what it sees there), and deliberately honours
start "true" with an empty id as TorchServe's code intends: a server-made sequence id instead
of a refusal. A client written for TorchServe, which always sends an id, sees no difference.

Our own refusals that TorchServe has no counterpart for (overload, draining, a deadline, an
input map over its limit) keep our code table's status, as unary Predictions does. The
answers also echo `sequence_id` (TorchServe leaves it unset), so a pipelined client can match
them. `in_stream_status` is the one place a failure becomes a status.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass

import grpc
from google.protobuf import any_pb2

from mariner.server.common.grpc_status import grpc_code, torchserve_grpc
from mariner.server.common.grpc_stubs import status_pb2
from mariner.server.common.handler_status import answer_text
from mariner.server.contracts.errors import (
    HANDLER_EXCEPTION,
    Code,
    ServingError,
    TorchServeAnswer,
    torchserve_answer,
)
from mariner.server.contracts.types import InferResult

# ConfigManager's defaults (ts_header_key_sequence_* in config.properties can rename them there).
SEQUENCE_ID = "ts_request_sequence_id"
SEQUENCE_START = "ts_request_sequence_start"
SEQUENCE_END = "ts_request_sequence_end"
SEQUENCE_HEADERS = frozenset({SEQUENCE_ID, SEQUENCE_START, SEQUENCE_END})

BAD_REQUEST_REASON = "BadRequestException.()"
HANDLER_REASON = "org.pytorch.serve.http.InternalServerException"
_MODEL_EXCEPTIONS = frozenset({"ModelNotFoundException", "ModelVersionNotFoundException"})
_ERROR_INFO_URL = "type.googleapis.com/google.rpc.ErrorInfo"


class BadStreamRequest(ServingError):
    """A request TorchServe refuses before looking at the model (BadRequestException)."""

    def __init__(self, message: str) -> None:
        super().__init__(
            Code.INVALID_ARGUMENT, message, torchserve=TorchServeAnswer(400, "BadRequestException", message)
        )


@dataclass(frozen=True)
class Sequence:
    """A request's sequence: the id the handler sees, its headers, and the key that orders it."""

    sequence_id: str
    headers: Mapping[str, str]
    key: str | None  # the client's id: its steps run in arrival order; None for a generated one


def _is_true(inputs: Mapping[str, bytes], key: str) -> bool:
    """Java's Boolean.parseBoolean on the input's text (absent: false)."""
    value = inputs.get(key)
    return value is not None and bytes(value).decode("utf-8", errors="replace").lower() == "true"


def sequence_of(sequence_id: str, model_name: str, inputs: Mapping[str, bytes]) -> Sequence:
    """TorchServe's checks and headers for one request, in its order; raises BadStreamRequest.
    `inputs` is read only when `sequence_id` is empty (for the start flag)."""
    if not sequence_id and not _is_true(inputs, SEQUENCE_START):
        raise BadStreamRequest("Parameter sequenceId is required.")
    if not model_name:
        raise BadStreamRequest("Parameter model_name is required.")
    headers: dict[str, str] = {}
    key: str | None = sequence_id
    if not sequence_id:
        sequence_id, key = f"ts-seq-{uuid.uuid4()}", None
        headers[SEQUENCE_START] = "true"
    headers[SEQUENCE_ID] = sequence_id
    headers[SEQUENCE_END] = "true"  # TorchServe's `!parseBoolean(ByteString.toString())`: always
    return Sequence(sequence_id, headers, key)


def _error_info(reason: str) -> any_pb2.Any:
    """google.rpc.ErrorInfo{reason} packed in an Any, encoded by hand: field 1 (reason), length
    delimited, is all TorchServe sets, and no googleapis stub is installed to build it."""
    text = reason.encode("utf-8")
    length = bytearray()
    n = len(text)
    while True:
        byte, n = n & 0x7F, n >> 7
        length.append(byte | (0x80 if n else 0))
        if not n:
            break
    return any_pb2.Any(type_url=_ERROR_INFO_URL, value=b"\x0a" + bytes(length) + text)


def status(code: grpc.StatusCode, message: str, reason: str) -> status_pb2.Status:
    return status_pb2.Status(code=code.value[0], message=message, details=[_error_info(reason)])


def in_stream_status(error: ServingError, answer: InferResult | None = None) -> status_pb2.Status:
    """The in-stream status a failed request is answered with (the one mapping)."""
    internal = grpc.StatusCode.INTERNAL
    if isinstance(error, BadStreamRequest):
        return status(internal, error.message, BAD_REQUEST_REASON)
    if answer is not None:  # the handler's own error status for this request (set_response_status)
        text = answer_text(answer)
        code, _ = torchserve_grpc(TorchServeAnswer(answer.status, HANDLER_EXCEPTION, text))
        return status(code, text, HANDLER_REASON)
    ts = error.torchserve
    if ts is not None and ts.type in _MODEL_EXCEPTIONS:
        return status(internal, ts.message, f"org.pytorch.serve.archive.model.{ts.type}")
    if ts is not None and ts.type == HANDLER_EXCEPTION:
        code, _ = torchserve_grpc(ts)
        return status(code, ts.message, HANDLER_REASON)
    return status(
        grpc_code(error.code), error.message, f"org.pytorch.serve.http.{torchserve_answer(error).type}"
    )
