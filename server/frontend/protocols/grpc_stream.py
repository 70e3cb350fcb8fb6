"""A servicer's pipelined gRPC streams (`GrpcStreams`), their answers (`answers`), and how a
stream ends once they are written (`stream_pipeline.Ending`):

- the client half-closed: OK;
- the server began draining: UNAVAILABLE with the drain's message. Reading stopped, every
  request read was answered; requests the client sent after that were not run, and the status
  tells it to send them to another replica;
- reading the next request failed: that error's status (a `ServingError`'s own), else a
  sanitized INTERNAL. The requests read before were answered first.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from mariner.server.common.grpc_decoding import message_bytes
from mariner.server.common.grpc_status import abort, grpc_code
from mariner.server.common.held_bytes import HeldBytes
from mariner.server.contracts.errors import Code, ServingError, internal
from mariner.server.frontend.protocols.grpc_drain_gate import DRAINING_MESSAGE
from mariner.server.frontend.protocols.stream_pipeline import Ending, StreamPipeline, StreamStats


async def end_stream(context: grpc.aio.ServicerContext, pipe: StreamPipeline[Any, Any]) -> None:
    """Return for a clean end; abort the call with the status of any other ending."""
    if pipe.ending is Ending.DRAINED:
        await abort(context, ServingError(Code.UNAVAILABLE, DRAINING_MESSAGE))
    if pipe.ending is Ending.BROKEN:
        failure = pipe.failure
        if isinstance(failure, ServingError):
            await abort(context, failure)
        await context.abort(grpc_code(Code.INTERNAL), internal("reading the request stream").message)


async def answers(context: grpc.aio.ServicerContext, pipe: StreamPipeline[Any, Any]) -> AsyncIterator[Any]:
    """The pipeline's answers as they are done, then the end of the call (`end_stream`)."""
    async for response in pipe.responses():
        yield response
    await end_stream(context, pipe)


class GrpcStreams:
    """What one servicer's pipelined streams share: the plane that admits their messages
    (`admission`), the frontend's held bytes (each message's `message_bytes`, as it is read)
    and their counts (`stats`)."""

    def __init__(self, admission: object, held: HeldBytes | None) -> None:
        self.stats = StreamStats()
        self._admission = admission
        self._held = held

    def pipeline(
        self, requests: AsyncIterator[Any], answer: Callable[[Any], Awaitable[Any]], **options: Any
    ) -> StreamPipeline[Any, Any]:
        """A StreamPipeline of `requests` on these streams; `options`: its on_crash, key, window."""
        return StreamPipeline(
            requests,
            answer,
            admission=self._admission,
            stats=self.stats,
            held=self._held,
            size=message_bytes,
            **options,
        )
