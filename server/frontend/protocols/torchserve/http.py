"""TorchServe's REST inference API on Starlette: `/ping`, `/predictions/{model}[/{version}]`,
`/explanations/{model}[/{version}]` and SageMaker's `/invocations` (`/models/{model}/invoke`).

The apps translate HTTP to `InferRequest` and `InferResult`/`ServingError` back; the DataPlane
decides everything else. Wire shapes follow stock TorchServe 0.12 (checked against its
frontend), so clients written for it keep working: `/ping` answers `{"status": "Healthy"}` or
500 `{"status": "Unhealthy"}`, the handler receives `{"body": ...}` decoded the way TorchServe's
Python backend decodes it, handler statuses and bodies pass through untouched, and management
answers TorchServe's list/describe/status JSON. Every prediction runs through
`mariner.server.frontend.protocols.call`, which counts, times and maps it as it does every other entry
point's (a handler's own error status is passed through on the wire and labelled by its code).

Deliberate differences from TorchServe, each for a reason:
- A malformed JSON body (or non-UTF-8 text) is rejected with 400 before it is queued; TorchServe
  forwards the raw bytes and lets the handler fail. Validating first keeps one bad request from
  failing a whole batch. An empty body is a 400 too.
- Errors use TorchServe's `{"code", "type", "message"}` shape with its exception type names; a
  handler's failure is answered as TorchServe's worker answers it (`worker.handler_errors`). Our
  own refusals (queue full, bad body, unknown model) keep our more precise messages.
- Registering from a URL is always refused: archives come only from the model store.
- Cancelled clients are noticed: when the connection drops, the pending inference is cancelled
  so the batcher drops it before it reaches the device.

Explanations are predictions with the request header `explain: True` (predictions carry
`explain: False`, whatever the client sent), exactly as TorchServe's frontend sets it: a
BaseHandler-style handler checks `context.get_request_header(0, "explain") == "True"` and takes
its `explain_handle` path. Explanations and predictions never share a handler call (the runner
splits a mixed batch), because such handlers decide from request 0 for the whole batch.

A handler's intermediate answers (`send_intermediate_predict_response`) make the answer a
chunked one, each part a chunk and the final result the last (`torchserve/chunked.py`), as
TorchServe's frontend streams it; other requests answer in one piece.

What follows the version in `/predictions/{model}/{version}/...` (and `/explanations/...`)
reaches the handler as the request header `url_path` (`v1/chat/completion`), as TorchServe
hands it; every other prediction carries an empty `url_path`. It is refused (400) when it holds
control characters or is longer than `MAX_URL_PATH` characters.

`/invocations` (SageMaker's inference route) answers like /predictions for the model named by
the `model_name` query parameter, else the only model loaded at startup, else a `model_name`
form field; query parameters reach the handler as extra keys (UTF-8 bytes), as TorchServe passes
them. `/models/{model}/invoke` is the same with the model in the path.
"""

from __future__ import annotations

import logging
import re
from typing import TYPE_CHECKING, Any, Protocol

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from mariner.server.common.http_common import (
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_HEADERS,
    JSON,
    error_response,
    offload_if_large,
    read_body,
    request_headers,
)
from mariner.server.common.request_ids import new_request_id
from mariner.server.compat.torchserve.forms import MAX_FORM_PARTS, decode_data
from mariner.server.contracts.errors import STATUS, Code, ServingError
from mariner.server.contracts.types import InferRequest, InferResult, ModelInfo, WireProtocol
from mariner.server.frontend.protocols.call import CANCELLED_STATUS, CallPlane, Failed, Infer, Ok, run_call
from mariner.server.frontend.protocols.http_call import infer_unless_client_gone
from mariner.server.frontend.protocols.torchserve.answer_check import sendable
from mariner.server.frontend.protocols.torchserve.chunked import ChunkedAnswer, asgi_send
from mariner.server.frontend.streams import STREAMS

if TYPE_CHECKING:
    from mariner.server.frontend.dataplane import DataPlane

log = logging.getLogger("mariner.http")

_PROTOCOL = WireProtocol.TS_HTTP
_JSON_OPENERS = (b"{", b"[")
# Headers a handler must not set: the server frames the body itself.
_FRAMING_HEADERS = frozenset({"content-length", "transfer-encoding", "connection"})

# TorchServe pretty-prints with GSON and ends with a newline; the constant answers are prebuilt.
_HEALTHY = b'{\n  "status": "Healthy"\n}\n'
_UNHEALTHY = b'{\n  "status": "Unhealthy"\n}\n'
_UNHEALTHY_STATUS = STATUS[Code.INTERNAL].http  # TorchServe answers 500 for Unhealthy
# The request header TorchServe's frontend sets on every prediction and explanation.
EXPLAIN_HEADER = "explain"
# The request header carrying what follows the version in the path (TorchServe's name for it).
URL_PATH_HEADER = "url_path"
# Characters of that path a request may carry, and the ones it may not (C0, DEL, C1).
MAX_URL_PATH = 2048
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f]")
_MODEL_NAME = "model_name"


