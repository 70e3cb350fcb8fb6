"""How a pipelined gRPC stream ends once its answers are written (`stream_pipeline.Ending`).

- the client half-closed: OK;
- the server began draining: UNAVAILABLE with the drain's message. Reading stopped, every
  request read was answered; requests the client sent after that were not run, and the status
  tells it to send them to another replica;
- reading the next request failed: that error's status (a `ServingError`'s own), else a
  sanitized INTERNAL. The requests read before were answered first.
"""

from __future__ import annotations

from typing import Any

import grpc

from mariner.server.common.grpc_status import abort, grpc_code
from mariner.server.contracts.errors import Code, ServingError, internal
from mariner.server.frontend.protocols.grpc_drain_gate import DRAINING_MESSAGE
from mariner.server.frontend.protocols.stream_pipeline import Ending, StreamPipeline


async def end_stream(context: grpc.aio.ServicerContext, pipe: StreamPipeline[Any, Any]) -> None:
    """Return for a clean end; abort the call with the status of any other ending."""
    if pipe.ending is Ending.DRAINED:
        await abort(context, ServingError(Code.UNAVAILABLE, DRAINING_MESSAGE))
    if pipe.ending is Ending.BROKEN:
        failure = pipe.failure
        if isinstance(failure, ServingError):
            await abort(context, failure)
        await context.abort(grpc_code(Code.INTERNAL), internal("reading the request stream").message)
