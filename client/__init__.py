"""Python client for Mariner: one class per transport, the same methods on each.

    from mariner.client import GrpcClient, HttpClient
    with HttpClient("http://127.0.0.1:8080") as c:          # or GrpcClient("127.0.0.1:7070")
        c.predict("digits_torchscript", pixels).json()      # TorchServe API -> Prediction
        c.infer("digits_torchscript", {"pixels": rows})     # OIP: name -> ndarray in and out
        c.health(); c.ready(); c.ready("digits_torchscript"); c.metadata("digits_torchscript")
        c.list_models()

Every call has a deadline (retries included) and retries UNAVAILABLE / RESOURCE_EXHAUSTED with
bounded exponential backoff and jitter (`RetryPolicy`); failures raise `MarinerError`
subclasses carrying the canonical status, the HTTP status where there is one, and the server's
message. The clients are tested and used by the tests and the load tests, so what users run is
what we prove.
"""

from mariner.client.errors import (
    DeadlineExceededError,
    InvalidArgumentError,
    MarinerError,
    NotFoundError,
    ResourceExhaustedError,
    Status,
    UnauthenticatedError,
    UnavailableError,
)
from mariner.client.grpc_client import GrpcClient
from mariner.client.http_client import HttpClient
from mariner.client.retry import NO_RETRY, RetryPolicy
from mariner.client.types import Prediction

__all__ = [
    "NO_RETRY",
    "DeadlineExceededError",
    "GrpcClient",
    "HttpClient",
    "InvalidArgumentError",
    "MarinerError",
    "NotFoundError",
    "Prediction",
    "ResourceExhaustedError",
    "RetryPolicy",
    "Status",
    "UnauthenticatedError",
    "UnavailableError",
]
