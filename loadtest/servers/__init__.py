"""The servers the load tools and the tests start, each as a subprocess on free 127.0.0.1 ports,
with one vocabulary: construct, `start()` (returns once ready, raises ServerError with the log
tail otherwise) or `with`, the addresses (`http_url`, `management_url`, `metrics_url`,
`grpc_target`, `grpc_management_target`, `ports`), `pid`, `ready_seconds`, `log_tail()`, `stop()`.

- `MarinerProcess`: `mariner serve` exactly as users run it (`servers.mariner`);
- `StockTorchServe`: stock TorchServe 0.12 through its own launcher and Java frontend, the oracle
  the tests compare Mariner with and the benchmark's baseline (`servers.torchserve`);
- `FloorProcess`: the transport floor, the same RPC and route answering fixed bytes
  (`servers.floor`).

The benchmark, `make loadtest`, the GPU check and the tests all start servers through here, so a
fix to readiness or shutdown lands everywhere at once (`servers.process`).
"""

from mariner.loadtest.servers.archives import ArchiveInfo, read_archive, resolve_models
from mariner.loadtest.servers.leftovers import leftover_processes
from mariner.loadtest.servers.mariner import FloorProcess, MarinerProcess
from mariner.loadtest.servers.process import (
    LOCALHOST,
    Ports,
    ServerError,
    ServerProcess,
    pick_free_ports,
    process_tree_cpu_seconds,
    wait_http_ok,
)
from mariner.loadtest.servers.torchserve import SOCKET_PATH_MAX, StockTorchServe

__all__ = [
    "LOCALHOST",
    "SOCKET_PATH_MAX",
    "ArchiveInfo",
    "FloorProcess",
    "MarinerProcess",
    "Ports",
    "ServerError",
    "ServerProcess",
    "StockTorchServe",
    "leftover_processes",
    "pick_free_ports",
    "process_tree_cpu_seconds",
    "read_archive",
    "resolve_models",
    "wait_http_ok",
]
