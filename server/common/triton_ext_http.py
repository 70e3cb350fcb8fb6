"""REST routes of Triton's extensions (`triton_ext`) and the `/v2` prefix's own 404 and 405.

Inference port: GET /v2/models[/{m}[/versions/{v}]]/stats, GET /v2/models/{m}[/versions/{v}]/config,
POST /v2/repository/index. Repository load and unload change what is served, so they are
management calls: the inference port refuses them (403, saying where to send them) and the
management app (8081, with the management token) serves them with the index.

Every answer under `/v2`, errors included, is OIP-shaped (`{"error": message}`): tritonclient
decodes nothing else, so the catch-all routes that end each list answer an unknown `/v2` path
(404) or a known path with the wrong method (405, with Allow) in that shape.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Match, Route

from mariner.server.common import triton_ext
from mariner.server.common.http_common import JSON, error_json_response, make_guard, read_body
from mariner.server.contracts.errors import Code, ServingError

# Repository request bodies are a few parameters; more is refused.
MAX_REPOSITORY_BODY_BYTES = 64 * 1024
_ALL_METHODS = ["GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"]
MANAGEMENT_ONLY = (
    "{what} is a management call: send it to the management address (port 8081 by default) "
    "with the management token"
)


# The same guard as the inference routes' (oip.http), built here: the management app serves the
# repository routes and must not import the inference adapter.
_guarded = make_guard("OIP", logging.getLogger("mariner.http.oip"), error_json_response)


def _json(obj: Any) -> Response:
    return Response(json.dumps(obj, separators=(",", ":")).encode(), 200, media_type=JSON)


async def _ready_only(request: Request) -> bool:
    """POST /v2/repository/index takes an optional JSON body {"ready": bool}."""
    body = await read_body(request, MAX_REPOSITORY_BODY_BYTES)
    if not body.strip():
        return False
    try:
        doc = json.loads(body)
    except ValueError as exc:
        raise ServingError(Code.INVALID_ARGUMENT, f"repository request is not valid JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise ServingError(Code.INVALID_ARGUMENT, "repository request body must be a JSON object")
    return doc.get("ready") is True


def fallback(routes: Sequence[BaseRoute]) -> Route:
    """The `/v2` catch-all: 405 (with Allow) when one of `routes` has this path, else 404."""

    async def unmatched(request: Request) -> Response:
        allowed: set[str] = set()
        for route in routes:
            match, _ = route.matches({**request.scope, "method": "\0"})
            if match is Match.PARTIAL and isinstance(route, Route) and route.methods:
                allowed |= route.methods
        if allowed:
            err = ServingError(
                Code.INVALID_ARGUMENT,
                f"method {request.method} is not allowed on {request.url.path}; "
                f"use {', '.join(sorted(allowed))}",
            )
            response = error_json_response(err, 405)
            response.headers["allow"] = ", ".join(sorted(allowed))
            return response
        err = ServingError(Code.NOT_FOUND, f"no such Open Inference Protocol endpoint: {request.url.path}")
        return error_json_response(err)

    return Route("/v2/{rest:path}", unmatched, methods=_ALL_METHODS)


def inference_routes(dataplane: Any) -> list[Route]:
    """Statistics, configuration and the repository index on the inference port."""

    async def stats(request: Request) -> Response:
        p = request.path_params
        found = triton_ext.model_statistics(dataplane, p.get("model"), p.get("version"))
        return _json({"model_stats": found})

    async def config(request: Request) -> Response:
        p = request.path_params
        return _json(triton_ext.model_config(dataplane, p["model"], p.get("version")))

    async def index(request: Request) -> Response:
        return _json(triton_ext.repository_index(dataplane, await _ready_only(request)))

    async def management_only(request: Request) -> Response:
        what = "model loading" if request.url.path.endswith("/load") else "model unloading"
        raise ServingError(Code.PERMISSION_DENIED, MANAGEMENT_ONLY.format(what=what))

    model = "/v2/models/{model}"
    versioned = "/v2/models/{model}/versions/{version}"
    get = ["GET"]
    return [
        Route("/v2/models/stats", _guarded("reading statistics", stats), methods=get),
        Route(f"{model}/stats", _guarded("reading statistics", stats), methods=get),
        Route(f"{versioned}/stats", _guarded("reading statistics", stats), methods=get),
        Route(f"{model}/config", _guarded("reading the model configuration", config), methods=get),
        Route(f"{versioned}/config", _guarded("reading the model configuration", config), methods=get),
        Route("/v2/repository/index", _guarded("listing the repository", index), methods=["POST"]),
        Route(
            "/v2/repository/models/{model}/load",
            _guarded("loading a model", management_only),
            methods=["POST"],
        ),
        Route(
            "/v2/repository/models/{model}/unload",
            _guarded("unloading a model", management_only),
            methods=["POST"],
        ),
    ]


def repository_routes(plane: Any) -> list[Route]:
    """The repository extension on the management app: index, load and unload, then the
    `/v2` catch-all. `plane` is the management plane (the DataPlane or the supervisor's registry)."""

    async def index(request: Request) -> Response:
        return _json(triton_ext.repository_index(plane, await _ready_only(request)))

    async def load(request: Request) -> Response:
        await read_body(request, MAX_REPOSITORY_BODY_BYTES)  # parameters: none are supported yet
        await triton_ext.load(plane, request.path_params["model"])
        return _json({})

    async def unload(request: Request) -> Response:
        await read_body(request, MAX_REPOSITORY_BODY_BYTES)
        await triton_ext.unload(plane, request.path_params["model"])
        return _json({})

    routes = [
        Route("/v2/repository/index", _guarded("listing the repository", index), methods=["POST"]),
        Route("/v2/repository/models/{model}/load", _guarded("loading a model", load), methods=["POST"]),
        Route(
            "/v2/repository/models/{model}/unload", _guarded("unloading a model", unload), methods=["POST"]
        ),
    ]
    return [*routes, fallback(routes)]
