"""TorchServe's management REST API (8081): list, describe, register, unregister, scale,
set-default, with TorchServe's list/describe/status JSON.

Reads always work; changes go to the DataPlane, which refuses them (403) unless the server was
started with model management enabled. Registering from a URL is always refused: archives come
only from the model store, by file name.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from mariner.server.control.describe import MAX_PAGE, describe_models, list_models
from mariner.server.core.errors import Code, ServingError
from mariner.server.core.model_settings import register_call_overrides
from mariner.server.protocols.http_common import (
    JSON,
    BodyTooLarge,
    error_response,
    json_response,
    make_app,
    make_guard,
    read_body,
)
from mariner.server.protocols.torchserve.forms import decode_value, mime_type

if TYPE_CHECKING:
    from mariner.server.core.dataplane import DataPlane

log = logging.getLogger("mariner.http")

# Management requests carry a few parameters at most.
MAX_MANAGEMENT_BODY_BYTES = 64 * 1024

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


_guarded = make_guard("management", log, error_response)


def management_app(dataplane: DataPlane) -> Starlette:
    """TorchServe's management API: list, describe, register, unregister, scale, set-default.

    Reads always work; changes go to the DataPlane, which refuses them (403) unless the server
    was started with model management enabled. Registering from a URL is refused regardless:
    archives are only taken from the model store, by file name.
    """

    async def list_models_page(request: Request) -> Response:
        q = request.query_params
        limit = _lenient_int(q, "limit", MAX_PAGE)
        start = _lenient_int(q, "next_page_token", 0)
        return json_response(list_models(dataplane.models(), limit, start))

    async def describe(request: Request) -> Response:
        p = request.path_params
        return json_response(describe_models(dataplane, p["name"], p.get("version")))

    async def register(request: Request) -> Response:
        params: dict[str, Any] = dict(request.query_params)
        if mime_type(request.headers.get("content-type", "")) == JSON:  # TorchServe also takes a JSON body
            try:
                raw = await read_body(request, MAX_MANAGEMENT_BODY_BYTES)
            except BodyTooLarge:
                raise ServingError(
                    Code.INVALID_ARGUMENT, f"register request body is over {MAX_MANAGEMENT_BODY_BYTES} bytes"
                ) from None
            body = decode_value(raw, JSON, "register request body") if raw else {}
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
        overrides = register_call_overrides(
            batch_size=params.get("batch_size"),
            max_batch_delay=params.get("max_batch_delay"),
            response_timeout=params.get("response_timeout"),
            initial_workers=params.get("initial_workers"),
        ).given()
        if params.get("model_name"):
            overrides["name"] = str(params["model_name"])
        # `synchronous` is accepted and moot: Mariner answers after the model has loaded.
        infos = await dataplane.register(url, **overrides)
        i = infos[0]
        n = sum(1 for w in i.workers if w.status == "READY")
        return json_response(
            {"status": f'Model "{i.name}" Version: {i.version} registered with {n} initial workers'}
        )

    async def unregister(request: Request) -> Response:
        p = request.path_params
        await dataplane.unregister(p["name"], p.get("version"))
        return json_response({"status": f'Model "{p["name"]}" unregistered'})

    async def scale(request: Request) -> Response:
        p, q = request.path_params, request.query_params
        version = p.get("version") or q.get("model_version")
        min_workers = _lenient_int(q, "min_worker", 1)
        max_workers = _lenient_int(q, "max_worker", min_workers)
        if max_workers < min_workers:
            raise ServingError(Code.INVALID_ARGUMENT, "max_worker cannot be less than min_worker")
        await dataplane.scale(p["name"], version, min_workers, max_workers)
        msg = f"Workers scaled to {min_workers} for model: {p['name']}"
        return json_response({"status": msg + (f", version: {version}" if version else "")})

    async def set_default(request: Request) -> Response:
        p = request.path_params
        await dataplane.set_default(p["name"], p["version"])
        return json_response(
            {"status": f'Default version successfully updated for model "{p["name"]}" to "{p["version"]}"'}
        )

    routes = [
        Route("/models", _guarded("listing models", list_models_page), methods=["GET"]),
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
    return make_app(routes)
