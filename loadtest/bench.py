"""Side-by-side benchmark: the raw model, Mariner and stock TorchServe on the same archive.

    python -m mariner.loadtest.bench                      # defaults: TorchScript digits, levels 1,8,64
    python -m mariner.loadtest.bench --levels 1,64 --duration 3 --repeats 2     # a quick look
    python -m mariner.loadtest.bench --mariner-args "--frontends 2" --servers mariner,torchserve
    python -m mariner.loadtest.bench --scaling            # Mariner alone: frontends 1/2 x workers 1/2
    python -m mariner.loadtest.bench --servers raw,mariner --duration 10   # e.g. on a GPU machine

What it measures (method and reasons: docs/benchmark.md):

- **raw**: the archive's handler loaded in-process (a spawned process of its own) exactly as the
  servers load it, with the same torch thread setting, called directly: batch-1 latency of
  `handle()` and its throughput at the max batch size. No transport, no queue: the ceiling.
- **mariner** (`mariner serve` subprocess, `--mariner-args` passed through) and **torchserve**
  (stock TorchServe 0.12, via `mariner.loadtest.stock_torchserve`), both with the same
  batchSize / maxBatchDelay and torch threads, over three client set-ups: `grpc` (TorchServe
  `Predictions` over `--grpc-channels` channels, each its own HTTP/2 connection), `grpc-1ch`
  (every call multiplexed on one channel) and `http` (`POST /predictions/{model}`, one
  keep-alive connection per client). When this build of Mariner has `--worker-mode`,
  **mariner-thread** (thread workers, one frontend: the single-process server as it was) runs
  at the lowest level, for the cost of the process hop, and `grpc-1ch` at the highest.
- Every server stays up for the whole run; the highest level is measured `--repeats` times,
  the servers interleaved in each repeat (the order flips every repeat), and ratios are the
  median of the per-repeat ratios: on a shared machine one run of each is a coin toss.
  TorchServe is warmed until its own throughput stops rising (2 s windows within 5%).
- **closed-loop clients** (`mariner.loadtest.closedloop`), **CPU accounting** per level (clients,
  the server's process tree, the whole machine), the devices the servers' workers run on, and
  Mariner's start-up to ready (`/readyz`) for the whole store and for the benchmarked archive.

It writes `bench/results.md` (machine, versions and the exact command at the top; tables;
the targets, each held, missed or not applicable; `mariner.loadtest.bench_report`),
`bench/results.json`, `bench/latency.png`, `bench/throughput.png`; `--scaling` writes
`bench/scaling.md` and `bench/scaling.json` instead.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import multiprocessing as mp
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psutil
import requests

from mariner.loadtest.bench_report import (
    fmt,
    other_cores,
    plot,
    render_markdown,
    render_scaling,
    stopped_rising,
    targets,
)
from mariner.loadtest.closedloop import LevelResult, LoadSpec, Percentiles, run_level
from mariner.loadtest.servers import MarinerProcess

REPO = Path(__file__).resolve().parent.parent
SERVERS = ("raw", "mariner", "torchserve")
PROTOCOLS = ("grpc", "grpc-1ch", "http")  # client set-ups; grpc-1ch: every call on one channel
WIRE = {"grpc": "grpc", "grpc-1ch": "grpc", "http": "http"}
THREAD_BASELINE = "mariner-thread"  # today's single-process server, when the build can run it
WARMUP_WINDOW_S = 2.0
WARMUP_TOLERANCE = 0.05


# ==================================================================================================
# Values
# ==================================================================================================
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

    def baseline(self, features: dict[str, bool]) -> tuple[str, ...] | None:
        """Arguments of the single-process baseline server, or None when it is not run: thread
        workers and one frontend by default, when this build has `--worker-mode`."""
        if self.baseline_args is not None:
            return self.baseline_args
        if not features.get("worker-mode"):
            return None
        return ("--worker-mode", "thread", *(("--frontends", "1") if features.get("frontends") else ()))

    @property
    def load(self) -> LoadSpec:
        return LoadSpec(self.requests, self.warmup, self.duration_s, self.client_procs)

    def load_for(self, protocol: str) -> LoadSpec:
        """The load of one client set-up: how many gRPC channels it opens."""
        channels = {"grpc": self.grpc_channels, "grpc-1ch": 1}.get(protocol)
        return replace(self.load, grpc_channels=channels)


@dataclass(frozen=True)
class RawResult:
    """The handler called in-process: the ceiling no server can beat."""

    batch1: Percentiles  # handle() on one request
    batched_rps: float  # requests/s through handle() at the max batch size
    model_batch1: Percentiles  # predict_topk() on one decoded digit
    model_batched_rps: float  # requests/s through predict_topk() at the max batch size
    batch_size: int
    torch_threads: int
    device: str


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
    elapsed_s: float = 0.0


# ==================================================================================================
# Raw: the handler in-process
# ==================================================================================================
def _raw_main(settings: Settings, bodies: tuple[bytes, ...], conn: Any) -> None:
    """Entry point of the raw process: load the handler as Mariner does, time it, send back."""
    try:
        conn.send(("ok", _measure_raw(settings, bodies)))
    except BaseException as exc:
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        raise


def _timed_loop(fn: Any, seconds: float, *, min_iters: int = 50) -> list[float]:
    out: list[float] = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end or len(out) < min_iters:
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def _measure_raw(settings: Settings, bodies: tuple[bytes, ...]) -> RawResult:
    import numpy as np
    import torch

    from mariner.handlers.digits_handler import decode_item
    from mariner.server.core.archive import open_archive
    from mariner.server.core.context import Context
    from mariner.server.core.runner import load_entry_point

    torch.set_num_threads(settings.torch_threads)  # the servers get the same setting
    gpu_id = 0 if torch.cuda.is_available() else None
    with tempfile.TemporaryDirectory(prefix="bench-raw-") as work:
        archive = open_archive(settings.store / f"{settings.model}.mar", Path(work))
        ctx = Context(
            archive.name,
            str(archive.model_dir),
            archive.manifest,
            batch_size=settings.batch_size,
            gpu_id=gpu_id,
            model_yaml_config=archive.model_config,
        )
        handle, initialize = load_entry_point(archive)
        initialize(ctx)
        handler = getattr(handle, "__self__", None)
        device = str(getattr(handler, "device", "cpu"))
        b = settings.batch_size
        rows = [{"data": bodies[i % len(bodies)]} for i in range(max(b, 1))]
        ids = [f"r{i}" for i in range(b)]
        heads: list[dict[str, str]] = [{} for _ in range(b)]
        half = settings.raw_seconds / 4

        def one(k: list[int] = [0]) -> None:  # noqa: B006 - a counter that walks the digits
            k[0] += 1
            ctx.begin_batch(ids[:1], heads[:1])
            handle([rows[k[0] % len(rows)]], ctx)

        def full() -> None:
            ctx.begin_batch(ids, heads)
            handle(rows, ctx)

        for _ in range(20):  # warm-up: first calls fault in kernels and allocator pools
            one()
            full()
        batch1 = Percentiles.of(_timed_loop(one, half))
        batched = _timed_loop(full, half)
        batched_rps = b / (statistics.median(batched) / 1e3)

        model_b1 = model_batched_rps = math.nan
        model_batch1 = Percentiles.of([])
        predict = getattr(handler, "predict_topk", None)
        if predict is not None:
            pixels = np.stack([decode_item(r) for r in rows])
            for _ in range(20):
                predict(pixels[:1])
                predict(pixels)
            model_batch1 = Percentiles.of(_timed_loop(lambda: predict(pixels[:1]), half))
            model_b1 = statistics.median(_timed_loop(lambda: predict(pixels), half))
            model_batched_rps = b / (model_b1 / 1e3)
    return RawResult(
        batch1=batch1,
        batched_rps=batched_rps,
        model_batch1=model_batch1,
        model_batched_rps=model_batched_rps,
        batch_size=b,
        torch_threads=settings.torch_threads,
        device=device,
    )


def measure_raw(settings: Settings, bodies: tuple[bytes, ...]) -> RawResult:
    ctx = mp.get_context("spawn")
    parent_end, child_end = ctx.Pipe(duplex=False)
    p = ctx.Process(target=_raw_main, args=(settings, bodies, child_end), daemon=True)
    p.start()
    child_end.close()
    try:
        status, payload = parent_end.recv()
    finally:
        p.join(30)
    if status != "ok":
        raise RuntimeError(f"raw measurement failed: {payload}")
    result: RawResult = payload
    return result


# ==================================================================================================
# Servers
# ==================================================================================================
@dataclass(frozen=True)
class Cell:
    """One measurement in the run's order: a server at a level over a client set-up (raw: none)."""

    level: int
    repeat: int
    server: str
    protocol: str = ""