# -- responses --------------------------------------------------------------------------------
def _result_response(result: InferResult, request_id: str) -> Response:
    """The handler's answer, byte for byte, with its status and headers (once they are checked
    sendable: see `answer_check`)."""
    result = sendable(result, request_id)
    status, headers = answer_head(result, request_id)
    return Response(result.body, status, headers)


def answer_head(result: InferResult, request_id: str) -> tuple[int, dict[str, str]]:
    """An answer's status and headers (one sent whole, or a streamed one's first part).

    TorchServe sends a Content-Type only when the handler set one. We do the same and, when the
    handler set none, label bodies that start like a JSON object or array as application/json
    (what the runner produces for non-str results), so generic clients see JSON as JSON.
    """
    headers = {"x-request-id": request_id}
    if result.headers:
        for k, v in result.headers.items():
            if k.lower() not in _FRAMING_HEADERS:
                headers[k] = v
    if result.content_type:
        headers["content-type"] = result.content_type  # verbatim: no charset appended
    elif result.body[:1] in _JSON_OPENERS:
        headers["content-type"] = JSON
    return result.status, headers


def url_path_of(raw: str) -> str:
    """What follows the version, as TorchServe joins it (trailing slashes dropped), checked."""
    path = raw.rstrip("/")
    if len(path) > MAX_URL_PATH:
        raise ServingError(
            Code.INVALID_ARGUMENT,
            f"the path after the model version is {len(path)} characters; "
            f"at most {MAX_URL_PATH} are accepted",
        )
    if _CONTROL.search(path):
        raise ServingError(
            Code.INVALID_ARGUMENT,
            "the path after the model version holds control characters; send printable characters only",
        )
    return path


def _streamed_end(answer: ChunkedAnswer, outcome: Ok[InferResult] | Failed) -> Response:
    """The end of an answer whose first parts were sent (see `torchserve/chunked.py`)."""
    if isinstance(outcome, Ok):
        return answer.end(outcome.value)
    if outcome.answer is not None:  # TorchServe writes the final body as the last chunk, whatever its status
        return answer.end(outcome.answer)
    if outcome.cancelled:
        answer.abandon()
        return answer.end(None, "the client went away")
    return answer.end(None, f"the call failed after parts of its answer were sent: {outcome.error.message}")


# -- predictions -------------------------------------------------------------------------------
class PredictionPlane(CallPlane, Protocol):
    """The slice of the DataPlane `Predictions` uses (the real one and test fakes provide it)."""

    def models(self) -> list[ModelInfo]: ...

    def resolve(self, model: str, version: str | None = None) -> Any: ...


def enveloped(dataplane: PredictionPlane, model: str, version: str | None = None) -> bool:
    """Whether the served `model` is wrapped in a TorchServe service_envelope (kserve, kservev2,
    ...); an unknown model is not (the ordinary route answers its 404)."""
    try:
        return bool(getattr(dataplane.resolve(model, version), "envelope", None))
    except ServingError:
        return False


class Predictions:
    """TorchServe's prediction call over HTTP: the request body decoded as its backend decodes it,
    the handler's answer byte for byte (in parts when it streams). /predictions, /explanations
    and /invocations answer through it, and so do KServe's and OIP's routes for a model with a
    `service_envelope`, as TorchServe's frontend hands those to the handler too.

    `max_body_bytes` bounds a prediction body (413 beyond it, before it is read when the client
    declares its length); `max_headers` bounds the headers handed to the handler.
    """

    def __init__(self, dataplane: PredictionPlane, *, max_body_bytes: int, max_headers: int) -> None:
        self._plane = dataplane
        self._max_body_bytes = max_body_bytes
        self._max_headers = max_headers

    def _single_startup_model(self) -> str | None:
        names = {info.name for info in self._plane.models() if info.loaded_at_startup}
        return names.pop() if len(names) == 1 else None

    def _invocation_target(self, request: Request, data: dict[str, Any]) -> str:
        """SageMaker's /invocations model: TorchServe's order of choices (module docstring)."""
        name = request.query_params.get(_MODEL_NAME) or self._single_startup_model()
        field = data.get(_MODEL_NAME)
        if not name and isinstance(field, (bytes, str)):
            name = field.decode("utf-8", errors="replace") if isinstance(field, bytes) else field
        if not name:
            raise ServingError(
                Code.INVALID_ARGUMENT,
                "Parameter model_name is required: more than one model is loaded; "
                "add ?model_name=<model> or use /predictions/<model>",
            )
        return name

    async def answer(
        self,
        request: Request,
        model: str,
        version: str | None,
        *,
        explain: bool = False,
        invocations: bool = False,
        url_path: str | None = None,
        protocol: WireProtocol = _PROTOCOL,
    ) -> Response:
        dataplane = self._plane
        request_id = new_request_id()
        # Where the handler's intermediate answers go, if it sends any (most send none).
        streamed = ChunkedAnswer(asgi_send(request), request_id, answer_head)

        async def work(infer: Infer) -> InferResult:
            body = await read_body(request, self._max_body_bytes)
            require_body(body)
            data = await offload_if_large(
                len(body), decode_data, request.headers.get("content-type", ""), body
            )
            target = model
            if invocations:
                query = list(request.query_params.multi_items())[:MAX_FORM_PARTS]
                data = {**{k: v.encode("utf-8") for k, v in query}, **data}
                target = model or self._invocation_target(request, data)
            headers = request_headers(request, self._max_headers)
            return await infer(
                prediction_request(
                    target,
                    version,
                    data,
                    headers,
                    len(body),
                    request_id,
                    explain=explain,
                    url_path=url_path,
                    protocol=protocol,
                )  # fmt: skip
            )

        label = model
        if invocations and not label:  # the form-field choice is only known once the body is read
            label = request.query_params.get(_MODEL_NAME) or self._single_startup_model() or ""
        STREAMS[request_id] = streamed
        try:
            outcome = await run_call(
                dataplane,
                protocol,
                label,
                version,
                work,
                infer=lambda req: infer_unless_client_gone(dataplane, req, request.scope, request.receive),
                what="answering an explanation" if explain else "answering a prediction",
            )
        except BaseException:
            streamed.abandon()
            raise
        finally:
            STREAMS.pop(request_id, None)
        return final_answer(outcome, request_id, streamed)


