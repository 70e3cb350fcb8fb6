"""Closed-loop callers over bidirectional gRPC streams, for `mariner.loadtest.closedloop`.

Two client set-ups, next to the unary ones:

- `grpc-stream`: TorchServe's `StreamPredictions2` (the same `PredictionsRequest` as unary
  `Predictions`, the body in the `data` input);
- `oip-stream`: the Open Inference Protocol's `ModelStreamInfer` (the digit as a raw FP32
  `pixels` tensor, `mariner.loadtest.oip.grpc_request`, as the locust OIP user sends it).

Each closed-loop coroutine owns one stream, opened on first use and kept for every request it
sends: write one request, read its answer, write the next. So at concurrency C there are C
streams with one request each in flight, exactly the load of C unary callers, and the only
difference measured is the per-call cost a stream saves (call set-up, headers, trailers). The
streams of a process are spread over its channels as unary callers are.

StreamPredictions2 needs a `sequence_id` on every request: stock TorchServe answers a request
with neither one nor `ts_request_sequence_start`="true" with an in-stream error ("Parameter
sequenceId is required."). Each coroutine sends a fixed id of its own. An answer carrying a
`status` (TorchServe's in-stream error) or an `error_message` (OIP's) is an error, as is an
answer that is not a valid prediction (`check_answer` / `oip.label_from_grpc`).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import grpc

STREAM_PROTOCOLS = ("grpc-stream", "oip-stream")

Caller = Callable[[int], Awaitable[bytes]]


class StreamAnswerError(RuntimeError):
    """An in-stream error answer, or a stream that ended before answering."""


class _Stream:
    """One bidirectional call, opened lazily; reopened after a failure (it is then mid-message)."""

    def __init__(self, open_call: Callable[[], Any], timeout_s: float) -> None:
        self._open = open_call
        self._timeout = timeout_s
        self._call: Any = None

    async def exchange(self, request: Any) -> Any:
        if self._call is None:
            self._call = self._open()
        call = self._call
        # A timer per message, not asyncio.wait_for (a task per request): the client's own CPU
        # is taken from the server on a small machine. A hung answer cancels the stream.
        expired = False

        def expire() -> None:
            nonlocal expired
            expired = True
            call.cancel()

        timer = asyncio.get_running_loop().call_later(self._timeout, expire)
        try:
            await call.write(request)
            answer = await call.read()
        except BaseException as exc:
            self.cancel()
            if expired:
                raise TimeoutError(f"no answer on the stream within {self._timeout:g} s") from exc
            raise
        finally:
            timer.cancel()
        if answer is grpc.aio.EOF:
            self.cancel()
            raise StreamAnswerError("the server ended the stream")
        return answer

    def cancel(self) -> None:
        if self._call is not None:
            self._call.cancel()
            self._call = None


def stream_callers(
    protocol: str,
    channels: Sequence[Any],
    model: str,
    bodies: Sequence[bytes],
    coroutines: int,
    timeout_s: float,
    *,
    tag: str = "",
) -> tuple[list[Caller], Callable[[], None]]:
    """One caller per coroutine, each on its own stream (round-robin over `channels`), and a
    function that cancels every stream still open. `tag` makes the sequence ids of one client
    process distinct from another's."""
    streams: list[_Stream] = []
    if protocol == "grpc-stream":
        from mariner.server._proto.torchserve import inference_pb2, inference_pb2_grpc

        stubs = [inference_pb2_grpc.InferenceAPIsServiceStub(ch) for ch in channels]
        make = inference_pb2.PredictionsRequest

        def torchserve_caller(k: int) -> Caller:
            stream = _Stream(stubs[k % len(stubs)].StreamPredictions2, timeout_s)
            streams.append(stream)
            # Built per coroutine: the sequence id is part of every request it sends.
            requests = [
                make(model_name=model, input={"data": b}, sequence_id=f"bench-{tag}{k}") for b in bodies
            ]

            async def call(i: int) -> bytes:
                answer = await stream.exchange(requests[i])
                if answer.HasField("status"):
                    raise StreamAnswerError(f"in-stream error {answer.status.code}: {answer.status.message}")
                return bytes(answer.prediction)

            return call

        return [torchserve_caller(k) for k in range(coroutines)], lambda: _cancel(streams)
    if protocol == "oip-stream":
        import numpy as np

        from mariner.loadtest import oip

        pb2, pb2_grpc = oip.grpc_messages()
        oip_stubs = [pb2_grpc.GRPCInferenceServiceStub(ch) for ch in channels]
        oip_requests = [oip.grpc_request(pb2, model, np.asarray(json.loads(b), np.float32)) for b in bodies]

        def oip_caller(k: int) -> Caller:
            stream = _Stream(oip_stubs[k % len(oip_stubs)].ModelStreamInfer, timeout_s)
            streams.append(stream)

            async def call(i: int) -> bytes:
                answer = await stream.exchange(oip_requests[i])
                if answer.error_message:
                    raise StreamAnswerError(f"in-stream error: {answer.error_message}")
                label = oip.label_from_grpc(answer.infer_response)
                # The digits answer check reads TorchServe's JSON; the OIP check above is stricter.
                return json.dumps({"label": label}).encode()

            return call

        return [oip_caller(k) for k in range(coroutines)], lambda: _cancel(streams)
    raise ValueError(f"not a stream protocol: {protocol!r}; choose from {STREAM_PROTOCOLS}")


def _cancel(streams: Sequence[_Stream]) -> None:
    for stream in streams:
        stream.cancel()
