"""Hand-made HTTP/2 frames for attacking a gRPC listener below any gRPC client.

No HTTP/2 library is a test dependency, and the frames an attacker sends are few and simple: a
9-byte header (length, type, flags, stream id) and a payload. Request headers use HPACK
literals without indexing (names from the static table), which every decoder must accept.
"""

from __future__ import annotations

import socket
import struct
from dataclasses import dataclass

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, RST_STREAM, SETTINGS, PING, GOAWAY = 0, 1, 3, 4, 6, 7
ACK, END_STREAM, END_HEADERS = 0x1, 0x1, 0x4
REFUSED_STREAM, CANCEL, ENHANCE_YOUR_CALM = 7, 8, 11
SETTINGS_MAX_CONCURRENT_STREAMS = 3


@dataclass(frozen=True)
class Frame:
    kind: int
    flags: int
    stream: int
    payload: bytes


def frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    return struct.pack(">I", len(payload))[1:] + bytes([kind, flags]) + struct.pack(">I", stream) + payload


def _literal(index: int, value: str) -> bytes:
    raw = value.encode()
    name = bytes([index]) if index < 15 else bytes([15, index - 15])
    return name + bytes([len(raw)]) + raw


def grpc_headers(path: str, authority: str = "127.0.0.1") -> bytes:
    """The HPACK block of a gRPC request: POST, http, `path`, content-type and te."""
    te = b"\x00\x02te\x08trailers"
    return b"\x83\x86" + _literal(4, path) + _literal(1, authority) + _literal(31, "application/grpc") + te


def rst(stream: int, code: int = CANCEL) -> bytes:
    return frame(RST_STREAM, 0, stream, struct.pack(">I", code))


def client_start() -> bytes:
    """The connection preface and an empty SETTINGS frame."""
    return PREFACE + frame(SETTINGS, 0, 0)


class FrameReader:
    """Frames from a socket, in order; `None` once the server closed the connection."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._buf = b""
        self.closed = False

    def frames(self, timeout: float) -> list[Frame]:
        """Every complete frame that arrives within `timeout` s of the last one (or the close)."""
        self.sock.settimeout(timeout)
        out: list[Frame] = []
        while not self.closed:
            try:
                data = self.sock.recv(1 << 20)
            except TimeoutError:
                break
            except OSError:
                self.closed = True
                break
            if not data:
                self.closed = True
                break
            self._buf += data
            while len(self._buf) >= 9:
                n = int.from_bytes(self._buf[:3], "big")
                if len(self._buf) < 9 + n:
                    break
                head, self._buf = self._buf[: 9 + n], self._buf[9 + n :]
                stream = int.from_bytes(head[5:9], "big") & 0x7FFFFFFF
                out.append(Frame(head[3], head[4], stream, head[9:]))
        return out


def settings_of(frames: list[Frame]) -> dict[int, int]:
    """The parameters of the server's SETTINGS frames (not their ACKs)."""
    params: dict[int, int] = {}
    for f in frames:
        if f.kind == SETTINGS and not f.flags & 0x1:
            for i in range(0, len(f.payload), 6):
                key, value = struct.unpack(">HI", f.payload[i : i + 6])
                params[key] = value
    return params
