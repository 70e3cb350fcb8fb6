"""Intermediate answers: what TorchServe's `send_intermediate_predict_response` sends, read back.

TorchServe's handler library (`ts.handler_utils.utils.send_intermediate_predict_response`)
builds its backend's predict-response frame (`ts.protocol.otf_message_handler.
create_predict_response` with `ts_stream_next`) and writes it with `context.cl_socket.sendall`.
A handler written for TorchServe calls that function unchanged, so the Context hands it an
`IntermediateChannel` as `cl_socket`: `sendall` decodes the frame back into one `InferResult`
per request it names and passes each, with the request's id, to whoever runs the handler (a
worker sends it to the frontend ahead of the batch's final result).

The frame, all integers signed big-endian 32 bits (TorchServe's OTF codec):

    code | len message | message
    per request: len id | id | len content type | content type | status | len phrase | phrase |
                 header count | (len key | key | len value | value)* | len body | body
    -1

A frame whose overall `code` is not 200 is TorchServe's way to fail the named requests from
the middle of a stream: each one's part carries that code and the message as its body.
"""

from __future__ import annotations

import logging
import struct
from collections.abc import Callable
from dataclasses import dataclass

from mariner.server.contracts.types import InferResult

log = logging.getLogger("mariner.intermediate")

# The response header TorchServe's codec sets on each intermediate answer ("true") and on the
# final one after a stream ("false"); it frames the stream there. Mariner frames streams itself.
STREAM_NEXT_HEADER = "ts_stream_next"
_INT = struct.Struct(">i")
_END = -1

Deliver = Callable[[str, InferResult], None]


class FrameFormatError(ValueError):
    """`sendall` was given bytes that are not one TorchServe predict-response frame."""


@dataclass(frozen=True)
class IntermediateFrame:
    """One decoded frame: its overall code and message, and a part per request id."""

    code: int
    message: str
    parts: tuple[tuple[str, InferResult], ...]


class _Reader:
    def __init__(self, data: memoryview) -> None:
        self._data = data
        self._pos = 0

    def number(self) -> int:
        if self._pos + 4 > len(self._data):
            raise FrameFormatError("the frame ends inside a length or code field")
        (value,) = _INT.unpack_from(self._data, self._pos)
        self._pos += 4
        return int(value)

    def field(self, length: int) -> bytes:
        if length < 0 or self._pos + length > len(self._data):
            raise FrameFormatError(f"a field of {length} bytes runs past the end of the frame")
        out = bytes(self._data[self._pos : self._pos + length])
        self._pos += length
        return out

    def text(self) -> str:
        return self.field(self.number()).decode("utf-8", errors="replace")

    @property
    def left(self) -> int:
        return len(self._data) - self._pos


def decode_frame(data: bytes | bytearray | memoryview) -> IntermediateFrame:
    """The requests' parts of one predict-response frame; FrameFormatError if it is not one."""
    reader = _Reader(memoryview(data).cast("B"))
    code = reader.number()
    message = reader.text()
    parts: list[tuple[str, InferResult]] = []
    while True:
        length = reader.number()
        if length == _END:
            break
        request_id = reader.field(length).decode("utf-8", errors="replace")
        content_type = reader.text()
        status = reader.number()
        phrase = reader.text()
        headers: dict[str, str] = {}
        for _ in range(reader.number()):
            key = reader.text()
            headers[key.lower()] = reader.text()
        body = reader.field(reader.number())
        headers.pop(STREAM_NEXT_HEADER, None)
        headers.pop("content-type", None)  # travels apart, as in a final result
        if code != 200:  # the whole frame fails its requests (TorchServe's sendError)
            status, phrase, body = code, message, message.encode("utf-8")
        parts.append(
            (
                request_id,
                InferResult(
                    body=body,
                    status=status,
                    phrase=phrase,
                    content_type=content_type or None,
                    headers=headers,
                ),
            )
        )
    if reader.left:
        raise FrameFormatError(f"{reader.left} bytes follow the end of the frame")
    return IntermediateFrame(code, message, tuple(parts))


class IntermediateChannel:
    """`context.cl_socket` for handlers written for TorchServe: accepts the frames its
    `send_intermediate_predict_response` writes and delivers each request's part.

    `deliver(request_id, part)` is the Context's; with nobody to deliver to (a handler run
    outside a worker), parts are dropped with one log line.
    """

    def __init__(self, deliver: Deliver | None = None) -> None:
        self.deliver = deliver
        self._warned = False

    def sendall(self, data: bytes | bytearray | memoryview) -> None:
        frame = decode_frame(data)
        deliver = self.deliver
        if deliver is None:
            if not self._warned:
                log.warning("a handler sent an intermediate answer outside a serving worker; dropped")
                self._warned = True
            return
        for request_id, part in frame.parts:
            deliver(request_id, part)
