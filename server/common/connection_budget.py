"""The file-descriptor budget of a frontend, shared by its HTTP and gRPC listeners.

Every connection costs a descriptor; when a process runs out, accept() fails for every listener
at once and so do the worker sockets and shared-memory segments it opens per batch: a flood of
idle connections on one protocol would take down the other and health with it. So at start a
frontend raises its soft RLIMIT_NOFILE to the hard limit, keeps `RESERVED_DESCRIPTORS` for its
own files (worker connections, shared memory, logs, the control channel), and gives each
protocol its configured connection cap, scaled down in proportion when both caps together do not
fit in what is left. Each protocol's cap is enforced by its own listener (http_limits for HTTP,
grpc core's max_allowed_incoming_connections for gRPC), so neither can take the other's share.
"""

from __future__ import annotations

import logging
import resource
from dataclasses import dataclass

log = logging.getLogger("mariner.frontend")

# Descriptors a frontend keeps for itself beyond its listeners' connections.
RESERVED_DESCRIPTORS = 256


@dataclass(frozen=True)
class ConnectionBudget:
    """Connections each listener may hold (`http`, `grpc`) within `limit` descriptors."""

    limit: int
    http: int
    grpc: int
    scaled: bool = False


def share(
    limit: int, http_wanted: int, grpc_wanted: int, reserved: int = RESERVED_DESCRIPTORS
) -> ConnectionBudget:
    """Each protocol's connection cap within `limit` descriptors, `reserved` kept aside.

    The configured caps when they fit; else each scaled down by the same factor (at least one
    connection each), so the two together never exceed what the process can open."""
    room = limit - reserved
    if http_wanted + grpc_wanted <= room:
        return ConnectionBudget(limit, http_wanted, grpc_wanted)
    room = max(room, 2)
    factor = room / (http_wanted + grpc_wanted)
    http = max(1, int(http_wanted * factor))
    grpc = max(1, min(int(grpc_wanted * factor), room - http))
    return ConnectionBudget(limit, http, grpc, scaled=True)


# What an unlimited RLIMIT_NOFILE is taken as (the kernel's usual nr_open ceiling).
UNLIMITED_AS = 1 << 20


def raise_descriptor_limit() -> int:
    """Raise the soft RLIMIT_NOFILE to the hard limit (allowed without privilege); the new soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return UNLIMITED_AS
    target = UNLIMITED_AS if hard == resource.RLIM_INFINITY else hard
    if soft >= target:
        return soft
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ValueError, OSError):  # more than the kernel grants (nr_open): keep the soft limit
        return soft
    return target


def frontend_budget(http_wanted: int, grpc_wanted: int) -> ConnectionBudget:
    """The budget for this process, after raising its descriptor limit; a warning when the
    configured caps had to shrink to fit."""
    budget = share(raise_descriptor_limit(), http_wanted, grpc_wanted)
    if budget.scaled:
        log.warning(
            "%d descriptors (RLIMIT_NOFILE) do not fit http_max_connections=%d and grpc_max_connections=%d "
            "beside %d kept for the frontend: serving at most %d HTTP and %d gRPC connections; raise the "
            "limit (ulimit -n) or lower the caps",
            budget.limit,
            http_wanted,
            grpc_wanted,
            RESERVED_DESCRIPTORS,
            budget.http,
            budget.grpc,
        )
    return budget
