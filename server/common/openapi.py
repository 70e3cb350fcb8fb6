"""The OpenAPI 3 description of what a listener serves (`OPTIONS /`, `GET /api-description`).

TorchServe answers both with `{"openapi": "3.0.1", "info": {...}, "paths": {...}}` on its
inference and management ports; clients and API gateways read it to learn the routes. The
document is generated, at request time, by walking the Starlette app that received the request:
a route added to an app (by any module) is described without anyone keeping a list, and a route
removed disappears. Each operation's summary is the first line of its endpoint's docstring.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Iterator, Sequence
from importlib import metadata
from typing import Any

from starlette.convertors import FloatConvertor, IntegerConvertor, PathConvertor
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Mount, Route

from mariner.server.common.http_common import json_response

OPENAPI_VERSION = "3.0.1"  # what TorchServe 0.12 declares

# Methods Starlette adds on its own (HEAD beside every GET) are not operations of ours.
_IMPLICIT = frozenset({"HEAD"})
_CONVERTOR = re.compile(r"\{(\w+):[^}]+\}")
_ERROR = {"description": "Error, as JSON: {code, type, message}"}


def _version() -> str:
    try:
        return metadata.version("mariner")
    except metadata.PackageNotFoundError:  # running from a tree that was not installed
        return "0.0.0"


def _summary(endpoint: Any) -> tuple[str, str]:
    """First docstring line and the whole docstring of the function a route calls (through any
    wrapper that kept `__wrapped__`)."""
    doc = inspect.getdoc(inspect.unwrap(endpoint)) or ""
    first = doc.strip().split("\n\n", 1)[0].replace("\n", " ").strip()
    return first, doc


def _param_schema(convertor: Any) -> dict[str, str]:
    if isinstance(convertor, IntegerConvertor):
        return {"type": "integer"}
    if isinstance(convertor, FloatConvertor):
        return {"type": "number"}
    return {"type": "string"}


def _walk(routes: Sequence[BaseRoute], prefix: str = "") -> Iterator[tuple[str, Route]]:
    """Every Route with its OpenAPI path template (`{times:int}` becomes `{times}`). A catch-all
    (a `path` parameter, which matches across slashes) only shapes the errors for what is not
    served: it is no operation, and OpenAPI has no template for it."""
    for route in routes:
        if isinstance(route, Route) and any(
            isinstance(c, PathConvertor) for c in route.param_convertors.values()
        ):
            continue
        if isinstance(route, Route):
            yield _CONVERTOR.sub(r"{\1}", prefix + route.path), route
        elif isinstance(route, Mount):
            yield from _walk(route.routes, prefix + route.path)


def _operation(path: str, route: Route, method: str) -> dict[str, Any]:
    summary, doc = _summary(route.endpoint)
    op: dict[str, Any] = {"summary": summary or f"{method} {path}"}
    if doc and doc != summary:
        op["description"] = doc
    params = [
        {"name": name, "in": "path", "required": True, "schema": _param_schema(conv)}
        for name, conv in route.param_convertors.items()
    ]
    if params:
        op["parameters"] = params
    op["responses"] = {"200": {"description": "OK"}, "default": _ERROR}
    return op


def openapi_document(routes: Sequence[BaseRoute], title: str) -> dict[str, Any]:
    """The OpenAPI 3 document of `routes`: one path per route template, one operation per
    method, with its path parameters and the summary from the endpoint's docstring."""
    paths: dict[str, dict[str, Any]] = {}
    for path, route in _walk(routes):
        for method in sorted((route.methods or {"GET"}) - _IMPLICIT):
            paths.setdefault(path, {})[method.lower()] = _operation(path, route, method)
    return {
        "openapi": OPENAPI_VERSION,
        "info": {
            "title": title,
            "description": "Mariner serves TorchServe model archives; these are the routes of this port.",
            "version": _version(),
        },
        "paths": dict(sorted(paths.items())),
    }


def api_description_routes(title: str) -> list[Route]:
    """`OPTIONS /` and `GET /api-description`, as TorchServe serves them, describing the app
    they are part of (whatever routes it has when asked)."""

    async def describe_api(request: Request) -> Response:
        """Get the OpenAPI description of this port's API."""
        return json_response(openapi_document(request.app.routes, title))

    return [
        Route("/", describe_api, methods=["OPTIONS"]),
        Route("/api-description", describe_api, methods=["GET"]),
    ]
