"""What the supervisor's zygote client and the zygote process agree on: message and descriptor
counts, where a forked worker finds its ready pipe, and what the zygote imports once for every
fork."""

from __future__ import annotations

# Messages are small (a spec is a few kB); a recv buffer well above any of them.
MAX_MESSAGE = 1 << 20


FDS_PER_FORK = 3  # the ready pipe, stdout, stderr


READY_FD = 3  # where a forked worker finds its ready pipe


WORKER_CMDLINE_MODULE = "mariner.server.worker.main"


# What a worker imports before it loads its handler: imported once here, shared by every fork.
PRELOAD = (
    "numpy",
    "torch",
    "mariner.server.common.archive",
    "mariner.server.common.batch_policy",
    "mariner.server.worker.runner",
    "mariner.server.contracts.worker_wire",
    "mariner.server.worker.main",
    "mariner.server.common.parent_death",
)
