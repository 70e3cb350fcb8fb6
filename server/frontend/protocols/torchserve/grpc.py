"""TorchServe's gRPC inference API (`org.pytorch.serve.grpc.inference.InferenceAPIsService`).

A transport adapter only: it turns `PredictionsRequest`s into `InferRequest`s, hands them to
the DataPlane and turns the `InferResult` or `ServingError` back into gRPC. Status codes come
from `mariner.server.contracts.errors.STATUS` and nowhere else; anything unexpected becomes INTERNAL with a
sanitized message, because grpc.aio would otherwise answer UNKNOWN with the exception text.

A handler's intermediate answers (`send_intermediate_predict_response`) are messages of their
own on the streaming RPCs, as TorchServe sends them: `StreamPredictions` writes each part, then
the final result, then ends; `StreamPredictions2` writes each part ahead of the request's own
answer (with its `sequence_id`). Unary `Predictions` answers once: the parts joined in front of
the final body (`frontend.streams`), the bytes an HTTP client reading the whole answer gets.
TorchServe answers the first part there, then fails the worker thread on the next part.

A request's decoding is `grpc_request`'s; the intermediate answers' sinks are `grpc_parts`'.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any, Protocol

import grpc
from google.protobuf import empty_pb2

from mariner.server.common.grpc_decoding import register
from mariner.server.common.grpc_status import abort, torchserve_grpc
from mariner.server.common.grpc_stubs import inference_pb2, inference_pb2_grpc
from mariner.server.common.handler_status import answer_text
from mariner.server.common.held_bytes import HeldBytes
from mariner.server.common.request_ids import new_request_id
from mariner.server.contracts.errors import HANDLER_EXCEPTION, Code, ServingError, internal
from mariner.server.contracts.types import InferRequest, InferResult, ModelInfo
from mariner.server.frontend.protocols.call import Failed, Infer, run_call
from mariner.server.frontend.protocols.grpc_stream import GrpcStreams, answers
from mariner.server.frontend.protocols.torchserve import stream2
from mariner.server.frontend.protocols.torchserve.grpc_parts import Emit, PartEmitter, PendingParts
from mariner.server.frontend.protocols.torchserve.grpc_request import (
    PROTOCOL,
    ShallowPredictionsRequest,
    input_map,
    request_headers,
    to_infer_request,
)
from mariner.server.frontend.streams import STREAMS

if TYPE_CHECKING:
    from mariner.server.common.metrics import Metrics

log = logging.getLogger("mariner.grpc.inference")

SERVICE_NAME: str = inference_pb2.DESCRIPTOR.services_by_name["InferenceAPIsService"].full_name


class InferencePlane(Protocol):
    """The slice of the DataPlane this adapter needs (the real one and test fakes provide it)."""

    metrics: Metrics

    async def infer(self, req: InferRequest) -> InferResult: ...

    def models(self) -> list[ModelInfo]: ...

    def is_ready(self) -> bool: ...

    def known_label(self, model: str, version: str | None) -> tuple[str, str]: ...


def health_json(healthy: bool) -> str:
    """TorchServe's Ping body: its StatusResponse as pretty JSON ({"status": "Healthy"})."""
    return json.dumps({"status": "Healthy" if healthy else "Unhealthy"}, indent=2)


