"""TorchServe's REST APIs on Starlette: inference (8080), management (8081), metrics (8082).

The apps translate HTTP to `InferRequest` and `InferResult`/`ServingError` back; the DataPlane
decides everything else. Wire shapes follow stock TorchServe 0.12 (checked against its
frontend), so clients written for it keep working: `/ping` answers `{"status": "Healthy"}` or
500 `{"status": "Unhealthy"}`, the handler receives `{"body": ...}` decoded the way TorchServe's
Python backend decodes it, handler statuses and bodies pass through untouched, and management
answers TorchServe's list/describe/status JSON.

Deliberate differences from TorchServe, each for a reason:
- A malformed JSON body (or non-UTF-8 text) is rejected with 400 before it is queued; TorchServe
  forwards the raw bytes and lets the handler fail. Validating first keeps one bad request from
  failing a whole batch. An empty body is a 400 too.
- Errors use TorchServe's `{"code", "type", "message"}` shape, but `type` is our `Code` name and
  the status comes from `server.errors.STATUS` (the one place codes map to HTTP statuses).
- Registering from a URL is always refused: archives come only from the model store.
- Cancelled clients are noticed: when the connection drops, the pending inference is cancelled
  so the batcher drops it before it reaches the device.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from email.parser import BytesHeaderParser
from email.policy import HTTP as _HTTP_POLICY
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qsl

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route

from server import metrics as metrics_mod
from server.errors import RETRY_AFTER_SECONDS, STATUS, Code, ServingError, internal
from server.types import InferRequest, InferResult, ModelInfo, Protocol

if TYPE_CHECKING:
    from server.dataplane import DataPlane

log = logging.getLogger("mariner.http")

# TorchServe's default `max_request_size` (bytes); bigger bodies are answered 413, as it does.
DEFAULT_MAX_BODY_BYTES = 6_553_500
# Request headers handed to the handler; more are dropped (the first ones are kept) so a client
# cannot make every batch carry an unbounded header map.
DEFAULT_MAX_HEADERS = 100
# Parts of a multipart/form-data or urlencoded body; each becomes one key of the handler's dict.
MAX_FORM_PARTS = 64
# Management requests carry a few parameters at most.
MAX_MANAGEMENT_BODY_BYTES = 64 * 1024
# Bodies at least this big are decoded (JSON, multipart) on a worker thread, so one large request
# does not stall the event loop that every other request shares.
OFFLOAD_DECODE_BYTES = 256 * 1024
# TorchServe caps a list-models page at 100 entries.
MAX_PAGE = 100

_PROTOCOL = Protocol.TS_HTTP
_PROTOCOL_LABEL = _PROTOCOL.value
_JSON = "application/json"
_JSON_OPENERS = (b"{", b"[")
_CANCELLED_STATUS = STATUS[Code.CANCELLED].http
_PAYLOAD_TOO_LARGE = 413  # transport-level, like Starlette's 405: not a serving Code
# Headers a handler must not set: the server frames the body itself.
_FRAMING_HEADERS = frozenset({"content-length", "transfer-encoding", "connection"})

# TorchServe pretty-prints with GSON and ends with a newline; the constant answers are prebuilt.
_HEALTHY = b'{\n  "status": "Healthy"\n}\n'
_UNHEALTHY = b'{\n  "status": "Unhealthy"\n}\n'
_UNHEALTHY_STATUS = STATUS[Code.INTERNAL].http  # TorchServe answers 500 for Unhealthy
_NOT_READY_STATUS = STATUS[Code.UNAVAILABLE].http


def _json_bytes(obj: Any) -> bytes:
    """JSON as TorchServe's frontend writes it (two-space indent, trailing newline)."""
    return (json.dumps(obj, indent=2) + "\n").encode("utf-8")


