"""What a batcher is given and what it expects: its policy, its runners and what they raise, the
observer that feeds metrics, and the token budget of length-aware batching (`batcher.py` is
the dispatcher itself)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Hashable, Mapping, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Protocol

from mariner.server.contracts.errors import ServingError
from mariner.server.contracts.setting_values import positive_int
from mariner.server.contracts.types import InferRequest, InferResult, TokenCost


class BatchRunner(Protocol):
    id: str

    async def run(self, requests: Sequence[InferRequest]) -> list[InferResult]: ...


class BatchObserver(Protocol):
    """Hooks for metrics; the batcher itself stays free of Prometheus."""

    def queue_depth(self, items: int) -> None: ...
    def batch_started(
        self, items: int, queue_waits: Sequence[float], versions: Sequence[str | None] = ()
    ) -> None:
        """A batch left the queue: its items, each request's wait and the version each asked
        for (None: the default version)."""

    def batch_finished(self, seconds: float) -> None: ...
    def batch_tokens(self, padded: int, unpadded: int) -> None:
        """With a token counter: the batch's padded tokens (rows x longest row) and what its
        requests would cost padded each to its own longest row (the difference is waste)."""


class TokenBudget(Protocol):
    """Counts a request's tokens before it is queued (token_cost.TokenCounter); never raises.
    `max_batch_tokens` None groups by length without a budget."""

    max_batch_tokens: int | None

    def cost(self, req: InferRequest) -> TokenCost: ...


class NullObserver:
    """Observes nothing: a batcher given no observer."""

    def queue_depth(self, items: int) -> None:
        pass

    def batch_started(
        self, items: int, queue_waits: Sequence[float], versions: Sequence[str | None] = ()
    ) -> None:
        pass

    def batch_finished(self, seconds: float) -> None:
        pass

    def batch_tokens(self, padded: int, unpadded: int) -> None:
        pass


# Who sent the request being submitted: the client's connection (an HTTP connection's address
# pair, grpc's peer), set by the protocol when a call starts. Requests of one caller run in their
# order; callers share a model by bytes (the batcher's fair order). A context variable rather than
# an argument because the one call path from every protocol to the batcher carries no connection,
# and a call's own task (and every task a stream starts) sees what was set when the call began.
# None (unknown) is one caller like any other.
CALLER: ContextVar[Hashable] = ContextVar("mariner_caller", default=None)

# The bytes one batch holds at most unless the archive's model-config says otherwise
# (`maxBatchBytes`); its first request goes whatever its size. A batch runs without pause once its
# worker took it, so its size bounds how long a request that arrived just after waits, whoever
# sent it. Large inputs then run in batches of a few, which costs them little on a CPU (a worker's
# time on such a batch goes to the inputs, not to the call); a model that gains from large
# batches of large inputs (a GPU model fed raw image tensors: 32 of 600 KB make 19 MiB) raises it.
MAX_BATCH_BYTES = 8 << 20
BATCH_BYTES_KEY = "maxBatchBytes"


def max_batch_bytes(model_config: Mapping[str, Any], archive_file: str) -> int:
    """The archive's `maxBatchBytes` (a positive integer of bytes), MAX_BATCH_BYTES when unset;
    ServingError (INVALID_ARGUMENT) naming the key, the value and the archive otherwise."""
    value = model_config.get(BATCH_BYTES_KEY)
    if value is None:
        return MAX_BATCH_BYTES
    return positive_int(BATCH_BYTES_KEY, value, f"the model-config of {archive_file}")


@dataclass(frozen=True)
class BatchPolicy:
    max_batch_size: int = 8
    max_batch_delay_s: float = 0.0
    max_queue: int = 1024
    # A batch running longer than this is abandoned: its callers get DEADLINE_EXCEEDED and the
    # instance is replaced (a hung handler must not stall the model forever). None = no limit.
    batch_timeout_s: float | None = None
    # Batches one runner may hold at once: 1 (it answers one before it gets the next), or more
    # for a model whose worker runs several calls at once (asyncCommunication).
    runner_concurrency: int = 1
    # A runner of one batch at a time is sent the next one while it computes, once the queue
    # holds a full batch, so its worker starts it the moment the first ends (`Batcher`).
    pipelined: bool = False
    # A batch stops taking requests before its inputs pass this many bytes (MAX_BATCH_BYTES).
    max_batch_bytes: int = MAX_BATCH_BYTES

    @property
    def pipelines(self) -> bool:
        """Whether the next batch goes to a busy runner early: `pipelined`, for a runner of one
        batch at a time (one of several at once is offered batches while it has room anyway)."""
        return self.pipelined and self.runner_concurrency == 1

    def __post_init__(self) -> None:
        if (
            self.max_batch_size < 1
            or self.max_batch_bytes < 1
            or self.max_queue < 1
            or self.max_batch_delay_s < 0
            or self.runner_concurrency < 1
        ):
            raise ValueError(f"invalid batch policy {self}")


# Batches a frontend keeps in flight on one worker of a model with `asyncCommunication: true`
# (TorchServe's model-config switch: its frontend sends each job without waiting for the last).
ASYNC_BATCHES_PER_RUNNER = 64


def async_communication(model_config: Mapping[str, Any]) -> bool | str:
    """The model-config's `asyncCommunication`: True or False as TorchServe reads it (a YAML
    boolean), or, for any other value, the warning TorchServe logs before it ignores it."""
    value = model_config.get("asyncCommunication", False)
    if isinstance(value, bool):
        return value
    return f"Invalid asyncCommunication: {value!r}, should be true or false; it is ignored (false)"


class InstanceFailed(Exception):
    """Raised by a runner that can no longer be used (its handler ended the instance, or its
    worker process died). `error` is what the batch's callers get; by default UNAVAILABLE
    ("restarting")."""

    def __init__(self, message: str, *, error: ServingError | None = None) -> None:
        super().__init__(message)
        self.error = error


# Called with a failed or hung runner and the reason; returns its replacement (or None to
# retire it). The batcher keeps serving with the remaining runners meanwhile.
ReplaceRunner = Callable[[BatchRunner, str], Awaitable[BatchRunner | None]]


class RunnerRetired(Exception):
    """Raised by a runner retired before it took a batch (its worker was scaled down or
    replaced while the dispatcher held it): nothing of the batch ran, so the batcher queues it
    again, at the head, for another runner of the version."""
