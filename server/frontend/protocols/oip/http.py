"""The Open Inference Protocol's REST API (`/v2/...`), mounted on the inference app (8080).

Routes: GET /v2 (server metadata), /v2/health/live, /v2/health/ready,
/v2/models/{m}[/versions/{v}] (model metadata), .../ready, and POST .../infer with JSON
tensors and Triton's binary tensor data extension, exactly as tritonclient's HTTP client
speaks it (binary is its default):

- request: `Inference-Header-Content-Length: n` says the first n bytes of the body are the
  JSON; each input with `parameters.binary_data_size` takes its bytes, in input order, from
  what follows. Without the header the whole body is JSON and inputs carry `data`.
- response: an output is binary when its request entry says `parameters.binary_data: true`,
  or, when it says nothing, when the request-level `parameters.binary_data_output` is true
  (tritonclient sets it when it requests no outputs). Binary outputs carry
  `parameters.binary_data_size` instead of `data` and follow the JSON, in output order, with
  `Inference-Header-Content-Length` on the response; otherwise the answer is plain JSON.
- errors: `{"error": message}` (what tritonclient reads), status from `contracts.errors.STATUS`,
  for every `/v2` path: an unknown one is a 404 and a wrong method a 405 in that shape too.
- Triton's statistics, configuration and repository extensions: `http_ext`.
- `Content-Encoding: gzip|deflate` request bodies are inflated (bounded by the body limit);
  responses are never compressed, which the protocol allows.

Decoding and checks are those of `mariner.server.common.oip_codec`, shared with the gRPC adapter.

A model served with TorchServe's `service_envelope=kservev2` that declares no tensor signature
is answered as TorchServe answers `/v2/models/{m}/infer`: the request body goes to the handler
(TorchServe's KServe v2 envelope decodes it and shapes the answer) and its answer is the
response byte for byte (`torchserve.http.Predictions`, errors in TorchServe's shape).
"""

from __future__ import annotations

import logging
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from mariner.server.common import oip_codec as oip
from mariner.server.common.http_common import (
    DEFAULT_MAX_HEADERS,
    JSON,
    NOT_READY_STATUS,
    compact_json_response,
    error_json_response,
    make_guard,
    offload_if_large,
    read_body,
    request_headers,
)
from mariner.server.contracts.errors import ServingError
from mariner.server.contracts.types import InferResult, WireProtocol
from mariner.server.frontend.protocols.call import CANCELLED_STATUS, Failed, Infer, run_call
from mariner.server.frontend.protocols.http_call import infer_unless_client_gone
from mariner.server.frontend.protocols.oip.rest_codec import (
    HEADER_LENGTH,
    ParsedInfer,
    encode_response,
    header_length,
    inflate,
)
from mariner.server.frontend.protocols.torchserve.http import Predictions

log = logging.getLogger("mariner.http.oip")

PROTOCOL = WireProtocol.OIP_HTTP
_OCTETS = "application/octet-stream"
# Outputs with at least this many elements are encoded on a worker thread.
_OFFLOAD_ELEMENTS = 64 * 1024


_guarded = make_guard("OIP", log, error_json_response)


def prepared_infer(handle: Any, parsed: ParsedInfer, headers: dict[str, str]) -> oip.Prepared:
    """The checked request a decoded infer call makes (both ways an infer call arrives:
    `routes` and `frontend.protocols.prediction_path`)."""
    return oip.prepare(
        handle,
        inputs=parsed.inputs,
        requested=parsed.requested,
        request_id=oip.request_id_of(parsed.client_id),
        protocol=PROTOCOL,
        deadline=oip.deadline_from(parsed.params, None),
        headers=headers,
    )


def answer_outputs(
    prepared: oip.Prepared, parsed: ParsedInfer, result: InferResult
) -> tuple[list[oip.OutputTensor], dict[str, Any]]:
    """The outputs an answer carries and its JSON header fields."""
    outputs = oip.pick_outputs(prepared, result)
    handle = prepared.handle
    header: dict[str, Any] = {
        "model_name": handle.name,
        "model_version": result.model_version or handle.version,
    }
    if parsed.client_id:
        header["id"] = parsed.client_id
    return outputs, header


def large_outputs(outputs: list[oip.OutputTensor]) -> bool:
    """Whether encoding `outputs` belongs on a worker thread (`_OFFLOAD_ELEMENTS`)."""
    return sum(o.array.size for o in outputs) >= _OFFLOAD_ELEMENTS


def infer_response(content: bytes, json_length: int | None) -> Response:
    """An infer call's answer: plain JSON, or JSON and binary parts (module docstring)."""
    if json_length is None:
        return Response(content, 200, media_type=JSON)
    return Response(content, 200, {"inference-header-content-length": str(json_length)}, media_type=_OCTETS)