def error_response(
    err: ServingError, *, status: int | None = None, headers: Mapping[str, str] | None = None
) -> Response:
    """`ServingError` as TorchServe's error JSON, status from `server.errors.STATUS`.

    `status` overrides the table only for transport-level answers that are not a serving code
    (413 for an oversized body). RESOURCE_EXHAUSTED carries Retry-After so clients back off.
    """
    code = status if status is not None else err.http_status
    hdrs = dict(headers) if headers else {}
    if err.code is Code.RESOURCE_EXHAUSTED:
        hdrs["retry-after"] = str(RETRY_AFTER_SECONDS)
    body = _json_bytes({"code": code, "type": err.code.name, "message": err.message})
    return Response(body, code, hdrs, media_type=_JSON)


def _json_response(obj: Any, status: int = 200) -> Response:
    return Response(_json_bytes(obj), status, media_type=_JSON)


async def _http_error(request: Request, exc: Exception) -> Response:
    """Unmatched routes and methods in TorchServe's error shape rather than Starlette's text."""
    assert isinstance(exc, HTTPException)
    if exc.status_code == STATUS[Code.NOT_FOUND].http:
        return error_response(
            ServingError(
                Code.NOT_FOUND,
                f"no such endpoint: {request.method} {request.url.path}; see the API documentation",
            )
        )
    body = {"code": exc.status_code, "type": "METHOD_NOT_ALLOWED", "message": str(exc.detail)}
    return Response(_json_bytes(body), exc.status_code, exc.headers, media_type=_JSON)


_HTTP_ERROR_HANDLERS: Mapping[Any, Callable[[Request, Exception], Awaitable[Response]]] = {
    404: _http_error,
    405: _http_error,
}


# -- request decoding -------------------------------------------------------------------------
class _BodyTooLarge(Exception):
    pass


class _ClientGone(Exception):
    pass


async def _read_body(request: Request, limit: int) -> bytes:
    """The raw body, refusing (before reading, when Content-Length says so) more than `limit` bytes."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _BodyTooLarge
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        if chunk:
            size += len(chunk)
            if size > limit:
                raise _BodyTooLarge
            chunks.append(chunk)
    if len(chunks) == 1:  # the usual case: no join, no copy
        return chunks[0]
    return b"".join(chunks)


def _decode_value(raw: bytes, mime: str, what: str) -> Any:
    """One input the way TorchServe's Python backend decodes it: JSON, text or bytes."""
    if mime == _JSON:
        try:
            return json.loads(raw)
        except ValueError as e:  # JSONDecodeError and UnicodeDecodeError both name the position
            raise ServingError(
                Code.INVALID_ARGUMENT,
                f"{what} is not valid JSON: {e}; send a JSON document, or another Content-Type for raw bytes",
            ) from None
    if mime.startswith("text/"):
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ServingError(
                Code.INVALID_ARGUMENT,
                f"{what} is not valid UTF-8 text (byte {e.start}); "
                "send UTF-8, or a non-text Content-Type for raw bytes",
            ) from None
    return raw


def _mime(content_type: str) -> str:
    return content_type.partition(";")[0].strip().lower()


def _parse_urlencoded(body: bytes) -> dict[str, Any]:
    """Form fields as TorchServe passes them: each field's value as UTF-8 bytes."""
    try:
        pairs = parse_qsl(
            body.decode("utf-8"), keep_blank_values=True, max_num_fields=MAX_FORM_PARTS, errors="strict"
        )
    except UnicodeDecodeError as e:
        raise ServingError(Code.INVALID_ARGUMENT, f"form body is not valid UTF-8 (byte {e.start})") from None
    except ValueError:  # more fields than allowed
        raise ServingError(
            Code.INVALID_ARGUMENT, f"form body has more than {MAX_FORM_PARTS} fields"
        ) from None
    return {k: v.encode("utf-8") for k, v in pairs}


_BOUNDARY = re.compile(r'boundary="?([^";]+)"?', re.IGNORECASE)


