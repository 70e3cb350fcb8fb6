"""Side-by-side benchmark: the raw model, Mariner and stock TorchServe on the same archive.

    python -m mariner.loadtest.bench                      # defaults: TorchScript digits, levels 1,8,64
    python -m mariner.loadtest.bench --model digits_onnx --levels 1,4,16,64 --requests 5000
    python -m mariner.loadtest.bench --servers raw,mariner --duration 10   # e.g. on a GPU machine

What it measures, in this order (each server alone on the machine, started and stopped here):

- **raw**: the archive's handler loaded in-process (a spawned process of its own) exactly as the
  servers load it, with the same torch thread setting, called directly: batch-1 latency of
  `handle()` and its throughput at the max batch size. No transport, no queue: the ceiling.
  The model call alone (`predict_topk`, decoding excluded) is reported too.
- **mariner** (`mariner serve` subprocess) and **torchserve** (stock TorchServe 0.12, via
  `mariner.loadtest.stock_torchserve`), both with the same batchSize / maxBatchDelay, one instance and
  the same torch threads, each over gRPC (TorchServe `Predictions`) and HTTP
  (`POST /predictions/{model}`).
- **closed-loop clients** at each concurrency level (`mariner.loadtest.closedloop`): client processes
  separate from the servers, each running `concurrency / processes` coroutines on uvloop
  (grpc.aio for gRPC, HTTP/1.1 keep-alive over raw asyncio streams), sending real test-set
  digits. Every level warms up, then sends a fixed number of requests (or runs for
  `--duration` seconds); all client processes start the timed phase together. Latency is per
  request; throughput is completed requests / wall time of the timed phase.
- **CPU accounting** per level: CPU seconds of the client processes, of the server's process
  tree, and of the whole machine (the rest is other users of a shared machine), as cores.

It writes `bench/results.md` (machine, versions and the exact command at the top; tables;
ratios TorchServe/Mariner; Mariner as a fraction of raw; the performance targets, each marked
held or missed: latency against stock TorchServe at the lowest level, throughput against
TorchServe and against the raw model and the tail p99/p50 at the highest;
`mariner.loadtest.bench_report`), `bench/results.json` (every figure) and `bench/latency.png`,
`bench/throughput.png`. How to run it on a GPU machine: docs/benchmark.md.
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
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psutil

from mariner.loadtest.bench_report import fmt, other_cores, plot, render_markdown, targets
from mariner.loadtest.closedloop import LevelResult, LoadSpec, Percentiles, run_level
from mariner.loadtest.servers import MarinerProcess

REPO = Path(__file__).resolve().parent.parent
SERVERS = ("raw", "mariner", "torchserve")
PROTOCOLS = ("grpc", "http")


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

    @property
    def load(self) -> LoadSpec:
        return LoadSpec(self.requests, self.warmup, self.duration_s, self.client_procs)


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


@dataclass
class Report:
    settings: Settings
    command: str
    started: str
    machine: dict[str, Any]
    versions: dict[str, str]
    raw: RawResult | None = None
    levels: list[LevelResult] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    elapsed_s: float = 0.0


# ==================================================================================================
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
def _levels_for(
    server: str,
    endpoints: dict[str, tuple[str, int]],
    settings: Settings,
    bodies: tuple[bytes, ...],
    pid: int | None,
    report: Report,
) -> None:
    for protocol in settings.protocols:
        host, port = endpoints[protocol]
        for c in settings.levels:
            r = run_level(
                server=server, protocol=protocol, host=host, port=port, model=settings.model,
                concurrency=c, load=settings.load, bodies=bodies, server_pid=pid,
            )  # fmt: skip
            report.levels.append(r)
            lat = r.latency
            print(
                f"  {server:10s} {protocol:4s} c={c:<3d} n={lat.n:<6d} p50={lat.p50_ms:7.2f} "
                f"p90={lat.p90_ms:7.2f} p99={lat.p99_ms:7.2f} max={lat.max_ms:7.2f} ms  "
                f"{r.throughput_rps:8.0f} req/s  errors={r.errors}  cores: clients {r.client_cores:.2f} "
                f"server {r.server_cores:.2f} other {other_cores(r):.2f}",
                flush=True,
            )
            if r.errors:
                print(f"    first error: {r.first_error}", flush=True)


def bench_mariner(settings: Settings, bodies: tuple[bytes, ...], report: Report) -> None:
    server = MarinerProcess(
        settings.store,
        f"{settings.model}.mar",
        batch_size=settings.batch_size,
        max_batch_delay_ms=settings.max_batch_delay_ms,
        torch_threads=settings.torch_threads,
    )
    with server:
        print(f"mariner ready in {server.ready_seconds:.1f} s (pid {server.pid})", flush=True)
        endpoints = {
            "grpc": ("127.0.0.1", server.ports.grpc_inference),
            "http": ("127.0.0.1", server.ports.inference),
        }
        _levels_for("mariner", endpoints, settings, bodies, server.pid, report)


def bench_torchserve(settings: Settings, bodies: tuple[bytes, ...], report: Report) -> None:
    from mariner.loadtest.stock_torchserve import StockTorchServe

    t0 = time.monotonic()
    with StockTorchServe(
        settings.store,
        [settings.model],
        batch_size=settings.batch_size,
        max_batch_delay_ms=settings.max_batch_delay_ms,
        workers=1,
    ) as ts:
        print(f"torchserve ready in {time.monotonic() - t0:.1f} s (pid {ts.pid})", flush=True)
        endpoints = {
            "grpc": ("127.0.0.1", ts.ports.grpc_inference),
            "http": ("127.0.0.1", ts.ports.inference),
        }
        _levels_for("torchserve", endpoints, settings, bodies, ts.pid, report)


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
# Report
# ==================================================================================================
# ==================================================================================================
# CLI
# ==================================================================================================
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
    p.add_argument("--protocols", type=lambda t: _csv(t, PROTOCOLS), default=PROTOCOLS, help="grpc,http")
    p.add_argument(
        "--levels",
        type=lambda t: tuple(int(x) for x in _csv(t)),
        default=(1, 8, 64),
        help="concurrency levels (closed-loop clients), comma-separated",
    )
    p.add_argument("--requests", type=int, default=10000, help="timed requests per level")
    p.add_argument("--warmup", type=int, default=500, help="warm-up requests per level (not timed)")
    p.add_argument(
        "--duration", type=float, default=None, help="seconds per level instead of a request count"
    )
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
    if a.requests < 1 or a.warmup < 0 or min(a.levels) < 1 or a.client_procs < 1 or a.torch_threads < 1:
        p.error("--requests, --levels, --client-procs and --torch-threads must be positive")
    return Settings(
        store=a.store.resolve(),
        model=a.model.removesuffix(".mar"),
        servers=a.servers,
        protocols=a.protocols,
        levels=tuple(sorted(set(a.levels))),
        requests=a.requests,
        warmup=a.warmup,
        duration_s=a.duration,
        batch_size=a.batch_size,
        max_batch_delay_ms=a.max_batch_delay_ms,
        torch_threads=a.torch_threads,
        client_procs=a.client_procs,
        raw_seconds=a.raw_seconds,
        out=a.out,
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
    )
    if (report.machine["logical_cpus"] or 0) <= 4:
        report.notes.append(
            f"This machine has {report.machine['logical_cpus']} logical CPUs: clients and server share "
            "them, so client CPU is taken from the server (see the cores columns)."
        )
    from mariner.loadtest.payloads import test_digit_bodies

    bodies = test_digit_bodies()
    t0 = time.monotonic()
    print(
        f"bench: {settings.model}, servers {','.join(settings.servers)}, levels {settings.levels}", flush=True
    )
    if "raw" in settings.servers:
        report.raw = measure_raw(settings, bodies)
        r = report.raw
        print(
            f"  raw        handle() b=1 p50={r.batch1.p50_ms:.3f} p99={r.batch1.p99_ms:.3f} ms; "
            f"b={r.batch_size}: {r.batched_rps:,.0f} req/s (model only {r.model_batched_rps:,.0f})",
            flush=True,
        )
    if "mariner" in settings.servers:
        bench_mariner(settings, bodies, report)
    if "torchserve" in settings.servers:
        bench_torchserve(settings, bodies, report)
    report.elapsed_s = time.monotonic() - t0
    report.machine["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    settings.out.mkdir(parents=True, exist_ok=True)
    (settings.out / "results.md").write_text(render_markdown(report))
    (settings.out / "results.json").write_text(json.dumps(asdict(report), indent=1, default=str) + "\n")
    paths = plot(report, settings.out)
    print(f"wrote {settings.out / 'results.md'}, {', '.join(str(p) for p in paths)}")
    for t in targets(report):
        print(f"  target {t.what}: {fmt(t.value)} (wanted {'>=' if t.higher_is_better else '<='} "
              f"{t.limit:g}) -> {t.held}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