def plan_cells(settings: Settings, servers: Sequence[str]) -> list[Cell]:
    """Every measurement, in order. Lower levels run once; the highest `settings.repeats` times,
    each repeat every server in turn (reversed on odd repeats, so neither always goes first after
    the other's load), raw first. grpc-1ch is skipped at one client (the same as grpc there); the
    thread baseline runs only where it answers a target: the lowest level (the process hop) and
    grpc-1ch at the highest (no worse than before)."""
    lo, hi = min(settings.levels), max(settings.levels)
    served = [s for s in servers if s != "raw"]
    out: list[Cell] = []
    for level in settings.levels:
        repeats = settings.repeats if level == hi else 1
        for rep in range(repeats):
            if level == hi and "raw" in servers:
                out.append(Cell(level, rep, "raw"))
            order = served if rep % 2 == 0 else served[::-1]
            for proto in settings.protocols:
                if proto == "grpc-1ch" and level == 1:
                    continue
                for server in order:
                    if server == THREAD_BASELINE and not (
                        (level == lo and proto != "grpc-1ch") or (level == hi and proto == "grpc-1ch")
                    ):
                        continue
                    out.append(Cell(level, rep, server, proto))
    return out


@dataclass(frozen=True)
class Running:
    """A server that is up: where to send each protocol, and whose CPU to count."""

    name: str
    grpc: tuple[str, int]
    http: tuple[str, int]
    pid: int | None

    def endpoint(self, protocol: str) -> tuple[str, int]:
        return self.grpc if WIRE[protocol] == "grpc" else self.http


