"""The Open Inference Protocol's gRPC service (`inference.GRPCInferenceService`).

A transport adapter only, mounted on the same grpc.aio server (port 7070) as TorchServe's
InferenceAPIsService: it turns `ModelInferRequest`s into `InferRequest`s through
`mariner.server.common.oip_codec` and the tensor codec, hands them to the same DataPlane
and batcher, and answers
with `raw_output_contents` (the form tritonclient reads by default). Status codes come from
`mariner.server.contracts.errors.STATUS` only; anything unexpected becomes INTERNAL with a sanitized message,
never gRPC UNKNOWN.

Mapping of a Triton client's request to the handler:
- `inputs[i]` with `raw_input_contents[i]` (or typed `contents`) -> numpy array of its
  datatype and shape. Each input's header (name, datatype, shape, rows against the max batch
  size, element count) is checked against the model's declared signature before any element
  is read; `contents` is kept opaque by the request parser until then (see `oip.contents`),
  and inputs of more than `OFFLOAD_DECODE_BYTES` are decoded on a worker thread;
- the request carries them in its typed `tensors` field, as one request taking N batch slots
  (the handler receives {"tensors": {name: array [N, ...]}});
- its {"tensors": {...}} answer -> `outputs` + `raw_output_contents`, the requested outputs in
  request order (all declared outputs when none are requested); `id` is echoed.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np

from mariner.server.common import oip_codec as oip
from mariner.server.common import triton_ext_grpc as ext
from mariner.server.common.grpc_decoding import register, shallow_class
from mariner.server.common.grpc_status import abort
from mariner.server.common.grpc_stubs import grpc_service_pb2 as pb
from mariner.server.common.grpc_stubs import grpc_service_pb2_grpc as pb_grpc
from mariner.server.common.held_bytes import HeldBytes
from mariner.server.contracts.errors import Code, as_serving_error, internal
from mariner.server.contracts.tensors import CONTENTS_FIELD, ModelSignature, bad, decode_raw, encode_raw
from mariner.server.contracts.types import WireProtocol
from mariner.server.frontend.protocols.call import Failed, Infer, Ok, run_call
from mariner.server.frontend.protocols.grpc_stream import GrpcStreams, answers
from mariner.server.frontend.protocols.oip.contents import decode_contents
from mariner.server.frontend.protocols.stream_pipeline import WINDOW
from mariner.server.frontend.protocols.torchserve.grpc_request import request_headers

log = logging.getLogger("mariner.grpc.oip")

SERVICE_NAME: str = pb.DESCRIPTOR.services_by_name["GRPCInferenceService"].full_name
PROTOCOL = WireProtocol.OIP_GRPC
# Requests of one ModelStreamInfer call in flight at once (read and not yet answered). They run
# concurrently (so a client streaming many requests gets them batched together) and are
# answered as each finishes; the window bounds what one stream can hold in memory.
STREAM_WINDOW = WINDOW
# Inputs carrying at least this many bytes are decoded on a worker thread, not the event loop.
OFFLOAD_DECODE_BYTES = 256 * 1024
# ModelInferRequest as parsed off the wire: each input's `contents` stays serialized bytes until
# its header has passed the signature (wire-compatible with the generated class otherwise).
ShallowInferRequest = shallow_class(
    pb.ModelInferRequest.DESCRIPTOR, {"inference.ModelInferRequest.InferInputTensor": ("contents",)}
)


def params_of(parameters: Mapping[str, Any]) -> dict[str, Any]:
    """An `InferParameter` map as plain Python values."""
    out: dict[str, Any] = {}
    for key, param in parameters.items():
        which = param.WhichOneof("parameter_choice")
        out[key] = getattr(param, which) if which else None
    return out


@dataclass(frozen=True)
class CheckedInput:
    """An input whose header passed the signature; its data is still as it came on the wire."""

    name: str
    datatype: str
    shape: tuple[int, ...]
    raw: bytes | None  # its raw_input_contents buffer, or None when it comes in `contents`
    contents: Any  # serialized InferTensorContents (bytes), or a parsed message

    @property
    def nbytes(self) -> int:
        data = self.raw if self.raw is not None else self.contents
        return len(data) if isinstance(data, bytes) else data.ByteSize()

    def decode(self) -> np.ndarray:
        if self.raw is not None:
            return decode_raw(self.name, self.datatype, self.shape, self.raw)
        if isinstance(self.contents, bytes):
            return decode_contents(self.name, self.datatype, self.shape, self.contents)
        return decode_contents(self.name, self.datatype, self.shape, self.contents.SerializeToString())


def check_inputs(request: Any, sig: ModelSignature, max_rows: int, max_elements: int) -> list[CheckedInput]:
    """Every input's header against the signature, before any of its data is read."""
    raw = request.raw_input_contents
    if raw and len(raw) != len(request.inputs):
        raise bad(
            f"raw_input_contents has {len(raw)} buffers for {len(request.inputs)} inputs; "
            "send one buffer per input, in the order of `inputs`"
        )
    checked: list[CheckedInput] = []
    names: set[str] = set()
    for i, tensor in enumerate(request.inputs):
        name, datatype = tensor.name, tensor.datatype.upper()
        if name in names:
            raise bad(f"input {name!r} is given more than once")
        names.add(name)
        if tensor.parameters:
            oip.check_tensor_params("input", name, params_of(tensor.parameters))
        shape = oip.check_header(name, datatype, tensor.shape, max_elements)
        contents = tensor.contents
        has_contents = bool(contents) if isinstance(contents, bytes) else tensor.HasField("contents")
        if raw and has_contents:
            raise bad(
                f"input {name!r} has `contents` while the request uses raw_input_contents; use one form"
            )
        if not raw and CONTENTS_FIELD.get(datatype) is None:
            raise bad(f"input {name!r}: {datatype} data must be sent in raw_input_contents")
        oip.check_input(sig, max_rows, name, datatype, shape)
        checked.append(CheckedInput(name, datatype, shape, raw[i] if raw else None, contents))
    return checked


