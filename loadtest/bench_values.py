"""The benchmark's values: its settings, the servers it ran and what it measured.

`mariner.loadtest.bench` (orchestration and CLI), `bench_servers` (starting and driving the
servers) and `bench_report` (tables, targets, plots) all share these, so they live apart from
each of them.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from mariner.loadtest.ceiling import RawResult
from mariner.loadtest.closedloop import LevelResult, LoadSpec
from mariner.loadtest.server_stats import BatchStats
from mariner.loadtest.workloads import family_of

__all__ = [
    "PADDING_MAX",
    "PROTOCOLS",
    "REPO",
    "SERVERS",
    "THREAD_BASELINE",
    "WIRE",
    "Cell",
    "RawResult",
    "Report",
    "Running",
    "ServerFacts",
    "Settings",
    "WarmUp",
]

REPO = Path(__file__).resolve().parent.parent
SERVERS = ("raw", "mariner", "torchserve")
PROTOCOLS = ("grpc", "grpc-1ch", "http")  # client set-ups; grpc-1ch: every call on one channel
WIRE = {"grpc": "grpc", "grpc-1ch": "grpc", "http": "http"}
THREAD_BASELINE = "mariner-thread"  # today's single-process server, when the build can run it
# MiniLM only: the same archive with padding to max_length and no token budget (length-blind batches)
PADDING_MAX = "mariner-pad-max"
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
    baseline_args: tuple[str, ...] | None = None  # mariner-thread's extra args; None: the default
    scaling_frontends: tuple[int, ...] = (1, 2)
    scaling_workers: tuple[int, ...] = (1, 2)
    warmup_per_client: int = 4  # untimed requests per client at least, before every measurement
    padding_compare: bool = False  # also run PADDING_MAX at the highest level (MiniLM archives)
    padding_store: Path | None = None  # where the rewritten archive is (set once it is written)

    @property
    def family(self) -> str:
        """The model family (`mariner.loadtest.workloads`): digits, minilm or resnet18."""
        return family_of(self.model)

    def baseline(self, features: dict[str, bool]) -> tuple[str, ...] | None:
        """Arguments of the single-process baseline server, or None when it is not run: thread
        workers and one frontend by default, when this build has `--worker-mode` (digits only: the
        hop costs microseconds, invisible beside a transformer's or a ResNet's batch)."""
        if self.baseline_args is not None:
            return self.baseline_args
        if self.family != "digits" or not features.get("worker-mode"):
            return None
        return ("--worker-mode", "thread", *(("--frontends", "1") if features.get("frontends") else ()))

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
        channels = {"grpc": self.grpc_channels, "grpc-1ch": 1}.get(protocol)
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
    features: dict[str, bool] = field(default_factory=dict)  # which Mariner flags this build has
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
    """A server that is up: where to send each protocol, and whose CPU to count."""

    name: str
    grpc: tuple[str, int]
    http: tuple[str, int]
    pid: int | None
    metrics_url: str | None = None  # Mariner's metrics endpoint (batch stats per measurement)

    def endpoint(self, protocol: str) -> tuple[str, int]:
        return self.grpc if WIRE[protocol] == "grpc" else self.http