def failed_response(outcome: Failed) -> Response:
    """What a failed infer call is answered with."""
    if outcome.cancelled:
        return Response(status_code=CANCELLED_STATUS)  # nobody reads it
    return error_json_response(outcome.error, outcome.http_status)


def through_envelope(dataplane: oip.OipPlane, model: str, version: str | None) -> bool:
    """A model with a TorchServe service_envelope (kservev2) and no tensor signature of its own:
    its handler answers /infer through the envelope, as on TorchServe (module docstring)."""
    try:
        handle = dataplane.resolve(model, version)
    except ServingError:
        return False
    sig = handle.signature
    return bool(getattr(handle, "envelope", None)) and (sig is None or not sig.inputs)


# -- routes -----------------------------------------------------------------------------------
def routes(
    dataplane: oip.OipPlane, *, max_body_bytes: int, max_headers: int = DEFAULT_MAX_HEADERS
) -> list[Route]:
    """The /v2 routes over `dataplane`; `max_body_bytes` bounds a request (inflated) body."""
    max_elements = oip.element_cap(max_body_bytes)

    async def server_metadata(request: Request) -> Response:
        return compact_json_response(oip.server_metadata())

    async def live(request: Request) -> Response:
        ok = dataplane.is_live()
        return compact_json_response({"live": ok}, 200 if ok else NOT_READY_STATUS)

    async def ready(request: Request) -> Response:
        ok = dataplane.is_ready()
        return compact_json_response({"ready": ok}, 200 if ok else NOT_READY_STATUS)

    async def model_metadata(request: Request) -> Response:
        p = request.path_params
        return compact_json_response(oip.model_metadata(dataplane, p["model"], p.get("version")))

    async def model_ready(request: Request) -> Response:
        p = request.path_params
        handle = dataplane.resolve(p["model"], p.get("version"))  # unknown: 404
        ok = dataplane.model_ready(handle.name, handle.version)
        return compact_json_response({"name": handle.name, "ready": ok}, 200 if ok else NOT_READY_STATUS)

    async def run_infer(request: Request, infer: Infer) -> Response:
        p = request.path_params
        body = await read_body(request, max_body_bytes)
        body = inflate(body, request.headers.get("content-encoding", "").strip().lower(), max_body_bytes)
        head_length = header_length(request.headers.get(HEADER_LENGTH), len(body))
        handle = dataplane.resolve(p["model"], p.get("version"))
        sig = oip.signature_of(handle)
        parsed = await offload_if_large(
            len(body), ParsedInfer, body, head_length, max_elements, sig, handle.batch_size
        )
        prepared = prepared_infer(handle, parsed, request_headers(request, max_headers))
        result = await infer(prepared.request)
        outputs, header = answer_outputs(prepared, parsed, result)
        if large_outputs(outputs):  # the fast path's route decides the same way
            return infer_response(*await run_in_threadpool(encode_response, outputs, parsed, header))
        return infer_response(*encode_response(outputs, parsed, header))

    predictions = Predictions(dataplane, max_body_bytes=max_body_bytes, max_headers=max_headers)

    async def infer(request: Request) -> Response:
        p = request.path_params
        if through_envelope(dataplane, p["model"], p.get("version")):
            return await predictions.answer(request, p["model"], p.get("version"), protocol=PROTOCOL)
        outcome = await run_call(
            dataplane,
            PROTOCOL,
            p["model"],
            p.get("version"),
            lambda infer: run_infer(request, infer),
            infer=lambda req: infer_unless_client_gone(dataplane, req, request.scope, request.receive),
        )
        return outcome.value if not isinstance(outcome, Failed) else failed_response(outcome)

    from mariner.server.common import triton_ext_http as http_ext

    get = ["GET"]
    model = "/v2/models/{model}"
    versioned = "/v2/models/{model}/versions/{version}"
    # The extensions first: /v2/models/stats is statistics, not the metadata of a model "stats".
    own = http_ext.inference_routes(dataplane) + [
        Route("/v2", _guarded("reading server metadata", server_metadata), methods=get),
        Route("/v2/health/live", _guarded("checking liveness", live), methods=get),
        Route("/v2/health/ready", _guarded("checking readiness", ready), methods=get),
        Route(model, _guarded("reading model metadata", model_metadata), methods=get),
        Route(versioned, _guarded("reading model metadata", model_metadata), methods=get),
        Route(f"{model}/ready", _guarded("checking model readiness", model_ready), methods=get),
        Route(f"{versioned}/ready", _guarded("checking model readiness", model_ready), methods=get),
        Route(f"{model}/infer", infer, methods=["POST"]),
        Route(f"{versioned}/infer", infer, methods=["POST"]),
    ]
    return [*own, http_ext.fallback(own)]