class InferenceServicer(inference_pb2_grpc.InferenceAPIsServiceServicer):
    """Ping, Predictions, StreamPredictions and (pipelined) StreamPredictions2 over the DataPlane."""

    def __init__(self, dataplane: InferencePlane, held: HeldBytes | None = None) -> None:
        self._plane = dataplane
        self._streams = GrpcStreams(dataplane, held)
        self.stream_stats = self._streams.stats

    async def Ping(self, request: empty_pb2.Empty, context: grpc.aio.ServicerContext) -> Any:
        """Health as TorchServe reports it: always status OK, the verdict is in the JSON body."""
        try:
            healthy = self._plane.is_ready()
        except Exception:
            log.exception("readiness check failed during Ping")
            healthy = False
        return inference_pb2.TorchServeHealthResponse(health=health_json(healthy))

    async def Predictions(
        self, request: inference_pb2.PredictionsRequest, context: grpc.aio.ServicerContext
    ) -> inference_pb2.PredictionResponse:
        """One request, one answer: `prediction` carries the handler's bytes unchanged."""
        result = await self._predict(request, context)
        return inference_pb2.PredictionResponse(prediction=result.body)

    async def StreamPredictions(
        self, request: inference_pb2.PredictionsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[inference_pb2.PredictionResponse]:
        """Server streaming: one message per intermediate answer the handler sends, then the
        final result, then the end (a handler that sends none: the one message, as TorchServe).

        The parts are written while the request still waits for its final result; more than
        `MAX_HELD_BYTES` of them waiting for a client that does not read ends the call
        RESOURCE_EXHAUSTED. A failure after parts were written ends it with the failure's status.
        """
        request_id = new_request_id()
        parts = PendingParts()
        STREAMS[request_id] = parts
        predicting = asyncio.ensure_future(self._predict(request, context, request_id=request_id))
        predicting.add_done_callback(parts.predicted)
        try:
            while True:
                while parts.queue:
                    part = parts.queue.popleft()
                    parts.held -= len(part.body)
                    yield inference_pb2.PredictionResponse(prediction=part.body)
                if parts.overflow:
                    predicting.cancel()
                    await abort(context, ServingError(Code.RESOURCE_EXHAUSTED, parts.overflow))
                if predicting.done():
                    break
                parts.wake.clear()
                await parts.wake.wait()
            result = predicting.result()  # an abort inside it ends the call here
        finally:
            STREAMS.pop(request_id, None)
            predicting.cancel()
        yield inference_pb2.PredictionResponse(prediction=result.body)

    async def StreamPredictions2(
        self,
        request_iterator: AsyncIterator[inference_pb2.PredictionsRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[inference_pb2.PredictionResponse]:
        """Bidirectional sequence streaming, pipelined: up to `WINDOW` requests in flight, each
        answered as soon as it is done, failures in-stream (TorchServe's rules: `stream2`).

        Steps of one sequence id run one after another in arrival order; different ids run
        concurrently. A drain stops the reading: what was read is answered, then UNAVAILABLE.
        """
        # The stream's metadata is the same for every message: its headers are read once.
        kept = {
            k: v
            for k, v in request_headers(context.invocation_metadata()).items()
            if k not in stream2.SEQUENCE_HEADERS
        }

        async def answer(request: Any) -> inference_pb2.PredictionResponse:
            return await self._stream2_one(request, kept, context.time_remaining(), pipe.emit)

        def key(request: Any) -> str | None:
            return request.sequence_id or None  # a generated id is new each time: no order to keep

        def on_crash(request: Any) -> inference_pb2.PredictionResponse:
            return self._stream2_failure(request.sequence_id, internal("running the prediction"))

        pipe = self._streams.pipeline(request_iterator, answer, on_crash=on_crash, key=key)
        async for response in answers(context, pipe):
            yield response

    async def _stream2_one(
        self,
        request: Any,
        kept: dict[str, str],
        time_remaining: float | None,
        emit: Emit,
    ) -> inference_pb2.PredictionResponse:
        """One StreamPredictions2 request through the call path (counted as a Predictions call);
        the handler's intermediate answers are `emit`ted ahead of its own."""
        echo = request.sequence_id

        async def work(infer: Infer) -> tuple[str, InferResult]:
            # the input map is read for the start flag only when there is no id (parsed once more below)
            inputs = input_map(request) if not request.sequence_id else {}
            seq = stream2.sequence_of(request.sequence_id, request.model_name, inputs)
            headers = {**kept, **seq.headers}
            req = to_infer_request(request, metadata=None, time_remaining=time_remaining, headers=headers)
            sink = PartEmitter(emit, seq.sequence_id)
            STREAMS[req.request_id] = sink
            try:
                result = await infer(req)
            finally:
                STREAMS.pop(req.request_id, None)
            if sink.overflow:
                raise ServingError(Code.RESOURCE_EXHAUSTED, sink.overflow)
            return seq.sequence_id, result

        model, version = request.model_name, request.model_version or None
        outcome = await run_call(self._plane, PROTOCOL, model, version, work, what="running the prediction")
        if isinstance(outcome, Failed):
            return self._stream2_failure(echo, outcome.error, outcome.answer)
        sequence_id, result = outcome.value
        return inference_pb2.PredictionResponse(prediction=result.body, sequence_id=sequence_id)

    @staticmethod
    def _stream2_failure(
        sequence_id: str, error: ServingError, answer: InferResult | None = None
    ) -> inference_pb2.PredictionResponse:
        response = inference_pb2.PredictionResponse(status=stream2.in_stream_status(error, answer))
        if sequence_id:
            response.sequence_id = sequence_id
        return response

    async def _predict(
        self,
        request: inference_pb2.PredictionsRequest,
        context: grpc.aio.ServicerContext,
        *,
        request_id: str | None = None,
    ) -> InferResult:
        """Run one prediction through the call path; aborts the call with the mapped status on failure.

        A handler's own error status becomes the gRPC status (stock TorchServe answers OK with
        the error body instead), and the handler's body itself, bounded, is the details: over
        both TorchServe transports the client reads the handler's answer unchanged.
        """

        async def work(infer: Infer) -> InferResult:
            req = to_infer_request(
                request,
                metadata=context.invocation_metadata(),
                time_remaining=context.time_remaining(),
                request_id=request_id,
            )
            return await infer(req)

        model, version = request.model_name, request.model_version or None
        outcome = await run_call(self._plane, PROTOCOL, model, version, work, what="running the prediction")
        if isinstance(outcome, Failed):
            ts = outcome.error.torchserve
            if ts is not None and ts.type == HANDLER_EXCEPTION:  # a handler's failure: as TorchServe's
                status, description = torchserve_grpc(ts)
                await context.abort(status, description)
            details = answer_text(outcome.answer) if outcome.answer is not None else ""
            await abort(context, outcome.error, details)
        return outcome.value


def add_to_server(
    dataplane: InferencePlane, server: grpc.aio.Server, held: HeldBytes | None = None
) -> InferenceServicer:
    """Register the inference service on `server`, its requests held in the frontend's budget
    `held` when given; returns the servicer (tests poke at it)."""
    servicer = InferenceServicer(dataplane, held)
    parse = ShallowPredictionsRequest.FromString
    register(
        server,
        inference_pb2_grpc.add_InferenceAPIsServiceServicer_to_server,
        servicer,
        {"Predictions": parse, "StreamPredictions": parse, "StreamPredictions2": parse},
        held,
    )
    return servicer