def mariner_features(python: str = sys.executable) -> dict[str, bool]:
    """Which process-model flags this build's `mariner serve` has (they may not exist yet)."""
    try:
        text = subprocess.run(
            [python, "-m", "mariner.server.cli", "serve", "--help"],
            cwd=REPO, capture_output=True, text=True, timeout=120, check=False,
        ).stdout  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        text = ""
    return {flag: f"--{flag}" in text for flag in ("frontends", "worker-mode", "min-workers")}


def _tree_size(pid: int | None) -> int:
    try:
        return 1 + len(psutil.Process(pid).children(recursive=True)) if pid else 0
    except psutil.NoSuchProcess:
        return 0


def _cpus_allowed(pid: int | None) -> int:
    with contextlib.suppress(psutil.Error, AttributeError, TypeError):
        return len(psutil.Process(pid).cpu_affinity())
    return psutil.cpu_count() or 0


def _describe_workers(url: str) -> list[dict[str, Any]]:
    with contextlib.suppress(requests.RequestException, ValueError):
        r = requests.get(url, timeout=5)
        if r.status_code == 200:
            return [w for v in r.json() for w in v.get("workers", [])]
    return []


def mariner_device(server: MarinerProcess, model_name: str) -> str:
    """The devices of the model's workers, from Mariner's own describe (`mariner.devices`)."""
    url = f"http://127.0.0.1:{server.ports.management}/models/{model_name}"
    with contextlib.suppress(requests.RequestException, ValueError):
        r = requests.get(url, timeout=5)
        if r.status_code == 200:
            devices = sorted({d for v in r.json() for d in v.get("mariner", {}).get("devices", [])})
            if devices:
                return ",".join(devices)
    workers = _describe_workers(url)
    return ("cuda" if any(w.get("gpu") for w in workers) else "cpu") if workers else "unknown"


