"""The supervisor's hold on the inference ports, taken before any child starts."""

from __future__ import annotations

import socket

from mariner.server.common.listeners import reuseport_socket, split_address


def reserve_port(address: str) -> socket.socket:
    """Bind (without listening) a SO_REUSEPORT socket on `address`; port 0 picks a free one.

    The frontends listen on the same port with SO_REUSEPORT; this socket keeps the port ours
    while a frontend restarts (the kernel lets only sockets of the same user with SO_REUSEPORT
    share it, so a foreign server cannot take it), and resolves port 0 before they start.
    A port that another server holds fails here, before anything is started.
    """
    host, port = split_address(address)
    try:
        return reuseport_socket(host, port)
    except OSError as exc:
        raise OSError(f"cannot listen on {address!r}: {exc.strerror or exc}") from exc
