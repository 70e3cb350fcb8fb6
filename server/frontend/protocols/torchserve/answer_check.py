"""What a handler's answer may put on the HTTP wire, checked before a byte of it is written.

A handler sets its answer's status and headers (`context.set_response_status`,
`set_response_header`, `set_response_content_type`), and those reach the wire as they are. Some
values would break HTTP/1.1 itself rather than just answer oddly: a 1xx status is an interim
response that clients skip while they wait for the real one; 204 and 304 may not carry a body, so
one written after them is read as the start of the next response; a header name that is not a
token, or a value holding CR, LF or another control character, splits or corrupts the head. Sent
as they are, they leave the client with a broken answer and the keep-alive connection unusable.

So an answer is made sendable here: a status outside 200-599 or a bad header becomes TorchServe's
500 error JSON, with one log line naming the handler's value (the model's owner reads it there; the
client gets the reason too), and a 204 or 304 is sent without its body. A streamed answer (parts
sent before the final result) may not open with 204 or 304 at all: its parts are its body.
"""

from __future__ import annotations

import logging
import re
from dataclasses import replace

from mariner.server.common.http_common import JSON, json_bytes
from mariner.server.contracts.types import InferResult

log = logging.getLogger("mariner.http")

# RFC 9110's token (header names) and field-value characters: visible ASCII, obs-text, space
# and tab; never CR, LF, NUL or another control character.
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_FIELD_VALUE = re.compile(r"[\t\x20-\x7e\x80-\xff]*")
# Statuses that may not carry a body (RFC 9110 6.4.1).
NO_BODY = frozenset({204, 304})
LOWEST, HIGHEST = 200, 599


def answer_problem(result: InferResult, *, streamed: bool = False) -> str | None:
    """Why `result` cannot be sent as it is, in words naming the handler's value; None if it can."""
    status = result.status
    if type(status) is not int or not LOWEST <= status <= HIGHEST:
        return f"the status {status!r}: a handler may set {LOWEST} to {HIGHEST}"
    if streamed and status in NO_BODY:
        return f"the status {status} on a streamed answer: {status} carries no body, and the parts are one"
    headers = dict(result.headers)
    if result.content_type is not None:  # set apart from the others (set_response_content_type)
        headers["content-type"] = result.content_type
    for name, value in headers.items():
        if type(name) is not str or not _TOKEN.fullmatch(name):
            return f"the header name {name!r}: a header name is letters, digits and !#$%&'*+-.^_`|~"
        if type(value) is not str or not _FIELD_VALUE.fullmatch(value):
            return (
                f"the value {value!r} of header {name!r}: a header value may not hold CR, LF or "
                "other control characters, or characters beyond Latin-1"
            )
    return None


def sendable(result: InferResult, request_id: str, *, streamed: bool = False) -> InferResult:
    """`result` itself when it can be sent, else the answer sent in its place (module docstring)."""
    if result.status == 200 and not result.headers and result.content_type is None:
        return result  # nearly every answer: nothing to check
    problem = answer_problem(result, streamed=streamed)
    if problem is None:
        if result.status in NO_BODY and result.body:
            return replace(result, body=b"")
        return result
    log.error("the handler answered request %s with %s; sending 500 instead", request_id, problem)
    message = f"The model's handler set an answer HTTP cannot carry: {problem}"
    body = json_bytes({"code": 500, "type": "InternalServerException", "message": message})
    return InferResult(body=body, status=500, content_type=JSON, model_version=result.model_version)