def torchserve_device(management_url: str, model_name: str) -> str:
    """TorchServe's describe says per worker whether it holds a GPU (`gpu`), not which one."""
    workers = _describe_workers(f"{management_url}/models/{model_name}")
    if not workers:
        return "unknown"
    return "cuda" if any(w.get("gpu") for w in workers) else "cpu"


def model_name(settings: Settings) -> str:
    from mariner.loadtest.stock_torchserve import read_archive

    return read_archive(settings.store / f"{settings.model}.mar").name


def new_mariner(settings: Settings, extra: Sequence[str] = (), models: str | None = None) -> MarinerProcess:
    return MarinerProcess(
        settings.store,
        models or f"{settings.model}.mar",
        batch_size=settings.batch_size,
        max_batch_delay_ms=settings.max_batch_delay_ms,
        torch_threads=settings.torch_threads,
        extra_args=[*settings.mariner_args, *extra],
    )


def start_mariner(
    stack: contextlib.ExitStack, settings: Settings, name: str, extra: Sequence[str] = ()
) -> tuple[Running, ServerFacts]:
    server = stack.enter_context(new_mariner(settings, extra))
    running = Running(
        name,
        ("127.0.0.1", server.ports.grpc_inference),
        ("127.0.0.1", server.ports.inference),
        server.pid,
    )
    facts = ServerFacts(
        name=name,
        args=shlex.join([*settings.mariner_args, *extra]) or "(defaults)",
        device=mariner_device(server, model_name(settings)),
        processes=_tree_size(server.pid),
        cpus_allowed=_cpus_allowed(server.pid),
        ready_s=server.ready_seconds or math.nan,
    )
    return running, facts


def start_torchserve(stack: contextlib.ExitStack, settings: Settings) -> tuple[Running, ServerFacts]:
    from mariner.loadtest.stock_torchserve import StockTorchServe

    t0 = time.monotonic()
    ts = stack.enter_context(
        StockTorchServe(
            settings.store,
            [settings.model],
            batch_size=settings.batch_size,
            max_batch_delay_ms=settings.max_batch_delay_ms,
            workers=1,
        )
    )
    running = Running(
        "torchserve",
        ("127.0.0.1", ts.ports.grpc_inference),
        ("127.0.0.1", ts.ports.inference),
        ts.pid,
    )
    facts = ServerFacts(
        name="torchserve",
        args=f"1 worker, OMP_NUM_THREADS={settings.torch_threads}, metrics_mode=prometheus",
        device=torchserve_device(ts.management_url, ts.model_names[0]),
        processes=_tree_size(ts.pid),
        cpus_allowed=_cpus_allowed(ts.pid),
        ready_s=time.monotonic() - t0,
    )
    return running, facts


def warm_up(
    server: Running, settings: Settings, bodies: tuple[bytes, ...], cap_s: float, level: int
) -> WarmUp:
    """Load the server in 2 s windows, alternating protocols, until each protocol's throughput
    stops rising (its last two windows within 5% of each other) or `cap_s` has passed.

    A JVM keeps getting faster for tens of seconds (JIT); a fixed warm-up of a few hundred
    requests measured TorchServe anywhere between 1,100 and 5,000 req/s on the same machine.
    """
    windows: dict[str, list[float]] = {p: [] for p in settings.protocols}
    t0 = time.monotonic()
    while True:
        for proto in settings.protocols:
            if stopped_rising(windows[proto], WARMUP_TOLERANCE):
                continue
            host, port = server.endpoint(proto)
            r = run_level(
                server=server.name, protocol=WIRE[proto], host=host, port=port, model=settings.model,
                concurrency=level,
                load=replace(settings.load_for(proto), duration_s=WARMUP_WINDOW_S, warmup=level * 2),
                bodies=bodies, server_pid=server.pid, label=proto,
            )  # fmt: skip
            windows[proto].append(round(r.throughput_rps, 1))
        stable = all(stopped_rising(w, WARMUP_TOLERANCE) for w in windows.values())
        if stable or time.monotonic() - t0 >= cap_s:
            break
    warm = WarmUp(time.monotonic() - t0, windows, stable)
    print(
        f"  {server.name} warmed {warm.seconds:.0f} s ({'stable' if stable else 'cap reached'}): "
        + "; ".join(f"{p} " + ",".join(f"{x:.0f}" for x in w) for p, w in windows.items()),
        flush=True,
    )
    return warm


