"""The control channel between the supervisor and one frontend: pickled messages, length-prefixed,
over a Unix socketpair the frontend inherits (its fd number is on the command line).

Both ends are our own processes on a socketpair the supervisor made: nothing else can connect
to it, and the frontend checks that its peer runs as our uid before its first read. Messages are
still loaded with `safe_pickle` (our value types only), so a frame never runs code. The
supervisor sends `FrontendInit` once, then a `ModelTable` at start
and after every change; the frontend answers `Listening` once its listeners are bound,
`TableApplied` after each table, and `Drained` with its accounting before it exits.
"""

from __future__ import annotations

import asyncio
import logging
import pickle
import socket
import struct
from dataclasses import dataclass, field
from typing import Any

from mariner.server.compat.torchserve.tokens import Key
from mariner.server.contracts import safe_pickle
from mariner.server.contracts.peer import check_peer
from mariner.server.contracts.worker_api import ModelEntry
from mariner.server.contracts.workflow_dag import WorkflowDag

log = logging.getLogger("mariner.control_channel")

_HEADER = struct.Struct("!I")
MAX_MESSAGE_BYTES = 64 << 20


@dataclass(frozen=True)
class FrontendInit:
    """What a frontend needs to start: the server's config and the concrete inference ports."""

    cfg: Any  # mariner.server.common.config.ServerConfig (frozen)
    index: int
    http_port: int
    grpc_port: int


@dataclass(frozen=True)
class ModelTable:
    """Every model version served and its live workers; `version` counts the tables sent.

    With TorchServe's token authorization on, it also carries the current inference key (the
    only key a frontend needs): a frontend applies its first table before it listens, and the
    supervisor's wait for every frontend's TableApplied is what makes a replaced key stop working
    everywhere before the token API answers."""

    version: int
    entries: tuple[ModelEntry, ...]
    inference_key: Key | None = field(default=None, repr=False)
    # TorchServe workflows: each one's graph over models of `entries` (`/wfpredict`).
    workflows: tuple[WorkflowDag, ...] = ()


@dataclass(frozen=True)
class Listening:
    pid: int


@dataclass(frozen=True)
class TableApplied:
    version: int


@dataclass(frozen=True)
class Drained:
    accepted: int
    answered: int
    ok: int


def encode(message: object) -> bytes:
    body = pickle.dumps(message, protocol=5)
    return _HEADER.pack(len(body)) + body


async def send(writer: asyncio.StreamWriter, message: object) -> None:
    writer.write(encode(message))
    await writer.drain()


async def receive(reader: asyncio.StreamReader) -> Any | None:
    """The next message, or None when the other end has gone (EOF). A message `safe_pickle`
    refuses is logged and skipped: it fails alone, the channel goes on."""
    while True:
        try:
            header = await reader.readexactly(_HEADER.size)
            (size,) = _HEADER.unpack(header)
            if size > MAX_MESSAGE_BYTES:
                raise ValueError(f"control message of {size} bytes is over the limit")
            return safe_pickle.loads(await reader.readexactly(size))
        except (asyncio.IncompleteReadError, ConnectionError):
            return None
        except safe_pickle.UnsafePickle as exc:
            log.error("control channel: a message was refused: %s", exc)


def receive_blocking(sock: socket.socket) -> Any | None:
    """The next message on a blocking socket (the frontend reads its init before its loop runs);
    raises PeerRefused if the other end does not run as our uid."""
    check_peer(sock, what="control channel")

    def exactly(n: int) -> bytes | None:
        buf = bytearray()
        while len(buf) < n:
            chunk = sock.recv(n - len(buf))
            if not chunk:
                return None
            buf += chunk
        return bytes(buf)

    header = exactly(_HEADER.size)
    if header is None:
        return None
    (size,) = _HEADER.unpack(header)
    body = exactly(size)
    return None if body is None else safe_pickle.loads(body)
