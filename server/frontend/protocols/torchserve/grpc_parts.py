"""A handler's intermediate answers (`send_intermediate_predict_response`) on TorchServe's
streaming gRPC calls: the sinks `frontend.streams` hands them to, by request id.
`StreamPredictions` holds them for its writer (`PendingParts`, bounded by MAX_HELD_BYTES);
`StreamPredictions2` writes each as a message of the stream ahead of the request's own answer
(`PartEmitter`).

Apart from `grpc` (the servicer that drains them): what is held, and when holding fails.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from typing import Any

from mariner.server.common.grpc_stubs import inference_pb2
from mariner.server.contracts.types import InferResult
from mariner.server.frontend.streams import MAX_HELD_BYTES, too_much_held

# Writes a message ahead of a request's own answer on a StreamPredictions2 stream (its bytes).
Emit = Callable[[inference_pb2.PredictionResponse, int], bool]


class PendingParts:
    """A StreamPredictions call's intermediate answers, waiting for its writer (a sink,
    `frontend.streams`); past MAX_HELD_BYTES it keeps none and says why (`overflow`)."""

    def __init__(self) -> None:
        self.queue: deque[InferResult] = deque()
        self.held = 0
        self.overflow = ""
        self.wake = asyncio.Event()

    def predicted(self, task: asyncio.Future[Any]) -> None:
        """The call's prediction is done: wake the writer (which reads its outcome, unless the
        call ended first: then it is only marked read here)."""
        if not task.cancelled():
            task.exception()
        self.wake.set()

    def partial(self, part: InferResult) -> None:
        if self.overflow:
            return
        self.held += len(part.body)
        if self.held > MAX_HELD_BYTES:
            self.overflow = too_much_held(self.held)
            self.queue.clear()
        else:
            self.queue.append(part)
        self.wake.set()


class PartEmitter:
    """A StreamPredictions2 request's sink: each intermediate answer becomes a message of the
    stream, ahead of the request's own; the stream refusing one (too much unwritten) fails it."""

    def __init__(self, emit: Emit, sequence_id: str) -> None:
        self._emit = emit
        self._sequence_id = sequence_id
        self.overflow = ""

    def partial(self, part: InferResult) -> None:
        if self.overflow:
            return
        message = inference_pb2.PredictionResponse(prediction=part.body, sequence_id=self._sequence_id)
        if not self._emit(message, len(part.body)):
            self.overflow = (
                "the client read the stream slower than the model wrote it: more than "
                f"{MAX_HELD_BYTES} bytes of intermediate answers were waiting to be written"
            )
