"""TorchServe's management REST API (8081): list, describe, register, unregister, scale,
set-default, with TorchServe's list/describe/status JSON and status codes.

As in TorchServe 0.11+, only what loads or drops code is gated: register and unregister answer
TorchServe's 405 MethodNotAllowedException unless the server was started with model management
enabled (TorchServe's `enable_model_api`); scale and set-default work whenever this API is
reachable (with its token). Registering from a URL is refused as TorchServe refuses a URL no
`allowed_urls` pattern matches (404 ModelNotFoundException): archives come only from the model
store, by entry name.

Parameters are read as TorchServe reads them (`RegisterModelRequest`, `NettyUtils`): a number that
is not one means "not given", `synchronous` is true only for "true", a parameter TorchServe does
not know is ignored; each value ignored that way is named in one warning. A register without a
worker count registers the model with none (or `default_workers_per_model`) and answers 200 at
once, even with `synchronous=false`; one with workers and `synchronous=false` answers 202, as does
a scale without `synchronous=true` (TorchServe's default for scaling). A path may end in `/`
(`DELETE /models/m/`): TorchServe's router ignores trailing slashes.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from mariner.server.common import triton_ext_http as oip_http_ext
from mariner.server.common.archive import is_url, url_not_allowed
from mariner.server.common.http_common import (
    JSON,
    BodyTooLarge,
    TrailingSlashes,
    error_response,
    json_response,
    make_app,
    make_guard,
    read_body,
)
from mariner.server.common.openapi import api_description_routes
from mariner.server.common.register_settings import register_call_overrides
from mariner.server.compat.torchserve.forms import decode_value, mime_type
from mariner.server.contracts.errors import Code, ServingError
from mariner.server.contracts.names import check_model_name, check_params
from mariner.server.contracts.types import WireProtocol
from mariner.server.supervisor.management.describe import (
    MAX_PAGE,
    describe_customized,
    describe_models,
    list_models,
    registered_message,
)

if TYPE_CHECKING:
    from mariner.server.supervisor.management.grpc import ManagementPlane

log = logging.getLogger("mariner.http")

# Management requests carry a few parameters at most.
MAX_MANAGEMENT_BODY_BYTES = 64 * 1024

# TorchServe's RegisterModelRequest fields; any other parameter is ignored with a warning, as
# TorchServe ignores it.
_REGISTER_PARAMS = frozenset(
    {
        "url",
        "model_name",
        "handler",
        "batch_size",
        "max_batch_delay",
        "response_timeout",
        "startup_timeout",
        "initial_workers",
        "synchronous",
        "runtime",
        "s3_sse_kms",
    }
)
# Manifest.RuntimeType values TorchServe accepts; Mariner runs Python handlers ("LSP" is C++).
_PYTHON_RUNTIMES = ("python", "python3")
# TorchServe's body for a request its router does not serve (and for the model API turned off).
METHOD_NOT_ALLOWED = {
    "code": 405,
    "type": "MethodNotAllowedException",
    "message": "Requested method is not allowed, please refer to API document.",
}


def _lenient_int(params: Mapping[str, str], key: str, default: int) -> int:
    """TorchServe's getIntParameter: a missing or malformed value means the default (a malformed
    one is named in a warning, as TorchServe accepts it silently)."""
    if key not in params:
        return default
    try:
        return int(params[key])
    except (ValueError, TypeError):
        log.warning("parameter %s=%r is not an integer (TorchServe accepts it): using %d instead",
                    key, str(params[key])[:80], default)  # fmt: skip
        return default


_guarded = make_guard("management", log, error_response)


def _path(request: Request) -> dict[str, str]:
    """The route's model name and version, refused (400) when they hold control characters: they
    reach log lines and error messages. Any other name is looked up and, when unknown, is 404."""
    params = dict(request.path_params)
    if "version" not in params and "model_version" in request.query_params:
        params["model_version"] = request.query_params["model_version"]
    check_params(params)
    return params


# TorchServe's answer to a change it accepted and carries on with after answering.
ACCEPTED_STATUS = "Processing worker updates..."


def _true(value: object, default: bool, name: str = "synchronous") -> bool:
    """Java's Boolean.parseBoolean, as TorchServe reads `synchronous`: only "true" (any case) is
    true; a JSON body may carry a real boolean. A value that is neither true nor false is named
    in a warning (read as false, as TorchServe reads it)."""
    if value is None:
        return default
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text not in ("true", "false"):
        log.warning("parameter %s=%r is not true or false (TorchServe accepts it): read as false",
                    name, str(value)[:80])  # fmt: skip
    return text == "true"


def _not_allowed(what: str) -> Response:
    """TorchServe's 405 for register/unregister while its model API is off, word for word (its
    clients compare the body); how to turn it on goes to the log."""
    log.warning(
        "%s refused (405): the model API is off; start the server with --enable-model-management "
        "(torchserve's --enable-model-api, enable_model_api=true) to allow it",
        what,
    )
    return json_response(METHOD_NOT_ALLOWED, status=405)


def _warn_ignored(params: Mapping[str, Any]) -> None:
    """One warning naming the register parameters TorchServe does not know (it ignores them)."""
    unknown = sorted(set(params) - _REGISTER_PARAMS)
    if unknown:
        log.warning(
            "register parameter(s) %s are not TorchServe's and are ignored; known: %s",
            ", ".join(repr(u[:40]) for u in unknown[:8]),
            ", ".join(sorted(_REGISTER_PARAMS)),
        )


async def register_params(request: Request) -> dict[str, Any]:
    """A register call's parameters: the query's, and a JSON body's fields over them (TorchServe
    takes either, for models and workflows); a body over MAX_MANAGEMENT_BODY_BYTES, or one that
    is not a JSON object, is a 400."""
    params: dict[str, Any] = dict(request.query_params)
    if mime_type(request.headers.get("content-type", "")) == JSON:
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
    return params


def management_app(dataplane: ManagementPlane) -> Starlette:
    """TorchServe's management API: list, describe, register, unregister, scale, set-default,
    and the OpenAPI description of these routes (`OPTIONS /`, `GET /api-description`).

    Register and unregister answer 405 unless model management is enabled; scale and
    set-default are always allowed (see the module docstring). Registering from a URL is
    refused regardless: archives are only taken from the model store, by file name.
    """
    background: set[asyncio.Task[None]] = set()  # accepted (202) changes still in progress

    async def accepted(change: Callable[[], Awaitable[None]], what: str) -> Response:
        """Start `change` and answer 202; a refusal it raises before its first wait (unknown
        model, bad count, not supported here) is still the caller's answer."""

        async def run() -> None:
            try:
                await change()
            except Exception as exc:
                if not first_step_done:
                    raise
                why = exc.message if isinstance(exc, ServingError) else repr(exc)
                log.error("%s failed after it was accepted: %s", what, why)

        first_step_done = False
        task = asyncio.create_task(run())
        await asyncio.sleep(0)  # one step: synchronous refusals surface now
        first_step_done = True
        if task.done():
            task.result()  # raises the refusal, if any
        else:
            background.add(task)
            task.add_done_callback(background.discard)
        return json_response({"status": ACCEPTED_STATUS}, status=202)

    async def list_models_page(request: Request) -> Response:
        """List the models served (their default versions), paginated."""
        q = request.query_params
        limit = _lenient_int(q, "limit", MAX_PAGE)
        start = _lenient_int(q, "next_page_token", 0)
        return json_response(list_models(dataplane.models(), limit, start))

    async def describe(request: Request) -> Response:
        """Describe a model's default version, one version, or every version ("all")."""
        p = _path(request)
        # customized=true: the handler's describe_handle
        if _true(request.query_params.get("customized"), False, "customized"):
            doc, status = await describe_customized(
                dataplane, p["name"], p.get("version"), request.headers, WireProtocol.TS_HTTP
            )
            return json_response(doc, status=status)
        return json_response(describe_models(dataplane, p["name"], p.get("version")))

    async def register(request: Request) -> Response:
        """Register an archive from the model store (needs model management)."""
        if not dataplane.management_enabled:
            return _not_allowed("model registration")
        params = await register_params(request)
        if isinstance(params.get("model_name"), str) and params["model_name"]:
            check_model_name(params["model_name"])  # before the generic check: its message says the rule
        _warn_ignored(params)
        check_params({k: v for k, v in params.items() if k in _REGISTER_PARAMS})  # NUL, newline, length
        url = params.get("url")
        if url is None:
            raise ServingError(Code.INVALID_ARGUMENT, "Parameter url is required.")
        if not isinstance(url, str):
            raise ServingError(Code.INVALID_ARGUMENT, f"parameter url must be a string, got {url!r}")
        if is_url(url):  # TorchServe's answer to a URL its allowed_urls do not match
            raise url_not_allowed(url)
        runtime = params.get("runtime")
        if runtime is not None and str(runtime) not in _PYTHON_RUNTIMES:
            raise ServingError(
                Code.INVALID_ARGUMENT,
                f"runtime {str(runtime)[:40]!r} is not supported; allowed: {', '.join(_PYTHON_RUNTIMES)}",
            )
        handler = params.get("handler")
        if handler is not None and not isinstance(handler, str):
            raise ServingError(Code.INVALID_ARGUMENT, f"parameter handler must be a string, got {handler!r}")
        overrides: dict[str, Any] = register_call_overrides(
            batch_size=params.get("batch_size"),
            max_batch_delay=params.get("max_batch_delay"),
            response_timeout=params.get("response_timeout"),
            initial_workers=params.get("initial_workers"),
            startup_timeout=params.get("startup_timeout"),
        ).given()
        if params.get("model_name"):
            overrides["name"] = check_model_name(str(params["model_name"]))
        if handler:
            overrides["handler"] = handler  # only when given, so planes that predate it see no change
        if not _true(params.get("synchronous"), True):
            # Only passed when asked for, so planes that predate it see the call unchanged.
            infos = await dataplane.register(url, synchronous=False, **overrides)
            if infos and infos[0].min_workers == 0:  # nothing to wait for: TorchServe's 200
                return json_response({"status": registered_message(infos[0])})
            return json_response({"status": ACCEPTED_STATUS}, status=202)
        infos = await dataplane.register(url, **overrides)
        return json_response({"status": registered_message(infos[0])})

    async def unregister(request: Request) -> Response:
        """Stop serving a model version (needs model management)."""
        if not dataplane.management_enabled:
            return _not_allowed("model unregistration")
        p = _path(request)
        await dataplane.unregister(p["name"], p.get("version"))
        return json_response({"status": f'Model "{p["name"]}" unregistered'})

    async def scale(request: Request) -> Response:
        """Set a model version's worker count; 202 at once unless synchronous=true."""
        p, q = _path(request), request.query_params
        version = p.get("version") or p.get("model_version")
        # TorchServe's getIntParameter: min_worker=nan is 1; number_gpu and timeout are not read.
        min_workers = _lenient_int(q, "min_worker", 1)
        max_workers = _lenient_int(q, "max_worker", min_workers)
        if max_workers < min_workers:
            raise ServingError(Code.INVALID_ARGUMENT, "max_worker cannot be less than min_worker.")
        if not _true(q.get("synchronous"), False):
            dataplane.describe(p["name"], version)  # an unknown model is a 404 now, not in the log
            return await accepted(
                lambda: dataplane.scale(p["name"], version, min_workers, max_workers), "scaling workers"
            )
        await dataplane.scale(p["name"], version, min_workers, max_workers)
        msg = f"Workers scaled to {min_workers} for model: {p['name']}"
        return json_response({"status": msg + (f", version: {version}" if version else "")})

    async def set_default(request: Request) -> Response:
        """Make a version the one calls without a version reach."""
        p = _path(request)
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
    # Triton's repository extension (load/unload/index) is a management call: served here.
    repository = oip_http_ext.repository_routes(dataplane)
    app = make_app([*routes, *api_description_routes("Mariner management API"), *repository])
    app.add_middleware(TrailingSlashes)
    return app
