"""The HTTP inference listener (8080): every inference protocol's routes on one Starlette app.

TorchServe's `/ping`, `/predictions`, `/explanations` and `/invocations`
(mariner.server.frontend.protocols.torchserve.http), its workflows' `/wfpredict`
(mariner.server.frontend.protocols.torchserve.workflows), KServe's v1 `/v1/models/...`
(mariner.server.frontend.protocols.kserve_v1), the Open Inference Protocol's `/v2`
(mariner.server.frontend.protocols.oip.http) and the probes `/healthz`,
`/readyz` (mariner.server.common.health) share the port and the DataPlane. Management (8081)
and metrics (8082) are apps of their own in mariner.server.control.

TorchServe's `POST|PUT /predictions/{model}[/{version}[/{url_path}]]`, the route most traffic takes, goes
straight to its endpoint: Starlette's error middleware, router and per-route exception wrapper
cost 40-47 µs of the ~197 µs a call takes in-process (`python -m mariner.loadtest.experiments.percall`,
the three ways in interleaved), and the endpoint needs none of them: every failure is answered
inside it (`frontend.protocols.call.run_call`), so the error middleware only ever saw a bug.
Every other request,
and any path that is not exactly that shape, goes through the Starlette app as before.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from mariner.server.common import health
from mariner.server.common.http_common import (
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_HEADERS,
    error_response,
    make_app,
    without_trailing_slashes,
)
from mariner.server.common.openapi import api_description_routes
from mariner.server.contracts.errors import internal
from mariner.server.frontend.protocols import kserve_v1
from mariner.server.frontend.protocols.oip import http as oip_http
from mariner.server.frontend.protocols.torchserve import http as torchserve_http
from mariner.server.frontend.protocols.torchserve import workflows as torchserve_workflows

if TYPE_CHECKING:
    from mariner.server.contracts.workflow_dag import WorkflowTable
    from mariner.server.frontend.dataplane import DataPlane


log = logging.getLogger("mariner.http")

_PREDICT_METHODS = frozenset({"POST", "PUT"})


def prediction_params(path: str) -> dict[str, str] | None:
    """The path parameters of `/predictions/{model}[/{version}[/{url_path}]]`, as Starlette's
    routes match it (model and version non-empty, no trailing slash after them; the rest, even
    empty, is the url_path), or None for any other path."""
    parts = path.split("/")
    n = len(parts)
    if n < 3 or parts[0] or parts[1] != "predictions" or not parts[2]:
        return None
    if n == 3:
        return {"model": parts[2]}
    if not parts[3]:
        return None
    if n == 4:
        return {"model": parts[2], "version": parts[3]}
    url_path = "/".join(parts[4:])
    if "\n" in url_path:  # the route's `.*` stops at a newline: no route matches it (404)
        return None
    return {"model": parts[2], "version": parts[3], "url_path": url_path}


class InferenceApp:
    """The inference listener's ASGI app: predictions straight to their endpoint, the rest to
    `app` (module docstring)."""

    def __init__(self, app: Starlette, predict: Callable[[Request], Awaitable[Response]]) -> None:
        self.app = app
        self.predict = predict  # the /predictions route's own endpoint

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].endswith("/"):
            scope = without_trailing_slashes(scope)  # `/predictions/m/` is `/predictions/m`
        if scope["type"] == "http" and scope["method"] in _PREDICT_METHODS and not scope.get("root_path"):
            params = prediction_params(scope["path"])
            if params is not None:
                scope["app"] = self.app
                scope["path_params"] = params
                request = Request(scope, receive, send)
                try:
                    response = await self.predict(request)
                except Exception:  # the endpoint answers its own failures; this is a bug's net
                    log.exception("answering a prediction for %s failed", scope["path"])
                    response = error_response(internal("answering a prediction"))
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def inference_app(
    dataplane: DataPlane,
    *,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    max_headers: int = DEFAULT_MAX_HEADERS,
    workflows: WorkflowTable | None = None,
) -> InferenceApp:
    """The inference listener's app. `max_body_bytes` bounds a request body (413 beyond it,
    before it is read when the client declares its length); `max_headers` bounds the headers
    handed to the handler. `workflows` (the frontend's table of TorchServe workflows) adds
    `/wfpredict/{workflow}`."""
    limits = {"max_body_bytes": max_body_bytes, "max_headers": max_headers}
    torchserve = torchserve_http.routes(dataplane, **limits)
    if workflows is not None:
        torchserve += torchserve_workflows.routes(dataplane, workflows, **limits)
    app = make_app(
        torchserve
        + health.http_routes(dataplane)
        + oip_http.routes(dataplane, **limits)
        + kserve_v1.routes(dataplane, **limits)
        + api_description_routes("Mariner inference API")  # OPTIONS / and GET /api-description
    )
    predict = next(r.endpoint for r in torchserve if r.path == "/predictions/{model}")
    return InferenceApp(app, predict)
