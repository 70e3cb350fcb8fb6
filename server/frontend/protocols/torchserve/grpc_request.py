"""TorchServe's gRPC `PredictionsRequest` decoded into the protocol-neutral `InferRequest`: the
invocation metadata as bounded handler headers (`request_headers`, OIP's gRPC adapter reads them
the same way), the `input` map as the request's data (`input_map`), checked before an entry is
read.

The `input` map is parsed as opaque entries first (`ShallowPredictionsRequest`): protobuf
building a 650,000-entry map took 4 s of event loop. Its size is checked against
`MAX_INPUT_ENTRIES` before an entry is read.

Apart from `grpc` (the servicer): what a request is, with its bounds, whatever RPC carries it.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from google.protobuf.message import DecodeError

from mariner.server.common.grpc_decoding import shallow_class
from mariner.server.common.grpc_stubs import inference_pb2
from mariner.server.common.request_ids import new_request_id
from mariner.server.common.security import HIDDEN_FROM_HANDLERS
from mariner.server.contracts.errors import Code, ServingError
from mariner.server.contracts.types import InferRequest, WireProtocol

PROTOCOL = WireProtocol.TS_GRPC

# Invocation metadata becomes the handler's request headers. Bounded so a client cannot make
# the server copy megabytes of metadata per request into every batch.
MAX_HEADERS = 64
MAX_HEADER_NAME = 256
MAX_HEADER_VALUE = 8192
# Entries of a request's `input` map (TorchServe handlers read a handful: "data", "body", ...).
MAX_INPUT_ENTRIES = 1024
# PredictionsRequest as parsed off the wire: `input` is a list of serialized map entries.
ShallowPredictionsRequest = shallow_class(
    inference_pb2.PredictionsRequest.DESCRIPTOR,
    {"org.pytorch.serve.grpc.inference.PredictionsRequest": ("input",)},
)
_InputEntry = inference_pb2.PredictionsRequest.InputEntry


def request_headers(metadata: Sequence[tuple[str, str | bytes]] | None) -> dict[str, str]:
    """Text metadata as a bounded header dict; binary (-bin) entries, overlong ones, credentials
    (checked by the server, never shown to handler code) and the server-set mode switches
    (`explain`, `describe`) are dropped."""
    headers: dict[str, str] = {}
    for key, value in metadata or ():
        if len(headers) >= MAX_HEADERS:
            break
        if not isinstance(value, str) or key.endswith("-bin") or key.lower() in HIDDEN_FROM_HANDLERS:
            continue
        if len(key) > MAX_HEADER_NAME or len(value) > MAX_HEADER_VALUE:
            continue
        headers.setdefault(key.lower(), value)
    return headers


def input_map(request: Any) -> dict[str, bytes]:
    """The request's `input` map, refused before any entry is read when it has too many."""
    entries = request.input
    if len(entries) > MAX_INPUT_ENTRIES:
        raise ServingError(
            Code.INVALID_ARGUMENT,
            f"the input map has {len(entries)} entries; at most {MAX_INPUT_ENTRIES} are accepted per request",
        )
    if not isinstance(request, ShallowPredictionsRequest):
        return dict(entries)
    out: dict[str, bytes] = {}
    for raw in entries:
        try:
            entry = _InputEntry.FromString(raw)
        except DecodeError:
            raise ServingError(
                Code.INVALID_ARGUMENT, "an `input` entry is not a valid PredictionsRequest map entry"
            ) from None
        out[entry.key] = entry.value  # a repeated key: the last one wins, as in a protobuf map
    return out


def to_infer_request(
    request: inference_pb2.PredictionsRequest,
    *,
    metadata: Sequence[tuple[str, str | bytes]] | None,
    time_remaining: float | None,
    headers: dict[str, str] | None = None,
    request_id: str | None = None,
) -> InferRequest:
    """The protocol-neutral request: `data` is the `input` map, as TorchServe hands it to handlers."""
    if not request.model_name:
        raise ServingError(Code.INVALID_ARGUMENT, "model_name is required: name a model this server serves")
    deadline = time.monotonic() + time_remaining if time_remaining is not None else None
    data = input_map(request)
    return InferRequest(
        model=request.model_name,
        version=request.model_version or None,
        data=data,
        protocol=PROTOCOL,
        request_id=request_id or new_request_id(),
        headers=request_headers(metadata) if headers is None else headers,
        deadline=deadline,
        size=sum(len(v) for v in data.values()),
    )
