"""Side-by-side benchmark: the raw model, Mariner and stock TorchServe on the same archive.

    python -m mariner.loadtest.bench                      # defaults: TorchScript digits, levels 1,8,64
    python -m mariner.loadtest.bench --model minilm_onnx  # any archive of the store's families
    python -m mariner.loadtest.bench --levels 1,64 --duration 3 --repeats 2     # a quick look
    python -m mariner.loadtest.bench --mariner-args "--frontends 2" --servers mariner,torchserve
    python -m mariner.loadtest.bench --scaling            # Mariner alone: frontends 1/2 x workers 1/2
    python -m mariner.loadtest.bench --servers raw,mariner --duration 10   # e.g. on a GPU machine

What it measures (method and reasons: docs/benchmark.md):

- **raw**: the archive's handler loaded in-process (a spawned process of its own) exactly as the
  servers load it, with the same torch thread setting, called directly: batch-1 latency of
  `handle()` and its throughput on full batches of batchSize requests
  (`mariner.loadtest.ceiling`). No transport, no queue: the ceiling.
- **mariner** (`mariner serve` subprocess, `--mariner-args` passed through) and **torchserve**
  (stock TorchServe 0.12, via `mariner.loadtest.stock_torchserve`), both with the same
  batchSize / maxBatchDelay (the archive's unless given), one worker and torch threads, over
  the client set-ups: `grpc` (TorchServe `Predictions` over `--grpc-channels` channels, each its
  own HTTP/2 connection), `grpc-1ch` (every call multiplexed on one channel) and `http`
  (`POST /predictions/{model}`, one keep-alive connection per client). For the digits CNN, when
  this build of Mariner has `--worker-mode`, **mariner-thread** (thread workers, one frontend:
  the single-process server as it was) runs at the lowest level, for the cost of the process
  hop, and `grpc-1ch` at the highest.
- **payloads** per family (`mariner.loadtest.workloads`): digits from the test split, MiniLM
  texts of 5..200 word pieces, ResNet JPEGs of varied sizes; every answer is checked.
- MiniLM archives only, **mariner-pad-max** at the highest level: the same archive rewritten
  (`mariner.loadtest.padding`) to pad every text to maxLength, without the token budget, for
  what length-aware batching buys (`--no-padding-compare` skips it).
- Every server stays up for the whole run; the highest level is measured `--repeats` times,
  the servers interleaved in each repeat (the order flips every repeat), and ratios are the
  median of the per-repeat ratios: on a shared machine one run of each is a coin toss.
  TorchServe is warmed until its own throughput stops rising (2 s windows within 5%).
- **closed-loop clients** (`mariner.loadtest.closedloop`), **CPU accounting** per level (clients,
  the server's process tree, the whole machine), the devices the servers' workers run on, and
  (digits) Mariner's start-up to ready (`/readyz`) for the whole store and the archive.

It writes `bench/results.md` for the default digits archive and `bench/results-<model>.md` for any
other (machine, versions and the exact command at the top; tables; the targets, each held,
missed or not applicable; `mariner.loadtest.bench_report`), the `.json` beside it and the
latency and throughput PNGs; `--scaling` writes `bench/scaling.md` and `bench/scaling.json`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shlex
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from datetime import UTC, datetime
from pathlib import Path

import psutil

from mariner.loadtest.bench_env import machine_info, mariner_features, versions
from mariner.loadtest.bench_report import output_names, plot, render_markdown, render_scaling, targets
from mariner.loadtest.bench_servers import (
    measure_startup,
    run_cell,
    start_mariner,
    start_torchserve,
    warm_up,
)
from mariner.loadtest.bench_values import (
    PADDING_MAX,
    PROTOCOLS,
    REPO,
    SERVERS,
    THREAD_BASELINE,
    Cell,
    RawResult,
    Report,
    Running,
    ServerFacts,
    Settings,
)
from mariner.loadtest.ceiling import CeilingSpec, measure_raw, median_raw
from mariner.loadtest.workloads import FAMILIES, family_of

__all__ = [
    "Cell",
    "RawResult",
    "Report",
    "ServerFacts",
    "Settings",
    "main",
    "parse_args",
    "plan_cells",
    "scaling_configs",
]

DEFAULT_MODEL = "digits_torchscript"


def ceiling_spec(settings: Settings) -> CeilingSpec:
    return CeilingSpec(
        settings.store / f"{settings.model}.mar",
        settings.family,
        settings.batch_size,
        settings.torch_threads,
        settings.raw_seconds,
    )


# ==================================================================================================
# The plan
# ==================================================================================================
def plan_cells(settings: Settings, servers: Sequence[str]) -> list[Cell]:
    """Every measurement, in order. Lower levels run once; the highest `settings.repeats` times,
    each repeat every server in turn (reversed on odd repeats, so neither always goes first after
    the other's load), raw first. grpc-1ch is skipped at one client (the same as grpc there); the
    thread baseline runs only where it answers a target: the lowest level (the process hop) and
    grpc-1ch at the highest (no worse than before). The length-blind MiniLM copy runs at the
    highest level only: the comparison it answers is about full batches."""
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
                    if server == PADDING_MAX and level != hi:
                        continue
                    if server == THREAD_BASELINE and not (
                        (level == lo and proto != "grpc-1ch") or (level == hi and proto == "grpc-1ch")
                    ):
                        continue
                    out.append(Cell(level, rep, server, proto))
    return out


def run_benchmark(settings: Settings, bodies: tuple[bytes, ...], report: Report) -> None:
    """Start every server, warm each, then run the planned cells in order."""
    features = report.features
    servers = list(settings.servers)
    baseline = settings.baseline(features)
    if "mariner" in servers and baseline is not None:
        servers.insert(servers.index("mariner") + 1, THREAD_BASELINE)
    elif "mariner" in servers and settings.family == "digits":
        report.notes.append(
            "This build of `mariner serve` has no `--worker-mode`: no thread-worker baseline, so the "
            "process hop and the one-channel comparison with the single-process server are not measured."
        )
    pad_store = None
    if settings.padding_compare and "mariner" in servers:
        pad_store = padding_copy(settings, report)
        servers.insert(servers.index("mariner") + 1, PADDING_MAX)
    hi = max(settings.levels)
    if settings.startup and "mariner" in servers:
        measure_startup(settings, report)
    with contextlib.ExitStack() as stack:
        up: dict[str, Running] = {}
        for name in servers:
            if name == "raw":
                continue
            if name == PADDING_MAX:
                running, facts = start_mariner(stack, settings, name, store=pad_store)
                facts = replace(facts, args=f"{facts.args}; archive copy padded to max_length, no budget")
                cap = min(20.0, settings.torchserve_warmup_cap_s)
            elif name == "torchserve":
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
                report.raw_runs.append(measure_raw(ceiling_spec(settings), bodies))
                r = report.raw_runs[-1]
                print(
                    f"  raw            #{cell.repeat + 1} handle() b=1 p50={r.batch1.p50_ms:.3f} ms; "
                    f"b={r.batch_size}: {r.batch_ms:.1f} ms, {r.batched_rps:,.1f} req/s "
                    f"(model only {r.model_batched_rps:,.0f})",
                    flush=True,
                )
                continue
            run_cell(up[cell.server], cell, settings, bodies, report)
    if "raw" in servers and not report.raw_runs:  # raw alone, or no level reached it
        report.raw_runs.append(measure_raw(ceiling_spec(settings), bodies))
    report.raw = median_raw(report.raw_runs)
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


def padding_copy(settings: Settings, report: Report) -> Path:
    """Write the length-blind copy of the archive (`mariner.loadtest.padding`) into a store of its
    own under build/; record what changed in the report."""
    from mariner.loadtest.padding import rewrite_archive

    store = REPO / "build" / "bench" / f"{settings.model}-pad-max"
    done = rewrite_archive(settings.store / f"{settings.model}.mar", store)
    report.padding = list(done.changes) or ["nothing to change (the archive already pads to max_length)"]
    print(f"{PADDING_MAX}: {done.path} ({'; '.join(report.padding)})", flush=True)
    return store


# ==================================================================================================
# CLI
# ==================================================================================================
DEFAULT_DURATION_S = 6.0


@dataclass(frozen=True)
class FamilyDefaults:
    """Defaults that depend on the model: a MiniLM or ResNet batch takes about a second on one
    core, the digits CNN's a millisecond, so the cheap-model defaults (500 warm-up requests,
    three client set-ups, a minute of TorchServe JIT warm-up) would make a run last an hour."""

    protocols: tuple[str, ...]
    warmup: int  # requests per measurement (the clients send at least warmup_per_client each anyway)
    warmup_per_client: int
    duration_s: float
    raw_seconds: float
    torchserve_warmup_cap_s: float
    startup: bool  # time Mariner's start-up to ready (whole store and the archive)


FAMILY_DEFAULTS = {
    "digits": FamilyDefaults(PROTOCOLS, 500, 4, DEFAULT_DURATION_S, 4.0, 60.0, True),
    "minilm": FamilyDefaults(("http",), 0, 1, 12.0, 8.0, 20.0, False),
    "resnet18": FamilyDefaults(("http",), 0, 1, 12.0, 8.0, 20.0, False),
}


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
    p.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help=f"archive stem in the store; its name says its family ({', '.join(FAMILIES)}_*)",
    )
    p.add_argument(
        "--servers", type=lambda t: _csv(t, SERVERS), default=SERVERS, help="raw,mariner,torchserve"
    )
    p.add_argument(
        "--protocols",
        type=lambda t: _csv(t, PROTOCOLS),
        default=None,
        help="grpc (--grpc-channels channels), grpc-1ch (one channel), http (default: all three for "
        "digits, http for MiniLM and ResNet, whose batches take about a second)",
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
        help=f"seconds per measurement (default {DEFAULT_DURATION_S:g}, 12 for MiniLM and ResNet, "
        "unless --requests is given)",
    )
    p.add_argument("--requests", type=int, default=None, help="timed requests per measurement instead")
    p.add_argument(
        "--warmup",
        type=int,
        default=None,
        help="warm-up requests per measurement, not timed (default 500 for digits; at least 4 per "
        "client, 1 for MiniLM and ResNet)",
    )
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
        default=None,
        help="most seconds spent warming TorchServe until its throughput stops rising (default 60 "
        "for digits, 20 for the others)",
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
    p.add_argument(
        "--startup",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="time Mariner's start-up to ready (default: on for digits)",
    )
    p.add_argument(
        "--padding-compare",
        action=argparse.BooleanOptionalAction,
        default=None,
        help=f"MiniLM: also run {PADDING_MAX}, the archive padded to max_length without the token "
        "budget, at the highest level (default: on for minilm_*)",
    )
    p.add_argument(
        "--batch-size", type=int, default=None, help="batchSize for both servers (default: the archive's)"
    )
    p.add_argument(
        "--max-batch-delay-ms",
        type=int,
        default=None,
        help="maxBatchDelay for both servers (default: the archive's)",
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
    p.add_argument(
        "--raw-seconds",
        type=float,
        default=None,
        help="seconds spent timing the raw handler (default 4, 8 for MiniLM and ResNet)",
    )
    p.add_argument("--out", type=Path, default=REPO / "bench", help="where results.md and the plots go")
    a = p.parse_args(argv)
    model = a.model.removesuffix(".mar")
    try:
        family = family_of(model)
    except ValueError as exc:
        p.error(str(exc))
    d = FAMILY_DEFAULTS[family]
    warmup = d.warmup if a.warmup is None else a.warmup
    if a.requests is not None and a.requests < 1:
        p.error("--requests must be positive")
    if a.duration is not None and a.duration <= 0:
        p.error("--duration must be positive")
    if warmup < 0 or min(a.levels) < 1 or a.client_procs < 1 or a.torch_threads < 1:
        p.error("--levels, --client-procs and --torch-threads must be positive")
    if a.repeats < 1 or a.grpc_channels < 1:
        p.error("--repeats and --grpc-channels must be positive")
    duration = a.duration if a.duration is not None or a.requests is not None else d.duration_s
    return Settings(
        store=a.store.resolve(),
        model=model,
        servers=a.servers,
        protocols=d.protocols if a.protocols is None else a.protocols,
        levels=tuple(sorted(set(a.levels))),
        requests=a.requests or 10000,
        warmup=warmup,
        duration_s=duration,
        batch_size=a.batch_size or 0,  # 0: the archive's (archive_settings)
        max_batch_delay_ms=-1 if a.max_batch_delay_ms is None else a.max_batch_delay_ms,  # -1: the archive's
        torch_threads=a.torch_threads,
        client_procs=a.client_procs,
        raw_seconds=d.raw_seconds if a.raw_seconds is None else a.raw_seconds,
        out=a.out,
        repeats=a.repeats,
        grpc_channels=a.grpc_channels,
        mariner_args=tuple(shlex.split(a.mariner_args)),
        torchserve_warmup_cap_s=(
            d.torchserve_warmup_cap_s if a.torchserve_warmup_cap is None else a.torchserve_warmup_cap
        ),
        scaling=a.scaling,
        startup=d.startup if a.startup is None else a.startup,
        baseline_args=None if a.baseline_args is None else tuple(shlex.split(a.baseline_args)),
        scaling_frontends=a.scaling_frontends,
        scaling_workers=a.scaling_workers,
        warmup_per_client=d.warmup_per_client,
        padding_compare=(family == "minilm") if a.padding_compare is None else a.padding_compare,
    )


def archive_settings(settings: Settings) -> Settings:
    """Fill in batchSize and maxBatchDelay from the archive's model-config where not given, so
    both servers run the archive as built (TorchServe's own defaults, 1 and 100 ms, otherwise)."""
    if settings.batch_size > 0 and settings.max_batch_delay_ms >= 0:
        return settings
    from mariner.server.core.archive import open_archive

    with tempfile.TemporaryDirectory(prefix="bench-config-") as tmp:
        config = open_archive(settings.store / f"{settings.model}.mar", Path(tmp)).model_config
    return replace(
        settings,
        batch_size=settings.batch_size or int(config.get("batchSize", 1)),
        max_batch_delay_ms=(
            settings.max_batch_delay_ms
            if settings.max_batch_delay_ms >= 0
            else int(config.get("maxBatchDelay", 100))
        ),
    )


def main(argv: Sequence[str] | None = None) -> int:
    settings = parse_args(argv)
    archive = settings.store / f"{settings.model}.mar"
    if not archive.is_file():
        print(f"error: {archive} not found (run `make models`)", file=sys.stderr)
        return 2
    settings = archive_settings(settings)
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
    from mariner.loadtest.workloads import length_summary, word_piece_counts, workload

    load = workload(settings.family)
    bodies = load.bodies
    report.workload = load.description
    counts = word_piece_counts(archive, bodies) if settings.family == "minilm" else None
    if counts:
        report.workload += f"; {length_summary(counts)} by the archive's tokenizer"
    t0 = time.monotonic()
    what = "scaling" if settings.scaling else ",".join(settings.servers)
    print(
        f"bench: {settings.model}, {what}, batchSize {settings.batch_size}, maxBatchDelay "
        f"{settings.max_batch_delay_ms} ms, levels {settings.levels}, {settings.repeats} repeat(s), "
        f"protocols {','.join(settings.protocols)}, mariner features {report.features}\n"
        f"  payloads: {report.workload}",
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
    names = output_names(settings.model)
    (settings.out / names.markdown).write_text(render_markdown(report))
    (settings.out / names.json).write_text(json.dumps(asdict(report), indent=1, default=str) + "\n")
    paths = plot(report, settings.out)
    print(f"wrote {settings.out / names.markdown}, {', '.join(str(p) for p in paths)}")
    for t in targets(report):
        print(f"  target {t.what}: {t.shown} (wanted {t.wanted}) -> {t.verdict}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
