"""The Open Inference Protocol's transport-neutral half, shared by its gRPC and REST adapters.

Both adapters decode wire tensors with `mariner.server.contracts.tensors` and then do the same
things, in the same order, with the same messages: resolve the model (NOT_FOUND), require a
declared tensor signature, check request parameters, check each input's header (element count
under the cap, then name, datatype, shape and rows against the signature and the max batch
size: `check_header`, `check_input`) before any element is read or allocated, decode,
match the inputs against the signature (all present, rows agree, shape x datatype x bytes),
check requested output names, and only then queue an `InferRequest` whose typed `tensors`
field is {input name: array [N, ...]} and whose `items` is N, so the batcher gives it N slots.
The handler's answer comes back as arrays in `InferResult.tensors`; `pick_outputs` selects and
orders them for the response. Keeping this here means a Triton gRPC client and a Triton HTTP
client see identical verdicts for the same request. Counting, timing and error mapping are
the call path's (`mariner.server.frontend.protocols.call`), as for every other protocol.
"""

from __future__ import annotations

import functools
import importlib.metadata
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from mariner.server.common.handler_status import handler_error, is_error_status
from mariner.server.common.request_ids import new_request_id
from mariner.server.contracts.errors import Code, ServingError
from mariner.server.contracts.tensors import (
    DTYPES,
    ModelSignature,
    TensorSpec,
    bad,
    check_against,
    check_shape,
    datatype_of,
    dtype_of,
    element_count,
    match_signature,
)
from mariner.server.contracts.types import InferRequest, InferResult, ModelInfo, WireProtocol

if TYPE_CHECKING:
    from mariner.server.common.metrics import Metrics

log = logging.getLogger("mariner.oip")

SERVER_NAME = "mariner"
# What ModelMetadata reports as `platform`: TorchServe-contract handlers running in Mariner.
PLATFORM = "pytorch_torchserve"
# Extensions of the protocol Mariner really implements (REST binary tensors; Triton's model
# configuration, statistics and repository, see `triton_ext`). Shared memory, classification
# and sequences are not, so they are not listed.
EXTENSIONS: tuple[str, ...] = ("binary_tensor_data", "model_configuration", "statistics", "model_repository")
# A client-chosen request id is echoed and logged; beyond this length it is refused.
MAX_ID_CHARS = 256
# Parameters that ask for features Mariner lacks; silently ignoring them would return wrong data.
_UNSUPPORTED_TENSOR_PARAMS = {
    "shared_memory_region": "shared-memory tensors are not supported; send the data in the request",
    "classification": "the classification extension is not supported; request the raw output",
}


class ModelHandle(Protocol):
    """What the adapters need of a resolved model version (DataPlane's ModelEndpoint has it)."""

    name: str
    version: str
    signature: ModelSignature | None
    batch_size: int


class OipPlane(Protocol):
    """The slice of the DataPlane the OIP adapters use (the real one and test fakes provide it)."""

    metrics: Metrics

    async def infer(self, req: InferRequest) -> InferResult: ...

    def resolve(self, model: str, version: str | None = None) -> ModelHandle: ...

    def describe(self, model: str, version: str | None = None) -> list[ModelInfo]: ...

    def models(self) -> list[ModelInfo]: ...

    def model_ready(self, model: str, version: str | None = None) -> bool: ...

    def is_ready(self) -> bool: ...

    def is_live(self) -> bool: ...

    def known_label(self, model: str, version: str | None) -> tuple[str, str]: ...


@functools.cache
def server_version() -> str:
    """The installed package's version (ServerMetadata), or a marker when run from a bare tree."""
    try:
        return importlib.metadata.version(SERVER_NAME)
    except importlib.metadata.PackageNotFoundError:
        return "0+unknown"


# -- metadata ---------------------------------------------------------------------------------
def tensor_meta(spec: TensorSpec) -> dict[str, Any]:
    return {"name": spec.name, "datatype": spec.datatype, "shape": list(spec.shape)}


