"""A handler's per-request status as every protocol reads it: which statuses fail a call, and the
error a failing one becomes. Shared by the frontend's call path and the OIP codec."""

from __future__ import annotations

import json

from mariner.server.contracts.errors import STATUS, Code, ServingError
from mariner.server.contracts.types import InferResult


def is_error_status(status: int) -> bool:
    """A handler's per-request status that fails the call (>= 400, or not an HTTP status at all)."""
    return not 100 <= status < 400


def handler_error(result: InferResult) -> ServingError:
    """A per-request error status the handler set (set_response_status), as a ServingError.

    The code comes from the status (400 -> INVALID_ARGUMENT, 503 -> UNAVAILABLE, other 4xx ->
    INVALID_ARGUMENT, other 5xx or a non-HTTP status -> INTERNAL). The message is the handler's
    own, bounded: the "error" string of a JSON object body (what TorchServe-style handlers such
    as the digits handler answer), else the phrase it set, else its body text, else a sentence
    naming the status. Protocols with their own error shape (OIP's {"error": message}) carry
    this message; TorchServe's protocols pass the handler's body itself (see `answer_text`).
    """
    status = result.status if 100 <= result.status <= 599 else STATUS[Code.INTERNAL].http
    message = ""
    if result.body[:1] == b"{":
        try:
            parsed = json.loads(result.body)
        except ValueError:
            parsed = None
        if isinstance(parsed, dict) and isinstance(parsed.get("error"), str):
            message = parsed["error"][:MAX_ERROR_DETAIL]
    message = (
        message
        or result.phrase
        or answer_text(result)
        or f"the model's handler answered with status {result.status}"
    )
    return ServingError.from_http_status(status, message)


# Bytes of a handler's error body carried into an error message or gRPC details.
MAX_ERROR_DETAIL = 1024


def answer_text(result: InferResult) -> str:
    """The handler's body as text, bounded (what TorchServe's gRPC details carry)."""
    return result.body[:MAX_ERROR_DETAIL].decode("utf-8", errors="replace").strip()