def _parse_multipart(content_type: str, body: bytes) -> dict[str, Any]:
    """multipart/form-data as TorchServe passes it: one key per part, by its form name.

    A part without a Content-Type (a plain form field) stays bytes; a file part is decoded by
    its own Content-Type (JSON, text, bytes). Split with bytes.find rather than the stdlib email
    parser, which takes ~150 ms for a 6 MB image. Later parts win over earlier ones of the same
    name, as in TorchServe's Python backend.
    """
    m = _BOUNDARY.search(content_type)
    if m is None:
        raise ServingError(Code.INVALID_ARGUMENT, "multipart/form-data without a boundary parameter")
    delim = b"--" + m.group(1).strip().encode("latin-1")
    sep = b"\r\n" + delim
    bad = ServingError(
        Code.INVALID_ARGUMENT,
        "malformed multipart/form-data body: every part needs headers, a blank line and a boundary",
    )
    pos = body.find(delim)
    if pos < 0:
        raise bad
    pos += len(delim)
    data: dict[str, Any] = {}
    for _ in range(MAX_FORM_PARTS):
        if body.startswith(b"--", pos):  # the closing delimiter
            break
        line_end = body.find(b"\r\n", pos)  # skips transport padding after the delimiter
        if line_end < 0:
            raise bad
        start = line_end + 2
        end = body.find(sep, start)
        if end < 0:
            raise bad
        if body.startswith(b"\r\n", start):  # a part without headers
            head, payload_start = b"", start + 2
        else:
            head_end = body.find(b"\r\n\r\n", start, end + 2)
            if head_end < 0:
                raise bad
            head, payload_start = body[start : head_end + 2], head_end + 4
        headers = BytesHeaderParser(policy=_HTTP_POLICY).parsebytes(head)
        name = headers.get_param("name", header="content-disposition")
        if not isinstance(name, str) or not name:
            raise ServingError(
                Code.INVALID_ARGUMENT, "a multipart/form-data part has no name in Content-Disposition"
            )
        payload = body[payload_start:end]
        ctype = headers.get("content-type")
        data[name] = _decode_value(payload, _mime(ctype), f"form part {name!r}") if ctype else payload
        pos = end + len(sep)
    else:
        if not body.startswith(b"--", pos):
            raise ServingError(
                Code.INVALID_ARGUMENT, f"multipart/form-data body has more than {MAX_FORM_PARTS} parts"
            )
    if not data:
        raise ServingError(Code.INVALID_ARGUMENT, "multipart/form-data body has no parts")
    return data


def _decode_data(content_type: str, body: bytes) -> dict[str, Any]:
    """The handler's per-request dict, as TorchServe builds it from the request body."""
    mime = _mime(content_type)
    if mime == "multipart/form-data":
        return _parse_multipart(content_type, body)
    if mime == "application/x-www-form-urlencoded":
        return _parse_urlencoded(body)
    return {"body": _decode_value(body, mime, "request body")}


def _request_headers(request: Request, limit: int) -> dict[str, str]:
    # ASGI servers deliver header names lower-cased already (the spec requires it).
    raw = request.scope["headers"]
    if len(raw) > limit:
        raw = raw[:limit]
    return {k.decode("latin-1"): v.decode("latin-1") for k, v in raw}


# -- responses --------------------------------------------------------------------------------
def _result_response(result: InferResult, request_id: str) -> Response:
    """The handler's answer, byte for byte, with its status and headers.

    TorchServe sends a Content-Type only when the handler set one. We do the same and, when the
    handler set none, label bodies that start like a JSON object or array as application/json
    (what the runner produces for non-str results), so generic clients see JSON as JSON.
    """
    status = result.status
    if not 100 <= status <= 599:
        log.error("handler answered request %s with status %r; sending 500", request_id, status)
        status = STATUS[Code.INTERNAL].http
    headers = {"x-request-id": request_id}
    if result.headers:
        for k, v in result.headers.items():
            if k.lower() not in _FRAMING_HEADERS:
                headers[k] = v
    if result.content_type:
        headers["content-type"] = result.content_type  # verbatim: no charset appended
    elif result.body[:1] in _JSON_OPENERS:
        headers["content-type"] = _JSON
    return Response(result.body, status, headers)