def model_metadata(plane: OipPlane, model: str, version: str | None) -> dict[str, Any]:
    """ModelMetadata as a dict (REST JSON as is; gRPC copies it into its message).

    `versions` lists every served version of the model; the tensors are those of the requested
    (or default) version. A model without a declared signature has empty inputs and outputs.
    """
    handle = plane.resolve(model, version)
    versions = [info.version for info in plane.describe(model)]
    sig = handle.signature
    return {
        "name": handle.name,
        "versions": versions or [handle.version],
        "platform": PLATFORM,
        "inputs": [tensor_meta(s) for s in sig.inputs] if sig else [],
        "outputs": [tensor_meta(s) for s in sig.outputs] if sig else [],
    }


def server_metadata() -> dict[str, Any]:
    return {"name": SERVER_NAME, "version": server_version(), "extensions": list(EXTENSIONS)}


# -- requests ---------------------------------------------------------------------------------
def element_cap(max_message_bytes: int) -> int:
    """Most elements one input may have: every element costs at least one byte on the wire, so
    a bigger count can only be a lie that would make us allocate for it (BYTES tensors)."""
    return max(1, max_message_bytes)


def check_header(name: str, datatype: str, shape: Sequence[int], max_elements: int) -> tuple[int, ...]:
    """Datatype known, dims sane and the element count under the cap: all before any allocation."""
    dtype_of(datatype, name)
    dims = check_shape(shape, name)
    count = element_count(dims)
    if count > max_elements:
        raise bad(
            f"input {name!r}: shape {list(dims)} has {count} elements; at most {max_elements} are "
            "accepted per tensor (bounded by the server's max request size)"
        )
    return dims


def check_input(sig: ModelSignature, max_rows: int, name: str, datatype: str, dims: Sequence[int]) -> None:
    """One input's header against the model: a declared input, its datatype and shape, at most
    `max_rows` rows (the max batch size). Runs before the input's data is touched."""
    spec = next((s for s in sig.inputs if s.name == name), None)
    if spec is None:
        takes = ", ".join(s.describe() for s in sig.inputs)
        raise bad(f"unknown input(s) [{name!r}]; the model takes: {takes}")
    check_against(spec, datatype, dims, max_rows)


def check_tensor_params(kind: str, name: str, params: Mapping[str, Any]) -> None:
    for key, why in _UNSUPPORTED_TENSOR_PARAMS.items():
        if key in params:
            raise bad(f"{kind} {name!r}: parameter {key!r}: {why}")


def deadline_from(params: Mapping[str, Any], time_remaining: float | None) -> float | None:
    """The request's `time.monotonic()` deadline: the transport's, tightened by OIP's `timeout`.

    `timeout` is in microseconds (as tritonclient sends it). Sequence requests are refused:
    Mariner has no sequence batcher, and answering them statelessly would be silently wrong.
    """
    seq = params.get("sequence_id")
    if seq not in (None, 0, ""):
        raise bad("sequence_id is not supported: Mariner has no sequence batching; send independent requests")
    now = time.monotonic()
    deadline = now + time_remaining if time_remaining is not None else None
    timeout = params.get("timeout")
    if timeout is not None:
        if isinstance(timeout, bool) or not isinstance(timeout, int) or timeout < 0:
            raise bad(f"parameter 'timeout' must be a non-negative integer (microseconds), got {timeout!r}")
        if timeout > 0:
            mine = now + timeout / 1e6
            deadline = mine if deadline is None else min(deadline, mine)
    return deadline


def request_id_of(client_id: str) -> str:
    if len(client_id) > MAX_ID_CHARS:
        raise bad(f"request id is {len(client_id)} characters; at most {MAX_ID_CHARS} are accepted")
    return client_id or new_request_id()


def signature_of(handle: ModelHandle) -> ModelSignature:
    sig = handle.signature
    if sig is None or not sig.inputs:
        raise bad(
            f"model {handle.name} declares no tensor signature; use the TorchServe API "
            "(/predictions or InferenceAPIsService) for it"
        )
    return sig


