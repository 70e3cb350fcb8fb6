"""Starting, describing, warming and driving the servers the benchmark compares.

Both servers start through `mariner.loadtest.servers` (`mariner serve` and stock TorchServe's
own launcher), both are asked for the same batchSize,
maxBatchDelay, one worker and the same torch threads, and each reports back what it actually
ran with (`ServerFacts`). Every measurement goes through `run_cell`, with the family's payloads,
content type and answer check (`mariner.loadtest.workloads`).
"""

from __future__ import annotations

import contextlib
import math
import shlex
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import psutil
import requests

from mariner.loadtest.bench_summary import fmt, other_cores, stopped_rising
from mariner.loadtest.bench_values import (
    WARMUP_TOLERANCE,
    WARMUP_WINDOW_S,
    WIRE,
    Cell,
    Report,
    Running,
    ServerFacts,
    Settings,
    WarmUp,
    unserved,
)
from mariner.loadtest.closedloop import LevelResult, run_level
from mariner.loadtest.server_stats import difference, scrape
from mariner.loadtest.servers import MarinerProcess, ServerProcess, StockTorchServe, read_archive
from mariner.loadtest.workloads import content_type


def _tree_size(pid: int | None) -> int:
    try:
        return 1 + len(psutil.Process(pid).children(recursive=True)) if pid else 0
    except psutil.NoSuchProcess:
        return 0


def _cpus_allowed(pid: int | None) -> int:
    with contextlib.suppress(psutil.Error, AttributeError, TypeError):
        return len(psutil.Process(pid).cpu_affinity())
    return psutil.cpu_count() or 0


def workers_device(server: ServerProcess, model_name: str) -> str:
    """The devices of the model's workers: Mariner's describe names them (`mariner.devices`);
    TorchServe's says per worker only whether it holds a GPU (`gpu`), not which one."""
    url = f"{server.management_url}/models/{model_name}"
    with contextlib.suppress(requests.RequestException, ValueError):
        r = requests.get(url, timeout=5)
        if r.status_code == 200:
            devices = sorted({d for v in r.json() for d in v.get("mariner", {}).get("devices", [])})
            if devices:
                return ",".join(devices)
            workers = [w for v in r.json() for w in v.get("workers", [])]
            if workers:
                return "cuda" if any(w.get("gpu") for w in workers) else "cpu"
    return "unknown"


def model_name(settings: Settings) -> str:
    return read_archive(settings.store / f"{settings.model}.mar").name


def new_mariner(
    settings: Settings, extra: Sequence[str] = (), models: str | None = None, store: Path | None = None
) -> MarinerProcess:
    """`mariner serve` with the run's settings, on `store` (default the run's model store)."""
    return MarinerProcess(
        store or settings.store,
        models or f"{settings.model}.mar",
        batch_size=settings.batch_size,
        max_batch_delay_ms=settings.max_batch_delay_ms,
        torch_threads=settings.torch_threads,
        extra_args=[*settings.mariner_args, *extra],
    )


def start(
    stack: contextlib.ExitStack, settings: Settings, name: str, server: ServerProcess, args: str
) -> tuple[Running, ServerFacts]:
    """Start `server` for the rest of the run (`stack`) and say what it runs with."""
    stack.enter_context(server)
    facts = ServerFacts(
        name=name,
        args=args,
        device=workers_device(server, model_name(settings)),
        processes=_tree_size(server.pid),
        cpus_allowed=_cpus_allowed(server.pid),
        ready_s=server.ready_seconds or math.nan,
    )
    # Batch statistics come from Mariner's own /metrics; TorchServe's do not have them.
    return Running(name, server, batch_stats=isinstance(server, MarinerProcess)), facts


def start_mariner(
    stack: contextlib.ExitStack,
    settings: Settings,
    name: str,
    extra: Sequence[str] = (),
    store: Path | None = None,
) -> tuple[Running, ServerFacts]:
    args = shlex.join([*settings.mariner_args, *extra]) or "(defaults)"
    return start(stack, settings, name, new_mariner(settings, extra, store=store), args)