def decode_checked(checked: Sequence[CheckedInput]) -> dict[str, tuple[str, np.ndarray]]:
    return {c.name: (c.datatype, c.decode()) for c in checked}


async def decode_inputs(
    request: Any, sig: ModelSignature, max_rows: int, max_elements: int
) -> dict[str, tuple[str, np.ndarray]]:
    """Every input as (datatype, array): headers checked first, then decoded (off the loop if big)."""
    checked = check_inputs(request, sig, max_rows, max_elements)
    if sum(c.nbytes for c in checked) < OFFLOAD_DECODE_BYTES:
        return decode_checked(checked)
    return await asyncio.to_thread(decode_checked, checked)


class OipServicer(pb_grpc.GRPCInferenceServiceServicer):
    """Health, metadata, ModelInfer and ModelStreamInfer over the DataPlane."""

    def __init__(
        self, dataplane: oip.OipPlane, *, max_message_bytes: int, held: HeldBytes | None = None
    ) -> None:
        self._plane = dataplane
        self._max_elements = oip.element_cap(max_message_bytes)
        self._streams = GrpcStreams(dataplane, held)
        self.stream_stats = self._streams.stats

    # -- health and metadata ------------------------------------------------------------
    async def ServerLive(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return pb.ServerLiveResponse(live=self._plane.is_live())

    async def ServerReady(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return pb.ServerReadyResponse(ready=self._plane.is_ready())

    async def ModelReady(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        """As Triton does: an unknown model is not ready (no error), so probes stay simple."""
        return pb.ModelReadyResponse(ready=self._plane.model_ready(request.name, request.version or None))

    async def ServerMetadata(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return pb.ServerMetadataResponse(**oip.server_metadata())

    async def ModelMetadata(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            meta = oip.model_metadata(self._plane, request.name, request.version or None)
        except Exception as exc:
            error = as_serving_error(exc, "describing the model")
            if error.code is Code.INTERNAL:
                log.exception("ModelMetadata for %r failed", request.name)
            await abort(context, error)
        tensor = pb.ModelMetadataResponse.TensorMetadata
        return pb.ModelMetadataResponse(
            name=meta["name"],
            versions=meta["versions"],
            platform=meta["platform"],
            inputs=[tensor(**t) for t in meta["inputs"]],
            outputs=[tensor(**t) for t in meta["outputs"]],
        )

    # -- Triton's extensions (grpc_ext) ----------------------------------------------------
    async def ModelConfig(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        async def make() -> Any:
            return ext.config_response(self._plane, request)

        return await ext.answer(context, "reading the model configuration", make)

    async def ModelStatistics(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        async def make() -> Any:
            return ext.statistics_response(self._plane, request)

        return await ext.answer(context, "reading statistics", make)

    async def RepositoryIndex(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        async def make() -> Any:
            return ext.index_response(self._plane, request)

        return await ext.answer(context, "listing the repository", make)

    async def RepositoryModelLoad(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        await abort(context, ext.refuse_on_inference_port("model loading"))

    async def RepositoryModelUnload(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        await abort(context, ext.refuse_on_inference_port("model unloading"))

    # -- inference ----------------------------------------------------------------------
    async def ModelInfer(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        outcome = await self._call(request, context.invocation_metadata(), context.time_remaining())
        if isinstance(outcome, Failed):
            await abort(context, outcome.error)
        return outcome.value

    async def ModelStreamInfer(
        self, request_iterator: AsyncIterator[Any], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[Any]:
        """Pipelined: up to `STREAM_WINDOW` requests in flight, each answered as soon as it is
        done (completion order; the client matches answers by the echoed `id`). A failed
        request is answered in-stream with `error_message` (and its id) and the stream goes on,
        as Triton's does. A drain stops the reading: what was read is answered, then UNAVAILABLE."""
        metadata = context.invocation_metadata()

        async def answer(request: Any) -> Any:
            return await self._stream_one(request, metadata, context.time_remaining())

        def on_crash(request: Any) -> Any:
            return self._stream_error(request, internal("running the inference").message)

        pipe = self._streams.pipeline(request_iterator, answer, on_crash=on_crash, window=STREAM_WINDOW)
        async for response in answers(context, pipe):
            yield response

    async def _stream_one(self, request: Any, metadata: Any, time_remaining: float | None) -> Any:
        outcome = await self._call(request, metadata, time_remaining)
        if isinstance(outcome, Ok):
            return pb.ModelStreamInferResponse(infer_response=outcome.value)
        return self._stream_error(request, outcome.error.message)

    @staticmethod
    def _stream_error(request: Any, message: str) -> Any:
        echo = pb.ModelInferResponse(
            model_name=request.model_name, model_version=request.model_version, id=request.id
        )
        return pb.ModelStreamInferResponse(error_message=message, infer_response=echo)

    async def _call(
        self, request: Any, metadata: Sequence[tuple[str, str | bytes]] | None, time_remaining: float | None
    ) -> Ok[Any] | Failed:
        """One ModelInferRequest through the call path (ModelInfer and each streamed request)."""

        async def work(infer: Infer) -> Any:
            return await self._answer(request, infer, metadata, time_remaining)

        model, version = request.model_name, request.model_version or None
        return await run_call(self._plane, PROTOCOL, model, version, work)

    async def _answer(
        self,
        request: Any,
        infer: Infer,
        metadata: Sequence[tuple[str, str | bytes]] | None,
        time_remaining: float | None,
    ) -> Any:
        """Decode, check, queue, and encode one ModelInferRequest; raises ServingError."""
        if not request.model_name:
            raise bad("model_name is required: name a model this server serves")
        handle = self._plane.resolve(request.model_name, request.model_version or None)
        deadline = oip.deadline_from(params_of(request.parameters), time_remaining)
        request_id = oip.request_id_of(request.id)
        sig = oip.signature_of(handle)
        inputs = await decode_inputs(request, sig, handle.batch_size, self._max_elements)
        requested = []
        for out in request.outputs:
            if out.parameters:
                oip.check_tensor_params("output", out.name, params_of(out.parameters))
            requested.append(out.name)
        prepared = oip.prepare(
            handle,
            inputs=inputs,
            requested=requested,
            request_id=request_id,
            protocol=PROTOCOL,
            deadline=deadline,
            headers=request_headers(metadata),
        )
        result = await infer(prepared.request)
        outputs = oip.pick_outputs(prepared, result)
        tensor = pb.ModelInferResponse.InferOutputTensor
        return pb.ModelInferResponse(
            model_name=handle.name,
            model_version=result.model_version or handle.version,
            id=request.id,
            outputs=[tensor(name=o.name, datatype=o.datatype, shape=o.array.shape) for o in outputs],
            raw_output_contents=[encode_raw(o.array) for o in outputs],
        )


# TorchServe's own copy of the protocol (its open_inference_grpc.proto): same messages, field
# names and numbers as ours except that its InferParameter lacks double_param (4) and
# uint64_param (5), which Mariner never sends in a response, and no ModelStreamInfer. Its clients
# call this service name, so the same handlers answer under it.
TORCHSERVE_SERVICE_NAME = "org.pytorch.serve.grpc.openinference.GRPCInferenceService"
TORCHSERVE_METHODS = (
    "ServerLive",
    "ServerReady",
    "ModelReady",
    "ServerMetadata",
    "ModelMetadata",
    "ModelInfer",
)


class _Recorder:
    """Passes registrations on to the server and keeps the method handlers it was given."""

    def __init__(self, server: grpc.aio.Server) -> None:
        self._server = server
        self.handlers: dict[str, grpc.RpcMethodHandler] = {}

    def add_generic_rpc_handlers(self, handlers: Any) -> None:
        self._server.add_generic_rpc_handlers(handlers)

    def add_registered_method_handlers(
        self, service: str, handlers: dict[str, grpc.RpcMethodHandler]
    ) -> None:
        self._server.add_registered_method_handlers(service, handlers)
        self.handlers = dict(handlers)


def add_to_server(
    dataplane: oip.OipPlane, server: grpc.aio.Server, *, max_message_bytes: int, held: HeldBytes | None = None
) -> OipServicer:
    """Register GRPCInferenceService on `server`, under our (KServe's) service name and under
    TorchServe's; returns the servicer (tests poke at it)."""
    servicer = OipServicer(dataplane, max_message_bytes=max_message_bytes, held=held)
    parse = ShallowInferRequest.FromString
    recorder = _Recorder(server)
    register(
        recorder,
        pb_grpc.add_GRPCInferenceServiceServicer_to_server,
        servicer,
        {"ModelInfer": parse, "ModelStreamInfer": parse},
        held,
    )
    torchserve = {name: recorder.handlers[name] for name in TORCHSERVE_METHODS}
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(TORCHSERVE_SERVICE_NAME, torchserve),)
    )
    server.add_registered_method_handlers(TORCHSERVE_SERVICE_NAME, torchserve)
    return servicer