def check_requested(requested: Sequence[str], sig: ModelSignature) -> None:
    """Requested output names must be declared outputs, each named once (checked before queueing)."""
    if len(set(requested)) != len(requested):
        raise bad(f"an output is requested more than once: {list(requested)}")
    if not sig.outputs:
        return  # nothing declared: names are checked against what the handler answers
    declared = {s.name for s in sig.outputs}
    unknown = [n for n in requested if n not in declared]
    if unknown:
        produces = ", ".join(s.describe() for s in sig.outputs)
        raise bad(f"unknown output(s) {unknown}; the model produces: {produces}")


@dataclass(frozen=True)
class Prepared:
    """A checked request, ready for the DataPlane, plus what is needed to shape its answer."""

    request: InferRequest
    handle: ModelHandle
    signature: ModelSignature
    requested: tuple[str, ...]


def prepare(
    handle: ModelHandle,
    *,
    inputs: Mapping[str, tuple[str, np.ndarray]],
    requested: Sequence[str],
    request_id: str,
    protocol: WireProtocol,
    deadline: float | None,
    headers: Mapping[str, str],
) -> Prepared:
    """Match decoded inputs against the signature and build the protocol-neutral request."""
    sig = signature_of(handle)
    rows = match_signature(inputs, sig)
    check_requested(requested, sig)
    tensors = {name: arr for name, (_, arr) in inputs.items()}
    req = InferRequest(
        model=handle.name,
        version=handle.version,
        data={},
        tensors=tensors,
        protocol=protocol,
        request_id=request_id,
        headers=headers,
        deadline=deadline,
        items=rows,
        size=sum(arr.nbytes for arr in tensors.values()),
    )
    return Prepared(req, handle, sig, tuple(requested))


# -- results ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class OutputTensor:
    name: str
    datatype: str
    array: np.ndarray


def _as_output(name: str, value: Any, declared: str | None) -> OutputTensor:
    arr = np.asarray(value)
    if declared is None:
        return OutputTensor(name, datatype_of(arr), arr)
    if declared == "BYTES":
        if arr.dtype.kind not in "OSU":
            raise TypeError(f"output {name!r} is {arr.dtype}, declared BYTES")
        return OutputTensor(name, declared, arr)
    want = DTYPES[declared]
    if arr.dtype != want:
        arr = arr.astype(want)
    return OutputTensor(name, declared, arr)


def pick_outputs(prepared: Prepared, result: InferResult) -> list[OutputTensor]:
    """The handler's arrays as response outputs: the requested ones in request order, or every
    declared output in signature order; datatypes as declared (arrays cast to them)."""
    if is_error_status(result.status):  # the call path stops these first; kept for direct callers
        raise handler_error(result)
    tensors = result.tensors
    model = prepared.handle.name
    if tensors is None:
        log.error("handler of %s answered a tensor request without tensors", model)
        raise ServingError(
            Code.INTERNAL, f"the handler of model {model} did not answer the tensor request with tensors"
        )
    declared = {s.name: s.datatype for s in prepared.signature.outputs}
    names: Sequence[str] = prepared.requested or (
        [s.name for s in prepared.signature.outputs] if declared else list(tensors)
    )
    missing = [n for n in names if n not in tensors]
    if missing and (declared or not prepared.requested):
        log.error("handler of %s did not produce declared output(s) %s", model, missing)
        raise ServingError(Code.INTERNAL, f"the handler of model {model} did not produce output(s) {missing}")
    if missing:
        raise bad(f"unknown output(s) {missing}; the model produced: {sorted(tensors)}")
    try:
        return [_as_output(n, tensors[n], declared.get(n)) for n in names]
    except (TypeError, ValueError) as exc:
        log.error("handler of %s produced an unusable output: %s", model, exc)
        raise ServingError(
            Code.INTERNAL, f"the handler of model {model} produced an output of the wrong type"
        ) from None