def run_cell(
    server: Running, cell: Cell, settings: Settings, bodies: tuple[bytes, ...], report: Report
) -> LevelResult:
    host, port = server.endpoint(cell.protocol)
    r = run_level(
        server=server.name, protocol=WIRE[cell.protocol], host=host, port=port, model=settings.model,
        concurrency=cell.level, load=settings.load_for(cell.protocol), bodies=bodies,
        server_pid=server.pid, label=cell.protocol, repeat=cell.repeat,
    )  # fmt: skip
    report.levels.append(r)
    lat = r.latency
    print(
        f"  {server.name:14s} {cell.protocol:8s} c={cell.level:<3d} #{cell.repeat + 1} n={lat.n:<6d} "
        f"p50={lat.p50_ms:7.2f} p99={lat.p99_ms:7.2f} ms {r.throughput_rps:7.0f} req/s "
        f"err={r.errors} conns={r.connections} cores: clients {r.client_cores:.2f} "
        f"server {r.server_cores:.2f} other {other_cores(r):.2f} ({fmt(r.cpu_us_per_request, 0)} us/req)",
        flush=True,
    )
    if r.errors:
        print(f"    first error: {r.first_error}", flush=True)
    return r


def _median_raw(runs: Sequence[RawResult]) -> RawResult | None:
    if not runs:
        return None
    ordered = sorted(runs, key=lambda r: r.batched_rps)
    return ordered[(len(ordered) - 1) // 2]


def measure_startup(settings: Settings, report: Report, extra: Sequence[str] = ()) -> None:
    """Seconds from `mariner serve` starting to /readyz 200: the whole store and one archive."""
    for rep in range(settings.repeats):
        for models in ("all", f"{settings.model}.mar"):
            with new_mariner(settings, extra, models=models) as server:
                report.startup_s.setdefault(models, []).append(round(server.ready_seconds or math.nan, 3))
        print(
            f"  start-up #{rep + 1}: " + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in report.startup_s.items()),
            flush=True,
        )


def run_benchmark(settings: Settings, bodies: tuple[bytes, ...], report: Report) -> None:
    """Start every server, warm each, then run the planned cells in order."""
    features = report.features
    servers = list(settings.servers)
    baseline = settings.baseline(features)
    if "mariner" in servers and baseline is not None:
        servers.insert(servers.index("mariner") + 1, THREAD_BASELINE)
    elif "mariner" in servers:
        report.notes.append(
            "This build of `mariner serve` has no `--worker-mode`: no thread-worker baseline, so the "
            "process hop and the one-channel comparison with the single-process server are not measured."
        )
    hi = max(settings.levels)
    if settings.startup and "mariner" in servers:
        measure_startup(settings, report)
    with contextlib.ExitStack() as stack:
        up: dict[str, Running] = {}
        for name in servers:
            if name == "raw":
                continue
            if name == "torchserve":
                running, facts = start_torchserve(stack, settings)
                cap = settings.torchserve_warmup_cap_s
            else:
                extra = baseline if name == THREAD_BASELINE and baseline is not None else ()
                running, facts = start_mariner(stack, settings, name, extra)
                cap = min(20.0, settings.torchserve_warmup_cap_s)
            print(
                f"{name} ready in {facts.ready_s:.1f} s (pid {running.pid}, {facts.processes} processes, "
                f"device {facts.device}, args {facts.args})",
                flush=True,
            )
            up[name] = running
            report.servers[name] = replace(facts, warmup=warm_up(running, settings, bodies, cap, hi))
        for cell in plan_cells(settings, servers):
            if cell.server == "raw":
                report.raw_runs.append(measure_raw(settings, bodies))
                r = report.raw_runs[-1]
                print(
                    f"  raw            #{cell.repeat + 1} handle() b=1 p50={r.batch1.p50_ms:.3f} ms; "
                    f"b={r.batch_size}: {r.batched_rps:,.0f} req/s (model only {r.model_batched_rps:,.0f})",
                    flush=True,
                )
                continue
            run_cell(up[cell.server], cell, settings, bodies, report)
    if "raw" in servers and not report.raw_runs:  # raw alone, or no level reached it
        report.raw_runs.append(measure_raw(settings, bodies))
    report.raw = _median_raw(report.raw_runs)
    if report.raw:
        report.servers["raw"] = ServerFacts(
            "raw", "handle() in-process", report.raw.device, 1, psutil.cpu_count() or 0, math.nan
        )


