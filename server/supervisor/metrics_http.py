"""Prometheus metrics over HTTP (8082): GET /metrics renders `dataplane.metrics` (TorchServe's
`name[]=` filter and OpenMetrics negotiation included)."""

from __future__ import annotations

from typing import Any, Protocol

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from mariner.server.common.http_common import make_app


class Exposed(Protocol):
    """What /metrics renders: a plane's `metrics` (the supervisor's merges every process)."""

    @property
    def metrics(self) -> Any: ...


def metrics_app(dataplane: Exposed) -> Starlette:
    """Prometheus exposition of `dataplane.metrics` at GET /metrics.

    Rendering runs on a worker thread: it walks every series and may touch CUDA, and scrapes
    must not stall the event loop that serves inference.
    """
    metrics = dataplane.metrics

    async def scrape(request: Request) -> Response:
        # TorchServe's filter (`?name[]=a&name[]=b`) and the scraper's format (OpenMetrics or text).
        names = request.query_params.getlist("name[]")
        accept = request.headers.get("accept")
        body, content_type = await run_in_threadpool(metrics.exposition, accept, names)
        return Response(body, headers={"content-type": content_type})

    return make_app([Route("/metrics", scrape, methods=["GET"])])