async def _infer_unless_client_gone(
    dataplane: DataPlane, req: InferRequest, receive: Callable[[], Awaitable[Mapping[str, Any]]]
) -> InferResult:
    """`dataplane.infer`, cancelled if the client disconnects first.

    A watcher task waits on the ASGI `receive` (the body is already read, so the next message is
    `http.disconnect`) and cancels this task; the batcher then skips the request. One small task
    per request is the price for not computing answers nobody will read.
    """
    task = asyncio.current_task()
    assert task is not None
    gone = False

    async def watch() -> None:
        nonlocal gone
        try:
            while (await receive())["type"] != "http.disconnect":
                pass
        except Exception:  # a server that cannot report disconnects: just stop watching
            return
        gone = True
        task.cancel()

    watcher = asyncio.get_running_loop().create_task(watch())
    try:
        return await dataplane.infer(req)
    except asyncio.CancelledError:
        if not gone:
            raise
        raise _ClientGone from None
    finally:
        watcher.cancel()
        if gone:  # our own cancel, not the server's: take it back so this task can still answer
            task.uncancel()


# -- inference app (8080) ----------------------------------------------------------------------
def inference_app(
    dataplane: DataPlane,
    *,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    max_headers: int = DEFAULT_MAX_HEADERS,
) -> Starlette:
    """TorchServe's inference API: /ping, /predictions/{model}[/{version}], plus /healthz, /readyz,
    and the Open Inference Protocol's /v2 routes (server.http_oip).

    `max_body_bytes` bounds a prediction body (413 beyond it, before it is read when the client
    declares its length); `max_headers` bounds the headers handed to the handler.
    """
    metrics = dataplane.metrics
    requests_total = metrics.requests
    duration = metrics.request_duration

    async def ping(request: Request) -> Response:
        if dataplane.is_ready():
            return Response(_HEALTHY, 200, media_type=_JSON)
        return Response(_UNHEALTHY, _UNHEALTHY_STATUS, media_type=_JSON)

    async def healthz(request: Request) -> Response:
        """Liveness: the process answers. Kubernetes restarts the pod when this fails."""
        if dataplane.is_live():
            return _json_response({"status": "alive"})
        return _json_response({"status": "not alive"}, _NOT_READY_STATUS)

    async def readyz(request: Request) -> Response:
        """Readiness: every model loaded and not draining, so load balancers send traffic here."""
        if dataplane.draining:
            return _json_response({"status": "draining"}, _NOT_READY_STATUS)
        if dataplane.is_ready():
            return _json_response({"status": "ready"})
        return _json_response({"status": "not ready"}, _NOT_READY_STATUS)

    async def predict(request: Request) -> Response:
        t0 = time.perf_counter()
        params = request.path_params
        model: str = params["model"]
        version: str | None = params.get("version")
        request_id = uuid.uuid4().hex
        try:
            body = await _read_body(request, max_body_bytes)
            if not body:
                raise ServingError(
                    Code.INVALID_ARGUMENT, "empty body: send the model input as the request body"
                )
            content_type = request.headers.get("content-type", "")
            if len(body) < OFFLOAD_DECODE_BYTES:
                data = _decode_data(content_type, body)
            else:
                data = await run_in_threadpool(_decode_data, content_type, body)
            req = InferRequest(
                model=model,
                version=version,
                data=data,
                protocol=_PROTOCOL,
                request_id=request_id,
                headers=_request_headers(request, max_headers),
            )
            response = _result_response(
                await _infer_unless_client_gone(dataplane, req, request.receive), request_id
            )
        except ServingError as e:
            response = error_response(e, headers={"x-request-id": request_id})
        except _BodyTooLarge:
            err = ServingError(
                Code.INVALID_ARGUMENT,
                f"request body is larger than the limit of {max_body_bytes} bytes (max_body_bytes)",
            )
            response = error_response(err, status=_PAYLOAD_TOO_LARGE, headers={"x-request-id": request_id})
        except (_ClientGone, ClientDisconnect):
            response = Response(status_code=_CANCELLED_STATUS)  # nobody reads it; counted as 499
        except Exception:
            log.exception("prediction request %s for model %r failed", request_id, model)
            response = error_response(
                internal("answering a prediction"), headers={"x-request-id": request_id}
            )
        label_model, label_version = dataplane.known_label(model, version)
        requests_total.labels(label_model, label_version, _PROTOCOL_LABEL, str(response.status_code)).inc()
        duration.labels(label_model, label_version, _PROTOCOL_LABEL).observe(time.perf_counter() - t0)
        return response

    methods = ["POST", "PUT"]
    routes = [
        Route("/ping", ping, methods=["GET"]),
        Route("/healthz", healthz, methods=["GET"]),
        Route("/readyz", readyz, methods=["GET"]),
        Route("/predictions/{model}", predict, methods=methods),
        Route("/predictions/{model}/{version}", predict, methods=methods),
    ]
    # The Open Inference Protocol's /v2 routes share the port and the DataPlane. Imported here
    # because server.http_oip reuses this module's body reading and disconnect handling.
    from server.http_oip import routes as oip_routes

    routes += oip_routes(dataplane, max_body_bytes=max_body_bytes, max_headers=max_headers)
    return Starlette(routes=routes, exception_handlers=dict(_HTTP_ERROR_HANDLERS))