def scaling_configs(
    features: dict[str, bool], frontends: Sequence[int] = (1, 2), workers: Sequence[int] = (1, 2)
) -> list[tuple[int, int]]:
    """(frontends, workers) pairs this build can run: more than one frontend only with `--frontends`."""
    fronts = tuple(frontends) if features.get("frontends") else (1,)
    return [(f, w) for f in fronts for w in workers]


def scaling_name(frontends: int, workers: int) -> str:
    return f"mariner f{frontends} w{workers}"


def run_scaling(settings: Settings, bodies: tuple[bytes, ...], report: Report) -> list[tuple[int, int]]:
    """Mariner alone at the highest level: every (frontends, workers) config up at once, each
    repeat running all of them in turn (order flipped every repeat), like the main run."""
    configs = scaling_configs(report.features, settings.scaling_frontends, settings.scaling_workers)
    if not report.features.get("frontends"):
        report.notes.append("This build of `mariner serve` has no `--frontends`: one frontend only.")
    hi = max(settings.levels)
    with contextlib.ExitStack() as stack:
        up: dict[str, Running] = {}
        for f, w in configs:
            name = scaling_name(f, w)
            extra = ["--min-workers", str(w)] + (
                ["--frontends", str(f)] if report.features.get("frontends") else []
            )
            running, facts = start_mariner(stack, settings, name, extra)
            print(
                f"{name} ready in {facts.ready_s:.1f} s ({facts.processes} processes, {facts.device})",
                flush=True,
            )
            up[name] = running
            report.servers[name] = replace(facts, warmup=warm_up(running, settings, bodies, 10.0, hi))
        names = list(up)
        for rep in range(settings.repeats):
            order = names if rep % 2 == 0 else names[::-1]
            for proto in settings.protocols:
                for name in order:
                    run_cell(up[name], Cell(hi, rep, name, proto), settings, bodies, report)
    return configs


# ==================================================================================================
# Machine and versions
# ==================================================================================================
def machine_info() -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    info: dict[str, Any] = {
        "host": platform.node(),
        "os": f"{platform.system()} {platform.release()}",
        "cpu": cpu,
        "logical_cpus": psutil.cpu_count(),
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
    }
    with contextlib.suppress(Exception):
        import torch

        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
    return info


def versions() -> dict[str, str]:
    from importlib import metadata

    out = {"python": platform.python_version()}
    for dist in ("torch", "grpcio", "protobuf", "uvicorn", "starlette", "uvloop", "torchserve", "numpy"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = "not installed"
    try:
        java = subprocess.run(["java", "-version"], capture_output=True, text=True, timeout=20, check=False)
        out["java"] = (java.stderr or java.stdout).splitlines()[0]
    except (OSError, IndexError, subprocess.TimeoutExpired):
        out["java"] = "not installed"
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=REPO, capture_output=True, text=True)
        out["mariner"] = sha + (" (with uncommitted changes)" if dirty.stdout.strip() else "")
    except (OSError, subprocess.CalledProcessError):
        out["mariner"] = "unknown"
    return out


# ==================================================================================================
# CLI
# ==================================================================================================
DEFAULT_DURATION_S = 6.0


