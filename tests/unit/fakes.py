"""Fakes shared by the adapter tests: quiet metrics, a uvicorn runner and a DataPlane for both protocols.

`FakePlane` serves one model, "digits" version "1", that speaks both protocols (a TorchServe
body and the OIP tensor signature) so one test can drive every entry point against it; `mode`
chooses what its handler does. Any other model name is not served (NOT_FOUND).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import grpc
import numpy as np
import uvicorn

from mariner.server.common.metrics import Metrics
from mariner.server.contracts.errors import Code, ServingError
from mariner.server.contracts.tensors import ModelSignature, TensorSpec
from mariner.server.contracts.types import InferRequest, InferResult, ModelInfo, ModelState, WorkerInfo

START_TIMEOUT = 10

DIGITS = ModelSignature(
    inputs=(TensorSpec("pixels", "FP32", (-1, 64)),),
    outputs=(
        TensorSpec("logits", "FP32", (-1, 10)),
        TensorSpec("probabilities", "FP32", (-1, 10)),
        TensorSpec("label", "INT64", (-1,)),
    ),
)


class QuietMetrics(Metrics):
    """Real metrics without the CUDA sampling, which would import torch into a unit test."""

    def _sample_gpu(self) -> None:
        pass


def make_info(
    name: str, version: str, signature: ModelSignature | None = None, *, default: bool = True, **changes: Any
) -> ModelInfo:
    """A READY model version with one CPU worker; `changes` override any ModelInfo field."""
    info = ModelInfo(
        name=name,
        version=version,
        archive=f"{name}.mar",
        sha256="ab" * 32,
        handler="handler.py",
        is_default=default,
        state=ModelState.READY,
        batch_size=8,
        max_batch_delay_ms=0.0,
        response_timeout_s=30.0,
        queue_size=64,
        min_workers=1,
        max_workers=1,
        workers=(WorkerInfo(id="w0", device="cpu", status="READY", batches=0),),
        load_seconds=0.1,
        signature=signature,
    )
    return dataclasses.replace(info, **changes)


def digits_outputs(pixels: np.ndarray) -> dict[str, np.ndarray]:
    """Deterministic 'model': logits are the first ten pixels doubled."""
    logits = (pixels[:, :10] * 2).astype(np.float32)
    return {
        "logits": logits,
        "probabilities": np.full_like(logits, 0.1),
        "label": logits.argmax(axis=1).astype(np.int64),
    }


Mode = Literal["ok", "reject", "boom"]


class TransportCalls:
    """What the prediction fast path asks of a DataPlane beyond `infer` (a fake plane's mixin):
    `enqueue` runs the plane's `infer` in a task, so a fake answers both ways alike."""

    draining = False

    def enqueue(self, req: InferRequest, caller: Any, *, admitted: bool) -> asyncio.Future[InferResult]:
        return asyncio.ensure_future(self.infer(req))  # type: ignore[attr-defined]

    def begin_call(self) -> None:
        pass

    def end_call(self) -> None:
        pass


@dataclass
class FakePlane(TransportCalls):
    """The DataPlane surface every inference adapter uses, serving "digits" version "1".

    `mode`: "ok" answers (tensors for a tensor request, bytes otherwise), "reject" answers
    with the handler's own 400 (as set_response_status does), "boom" raises an unexpected error.
    """

    mode: Mode = "ok"
    metrics: Metrics = field(default_factory=QuietMetrics)
    info: ModelInfo = field(default_factory=lambda: make_info("digits", "1", DIGITS))
    seen: list[InferRequest] = field(default_factory=list)

    def resolve(self, model: str, version: str | None = None) -> ModelInfo:
        if model != self.info.name or version not in (None, self.info.version):
            raise ServingError(Code.NOT_FOUND, f"model {model!r} version {version!r} is not served here")
        return self.info

    def known_label(self, model: str, version: str | None) -> tuple[str, str]:
        try:
            info = self.resolve(model, version)
        except ServingError:
            return "unknown", "unknown"
        return info.name, info.version

    def describe(self, model: str, version: str | None = None) -> list[ModelInfo]:
        return [self.resolve(model, version)]

    def models(self) -> list[ModelInfo]:
        return [self.info]

    def is_live(self) -> bool:
        return True

    def is_ready(self) -> bool:
        return True

    def model_ready(self, model: str, version: str | None = None) -> bool:
        return model == self.info.name

    async def infer(self, req: InferRequest) -> InferResult:
        self.seen.append(req)
        self.resolve(req.model, req.version)
        if self.mode == "reject":
            return InferResult(body=b'{"error": "pixels must be in [0, 16]", "code": 400}', status=400)
        if self.mode == "boom":
            raise RuntimeError("secret /srv/handler.py line 42")
        if req.tensors is not None:
            return InferResult(body=b"", tensors=digits_outputs(req.tensors["pixels"]), model_version="1")
        return InferResult(body=b'{"label": 3}', model_version="1")

    def samples(self, name: str, **labels: str) -> float:
        """Sum of `name`'s samples whose labels include `labels`."""
        total = 0.0
        for metric in self.metrics.registry.collect():
            for s in metric.samples:
                if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                    total += s.value
        return total


# The two ways an inference listener answers a prediction (the tests that cover predictions
# run on both): the protocol's fast path, and the ASGI app alone.
PREDICTION_PATHS = ("fast", "app")


def inference_protocol(plane: Any, way: str, *, max_body_bytes: int) -> type[Any]:
    """The inference listener's protocol class over `plane`, default limits, no tokens; with
    `way="fast"` it answers predictions itself (`frontend.protocols.prediction_path`)."""
    from mariner.server.common.http_common import DEFAULT_MAX_HEADERS
    from mariner.server.common.http_limits import HttpLimits, LimitedHttpToolsProtocol, limited_protocol
    from mariner.server.frontend.protocols.prediction_path import PredictionPath
    from mariner.server.frontend.protocols.prediction_protocol import prediction_protocol

    assert way in PREDICTION_PATHS
    base: type[LimitedHttpToolsProtocol] = LimitedHttpToolsProtocol
    if way == "fast":
        path = PredictionPath(
            plane,
            max_body_bytes=max_body_bytes,
            max_headers=DEFAULT_MAX_HEADERS,
            credential=None,
            thread="test",
        )
        base = prediction_protocol(path)
    return limited_protocol(HttpLimits(), None, base)


@contextlib.contextmanager
def serve_inference(plane: Any, app: Any, way: str, *, max_body_bytes: int) -> Iterator[str]:
    """`serve` the inference `app` over `plane` with the inference listener's protocol
    (`inference_protocol`)."""
    # uvicorn's own access log off, as Mariner's listeners run (`--access-log` turns it on).
    http = inference_protocol(plane, way, max_body_bytes=max_body_bytes)
    with serve(app, http=http, access_log=False) as url:
        yield url


@contextlib.contextmanager
def serve(app: Any, **config: Any) -> Iterator[str]:
    """Run `app` on uvicorn at 127.0.0.1:0 in a thread; yield its base URL. `config`: more
    uvicorn.Config options (`http=` a protocol class, as Mariner's listeners pass theirs)."""
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="off", **config)
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + START_TIMEOUT
    while not server.started:  # readiness poll
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.005)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(START_TIMEOUT)


@contextlib.asynccontextmanager
async def grpc_inference_channel(plane: Any, max_message_bytes: int) -> AsyncIterator[grpc.aio.Channel]:
    """The real gRPC listeners over `plane` on port 0 (health polling off) and a channel to the
    inference port; both are closed on exit. Callers generate the stubs first (protogen)."""
    from mariner.server.frontend.protocols.grpc_listener import build_grpc_servers

    servers = build_grpc_servers(
        plane,
        inference_address="127.0.0.1:0",
        max_message_bytes=max_message_bytes,
        health_poll_s=None,
    )
    await servers.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{servers.inference_port}") as channel:
            yield channel
    finally:
        await servers.stop(grace=0)