# -- management app (8081) ---------------------------------------------------------------------
_REGISTER_PARAMS = frozenset(
    {
        "url",
        "model_name",
        "batch_size",
        "max_batch_delay",
        "response_timeout",
        "initial_workers",
        "synchronous",
        "runtime",
    }
)
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]+:")  # two+ chars, so a Windows drive is not a scheme


def _lenient_int(params: Mapping[str, str], key: str, default: int) -> int:
    """TorchServe's getIntParameter: a missing or malformed value means the default."""
    try:
        return int(params[key])
    except (KeyError, ValueError, TypeError):
        return default


def _strict_number(params: Mapping[str, Any], key: str, kind: type[int] | type[float]) -> Any:
    value = params.get(key)
    if value is None:
        return None
    try:
        number = kind(value)
    except (TypeError, ValueError):
        raise ServingError(
            Code.INVALID_ARGUMENT,
            f"parameter {key} must be a{'n integer' if kind is int else ' number'}, got {value!r}",
        ) from None
    if number < 0:
        raise ServingError(Code.INVALID_ARGUMENT, f"parameter {key} must not be negative, got {value!r}")
    return number


def _truthy(value: Any) -> bool:
    return str(value).lower() == "true"


def _describe(info: ModelInfo, loaded_at_startup: bool) -> dict[str, Any]:
    """One entry of TorchServe's describe-model answer, with TorchServe's field names.

    Fields TorchServe has that Mariner cannot fill truthfully (startTime, memoryUsage, job queue
    counts, sequence settings) are left out rather than invented; Mariner-only facts go under
    "mariner" so TorchServe clients are not confused by them.
    """
    cuda = sorted({int(w.device.partition(":")[2] or 0) for w in info.workers if w.device.startswith("cuda")})
    pid = os.getpid()  # runners are threads of this process
    entry: dict[str, Any] = {
        "modelName": info.name,
        "modelVersion": info.version,
        "modelUrl": info.archive,
        "runtime": "python",
        "minWorkers": info.min_workers,
        "maxWorkers": info.max_workers,
        "batchSize": info.batch_size,
        "maxBatchDelay": round(info.max_batch_delay_ms),
        "responseTimeout": round(info.response_timeout_s),
        "deviceType": "gpu" if cuda else "cpu",
    }
    if cuda:
        entry["deviceIds"] = cuda
    entry.update(
        {
            "continuousBatching": False,
            "useJobTicket": False,
            "useVenv": False,
            "stateful": False,
            "status": info.state.value,
            "loadedAtStartup": loaded_at_startup,
            "workers": [
                {
                    "id": w.id,
                    "status": w.status,
                    "pid": pid,
                    "gpu": w.device.startswith("cuda"),
                    "gpuUsage": "N/A",
                    "device": w.device,
                    "batches": w.batches,
                }
                for w in info.workers
            ],
            "mariner": {
                "isDefault": info.is_default,
                "handler": info.handler,
                "sha256": info.sha256,
                "queueSize": info.queue_size,
                "maxBatchDelayMs": info.max_batch_delay_ms,
                "responseTimeoutSeconds": info.response_timeout_s,
                "loadSeconds": info.load_seconds,
            },
        }
    )
    return entry


