"""HTTP plumbing shared by the REST apps: a frontend's inference apps (`frontend.protocols`) and
the supervisor's management and metrics apps (`supervisor.management.http`, `metrics_http`).

What lives here is protocol-neutral transport work: reading a bounded body, handing request
headers to the handler, cancelling an inference whose client has gone, deciding when decoding
moves off the event loop, and turning failures of a route into answers. Wire shapes of one
protocol belong to that protocol's module; the TorchServe error JSON is here because every
TorchServe port (and Starlette's 404/405 on all of them) answers with it.
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from mariner.server.common.security import HIDDEN_FROM_HANDLERS
from mariner.server.contracts.errors import (
    RETRY_AFTER_SECONDS,
    STATUS,
    CallerGone,
    Code,
    Refused,
    ServingError,
    TorchServeAnswer,
    internal,
    torchserve_answer,
)

T = TypeVar("T")
Endpoint = Callable[[Request], Awaitable[Response]]

# TorchServe's default `max_request_size` (bytes); bigger bodies are answered 413, as it does.
DEFAULT_MAX_BODY_BYTES = 6_553_500
# Request headers handed to the handler; more are dropped (the first ones are kept) so a client
# cannot make every batch carry an unbounded header map.
DEFAULT_MAX_HEADERS = 100
# Bodies at least this big are decoded (JSON, multipart) on a worker thread, so one large request
# does not stall the event loop that every other request shares.
OFFLOAD_DECODE_BYTES = 256 * 1024

JSON = "application/json"
PAYLOAD_TOO_LARGE = 413  # transport-level, like Starlette's 405: not a serving Code
NOT_READY_STATUS = STATUS[Code.UNAVAILABLE].http


# -- JSON and errors (TorchServe's shape) ------------------------------------------------------
def json_bytes(obj: Any) -> bytes:
    """JSON as TorchServe's frontend writes it (two-space indent, trailing newline)."""
    return (json.dumps(obj, indent=2) + "\n").encode("utf-8")


def json_response(obj: Any, status: int = 200) -> Response:
    """`obj` as TorchServe-formatted JSON."""
    return Response(json_bytes(obj), status, media_type=JSON)


def error_response(
    err: ServingError, *, status: int | None = None, headers: Mapping[str, str] | None = None
) -> Response:
    """`ServingError` as TorchServe's error JSON: status, exception type and message as TorchServe
    answers that failure (`mariner.server.contracts.errors.torchserve_answer`).

    `status` overrides the table only for transport-level answers that are not a serving code
    (413 for an oversized body). RESOURCE_EXHAUSTED carries Retry-After so clients back off.
    """
    answer = torchserve_answer(err)
    code = status if status is not None else answer.status
    hdrs = dict(headers) if headers else {}
    if err.code is Code.RESOURCE_EXHAUSTED:
        hdrs["retry-after"] = str(RETRY_AFTER_SECONDS)
    body = json_bytes({"code": code, "type": answer.type, "message": answer.message})
    return Response(body, code, hdrs, media_type=JSON)


# -- JSON and errors (the Open Inference Protocol's and KServe v1's shape) ---------------------
def compact_json(obj: Any) -> bytes:
    """JSON without whitespace, as OIP and KServe clients are sent it."""
    return json.dumps(obj, separators=(",", ":")).encode("utf-8")


def compact_json_response(obj: Any, status: int = 200) -> Response:
    return Response(compact_json(obj), status, media_type=JSON)


def error_json_response(err: ServingError, status: int | None = None) -> Response:
    """`{"error": message}`, the error shape of OIP (tritonclient decodes it) and of KServe v1;
    Retry-After when overloaded."""
    headers = {"retry-after": str(RETRY_AFTER_SECONDS)} if err.code is Code.RESOURCE_EXHAUSTED else None
    return Response(compact_json({"error": err.message}), status or err.http_status, headers, media_type=JSON)


def body_too_large(limit: int) -> ServingError:
    """What a 413 says, on every protocol: the limit and the setting that raises it."""
    return ServingError(
        Code.INVALID_ARGUMENT,
        f"request body is larger than the limit of {limit} bytes (max_body_bytes)",
    )


async def _http_error(request: Request, exc: Exception) -> Response:
    """Unmatched routes and methods in TorchServe's error shape rather than Starlette's text."""
    assert isinstance(exc, HTTPException)
    if exc.status_code == STATUS[Code.NOT_FOUND].http:
        return error_response(
            ServingError(
                Code.NOT_FOUND,
                f"no such endpoint: {request.method} {request.url.path}; see the API documentation",
                torchserve=TorchServeAnswer(
                    404,
                    "ResourceNotFoundException",
                    "Requested resource is not found, please refer to API document.",
                ),
            )
        )
    body = {
        "code": exc.status_code,
        "type": "MethodNotAllowedException",
        "message": "Requested method is not allowed, please refer to API document.",
    }
    return Response(json_bytes(body), exc.status_code, exc.headers, media_type=JSON)