def _csv(text: str, allowed: Sequence[str] | None = None) -> tuple[str, ...]:
    items = tuple(x.strip() for x in text.split(",") if x.strip())
    if allowed is not None:
        bad = [x for x in items if x not in allowed]
        if bad:
            raise argparse.ArgumentTypeError(f"unknown {bad}; choose from {list(allowed)}")
    if not items:
        raise argparse.ArgumentTypeError("empty list")
    return items


def parse_args(argv: Sequence[str] | None) -> Settings:
    p = argparse.ArgumentParser(
        prog="python -m mariner.loadtest.bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--store", type=Path, default=REPO / "model_store")
    p.add_argument("--model", default="digits_torchscript", help="archive stem in the store")
    p.add_argument(
        "--servers", type=lambda t: _csv(t, SERVERS), default=SERVERS, help="raw,mariner,torchserve"
    )
    p.add_argument(
        "--protocols",
        type=lambda t: _csv(t, PROTOCOLS),
        default=PROTOCOLS,
        help="grpc (--grpc-channels channels), grpc-1ch (one channel), http",
    )
    p.add_argument(
        "--levels",
        type=lambda t: tuple(int(x) for x in _csv(t)),
        default=(1, 8, 64),
        help="concurrency levels (closed-loop clients), comma-separated",
    )
    p.add_argument(
        "--duration",
        type=float,
        default=None,
        help=f"seconds per measurement (default {DEFAULT_DURATION_S:g} unless --requests is given)",
    )
    p.add_argument("--requests", type=int, default=None, help="timed requests per measurement instead")
    p.add_argument("--warmup", type=int, default=500, help="warm-up requests per measurement (not timed)")
    p.add_argument(
        "--repeats", type=int, default=3, help="measurements of each cell at the highest level (median)"
    )
    p.add_argument(
        "--grpc-channels", type=int, default=16, help="gRPC channels (connections) in all for 'grpc'"
    )
    p.add_argument(
        "--mariner-args",
        default="",
        help='extra `mariner serve` arguments, one string, e.g. "--frontends 2 --worker-mode thread"',
    )
    p.add_argument(
        "--baseline-args",
        default=None,
        help="`mariner serve` arguments of the single-process baseline (mariner-thread), added to "
        '--mariner-args; default "--worker-mode thread --frontends 1" when this build has them, '
        "else no baseline",
    )
    p.add_argument(
        "--torchserve-warmup-cap",
        type=float,
        default=60.0,
        help="most seconds spent warming TorchServe until its throughput stops rising",
    )
    p.add_argument(
        "--scaling",
        action="store_true",
        help="Mariner alone at the highest level: frontends x workers (default 1/2 x 1/2; writes scaling.md)",
    )
    p.add_argument(
        "--scaling-frontends",
        type=lambda t: tuple(int(x) for x in _csv(t)),
        default=(1, 2),
        help="with --scaling: frontend counts, e.g. 1,2,4,8 on a 16-core machine",
    )
    p.add_argument(
        "--scaling-workers",
        type=lambda t: tuple(int(x) for x in _csv(t)),
        default=(1, 2),
        help="with --scaling: workers per model (minWorkers), e.g. 1,2",
    )
    p.add_argument("--no-startup", action="store_true", help="skip timing Mariner's start-up to ready")
    p.add_argument("--batch-size", type=int, default=32, help="batchSize for both servers (archives: 32)")
    p.add_argument(
        "--max-batch-delay-ms", type=int, default=5, help="maxBatchDelay for both servers (archives: 5)"
    )
    p.add_argument(
        "--torch-threads",
        type=int,
        default=1,
        help="torch intra-op threads for raw and both servers (1: clients need the other core here)",
    )
    p.add_argument(
        "--client-procs", type=int, default=2, help="client processes per level (fewer when conc. is lower)"
    )
    p.add_argument("--raw-seconds", type=float, default=4.0, help="seconds spent timing the raw handler")
    p.add_argument("--out", type=Path, default=REPO / "bench", help="where results.md and the plots go")
    a = p.parse_args(argv)
    if a.requests is not None and a.requests < 1:
        p.error("--requests must be positive")
    if a.duration is not None and a.duration <= 0:
        p.error("--duration must be positive")
    if a.warmup < 0 or min(a.levels) < 1 or a.client_procs < 1 or a.torch_threads < 1:
        p.error("--levels, --client-procs and --torch-threads must be positive")
    if a.repeats < 1 or a.grpc_channels < 1:
        p.error("--repeats and --grpc-channels must be positive")
    duration = a.duration if a.duration is not None or a.requests is not None else DEFAULT_DURATION_S
    return Settings(
        store=a.store.resolve(),
        model=a.model.removesuffix(".mar"),
        servers=a.servers,
        protocols=a.protocols,
        levels=tuple(sorted(set(a.levels))),
        requests=a.requests or 10000,
        warmup=a.warmup,
        duration_s=duration,
        batch_size=a.batch_size,
        max_batch_delay_ms=a.max_batch_delay_ms,
        torch_threads=a.torch_threads,
        client_procs=a.client_procs,
        raw_seconds=a.raw_seconds,
        out=a.out,
        repeats=a.repeats,
        grpc_channels=a.grpc_channels,
        mariner_args=tuple(shlex.split(a.mariner_args)),
        torchserve_warmup_cap_s=a.torchserve_warmup_cap,
        scaling=a.scaling,
        startup=not a.no_startup,
        baseline_args=None if a.baseline_args is None else tuple(shlex.split(a.baseline_args)),
        scaling_frontends=a.scaling_frontends,
        scaling_workers=a.scaling_workers,
    )