def start_torchserve(
    stack: contextlib.ExitStack, settings: Settings, name: str = "torchserve", store: Path | None = None
) -> tuple[Running, ServerFacts]:
    """Stock TorchServe on the run's store, or on `store` (the sequence-batching copy, `TS_STREAM`)."""
    ts = StockTorchServe(
        store or settings.store,
        [settings.model],
        batch_size=settings.batch_size,
        max_batch_delay_ms=settings.max_batch_delay_ms,
        workers=1,
    )
    args = f"1 worker, OMP_NUM_THREADS={settings.torch_threads}, metrics_mode=prometheus"
    if store is not None:
        args += "; archive copy with sequenceBatching (its StreamPredictions2 needs it)"
    return start(stack, settings, name, ts, args)


def start_mosec(stack: contextlib.ExitStack, settings: Settings) -> tuple[Running, ServerFacts]:
    """The archive's handler under mosec (`mariner.loadtest.servers.mosec`), HTTP only."""
    from mariner.loadtest.servers.mosec import MosecPeer

    peer = MosecPeer(
        settings.store / f"{settings.model}.mar",
        batch_size=settings.batch_size,
        max_wait_ms=max(settings.max_batch_delay_ms, 0),
        torch_threads=settings.torch_threads,
    )
    stack.enter_context(peer)
    facts = ServerFacts(
        name="mosec",
        args=f"1 worker, max_batch_size={settings.batch_size}, "
        f"max_wait_time={settings.max_batch_delay_ms} ms, torch threads {settings.torch_threads}, "
        f"POST {peer.inference_path}",
        device="cpu",
        processes=_tree_size(peer.pid),
        cpus_allowed=_cpus_allowed(peer.pid),
        ready_s=peer.ready_seconds or math.nan,
    )
    return Running("mosec", peer, http_path=peer.inference_path), facts


def warm_up(
    server: Running, settings: Settings, bodies: tuple[bytes, ...], cap_s: float, level: int
) -> WarmUp:
    """Load the server in 2 s windows, alternating protocols, until each protocol's throughput
    stops rising (its last two windows within 5% of each other) or `cap_s` has passed.

    A JVM keeps getting faster for tens of seconds (JIT); a fixed warm-up of a few hundred
    requests measured TorchServe anywhere between 1,100 and 5,000 req/s on the same machine.
    """
    windows: dict[str, list[float]] = {p: [] for p in settings.protocols if not unserved(server.name, p)}
    t0 = time.monotonic()
    while True:
        for proto in windows:
            if stopped_rising(windows[proto], WARMUP_TOLERANCE):
                continue
            host, port = server.endpoint(proto)
            r = run_level(
                server=server.name, protocol=WIRE[proto], host=host, port=port, model=settings.model,
                concurrency=level,
                load=replace(
                    settings.load_for(proto),
                    duration_s=WARMUP_WINDOW_S,
                    warmup=level * min(2, settings.warmup_per_client),
                ),
                bodies=bodies, server_pid=server.pid, label=proto, family=settings.family,
                content_type=content_type(settings.family), http_path=server.http_path,
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
    name = model_name(settings)
    before = scrape(server.metrics_url, name) if server.metrics_url else {}
    r = run_level(
        server=server.name, protocol=WIRE[cell.protocol], host=host, port=port, model=settings.model,
        concurrency=cell.level, load=settings.load_for(cell.protocol), bodies=bodies,
        server_pid=server.pid, label=cell.protocol, repeat=cell.repeat, family=settings.family,
        content_type=content_type(settings.family), http_path=server.http_path,
    )  # fmt: skip
    report.levels.append(r)
    if server.metrics_url:
        after = scrape(server.metrics_url, name)
        stats = difference(
            before,
            after,
            server=server.name,
            protocol=cell.protocol,
            concurrency=cell.level,
            repeat=cell.repeat,
        )
        if stats is not None:
            report.batch_stats.append(stats)
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
