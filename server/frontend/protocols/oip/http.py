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

import json
import logging
import zlib
from typing import Any

import numpy as np
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from mariner.server.common import oip_codec as oip
from mariner.server.common.http_common import (
    DEFAULT_MAX_HEADERS,
    JSON,
    NOT_READY_STATUS,
    BodyTooLarge,
    compact_json,
    compact_json_response,
    error_json_response,
    make_guard,
    offload_if_large,
    read_body,
    request_headers,
)
from mariner.server.contracts.errors import ServingError
from mariner.server.contracts.tensors import ModelSignature, bad, decode_raw, decode_values, encode_raw
from mariner.server.contracts.types import InferResult, WireProtocol
from mariner.server.frontend.protocols.call import CANCELLED_STATUS, Failed, Infer, run_call
from mariner.server.frontend.protocols.http_call import infer_unless_client_gone
from mariner.server.frontend.protocols.torchserve.http import Predictions

log = logging.getLogger("mariner.http.oip")

PROTOCOL = WireProtocol.OIP_HTTP
HEADER_LENGTH = "inference-header-content-length"
_OCTETS = "application/octet-stream"
# Outputs with at least this many elements are encoded on a worker thread.
_OFFLOAD_ELEMENTS = 64 * 1024


_guarded = make_guard("OIP", log, error_json_response)


# -- request decoding -------------------------------------------------------------------------
def inflate(body: bytes, encoding: str, limit: int) -> bytes:
    """A gzip/deflate request body, inflated to at most `limit` bytes (a zip bomb is a 413)."""
    if encoding in ("", "identity"):
        return body
    if encoding not in ("gzip", "deflate"):
        raise bad(f"Content-Encoding {encoding!r} is not supported; use gzip, deflate or none")
    inflater = zlib.decompressobj(16 + zlib.MAX_WBITS if encoding == "gzip" else zlib.MAX_WBITS)
    try:
        out = inflater.decompress(body, limit + 1)
    except zlib.error as exc:
        raise bad(f"request body is not valid {encoding} data: {exc}") from None
    if len(out) > limit:
        raise BodyTooLarge(limit)
    if not inflater.eof:
        raise bad(f"request body is truncated {encoding} data")
    return out


def header_length(value: str | None, size: int) -> int | None:
    if value is None:
        return None
    digits = value.strip()
    if not (digits.isascii() and digits.isdigit()) or int(digits) > size:
        raise bad(
            f"Inference-Header-Content-Length must be a byte count within the {size}-byte body, got {value!r}"
        )
    return int(value)


def _check_json_values(name: str, datatype: str, data: Any) -> None:
    """JSON BYTES elements must be strings: anything else would become bytes(int) garbage."""
    if datatype != "BYTES":
        return
    stack = [data]
    while stack:
        item = stack.pop()
        if isinstance(item, list):
            stack.extend(item)
        elif not isinstance(item, str):
            raise bad(f"input {name!r}: BYTES data in JSON must be strings, got {type(item).__name__}")


