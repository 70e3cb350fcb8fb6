"""KServe's v1 REST protocol on the inference port, as TorchServe serves it behind KServe.

TorchServe documents these as its KServe Inference and Explanations APIs; KServe's Python SDK
(`InferenceRESTClient` with protocol "v1") speaks them. Routes:

- `GET /` -> `{"status": "alive"}` (the SDK's v1 liveness check);
- `GET /v1/models` -> `{"models": [name, ...]}`;
- `GET /v1/models/{m}` -> `{"name": m, "ready": true}`, or 503 with `"ready": false` (what
  KServe answers and the SDK reads as not ready), 404 for a model not served;
- `POST /v1/models/{m}:predict` with `{"instances": [...]}` -> `{"predictions": [...]}`;
- `POST /v1/models/{m}:explain` with `{"instances": [...]}` -> `{"explanations": [...]}`.

Each instance is one request to the handler, the way TorchServe's kserve envelope unwraps
`instances` into the handler's rows: an instance that is a JSON object is the handler's row
itself (`{"data": ...}` reaches the handler as it would through the envelope); any other value
arrives as `{"body": value}`, what a /predictions JSON body gives. The requests go through the
batcher together, so a request's instances share batches with everyone else's. Explanations
carry the request header `explain: True` (and predictions `explain: False`), as TorchServe's
frontend sets it, so BaseHandler-style handlers take their `explain_handle` path.

Each handler answer that is JSON is decoded into the list; text stays text; other bytes become
`{"b64": ...}`. The call fails as a whole when any instance fails (KServe v1 has no per-instance
error): `{"error": message}` with the status from `mariner.server.contracts.errors.STATUS`.
Versions do not exist in v1: the default version answers.

A model served with TorchServe's `service_envelope` (config.properties: `kserve`, `kservev2`)
is answered as TorchServe answers it: the request body goes to the handler whole (the envelope
unwraps `instances` and wraps the answer itself), and the handler's answer is the response, byte
for byte (`torchserve.http.Predictions`), errors in TorchServe's shape.
"""

from __future__ import annotations

import asyncio
import base64
import logging
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from mariner.server.common import json_body
from mariner.server.common.http_common import (
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_HEADERS,
    JSON,
    NOT_READY_STATUS,
    compact_json,
    compact_json_response,
    error_json_response,
    make_guard,
    offload_if_large,
    read_body,
    request_headers,
)
from mariner.server.common.request_ids import new_request_id
from mariner.server.contracts.errors import Code, ServingError
from mariner.server.contracts.types import InferRequest, InferResult, WireProtocol
from mariner.server.frontend.protocols.call import CANCELLED_STATUS, Failed, Infer, run_call
from mariner.server.frontend.protocols.http_call import note_caller
from mariner.server.frontend.protocols.torchserve.http import Predictions, enveloped

if TYPE_CHECKING:
    from mariner.server.frontend.dataplane import DataPlane

log = logging.getLogger("mariner.http.kserve")

PROTOCOL = WireProtocol.KSERVE_HTTP
# The header TorchServe's frontend sets and BaseHandler._is_explain reads (request 0 of a batch).
EXPLAIN_HEADER = "explain"
# Instances in one request: each becomes a queued request, so the count is bounded like a body.
MAX_INSTANCES = 1024


_guarded = make_guard("KServe v1", log, error_json_response)


