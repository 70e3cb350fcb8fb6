"""The benchmark's values: its settings, the servers it ran and what it measured.

`mariner.loadtest.bench` (orchestration and CLI), `bench_servers` (starting and driving the
servers) and `bench_report` (tables, targets, plots) all share these, so they live apart from
each of them.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mariner.loadtest.bench_summary import PADDING_MAX
from mariner.loadtest.ceiling import RawResult
from mariner.loadtest.closedloop import LevelResult, LoadSpec
from mariner.loadtest.server_stats import BatchStats
from mariner.loadtest.workloads import family_of

if TYPE_CHECKING:
    from mariner.loadtest.servers import ServerProcess

__all__ = [
    "PADDING_MAX",
    "PROTOCOLS",
    "REPO",
    "SERVERS",
    "STREAMS",
    "TS_STREAM",
    "UNSERVED",
    "WIRE",
    "Cell",
    "RawResult",
    "Report",
    "Running",
    "ServerFacts",
    "Settings",
    "WarmUp",
    "default_servers",
    "unserved",
]

REPO = Path(__file__).resolve().parent.parent
SERVERS = ("raw", "mariner", "torchserve", "mosec")
# client set-ups; grpc-1ch: every call on one channel; the streams: one bidirectional stream per
# client (`mariner.loadtest.stream_clients`)
PROTOCOLS = ("grpc", "grpc-1ch", "http", "grpc-stream", "oip-stream")
STREAMS = ("grpc-stream", "oip-stream")
WIRE = {"grpc": "grpc", "grpc-1ch": "grpc", "http": "http", **{s: s for s in STREAMS}}
# Stock TorchServe on a copy of the archive with sequence batching, for its StreamPredictions2
# (`mariner.loadtest.servers.sequence_archive`); run when torchserve and grpc-stream both are.
TS_STREAM = "torchserve-seq"
# What a peer does not serve, and why (its cells are skipped and the report says so).
UNSERVED = {
    ("torchserve", "oip-stream"): "stock TorchServe 0.12 has no Open Inference Protocol ModelStreamInfer",
    ("torchserve", "grpc-stream"): (
        "stock TorchServe 0.12 fails StreamPredictions2 for a model without sequence batching "
        f"(NullPointerException on its null jobGroups, the stream ends UNKNOWN): see {TS_STREAM}"
    ),
    **{
        (TS_STREAM, p): "the sequence-batching copy serves StreamPredictions2 only"
        for p in ("grpc", "grpc-1ch", "http", "oip-stream")
    },
    **{("mosec", p): "mosec serves HTTP only" for p in ("grpc", "grpc-1ch", "grpc-stream", "oip-stream")},
}


def default_servers() -> tuple[str, ...]:
    """raw, Mariner, TorchServe, and mosec when it is installed (the `bench` extra)."""
    import importlib.util

    peers = ("mosec",) if importlib.util.find_spec("mosec") is not None else ()
    return ("raw", "mariner", "torchserve", *peers)


def unserved(server: str, protocol: str) -> str:
    """Why `server` is not measured over `protocol` ("" when it is)."""
    return UNSERVED.get((server, protocol), "")


WARMUP_WINDOW_S = 2.0
WARMUP_TOLERANCE = 0.05


@dataclass(frozen=True)
class Settings:
    """One benchmark configuration; everything a result depends on."""

    store: Path
    model: str
    servers: tuple[str, ...]
    protocols: tuple[str, ...]
    levels: tuple[int, ...]
    requests: int
    warmup: int
    duration_s: float | None
    batch_size: int
    max_batch_delay_ms: int
    torch_threads: int
    client_procs: int
    raw_seconds: float
    out: Path
    repeats: int = 3
    grpc_channels: int = 16
    mariner_args: tuple[str, ...] = ()
    torchserve_warmup_cap_s: float = 60.0
    scaling: bool = False
    startup: bool = True
    scaling_frontends: tuple[int, ...] = (1, 2)
    scaling_workers: tuple[int, ...] = (1, 2)
    warmup_per_client: int = 4  # untimed requests per client at least, before every measurement
    padding_compare: bool = False  # also run PADDING_MAX at the highest level (MiniLM archives)
    padding_store: Path | None = None  # where the rewritten archive is (set once it is written)

    @property
    def family(self) -> str:
        """The model family (`mariner.loadtest.workloads`): digits, minilm or resnet18."""
        return family_of(self.model)

    @property
    def load(self) -> LoadSpec:
        return LoadSpec(
            self.requests,
            self.warmup,
            self.duration_s,
            self.client_procs,
            min_warmup_per_client=self.warmup_per_client,
        )

    def load_for(self, protocol: str) -> LoadSpec:
        """The load of one client set-up: how many gRPC channels it opens."""
        many = self.grpc_channels
        channels = {"grpc": many, "grpc-1ch": 1, "grpc-stream": many, "oip-stream": many}.get(protocol)
        return replace(self.load, grpc_channels=channels)


@dataclass(frozen=True)
class WarmUp:
    """How a server was warmed before measuring: throughput of each 2 s window, per protocol."""

    seconds: float
    windows: dict[str, list[float]]
    stable: bool  # every protocol's last windows agreed within the tolerance before the cap


@dataclass(frozen=True)
class ServerFacts:
    """What a server actually ran with, as it reports itself, not as asked."""

    name: str
    args: str  # extra command-line arguments (Mariner) or settings (TorchServe)
    device: str  # the workers' devices, e.g. "cpu" or "cuda:0"
    processes: int  # the server's process tree once ready
    cpus_allowed: int  # CPUs the server may run on (its affinity)
    ready_s: float
    warmup: WarmUp | None = None

    @property
    def on_gpu(self) -> bool:
        return "cuda" in self.device


@dataclass
class Report:
    settings: Settings
    command: str
    started: str
    machine: dict[str, Any]
    versions: dict[str, str]
    raw: RawResult | None = None  # the repeat with the median batched throughput
    raw_runs: list[RawResult] = field(default_factory=list)
    levels: list[LevelResult] = field(default_factory=list)
    servers: dict[str, ServerFacts] = field(default_factory=dict)
    startup_s: dict[str, list[float]] = field(default_factory=dict)  # models -> seconds to ready
    notes: list[str] = field(default_factory=list)
    workload: str = ""  # what the payloads were (mariner.loadtest.workloads)
    padding: list[str] = field(default_factory=list)  # PADDING_MAX: what the rewrite changed
    batch_stats: list[BatchStats] = field(default_factory=list)  # Mariner's /metrics per measurement
    elapsed_s: float = 0.0


@dataclass(frozen=True)
class Cell:
    """One measurement in the run's order: a server at a level over a client set-up (raw: none)."""

    level: int
    repeat: int
    server: str
    protocol: str = ""


@dataclass(frozen=True)
class Running:
    """A server that is up under its benchmark name: where to send each protocol, whose CPU to
    count, and whether its /metrics has Mariner's batch statistics."""

    name: str
    server: ServerProcess
    batch_stats: bool = False
    http_path: str = ""  # the HTTP inference route when it is not TorchServe's (mosec's /inference)

    @property
    def pid(self) -> int | None:
        return self.server.pid

    @property
    def metrics_url(self) -> str | None:
        return self.server.metrics_url if self.batch_stats else None

    def endpoint(self, protocol: str) -> tuple[str, int]:
        ports = self.server.ports
        # every set-up but HTTP (unary gRPC, both streams) goes to the gRPC inference port
        return (self.server.host, ports.inference if WIRE[protocol] == "http" else ports.grpc_inference)
