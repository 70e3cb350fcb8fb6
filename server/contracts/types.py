"""Values that cross module boundaries: requests in, results out, model descriptions.

Transports build `InferRequest`s from wire messages and turn `InferResult`s back into wire
messages; the dataplane, batcher and runners see only these types.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np


class WireProtocol(enum.Enum):
    """Bounded label set for metrics: which API and transport a request came in on."""

    TS_HTTP = "torchserve-http"
    TS_GRPC = "torchserve-grpc"
    OIP_HTTP = "oip-http"
    OIP_GRPC = "oip-grpc"
    KSERVE_HTTP = "kserve-v1-http"


# TorchServe's own APIs: their wire answers are TorchServe's, their request ids the server's own.
TORCHSERVE_PROTOCOLS = frozenset({WireProtocol.TS_HTTP, WireProtocol.TS_GRPC})


@dataclass(frozen=True)
class TokenCost:
    """What a request costs a model that pads each batch to its longest member: `rows` texts,
    the longest `longest` tokens. A batch of requests costs sum(rows) x max(longest) padded
    tokens (the token budget the batcher and a worker's merge keep within)."""

    rows: int
    longest: int


@dataclass(frozen=True)
class InferRequest:
    """One client request, protocol-neutral.

    A request is one of two kinds, told apart by `tensors` and nothing else:
    - TorchServe's (`tensors` None): `data` is what the handler receives for this request, in
      TorchServe's shape: {"body": <parsed JSON | str | bytes>} or the gRPC `input` map's entries.
    - the Open Inference Protocol's (`tensors` set): input name -> numpy array [N, ...], already
      checked against the model's signature; `data` is empty. The runner builds the handler's
      input from this field, so no client-chosen field name ("tensors" in a form) can pose as one.
    `items` is the number of batch slots the request takes (N for a tensor request; 1 otherwise).
    `deadline` is a `time.monotonic()` instant after which the answer is useless.
    `size` is the bytes of its inputs as the frontend read them (a body, the input map's values,
    the tensors): the batcher's fair order and its batches' byte cut count it (0: not counted).
    """

    model: str
    version: str | None
    data: Mapping[str, Any]
    protocol: WireProtocol
    request_id: str
    headers: Mapping[str, str] = field(default_factory=dict)
    deadline: float | None = None
    items: int = 1
    tensors: Mapping[str, np.ndarray] | None = None
    # Set by the frontend's token counter before queueing when the model has one (tokenCounter).
    tokens: TokenCost | None = None
    size: int = 0

    def with_deadline(self, deadline: float | None) -> InferRequest:
        """A copy with `deadline`: what `dataclasses.replace` gives, at a sixth of its cost (every
        request passes here once, on the frontend's event loop; `replace` re-runs `__init__`
        through keyword handling for one field)."""
        new = object.__new__(InferRequest)
        new.__dict__.update(self.__dict__)
        new.__dict__["deadline"] = deadline
        return new


@dataclass(frozen=True)
class InferResult:
    """The handler's answer for one request, already encoded as TorchServe encodes it.

    `body` is bytes (a str is UTF-8 encoded, other values JSON with indent=2, exactly as
    TorchServe's Python backend does, so both servers return the same bytes). `status` is the
    per-request status the handler set (200 unless it called set_response_status).
    """

    body: bytes
    status: int = 200
    phrase: str = ""
    content_type: str | None = None
    headers: Mapping[str, str] = field(default_factory=dict)
    model_version: str = ""
    # Tensor answers (Open Inference Protocol): output name -> array, rows in request order.
    # Set instead of `body` when the handler answered a tensor request with {"tensors": {...}}.
    tensors: Mapping[str, np.ndarray] | None = None


class ModelState(enum.Enum):
    LOADING = "LOADING"
    READY = "READY"
    FAILED = "FAILED"
    RESTARTING = "RESTARTING"  # every instance is being replaced after a hang or failure
    # Registered with no worker (TorchServe's register without initial_workers, a scale to 0):
    # served as TorchServe serves it (503 "has no worker"), not a failure, not loading.
    NO_WORKERS = "NO_WORKERS"
    STOPPING = "STOPPING"


@dataclass(frozen=True)
class WorkerInfo:
    id: str
    device: str
    status: str  # READY | LOADING | FAILED
    batches: int
    # Facts about the process running this worker, None where not known (describe then omits
    # them rather than inventing a value).
    pid: int | None = None
    memory_bytes: int | None = None  # resident set size
    started_at: float | None = None  # time.time() when the worker last became ready


@dataclass(frozen=True)
class ModelInfo:
    """What management APIs describe: one model version and its serving settings."""

    name: str
    version: str
    archive: str
    sha256: str
    handler: str
    is_default: bool
    state: ModelState
    batch_size: int
    max_batch_delay_ms: float
    response_timeout_s: float
    queue_size: int
    min_workers: int
    max_workers: int
    workers: tuple[WorkerInfo, ...]
    load_seconds: float | None
    signature: Any = None  # mariner.server.contracts.tensors.ModelSignature | None (OIP ModelMetadata)
    loaded_at_startup: bool = True  # False for versions added by a management register call
    pending_requests: int = 0  # queued in the batcher now, not yet running
    device_type: str | None = None  # "cpu" / "gpu" when the settings asked for one
    error: str | None = None  # why a FAILED version is not served (a refused archive, a failed load)
    startup_timeout_s: float = 120.0  # how long a worker may take to start (TorchServe's startupTimeout)


def instance_id(name: str, version: str, instance: int, generation: int) -> str:
    """A model instance's id, the same wherever it is shown: `name-version-instance`, with
    `.generation` once it has been replaced."""
    return f"{name}-{version}-{instance}" + (f".{generation}" if generation else "")
