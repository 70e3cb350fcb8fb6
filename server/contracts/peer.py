"""Who is on the other end of a Unix socket (SO_PEERCRED), checked before reading its first frame.

Why: a private socket dir keeps other users from connecting to or replacing a worker socket,
but the check that counts is the one made on the connection itself: the kernel reports the
pid, uid and gid of the process that made the peer socket (for a listening socket, the one
that called listen()). A frontend reaching a worker requires the worker's uid to be ours and,
when it knows it, the worker's pid; a worker requires each connecting frontend's uid to be
ours; the zygote requires its control socket's peer to be its parent.
"""

from __future__ import annotations

import os
import socket
import struct
from dataclasses import dataclass
from typing import Any

_CRED = struct.Struct("3i")


@dataclass(frozen=True)
class PeerCredentials:
    pid: int
    uid: int
    gid: int


class PeerRefused(Exception):
    """The peer is not a process of ours (another uid, or not the pid we started)."""


def peer_credentials(sock: Any) -> PeerCredentials:
    """The peer's credentials; `sock` is a socket or anything with its `getsockopt` (asyncio's
    and uvloop's transport sockets)."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size)
    pid, uid, gid = _CRED.unpack(raw)
    return PeerCredentials(pid, uid, gid)


def check_peer(
    sock: Any, *, what: str, expected_pid: int | None = None, euid: int | None = None
) -> PeerCredentials:
    """Raise PeerRefused unless the peer runs as our effective uid (and is `expected_pid`)."""
    if sock is None:
        raise PeerRefused(f"{what}: the connection has no socket to check the peer of")
    cred = peer_credentials(sock)
    uid = os.geteuid() if euid is None else euid
    if cred.uid != uid:
        raise PeerRefused(
            f"{what}: the peer (pid {cred.pid}) runs as uid {cred.uid}; only uid {uid}, this "
            "server's own user, may be on this socket"
        )
    if expected_pid is not None and cred.pid != expected_pid:
        raise PeerRefused(
            f"{what}: the peer is pid {cred.pid}, not pid {expected_pid}, the process started for it"
        )
    return cred
