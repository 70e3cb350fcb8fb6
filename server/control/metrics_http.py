"""Prometheus metrics over HTTP (8082): GET /metrics renders `dataplane.metrics`."""

from __future__ import annotations

from typing import TYPE_CHECKING

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from mariner.server.control import metrics as metrics_mod
from mariner.server.protocols.http_common import make_app

if TYPE_CHECKING:
    from mariner.server.core.dataplane import DataPlane


def metrics_app(dataplane: DataPlane) -> Starlette:
    """Prometheus exposition of `dataplane.metrics` at GET /metrics.

    Rendering runs on a worker thread: it walks every series and may touch CUDA, and scrapes
    must not stall the event loop that serves inference.
    """
    metrics = dataplane.metrics

    async def scrape(request: Request) -> Response:
        return Response(await run_in_threadpool(metrics.render), media_type=metrics_mod.CONTENT_TYPE)

    return make_app([Route("/metrics", scrape, methods=["GET"])])
