"""The inference listener's HTTP stack, as a frontend serves it: the app behind TorchServe's
access log, the drain's admission and the listener's tokens, and the protocol that takes
predictions on their fast path (`prediction_path`). One builder, so the frontend and the tests
that compare the two ways a prediction is answered serve the same stack."""

from __future__ import annotations

from typing import TYPE_CHECKING

import uvicorn

from mariner.server.common.held_bytes import HeldBytes
from mariner.server.common.http_common import DEFAULT_MAX_HEADERS
from mariner.server.common.http_limits import LimitedHttpToolsProtocol
from mariner.server.common.listeners import ListenerAuth, split_address, uvicorn_config
from mariner.server.common.security import OPEN_HTTP_HEALTH_PATHS
from mariner.server.compat.torchserve.logs.access import HttpAccessLog
from mariner.server.frontend.protocols.http_drain import DrainAware
from mariner.server.frontend.protocols.http_listener import inference_app
from mariner.server.frontend.protocols.prediction_path import PredictionPath
from mariner.server.frontend.protocols.prediction_protocol import prediction_protocol

if TYPE_CHECKING:
    from mariner.server.common.config import ServerConfig
    from mariner.server.contracts.workflow_dag import WorkflowTable
    from mariner.server.frontend.dataplane import DataPlane


def inference_listener(
    dataplane: DataPlane,
    cfg: ServerConfig,
    auth: ListenerAuth,
    *,
    port: int,
    thread: str,
    held: HeldBytes | None,
    workflows: WorkflowTable | None = None,
    fast_predictions: bool = True,
) -> uvicorn.Config:
    """uvicorn's settings for the inference listener on `port` (the host is
    `cfg.inference_address`'s). `thread` names the listener in TorchServe's access log;
    `fast_predictions=False` sends predictions through the app too (the tests' comparison)."""
    app = HttpAccessLog(  # TorchServe's access_log.log: every answer, 401s and draining 503s too
        DrainAware(
            auth.http(
                inference_app(dataplane, max_body_bytes=cfg.max_request_bytes, workflows=workflows),
                open_paths=OPEN_HTTP_HEALTH_PATHS if cfg.open_health else frozenset(),
            ),
            dataplane,
        ),
        thread,
    )
    protocol: type[LimitedHttpToolsProtocol] = LimitedHttpToolsProtocol
    if fast_predictions:
        path = PredictionPath(
            dataplane,
            max_body_bytes=cfg.max_request_bytes,
            max_headers=DEFAULT_MAX_HEADERS,
            credential=auth.credential,
            thread=thread,
        )
        protocol = prediction_protocol(path)
    host, _ = split_address(cfg.inference_address)
    return uvicorn_config(app, host, port, cfg, listener="inference", held=held, protocol=protocol)