def parse_instances(body: bytes) -> list[Any]:
    """The request's `instances`, checked: a JSON object whose `instances` is a non-empty list."""
    if not body:
        raise ServingError(Code.INVALID_ARGUMENT, 'empty body: send {"instances": [...]}')
    try:
        doc = json_body.loads(body)
    except ValueError as exc:
        raise ServingError(Code.INVALID_ARGUMENT, f"request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise ServingError(Code.INVALID_ARGUMENT, "request body is JSON nested too deeply") from None
    instances = doc.get("instances") if isinstance(doc, dict) else None
    if not isinstance(instances, list) or not instances:
        raise ServingError(
            Code.INVALID_ARGUMENT,
            'the KServe v1 request must be a JSON object {"instances": [...]} with at least one instance',
        )
    if len(instances) > MAX_INSTANCES:
        raise ServingError(
            Code.INVALID_ARGUMENT,
            f"{len(instances)} instances in one request; at most {MAX_INSTANCES} are allowed",
        )
    return instances


def handler_row(instance: Any) -> dict[str, Any]:
    """What the handler receives for one instance (see the module docstring)."""
    return instance if isinstance(instance, dict) else {"body": instance}


def answer_value(result: InferResult) -> Any:
    """One handler answer as a JSON value of the response list."""
    body = result.body
    try:
        return json_body.loads(body)
    except ValueError:
        pass
    try:
        return body.decode("utf-8")
    except UnicodeDecodeError:
        return {"b64": base64.b64encode(body).decode("ascii")}


def routes(
    dataplane: DataPlane,
    *,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    max_headers: int = DEFAULT_MAX_HEADERS,
) -> list[Route]:
    """KServe v1's routes; `max_body_bytes` and `max_headers` as for TorchServe's /predictions."""

    async def live(request: Request) -> Response:
        return compact_json_response({"status": "alive"})

    async def list_models(request: Request) -> Response:
        names = sorted({info.name for info in dataplane.models()})
        return compact_json_response({"models": names})

    async def model_ready(request: Request) -> Response:
        model: str = request.path_params["model"]
        dataplane.resolve(model)  # 404 for a model not served
        ready = dataplane.model_ready(model)
        return compact_json_response({"name": model, "ready": ready}, 200 if ready else NOT_READY_STATUS)

    predictions = Predictions(dataplane, max_body_bytes=max_body_bytes, max_headers=max_headers)

    def call(explain: bool) -> Any:
        key = "explanations" if explain else "predictions"

        async def endpoint(request: Request) -> Response:
            model: str = request.path_params["model"]
            if enveloped(dataplane, model):
                return await predictions.answer(request, model, None, explain=explain, protocol=PROTOCOL)
            request_id = new_request_id()

            async def work(infer: Infer) -> Response:
                body = await read_body(request, max_body_bytes)
                instances = await offload_if_large(len(body), parse_instances, body)
                headers = request_headers(request, max_headers)
                headers[EXPLAIN_HEADER] = "True" if explain else "False"
                note_caller(request.scope)
                share = len(body) // max(1, len(instances))
                reqs = [
                    InferRequest(
                        model=model,
                        version=None,
                        data=handler_row(instance),
                        protocol=PROTOCOL,
                        request_id=f"{request_id}-{i}" if len(instances) > 1 else request_id,
                        headers=headers,
                        size=share,
                    )
                    for i, instance in enumerate(instances)
                ]
                tasks = [asyncio.ensure_future(infer(r)) for r in reqs]
                try:
                    results = await asyncio.gather(*tasks)
                finally:  # the first failure answers the call: the other instances stop queueing
                    for task in tasks:
                        task.cancel()
                out = {key: [answer_value(r) for r in results]}
                return Response(compact_json(out), 200, {"x-request-id": request_id}, media_type=JSON)

            outcome = await run_call(
                dataplane, PROTOCOL, model, None, work, what=f"answering a KServe v1 {key} request"
            )
            if not isinstance(outcome, Failed):
                return outcome.value
            if outcome.cancelled:
                return Response(status_code=CANCELLED_STATUS)
            return error_json_response(outcome.error, outcome.http_status)

        return endpoint

    get = ["GET"]
    return [
        Route("/", _guarded("checking liveness", live), methods=get),
        Route("/v1/models", _guarded("listing models", list_models), methods=get),
        Route("/v1/models/{model}:predict", call(explain=False), methods=["POST"]),
        Route("/v1/models/{model}:explain", call(explain=True), methods=["POST"]),
        Route("/v1/models/{model}", _guarded("checking model readiness", model_ready), methods=get),
    ]
