"""The HTTP inference listener (8080): every inference protocol's routes on one Starlette app.

TorchServe's `/ping`, `/predictions`, `/explanations` and `/invocations`
(mariner.server.protocols.torchserve.http), KServe's v1 `/v1/models/...`
(mariner.server.protocols.kserve_v1), the Open Inference Protocol's `/v2`
(mariner.server.protocols.oip.http) and the probes `/healthz`,
`/readyz` (mariner.server.control.health) share the port and the DataPlane. Management (8081)
and metrics (8082) are apps of their own in mariner.server.control.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from starlette.applications import Starlette

from mariner.server.control import health
from mariner.server.control.openapi import api_description_routes
from mariner.server.protocols import kserve_v1
from mariner.server.protocols.http_common import DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_HEADERS, make_app
from mariner.server.protocols.oip import http as oip_http
from mariner.server.protocols.torchserve import http as torchserve_http

if TYPE_CHECKING:
    from mariner.server.core.dataplane import DataPlane


def inference_app(
    dataplane: DataPlane,
    *,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    max_headers: int = DEFAULT_MAX_HEADERS,
) -> Starlette:
    """The inference listener's app. `max_body_bytes` bounds a request body (413 beyond it,
    before it is read when the client declares its length); `max_headers` bounds the headers
    handed to the handler."""
    limits = {"max_body_bytes": max_body_bytes, "max_headers": max_headers}
    return make_app(
        torchserve_http.routes(dataplane, **limits)
        + health.http_routes(dataplane)
        + oip_http.routes(dataplane, **limits)
        + kserve_v1.routes(dataplane, **limits)
        + api_description_routes("Mariner inference API")  # OPTIONS / and GET /api-description
    )