def main(argv: Sequence[str] | None = None) -> int:
    settings = parse_args(argv)
    archive = settings.store / f"{settings.model}.mar"
    if not archive.is_file():
        print(f"error: {archive} not found (run `make models`)", file=sys.stderr)
        return 2
    from mariner.server import protogen

    protogen.generate()
    # Every torch in play (raw process, Mariner, TorchServe's workers, which inherit the
    # launcher's environment) sees the same OpenMP thread count, whatever else sets it.
    os.environ["OMP_NUM_THREADS"] = str(settings.torch_threads)
    os.environ["MKL_NUM_THREADS"] = str(settings.torch_threads)
    argv_shown = list(sys.argv[1:] if argv is None else argv)
    report = Report(
        settings=settings,
        command=shlex.join(["python", "-m", "mariner.loadtest.bench", *argv_shown]),
        started=datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        machine=machine_info(),
        versions=versions(),
        features=mariner_features(),
    )
    if (report.machine["logical_cpus"] or 0) <= 4:
        report.notes.append(
            f"This machine has {report.machine['logical_cpus']} logical CPUs: clients and server share "
            "them, so client CPU is taken from the server (see the cores columns)."
        )
    from mariner.loadtest.payloads import test_digit_bodies

    bodies = test_digit_bodies()
    t0 = time.monotonic()
    what = "scaling" if settings.scaling else ",".join(settings.servers)
    print(
        f"bench: {settings.model}, {what}, levels {settings.levels}, {settings.repeats} repeat(s), "
        f"protocols {','.join(settings.protocols)}, mariner features {report.features}",
        flush=True,
    )
    settings.out.mkdir(parents=True, exist_ok=True)
    if settings.scaling:
        configs = run_scaling(settings, bodies, report)
        report.elapsed_s = time.monotonic() - t0
        report.machine["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
        text = render_scaling(report, configs)
        (settings.out / "scaling.md").write_text(text)
        (settings.out / "scaling.json").write_text(json.dumps(asdict(report), indent=1, default=str) + "\n")
        print(text)
        print(f"wrote {settings.out / 'scaling.md'}")
        return 0
    run_benchmark(settings, bodies, report)
    report.elapsed_s = time.monotonic() - t0
    report.machine["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    (settings.out / "results.md").write_text(render_markdown(report))
    (settings.out / "results.json").write_text(json.dumps(asdict(report), indent=1, default=str) + "\n")
    paths = plot(report, settings.out)
    print(f"wrote {settings.out / 'results.md'}, {', '.join(str(p) for p in paths)}")
    for t in targets(report):
        print(f"  target {t.what}: {t.shown} (wanted {t.wanted}) -> {t.verdict}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
