"""TorchServe request bodies decoded the way its Python backend decodes them.

The handler receives one dict per request: `{"body": value}` for a plain body, or one key per
field of a multipart/form-data or urlencoded form. A value is JSON-decoded for
application/json, text for text/*, raw bytes otherwise. Malformed JSON or non-UTF-8 text is a
400 here, before the request is queued (TorchServe forwards the bytes and lets the handler
fail), so one bad request cannot fail a whole batch.
"""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import parse_qsl

from mariner.server.common import json_body
from mariner.server.common.http_common import JSON
from mariner.server.compat.torchserve.part_headers import parse_part_headers
from mariner.server.contracts.errors import Code, ServingError

# Parts of a multipart/form-data or urlencoded body; each becomes one key of the handler's dict.
MAX_FORM_PARTS = 64
# One part's header block (Content-Disposition, Content-Type, ...): real ones are a few hundred
# bytes; the cap bounds the work per part (the body size cap alone allowed 6 MB of headers).
MAX_PART_HEADER_BYTES = 8 * 1024

_BOUNDARY = re.compile(r'boundary="?([^";]+)"?', re.IGNORECASE)


def decode_value(raw: bytes, mime: str, what: str) -> Any:
    """One input the way TorchServe's Python backend decodes it: JSON, text or bytes."""
    if mime == JSON:
        try:
            return json_body.loads(raw)
        except ValueError as e:  # JSONDecodeError and UnicodeDecodeError both name the position
            raise ServingError(
                Code.INVALID_ARGUMENT,
                f"{what} is not valid JSON: {e}; send a JSON document, or another Content-Type for raw bytes",
            ) from None
        except RecursionError:
            raise ServingError(Code.INVALID_ARGUMENT, f"{what} is JSON nested too deeply") from None
    if mime.startswith("text/"):
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ServingError(
                Code.INVALID_ARGUMENT,
                f"{what} is not valid UTF-8 text (byte {e.start}); "
                "send UTF-8, or a non-text Content-Type for raw bytes",
            ) from None
    return raw


def mime_type(content_type: str) -> str:
    """The media type of a Content-Type header, lower-cased, without parameters."""
    return content_type.partition(";")[0].strip().lower()


def _parse_urlencoded(body: bytes) -> dict[str, Any]:
    """Form fields as TorchServe passes them: each field's value as UTF-8 bytes."""
    try:
        pairs = parse_qsl(
            body.decode("utf-8"), keep_blank_values=True, max_num_fields=MAX_FORM_PARTS, errors="strict"
        )
    except UnicodeDecodeError as e:
        raise ServingError(Code.INVALID_ARGUMENT, f"form body is not valid UTF-8 (byte {e.start})") from None
    except ValueError:  # more fields than allowed
        raise ServingError(
            Code.INVALID_ARGUMENT, f"form body has more than {MAX_FORM_PARTS} fields"
        ) from None
    return {k: v.encode("utf-8") for k, v in pairs}


def _parse_multipart(content_type: str, body: bytes) -> dict[str, Any]:
    """multipart/form-data as TorchServe passes it: one key per part, by its form name.

    A part without a Content-Type (a plain form field) stays bytes; a file part is decoded by
    its own Content-Type (JSON, text, bytes). Split with bytes.find rather than the stdlib email
    parser, which takes ~150 ms for a 6 MB image, and part headers read by part_headers (linear,
    never recursive) after a size check. Later parts win over earlier ones of the same name, as
    in TorchServe's Python backend.
    """
    m = _BOUNDARY.search(content_type)
    if m is None:
        raise ServingError(Code.INVALID_ARGUMENT, "multipart/form-data without a boundary parameter")
    delim = b"--" + m.group(1).strip().encode("latin-1")
    sep = b"\r\n" + delim
    bad = ServingError(
        Code.INVALID_ARGUMENT,
        "malformed multipart/form-data body: every part needs headers, a blank line and a boundary",
    )
    pos = body.find(delim)
    if pos < 0:
        raise bad
    pos += len(delim)
    data: dict[str, Any] = {}
    for _ in range(MAX_FORM_PARTS):
        if body.startswith(b"--", pos):  # the closing delimiter
            break
        line_end = body.find(b"\r\n", pos)  # skips transport padding after the delimiter
        if line_end < 0:
            raise bad
        start = line_end + 2
        end = body.find(sep, start)
        if end < 0:
            raise bad
        if body.startswith(b"\r\n", start):  # a part without headers
            head, payload_start = b"", start + 2
        else:
            head_end = body.find(b"\r\n\r\n", start, end + 2)
            if head_end < 0:
                raise bad
            if head_end + 2 - start > MAX_PART_HEADER_BYTES:
                raise ServingError(
                    Code.INVALID_ARGUMENT,
                    f"a multipart/form-data part's headers are {head_end + 2 - start} bytes; "
                    f"at most {MAX_PART_HEADER_BYTES} are allowed",
                )
            head, payload_start = body[start : head_end + 2], head_end + 4
        headers = parse_part_headers(head)
        name = headers.name
        if not name:
            raise ServingError(
                Code.INVALID_ARGUMENT, "a multipart/form-data part has no name in Content-Disposition"
            )
        payload = body[payload_start:end]
        ctype = headers.content_type
        data[name] = decode_value(payload, mime_type(ctype), f"form part {name!r}") if ctype else payload
        pos = end + len(sep)
    else:
        if not body.startswith(b"--", pos):
            raise ServingError(
                Code.INVALID_ARGUMENT, f"multipart/form-data body has more than {MAX_FORM_PARTS} parts"
            )
    if not data:
        raise ServingError(Code.INVALID_ARGUMENT, "multipart/form-data body has no parts")
    return data


def decode_data(content_type: str, body: bytes) -> dict[str, Any]:
    """The handler's per-request dict, as TorchServe builds it from the request body."""
    mime = mime_type(content_type)
    if mime == "multipart/form-data":
        return _parse_multipart(content_type, body)
    if mime == "application/x-www-form-urlencoded":
        return _parse_urlencoded(body)
    return {"body": decode_value(body, mime, "request body")}
