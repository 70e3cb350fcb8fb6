"""TorchServe's management REST API (8081): list, describe, register, unregister, scale,
set-default, with TorchServe's list/describe/status JSON.

Reads always work; changes go to the DataPlane, which refuses them (403) unless the server was
started with model management enabled. Registering from a URL is always refused: archives come
only from the model store, by file name.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from mariner.server.core.errors import Code, ServingError
from mariner.server.core.types import ModelInfo
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
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

if TYPE_CHECKING:
    from mariner.server.core.dataplane import DataPlane

log = logging.getLogger("mariner.http")

# Management requests carry a few parameters at most.
MAX_MANAGEMENT_BODY_BYTES = 64 * 1024
# TorchServe caps a list-models page at 100 entries.
MAX_PAGE = 100

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


_guarded = make_guard("management", log, error_response)


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
        return json_response(answer)

    async def describe(request: Request) -> Response:
        p = request.path_params
        return json_response(describe_entries(p["name"], p.get("version")))

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
        return json_response(
            {"status": f'Model "{i.name}" Version: {i.version} registered with {n} initial workers'}
        )

    async def unregister(request: Request) -> Response:
        p = request.path_params
        await dataplane.unregister(p["name"], p.get("version"))
        for key in [k for k in registered_here if k[0] == p["name"] and p.get("version") in (None, k[1])]:
            registered_here.discard(key)
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
    return make_app(routes)
