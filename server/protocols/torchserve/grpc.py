"""TorchServe's gRPC inference API (`org.pytorch.serve.grpc.inference.InferenceAPIsService`).

A transport adapter only: it turns `PredictionsRequest`s into `InferRequest`s, hands them to
the DataPlane and turns the `InferResult` or `ServingError` back into gRPC. Status codes come
from `mariner.server.core.errors.STATUS` and nowhere else; anything unexpected becomes INTERNAL with a
sanitized message, because grpc.aio would otherwise answer UNKNOWN with the exception text.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import grpc
from mariner.server.core.errors import STATUS, Code, ServingError, as_serving_error
from mariner.server.core.types import InferRequest, InferResult, ModelInfo, WireProtocol
from mariner.server.protogen import stubs_missing

try:
    from google.protobuf import empty_pb2
    from mariner.server._proto.torchserve import inference_pb2, inference_pb2_grpc
except ModuleNotFoundError as exc:  # pragma: no cover - depends on the build step
    raise stubs_missing(exc) from exc

if TYPE_CHECKING:
    from mariner.server.control.metrics import Metrics

log = logging.getLogger("mariner.grpc.inference")

SERVICE_NAME: str = inference_pb2.DESCRIPTOR.services_by_name["InferenceAPIsService"].full_name
PROTOCOL = WireProtocol.TS_GRPC

# Invocation metadata becomes the handler's request headers. Bounded so a client cannot make
# the server copy megabytes of metadata per request into every batch.
MAX_HEADERS = 64
MAX_HEADER_NAME = 256
MAX_HEADER_VALUE = 8192
# Bytes of a handler's error body carried into the gRPC status details.
MAX_ERROR_DETAIL = 1024


def code_label(code: Code | None) -> str:
    """The `code` label of mariner_requests_total: the HTTP-equivalent status ("200", "404"...).

    The HTTP adapter labels with its status code, so one bounded label set (and one PromQL
    error-rate query) covers both transports; `protocol` tells them apart.
    """
    return "200" if code is None else str(STATUS[code].http)


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


def request_headers(metadata: Sequence[tuple[str, str | bytes]] | None) -> dict[str, str]:
    """Text metadata as a bounded header dict; binary (-bin) entries and overlong ones are dropped."""
    headers: dict[str, str] = {}
    for key, value in metadata or ():
        if len(headers) >= MAX_HEADERS:
            break
        if not isinstance(value, str) or key.endswith("-bin"):
            continue
        if len(key) > MAX_HEADER_NAME or len(value) > MAX_HEADER_VALUE:
            continue
        headers.setdefault(key.lower(), value)
    return headers


def to_infer_request(
    request: inference_pb2.PredictionsRequest,
    *,
    metadata: Sequence[tuple[str, str | bytes]] | None,
    time_remaining: float | None,
) -> InferRequest:
    """The protocol-neutral request: `data` is the `input` map, as TorchServe hands it to handlers."""
    if not request.model_name:
        raise ServingError(Code.INVALID_ARGUMENT, "model_name is required: name a model this server serves")
    deadline = time.monotonic() + time_remaining if time_remaining is not None else None
    return InferRequest(
        model=request.model_name,
        version=request.model_version or None,
        data=dict(request.input),
        protocol=PROTOCOL,
        request_id=uuid.uuid4().hex,
        headers=request_headers(metadata),
        deadline=deadline,
    )


def handler_error(result: InferResult) -> ServingError:
    """A per-request error status the handler set (set_response_status) as a ServingError.

    Stock TorchServe's gRPC frontend ignores that status and answers OK with the error body;
    Mariner maps it (400 -> INVALID_ARGUMENT, 503 -> UNAVAILABLE, ...) so gRPC clients see the
    failure in the status, with the handler's own message (bounded) as the details.
    """
    text = result.body[:MAX_ERROR_DETAIL].decode("utf-8", errors="replace").strip()
    message = text or result.phrase or f"the model's handler answered with status {result.status}"
    return ServingError.from_http_status(result.status, message)


class InferenceServicer(inference_pb2_grpc.InferenceAPIsServiceServicer):
    """Ping, Predictions and StreamPredictions over the DataPlane; StreamPredictions2 is refused."""

    def __init__(self, dataplane: InferencePlane) -> None:
        self._plane = dataplane
        self._metrics = dataplane.metrics

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
        result = await self._predict(request, context, "Predictions")
        return inference_pb2.PredictionResponse(prediction=result.body)

    async def StreamPredictions(
        self, request: inference_pb2.PredictionsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[inference_pb2.PredictionResponse]:
        """Server streaming. Mariner handlers do not stream yet, so the answer is one message.

        That is what stock TorchServe sends for a non-streaming handler too: the single
        response, then the end of the stream.
        """
        result = await self._predict(request, context, "StreamPredictions")
        yield inference_pb2.PredictionResponse(prediction=result.body)

    async def StreamPredictions2(
        self,
        request_iterator: AsyncIterator[inference_pb2.PredictionsRequest],
        context: grpc.aio.ServicerContext,
    ) -> None:
        """Sequence (stateful) streaming needs sequence-aware handlers, which Mariner lacks."""
        await context.abort(
            STATUS[Code.UNIMPLEMENTED].grpc,
            "StreamPredictions2 (bidirectional sequence streaming) is not supported by this server; "
            "use Predictions or StreamPredictions",
        )

    async def _predict(
        self, request: inference_pb2.PredictionsRequest, context: grpc.aio.ServicerContext, rpc: str
    ) -> InferResult:
        """Run one prediction and record it; aborts the call with the mapped status on failure."""
        start = time.perf_counter()
        model, version = self._labels(request.model_name, request.model_version or None)
        try:
            req = to_infer_request(
                request, metadata=context.invocation_metadata(), time_remaining=context.time_remaining()
            )
            result = await self._plane.infer(req)
            if result.status >= 400:
                raise handler_error(result)
        except asyncio.CancelledError:  # the client went away: record it, let grpc finish the call
            self._observe(model, version, code_label(Code.CANCELLED), time.perf_counter() - start)
            raise
        except ServingError as exc:
            error = exc
        except Exception as exc:
            log.exception("%s for model %r failed unexpectedly", rpc, model)
            error = as_serving_error(exc, "running the prediction")
        else:
            self._observe(model, version, code_label(None), time.perf_counter() - start)
            return result
        self._observe(model, version, code_label(error.code), time.perf_counter() - start)
        await context.abort(STATUS[error.code].grpc, error.message)
        raise AssertionError("unreachable: context.abort always raises")

    def _labels(self, model: str, version: str | None) -> tuple[str, str]:
        """Bounded label values: a loaded model's name and version, else "unknown"."""
        if not model:
            return "unknown", "unknown"
        try:
            return self._plane.known_label(model, version)
        except Exception:
            log.exception("metric label lookup failed")
            return "unknown", "unknown"

    def _observe(self, model: str, version: str, code: str, seconds: float) -> None:
        protocol = PROTOCOL.value
        self._metrics.requests.labels(model, version, protocol, code).inc()
        self._metrics.request_duration.labels(model, version, protocol).observe(seconds)


def add_to_server(dataplane: InferencePlane, server: grpc.aio.Server) -> InferenceServicer:
    """Register the inference service on `server`; returns the servicer (tests poke at it)."""
    servicer = InferenceServicer(dataplane)
    inference_pb2_grpc.add_InferenceAPIsServiceServicer_to_server(servicer, server)
    return servicer
