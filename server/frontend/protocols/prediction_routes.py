"""The routes the HTTP fast path answers (`prediction_path`): TorchServe's predictions and the Open
Inference Protocol's infer call. Each says which requests are its own, builds the InferRequest
from a complete body and the answer from the call's outcome, with the same functions its
Starlette route uses (`torchserve.http`, `oip.http`), so the two ways answer the same bytes.
"""

from __future__ import annotations

from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any, Protocol

from starlette.concurrency import run_in_threadpool
from starlette.responses import Response

from mariner.server.common import oip_codec as oip
from mariner.server.common.http_common import handler_headers
from mariner.server.common.raw_headers import first_header
from mariner.server.common.request_ids import new_request_id
from mariner.server.compat.torchserve.forms import decode_data
from mariner.server.contracts.types import InferRequest, InferResult, WireProtocol
from mariner.server.frontend.protocols.call import Failed, Ok
from mariner.server.frontend.protocols.http_listener import prediction_params
from mariner.server.frontend.protocols.oip import http as oip_http
from mariner.server.frontend.protocols.oip import rest_codec
from mariner.server.frontend.protocols.torchserve.chunked import ChunkedAnswer
from mariner.server.frontend.protocols.torchserve.http import (
    answer_head,
    final_answer,
    prediction_request,
    require_body,
)

if TYPE_CHECKING:
    from mariner.server.frontend.dataplane import DataPlane
    from mariner.server.frontend.protocols.prediction_path import Prediction

Value = InferResult | Response
_TS_METHODS = frozenset({"POST", "PUT"})
_IDENTITY = frozenset({b"", b"identity"})


class Route(Protocol):
    """One kind of call the fast path answers."""

    protocol: WireProtocol
    what: str  # the stage a sanitized INTERNAL message names

    def match(self, method: str, path: str) -> dict[str, str] | None:
        """The path's parameters when the request is this route's, else None."""

    def accepts(self, plane: DataPlane, params: dict[str, str], headers: list[tuple[bytes, bytes]]) -> bool:
        """Whether the fast path answers it as the app would (else the app answers it)."""

    def request(self, call: Prediction, body: bytes) -> InferRequest:
        """The request a complete body makes (raises what the app's route raises)."""

    def value(self, call: Prediction, result: InferResult) -> Value | Coroutine[Any, Any, Value]:
        """What a successful call is answered from (a coroutine when the work belongs off the loop)."""

    def answer(self, call: Prediction, outcome: Ok[Any] | Failed) -> Response:
        """The response for the call's outcome."""


class TorchServePredictions:
    """`POST|PUT /predictions/{model}[/{version}[/{url_path}]]` (`torchserve.http`)."""

    protocol = WireProtocol.TS_HTTP
    what = "answering a prediction"

    def match(self, method: str, path: str) -> dict[str, str] | None:
        return prediction_params(path) if method in _TS_METHODS else None

    def accepts(self, plane: DataPlane, params: dict[str, str], headers: list[tuple[bytes, bytes]]) -> bool:
        return True

    def request(self, call: Prediction, body: bytes) -> InferRequest:
        request_id = call.request_id = new_request_id()
        call.streamed = ChunkedAnswer(call.send, request_id, answer_head)
        require_body(body)
        params = call.params
        return prediction_request(
            params["model"],
            params.get("version"),
            decode_data(call.header(b"content-type") or "", body),
            handler_headers(call.headers, call.path.max_headers),
            len(body),
            request_id,
            url_path=params.get("url_path"),
        )

    def value(self, call: Prediction, result: InferResult) -> Value:
        return result

    def answer(self, call: Prediction, outcome: Ok[Any] | Failed) -> Response:
        assert call.streamed is not None, "made with the request"
        return final_answer(outcome, call.request_id, call.streamed)


class OipInfer:
    """`POST /v2/models/{model}[/versions/{version}]/infer` (`oip.http`) for a model with a
    tensor signature; one answered through TorchServe's envelope, and a compressed body, go to
    the app."""

    protocol = WireProtocol.OIP_HTTP
    what = "running the inference"

    def __init__(self, max_body_bytes: int) -> None:
        self._max_body_bytes = max_body_bytes
        self._max_elements = oip.element_cap(max_body_bytes)

    def match(self, method: str, path: str) -> dict[str, str] | None:
        if method != "POST":
            return None
        parts = path.split("/")
        if len(parts) == 5 and parts[:3] == ["", "v2", "models"] and parts[3] and parts[4] == "infer":
            return {"model": parts[3]}
        if (
            len(parts) == 7
            and parts[:3] == ["", "v2", "models"]
            and parts[3]
            and parts[4] == "versions"
            and parts[5]
            and parts[6] == "infer"
        ):
            return {"model": parts[3], "version": parts[5]}
        return None

    def accepts(self, plane: DataPlane, params: dict[str, str], headers: list[tuple[bytes, bytes]]) -> bool:
        encoding = first_header(headers, b"content-encoding") or b""
        return encoding.strip().lower() in _IDENTITY and not oip_http.through_envelope(
            plane, params["model"], params.get("version")
        )

    def request(self, call: Prediction, body: bytes) -> InferRequest:
        params = call.params
        header_length = rest_codec.header_length(call.header(rest_codec.HEADER_LENGTH.encode()), len(body))
        handle = call.path.plane.resolve(params["model"], params.get("version"))
        signature = oip.signature_of(handle)
        parsed = rest_codec.ParsedInfer(body, header_length, self._max_elements, signature, handle.batch_size)
        prepared = oip_http.prepared_infer(
            handle, parsed, handler_headers(call.headers, call.path.max_headers)
        )
        call.state = (parsed, prepared)
        return prepared.request

    def value(self, call: Prediction, result: InferResult) -> Value | Coroutine[Any, Any, Value]:
        parsed, prepared = call.state
        outputs, header = oip_http.answer_outputs(prepared, parsed, result)
        if oip_http.large_outputs(outputs):
            return self._encoded_off_the_loop(outputs, parsed, header)
        return oip_http.infer_response(*rest_codec.encode_response(outputs, parsed, header))

    async def _encoded_off_the_loop(self, outputs: Any, parsed: Any, header: dict[str, Any]) -> Value:
        content = await run_in_threadpool(rest_codec.encode_response, outputs, parsed, header)
        return oip_http.infer_response(*content)

    def answer(self, call: Prediction, outcome: Ok[Any] | Failed) -> Response:
        if isinstance(outcome, Ok):
            response: Response = outcome.value
            return response
        return oip_http.failed_response(outcome)