def _guarded(
    what: str, fn: Callable[[Request], Awaitable[Response]]
) -> Callable[[Request], Awaitable[Response]]:
    """Turn ServingError into its JSON answer and anything else into a sanitized 500."""

    async def endpoint(request: Request) -> Response:
        try:
            return await fn(request)
        except ServingError as e:
            return error_response(e)
        except Exception:
            log.exception("management request %s %s failed", request.method, request.url.path)
            return error_response(internal(what))

    return endpoint


def management_app(dataplane: DataPlane) -> Starlette:
    """TorchServe's management API: list, describe, register, unregister, scale, set-default.

    Reads always work; changes go to the DataPlane, which refuses them (403) unless the server
    was started with model management enabled. Registering from a URL is refused regardless:
    archives are only taken from the model store, by file name.
    """
    # Models registered through this API; everything else was loaded at startup. ModelInfo does
    # not carry this, and TorchServe's describe reports it as loadedAtStartup.
    registered_here: set[tuple[str, str]] = set()

    def describe_entries(name: str, version: str | None) -> list[dict[str, Any]]:
        infos = dataplane.describe(name, version)
        if version is None:  # TorchServe describes the default version unless asked for "all"
            infos = [i for i in infos if i.is_default] or infos
        return [_describe(i, (i.name, i.version) not in registered_here) for i in infos]

    async def list_models(request: Request) -> Response:
        q = request.query_params
        limit = _lenient_int(q, "limit", MAX_PAGE)
        if not 0 <= limit <= MAX_PAGE:
            limit = MAX_PAGE
        start = max(0, _lenient_int(q, "next_page_token", 0))
        defaults = sorted((i for i in dataplane.models() if i.is_default), key=lambda i: i.name)
        answer: dict[str, Any] = {}
        last = start + limit
        if last > len(defaults):
            last = len(defaults)
        else:  # as TorchServe: a token whenever the page was full, even if nothing follows
            answer["nextPageToken"] = str(last)
        answer["models"] = [{"modelName": i.name, "modelUrl": i.archive} for i in defaults[start:last]]
        return _json_response(answer)

    async def describe(request: Request) -> Response:
        p = request.path_params
        return _json_response(describe_entries(p["name"], p.get("version")))

    async def register(request: Request) -> Response:
        params: dict[str, Any] = dict(request.query_params)
        if _mime(request.headers.get("content-type", "")) == _JSON:  # TorchServe also takes a JSON body
            try:
                raw = await _read_body(request, MAX_MANAGEMENT_BODY_BYTES)
            except _BodyTooLarge:
                raise ServingError(
                    Code.INVALID_ARGUMENT, f"register request body is over {MAX_MANAGEMENT_BODY_BYTES} bytes"
                ) from None
            body = _decode_value(raw, _JSON, "register request body") if raw else {}
            if not isinstance(body, dict):
                raise ServingError(Code.INVALID_ARGUMENT, "register request body must be a JSON object")
            params.update(body)
        url = params.get("url")
        if isinstance(url, str) and _SCHEME.match(url):
            raise ServingError(
                Code.PERMISSION_DENIED,
                "registering a model from a URL is not allowed: copy the .mar into the model store "
                "and pass its file name as url",
            )
        unknown = sorted(set(params) - _REGISTER_PARAMS)
        if unknown:
            raise ServingError(
                Code.INVALID_ARGUMENT,
                f"unsupported register parameter(s) {', '.join(unknown)}; "
                f"supported: {', '.join(sorted(_REGISTER_PARAMS))}",
            )
        if not isinstance(url, str) or not url:
            raise ServingError(
                Code.INVALID_ARGUMENT, "parameter url is required: the .mar file name in the model store"
            )
        runtime = params.get("runtime")
        if runtime is not None and str(runtime).lower() != "python":
            raise ServingError(Code.INVALID_ARGUMENT, f"runtime {runtime!r} is not supported; only python")
        overrides: dict[str, Any] = {}
        if params.get("model_name"):
            overrides["name"] = str(params["model_name"])
        if (v := _strict_number(params, "batch_size", int)) is not None:
            overrides["batch_size"] = v
        if (v := _strict_number(params, "max_batch_delay", float)) is not None:
            overrides["max_batch_delay_ms"] = v
        if (v := _strict_number(params, "response_timeout", float)) is not None:
            overrides["response_timeout_s"] = v
        workers = _strict_number(params, "initial_workers", int)
        if workers:  # 0 or absent: the archive's minWorkers
            overrides["min_workers"] = overrides["max_workers"] = workers
        # `synchronous` is accepted and moot: Mariner answers after the model has loaded.
        infos = await dataplane.register(url, **overrides)
        for i in infos:
            registered_here.add((i.name, i.version))
        i = infos[0]
        n = sum(1 for w in i.workers if w.status == "READY")
        return _json_response(
            {"status": f'Model "{i.name}" Version: {i.version} registered with {n} initial workers'}
        )

    async def unregister(request: Request) -> Response:
        p = request.path_params
        await dataplane.unregister(p["name"], p.get("version"))
        for key in [k for k in registered_here if k[0] == p["name"] and p.get("version") in (None, k[1])]:
            registered_here.discard(key)
        return _json_response({"status": f'Model "{p["name"]}" unregistered'})

    async def scale(request: Request) -> Response:
        p, q = request.path_params, request.query_params
        version = p.get("version") or q.get("model_version")
        min_workers = _lenient_int(q, "min_worker", 1)
        max_workers = _lenient_int(q, "max_worker", min_workers)
        if max_workers < min_workers:
            raise ServingError(Code.INVALID_ARGUMENT, "max_worker cannot be less than min_worker")
        await dataplane.scale(p["name"], version, min_workers, max_workers)
        msg = f"Workers scaled to {min_workers} for model: {p['name']}"
        return _json_response({"status": msg + (f", version: {version}" if version else "")})

    async def set_default(request: Request) -> Response:
        p = request.path_params
        await dataplane.set_default(p["name"], p["version"])
        return _json_response(
            {"status": f'Default version successfully updated for model "{p["name"]}" to "{p["version"]}"'}
        )

    routes = [
        Route("/models", _guarded("listing models", list_models), methods=["GET"]),
        Route("/models", _guarded("registering a model", register), methods=["POST"]),
        Route("/models/{name}", _guarded("describing a model", describe), methods=["GET"]),
        Route("/models/{name}", _guarded("scaling a model", scale), methods=["PUT"]),
        Route("/models/{name}", _guarded("unregistering a model", unregister), methods=["DELETE"]),
        Route("/models/{name}/{version}", _guarded("describing a model", describe), methods=["GET"]),
        Route("/models/{name}/{version}", _guarded("scaling a model", scale), methods=["PUT"]),
        Route("/models/{name}/{version}", _guarded("unregistering a model", unregister), methods=["DELETE"]),
        Route(
            "/models/{name}/{version}/set-default",
            _guarded("setting the default version", set_default),
            methods=["PUT"],
        ),
    ]
    return Starlette(routes=routes, exception_handlers=dict(_HTTP_ERROR_HANDLERS))


# -- metrics app (8082) ------------------------------------------------------------------------
def metrics_app(dataplane: DataPlane) -> Starlette:
    """Prometheus exposition of `dataplane.metrics` at GET /metrics.

    Rendering runs on a worker thread: it walks every series and may touch CUDA, and scrapes
    must not stall the event loop that serves inference.
    """
    metrics = dataplane.metrics

    async def scrape(request: Request) -> Response:
        return Response(await run_in_threadpool(metrics.render), media_type=metrics_mod.CONTENT_TYPE)

    return Starlette(
        routes=[Route("/metrics", scrape, methods=["GET"])], exception_handlers=dict(_HTTP_ERROR_HANDLERS)
    )