def require_body(body: bytes) -> None:
    if not body:
        raise ServingError(Code.INVALID_ARGUMENT, "empty body: send the model input as the request body")


def prediction_request(
    model: str,
    version: str | None,
    data: dict[str, Any],
    headers: dict[str, str],
    size: int,
    request_id: str,
    *,
    explain: bool = False,
    url_path: str | None = None,
    protocol: WireProtocol = _PROTOCOL,
) -> InferRequest:
    """The request a prediction's decoded body and handler headers make, with the headers
    TorchServe's frontend sets (`explain`, `url_path`: module docstring). Both ways a prediction
    arrives build it here (`Predictions.answer`, `frontend.protocols.prediction_path`)."""
    headers[EXPLAIN_HEADER] = "True" if explain else "False"
    headers[URL_PATH_HEADER] = "" if url_path is None else url_path_of(url_path)
    return InferRequest(
        model=model,
        version=version,
        data=data,
        protocol=protocol,
        request_id=request_id,
        headers=headers,
        size=size,
    )


def final_answer(outcome: Ok[InferResult] | Failed, request_id: str, streamed: ChunkedAnswer) -> Response:
    """What a finished prediction is answered with: the handler's answer (its own error status
    and body too), the end of a streamed answer, or TorchServe's error JSON. Both ways a
    prediction arrives answer with it, so they answer the same bytes."""
    if streamed.started:
        return _streamed_end(streamed, outcome)
    if not isinstance(outcome, Failed):
        return _result_response(outcome.value, request_id)
    if outcome.answer is not None:  # the handler's own error status and body pass through
        return _result_response(outcome.answer, request_id)
    if outcome.cancelled:
        return Response(status_code=CANCELLED_STATUS)  # nobody reads it
    # A handler's failure answers with TorchServe's status; our refusals with their own.
    status = None if outcome.error.torchserve is not None else outcome.http_status
    return error_response(outcome.error, status=status, headers={"x-request-id": request_id})


# -- routes ------------------------------------------------------------------------------------
def routes(
    dataplane: DataPlane,
    *,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    max_headers: int = DEFAULT_MAX_HEADERS,
) -> list[Route]:
    """TorchServe's inference API: /ping, /predictions/{model}[/{version}[/{url_path}]], the
    same for /explanations, and SageMaker's routes (limits: `Predictions`)."""
    predictions = Predictions(dataplane, max_body_bytes=max_body_bytes, max_headers=max_headers)

    async def ping(request: Request) -> Response:
        if dataplane.is_ready():
            return Response(_HEALTHY, 200, media_type=JSON)
        return Response(_UNHEALTHY, _UNHEALTHY_STATUS, media_type=JSON)

    def infer_endpoint(*, explain: bool = False, invocations: bool = False) -> Any:
        async def endpoint(request: Request) -> Response:
            params = request.path_params
            return await predictions.answer(
                request,
                params.get("model", ""),
                params.get("version"),
                explain=explain,
                invocations=invocations,
                url_path=params.get(URL_PATH_HEADER),
            )

        return endpoint

    async def predict(request: Request) -> Response:  # the most taken route: no flags to pass
        params = request.path_params
        return await predictions.answer(
            request, params.get("model", ""), params.get("version"), url_path=params.get(URL_PATH_HEADER)
        )

    methods = ["POST", "PUT"]
    explanation = infer_endpoint(explain=True)
    invocation = infer_endpoint(invocations=True)
    return [
        Route("/ping", ping, methods=["GET"]),
        Route("/predictions/{model}", predict, methods=methods),
        Route("/predictions/{model}/{version}", predict, methods=methods),
        Route("/predictions/{model}/{version}/{url_path:path}", predict, methods=methods),
        Route("/explanations/{model}", explanation, methods=methods),
        Route("/explanations/{model}/{version}", explanation, methods=methods),
        Route("/explanations/{model}/{version}/{url_path:path}", explanation, methods=methods),
        Route("/invocations", invocation, methods=methods),
        Route("/models/{model}/invoke", invocation, methods=methods),
    ]
