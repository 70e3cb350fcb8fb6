"""Values both client transports share: the TorchServe-API answer and how a payload is encoded.

Kept in one place so `GrpcClient.predict` and `HttpClient.predict` send the same bytes for the
same Python value and hand back the same `Prediction`, whichever wire carried it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np

# TorchServe's default ports (Mariner keeps them): the clients' defaults and the CLI's.
DEFAULT_HTTP_URL = "http://127.0.0.1:8080"
DEFAULT_MANAGEMENT_PORT = 8081
DEFAULT_GRPC_TARGET = "127.0.0.1:7070"
DEFAULT_GRPC_MANAGEMENT_PORT = 7071
# Seconds a call may take, retries included, unless the caller says otherwise.
DEFAULT_TIMEOUT_S = 30.0

JSON_TYPE = "application/json"
OCTET_TYPE = "application/octet-stream"
TEXT_TYPE = "text/plain; charset=utf-8"


@dataclass(frozen=True)
class Prediction:
    """The handler's answer through the TorchServe API: raw bytes, plus helpers to read them.

    Raw bytes because a TorchServe handler may answer anything (JSON, text, an image); the
    digits handler answers JSON `{"label": int, "topk": [...]}`, read with `.json()`.
    """

    body: bytes
    content_type: str | None = None

    def json(self) -> Any:
        return json.loads(self.body)

    @property
    def text(self) -> str:
        return self.body.decode("utf-8")


def encode_payload(data: Any) -> tuple[bytes, str]:
    """(body, content type) for a predict payload.

    bytes go as they are (an image: the handler sniffs PNG/JPEG), str as UTF-8 text, a numpy
    array or any other value as JSON, which is what TorchServe handlers conventionally parse.
    """
    if isinstance(data, bytes | bytearray | memoryview):
        return bytes(data), OCTET_TYPE
    if isinstance(data, str):
        return data.encode("utf-8"), TEXT_TYPE
    if isinstance(data, np.ndarray):
        data = data.tolist()
    elif isinstance(data, np.generic):
        data = data.item()
    return json.dumps(data).encode("utf-8"), JSON_TYPE


def with_port(host_port: str, port: int) -> str:
    """`host:port` with the port replaced (IPv6 brackets kept): derives management addresses."""
    if host_port.startswith("["):
        host = host_port[: host_port.index("]") + 1]
    elif host_port.count(":") == 1:
        host = host_port.split(":", 1)[0]
    elif ":" in host_port:  # a bare IPv6 address
        host = f"[{host_port}]"
    else:
        host = host_port
    return f"{host}:{port}"
