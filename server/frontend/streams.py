"""Where a handler's intermediate answers go in a frontend: a sink per request that streams them.

A TorchServe handler may send intermediate answers before its final one
(`send_intermediate_predict_response`); the worker forwards each as it is sent, and the
frontend's worker connection hands it to the sink the request's adapter opened here, by the
request's id: HTTP writes it as one chunk of a chunked answer, gRPC `StreamPredictions` as one
message. The final result still comes back through the batcher as every result does, so the
batcher, the deadline and the drain account for a streamed request exactly as for any other.

Only TorchServe's adapters open sinks, under request ids the server made (`request_ids`), so no
client-chosen id (an OIP request's `id`) can reach another request's sink: the worker
connection looks sinks up for TorchServe's protocols only (`takes_sinks`). A request without a
sink (OIP, KServe, unary gRPC `Predictions`) gets its parts in front of its final body, as an
HTTP client that reads the whole chunked answer would (`MAX_HELD_BYTES` at most).

Each part also restarts its batch's responseTimeout (`BATCH_PROGRESS`), as on TorchServe, so a
handler streaming a long answer is bounded per part, not as a whole.

Bytes held per request are bounded: a sink holds at most `MAX_HELD_BYTES` of parts its client
has not taken yet, and past that it ends its stream with a clear error rather than buffer for a
client that reads slower than the handler writes.
"""

from __future__ import annotations

from collections.abc import Callable
from contextvars import ContextVar
from typing import Protocol

from mariner.server.contracts.types import TORCHSERVE_PROTOCOLS, InferResult, WireProtocol

# Bytes of intermediate answers one request may have waiting in a frontend for its client.
MAX_HELD_BYTES = 16 * 1024 * 1024


class PartialSink(Protocol):
    """Takes a request's intermediate answers as they arrive; never blocks (it is called from
    the worker connection's reader, which serves every request on that worker)."""

    def partial(self, part: InferResult) -> None: ...


def takes_sinks(protocol: WireProtocol) -> bool:
    """Whether requests of `protocol` may have a sink (their ids are the server's own)."""
    return protocol in TORCHSERVE_PROTOCOLS


def too_much_held(held: int) -> str:
    """Why a stream was ended for holding `held` bytes its client had not read."""
    return (
        f"the client read the streamed answer slower than the model wrote it: {held} bytes were "
        f"waiting, more than the {MAX_HELD_BYTES} a streamed answer may hold"
    )


# The frontend process's open sinks, by request id: its adapters open one for a call
# (`STREAMS[request_id] = sink`, `STREAMS.pop(request_id, None)` when the call ends: a plain
# dict, as every prediction opens one), its worker connections fill them.
STREAMS: dict[str, PartialSink] = {}

# Set by the batcher in the task that runs a batch: the worker connection calls it for each
# intermediate answer of that batch, so the batch's responseTimeout starts again, as TorchServe's
# worker thread waits responseTimeout for each reply of a streaming handler.
BATCH_PROGRESS: ContextVar[Callable[[], None] | None] = ContextVar("mariner_batch_progress", default=None)