def _object(value: Any, what: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise bad(f"{what} must be a JSON object")
    return value


class ParsedInfer:
    """A decoded REST infer request: tensors, requested outputs and their binary choices.

    Each input's header (datatype, shape, rows, element count) is checked against `sig` before
    its `data` or binary part is converted; conversion is numpy's, one call per tensor.
    """

    def __init__(
        self, body: bytes, header_length: int | None, max_elements: int, sig: ModelSignature, max_rows: int
    ) -> None:
        split = len(body) if header_length is None else header_length
        head = body[:split]
        # No `true`/`false` literal in the JSON text: no value can be a boolean, so the walk that
        # refuses JSON true as 1.0 is skipped (a C-speed byte search instead of one per element).
        self._may_hold_bools = b"true" in head or b"false" in head
        self._sig, self._max_rows = sig, max_rows
        try:
            doc = json.loads(head)
        except ValueError as exc:
            raise bad(f"inference request is not valid JSON: {exc}") from None
        except RecursionError:
            raise bad("inference request is JSON nested too deeply") from None
        doc = _object(doc, "the inference request")
        client_id = doc.get("id", "")
        if not isinstance(client_id, str):
            raise bad("request 'id' must be a string")
        self.client_id = client_id
        self.params = _object(doc.get("parameters"), "request 'parameters'")
        self.binary_default = self.params.get("binary_data_output") is True
        self.inputs = self._inputs(doc.get("inputs"), memoryview(body)[split:], max_elements)
        self.requested: list[str] = []
        self.binary: dict[str, bool] = {}
        outputs = doc.get("outputs") or []
        if not isinstance(outputs, list):
            raise bad("request 'outputs' must be a list")
        for out in outputs:
            out = _object(out, "each requested output")
            name = out.get("name")
            if not isinstance(name, str) or not name:
                raise bad("each requested output needs a 'name'")
            params = _object(out.get("parameters"), f"output {name!r} 'parameters'")
            oip.check_tensor_params("output", name, params)
            self.requested.append(name)
            if "binary_data" in params:
                self.binary[name] = params["binary_data"] is True

    def _inputs(
        self, raw_inputs: Any, binary: memoryview, max_elements: int
    ) -> dict[str, tuple[str, np.ndarray]]:
        if not isinstance(raw_inputs, list) or not raw_inputs:
            raise bad("request 'inputs' must be a non-empty list of tensors")
        decoded: dict[str, tuple[str, np.ndarray]] = {}
        pos = 0
        for entry in raw_inputs:
            entry = _object(entry, "each input")
            name, datatype, shape = entry.get("name"), entry.get("datatype"), entry.get("shape")
            if not isinstance(name, str) or not name:
                raise bad("each input needs a 'name'")
            if name in decoded:
                raise bad(f"input {name!r} is given more than once")
            if not isinstance(datatype, str):
                raise bad(f"input {name!r} needs a 'datatype' string")
            if not isinstance(shape, list) or not all(
                isinstance(d, int) and not isinstance(d, bool) for d in shape
            ):
                raise bad(f"input {name!r} needs a 'shape' list of integers")
            datatype = datatype.upper()
            dims = oip.check_header(name, datatype, shape, max_elements)
            params = _object(entry.get("parameters"), f"input {name!r} 'parameters'")
            oip.check_tensor_params("input", name, params)
            oip.check_input(self._sig, self._max_rows, name, datatype, dims)
            size = params.get("binary_data_size")
            if size is not None:
                if isinstance(size, bool) or not isinstance(size, int) or size < 0:
                    raise bad(f"input {name!r}: binary_data_size must be a non-negative integer")
                if pos + size > len(binary):
                    raise bad(
                        f"input {name!r}: binary_data_size {size} runs past the body "
                        f"({len(binary) - pos} binary bytes left)"
                    )
                chunk = binary[pos : pos + size]
                pos += size
                raw = bytes(chunk) if datatype == "BYTES" else chunk
                # A memoryview only for fixed-size types, which decode_raw's np.frombuffer reads as is.
                decoded[name] = (datatype, decode_raw(name, datatype, dims, raw))  # type: ignore[arg-type]
                continue
            if "data" not in entry:
                raise bad(f"input {name!r} has neither 'data' nor parameters.binary_data_size")
            data = entry["data"]
            if not isinstance(data, list):
                data = [data]
            _check_json_values(name, datatype, data)
            decoded[name] = (
                datatype,
                decode_values(name, datatype, dims, data, may_hold_bools=self._may_hold_bools),
            )
        if pos != len(binary):
            raise bad(
                f"{len(binary) - pos} bytes of binary data follow the JSON that no input's "
                "binary_data_size accounts for"
            )
        return decoded


# -- response encoding ------------------------------------------------------------------------
def _json_data(arr: np.ndarray) -> list[Any] | None:
    """Flat row-major JSON values, or None when they cannot be JSON (non-UTF-8 BYTES)."""
    flat = arr.reshape(-1)
    if flat.dtype.kind in "OSU":
        try:
            return [v if isinstance(v, str) else bytes(v).decode("utf-8") for v in flat]
        except UnicodeDecodeError:
            return None
    return flat.tolist()  # FP16 and BF16 included: numpy gives Python floats


def encode_response(
    outputs: list[oip.OutputTensor], parsed: ParsedInfer, header: dict[str, Any]
) -> tuple[bytes, int | None]:
    """JSON response body plus binary parts; returns (body, JSON length or None if no binary)."""
    entries: list[dict[str, Any]] = []
    parts: list[bytes] = []
    for out in outputs:
        entry: dict[str, Any] = {"name": out.name, "datatype": out.datatype, "shape": list(out.array.shape)}
        want_binary = parsed.binary.get(out.name, parsed.binary_default)
        data = None if want_binary else _json_data(out.array)
        if data is None:
            raw = encode_raw(out.array)
            entry["parameters"] = {"binary_data_size": len(raw)}
            parts.append(raw)
        else:
            entry["data"] = data
        entries.append(entry)
    head = compact_json({**header, "outputs": entries})
    if not parts:
        return head, None
    return b"".join([head, *parts]), len(head)


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
        content = await offload_if_large(
            sum(o.array.size for o in outputs),
            encode_response,
            outputs,
            parsed,
            header,
            threshold=_OFFLOAD_ELEMENTS,
        )
        return infer_response(*content)

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