HTTP_ERROR_HANDLERS: Mapping[Any, Callable[[Request, Exception], Awaitable[Response]]] = {
    404: _http_error,
    405: _http_error,
}


def make_guard(
    api: str, log: logging.Logger, answer: Callable[[ServingError], Response]
) -> Callable[[str, Endpoint], Endpoint]:
    """A wrapper for `api`'s routes: ServingError becomes `answer(err)`, anything else is logged
    and answered as a sanitized INTERNAL error naming `what` the route was doing."""

    def guard(what: str, fn: Endpoint) -> Endpoint:
        @functools.wraps(fn)  # keeps fn's docstring for the generated API description
        async def endpoint(request: Request) -> Response:
            try:
                return await fn(request)
            except ServingError as e:
                return answer(e)
            except Exception:
                log.exception("%s request %s %s failed", api, request.method, request.url.path)
                return answer(internal(what))

        return endpoint

    return guard


# -- requests ----------------------------------------------------------------------------------
class BodyTooLarge(Refused):
    """The body is over the route's limit of `limit` bytes (answered and counted as 413)."""

    def __init__(self, limit: int) -> None:
        super().__init__(body_too_large(limit), PAYLOAD_TOO_LARGE)


class ClientGone(CallerGone):
    """The client disconnected while its request was read or its inference pending (499)."""


async def read_body(request: Request, limit: int) -> bytes:
    """The raw body, refusing (before reading, when Content-Length says so) more than `limit` bytes."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise BodyTooLarge(limit)
    chunks: list[bytes] = []
    size = 0
    try:
        async for chunk in request.stream():
            if chunk:
                size += len(chunk)
                if size > limit:
                    raise BodyTooLarge(limit)
                chunks.append(chunk)
    except ClientDisconnect:
        raise ClientGone from None
    if len(chunks) == 1:  # the usual case: no join, no copy
        return chunks[0]
    return b"".join(chunks)


def request_headers(request: Request, limit: int) -> dict[str, str]:
    """The first `limit` request headers, as the handler sees them: credentials (the bearer
    token) are checked by the server and never reach handler code, and the mode switches only
    the server sets (`explain`, `describe`) are dropped (HIDDEN_FROM_HANDLERS)."""
    return handler_headers(request.scope["headers"], limit)


def handler_headers(raw: list[tuple[bytes, bytes]], limit: int) -> dict[str, str]:
    """`request_headers` from an ASGI scope's raw header list."""
    # ASGI servers deliver header names lower-cased already (the spec requires it).
    if len(raw) > limit:
        raw = raw[:limit]
    headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in raw}
    for name in HIDDEN_FROM_HANDLERS:
        headers.pop(name, None)
    return headers


async def offload_if_large(
    size: int, fn: Callable[..., T], *args: Any, threshold: int = OFFLOAD_DECODE_BYTES
) -> T:
    """`fn(*args)`, on a worker thread when `size` reaches `threshold`, inline when it is cheap."""
    if size < threshold:
        return fn(*args)
    return await run_in_threadpool(fn, *args)


def make_app(routes: list[Any]) -> Starlette:
    """A Starlette app with our error handlers and no trailing-slash redirects.

    Starlette redirects `/x/` to `/x` with a 307 whose Location comes from the client's Host
    header: a status outside our error table and a reflected header. A wrong path is a 404.
    """
    app = Starlette(routes=routes, exception_handlers=dict(HTTP_ERROR_HANDLERS))
    app.router.redirect_slashes = False
    return app


def without_trailing_slashes(scope: Any) -> Any:
    """`scope` with its path's trailing slashes dropped: `/models/m/` is `/models/m` and
    `/predictions/m/` is `/predictions/m`, as TorchServe's router reads them (it splits the path
    with Java's String.split, which drops trailing empty segments), so its clients' paths work."""
    path = scope.get("path", "")
    if scope.get("type") != "http" or len(path) < 2 or not path.endswith("/"):
        return scope
    scope = {**scope, "path": trimmed_path(path)}
    raw = scope.get("raw_path")
    if isinstance(raw, bytes):
        scope["raw_path"] = raw.rstrip(b"/") or b"/"
    return scope


def trimmed_path(path: str) -> str:
    """`path` without trailing slashes, as TorchServe's router reads it (`without_trailing_slashes`)."""
    return path.rstrip("/") or "/"


class TrailingSlashes:
    """ASGI wrapper applying `without_trailing_slashes` to every request."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await self.app(without_trailing_slashes(scope), receive, send)
