"""Side-by-side benchmark: the raw model, Mariner and stock TorchServe on the same archive.

    python -m mariner.loadtest.bench                      # defaults: TorchScript digits, levels 1,8,64
    python -m mariner.loadtest.bench --model minilm_onnx  # any archive of the store's families
    python -m mariner.loadtest.bench --levels 1,64 --duration 3 --repeats 2     # a quick look
    python -m mariner.loadtest.bench --mariner-args "--frontends 2" --servers mariner,torchserve
    python -m mariner.loadtest.bench --scaling            # Mariner alone: frontends 1/2 x workers 1/2
    python -m mariner.loadtest.bench --servers raw,mariner --duration 10   # e.g. on a GPU machine

Three more modes, each the first word (`python -m mariner.loadtest.bench MODE --help`):

    python -m mariner.loadtest.bench quick                 # one sequential client (make quickbench)
    python -m mariner.loadtest.bench ceiling --model resnet18_onnx   # the raw ceiling alone
    python -m mariner.loadtest.bench serve-torchserve      # stock TorchServe until Ctrl-C

What it measures (method and reasons: docs/benchmark.md):

- **raw**: the archive's handler loaded in-process (a spawned process of its own) exactly as the
  servers load it, with the same torch thread setting, called directly: batch-1 latency of
  `handle()` and its throughput on full batches of batchSize requests
  (`mariner.loadtest.ceiling`). No transport, no queue: the ceiling.
- **mariner** (`mariner serve` subprocess, `--mariner-args` passed through) and **torchserve**
  (stock TorchServe 0.12), both started through `mariner.loadtest.servers`, both with the same
  batchSize / maxBatchDelay (the archive's unless given), one worker and torch threads, over
  the client set-ups: `grpc` (TorchServe `Predictions` over `--grpc-channels` channels, each its
  own HTTP/2 connection), `grpc-1ch` (every call multiplexed on one channel), `http`
  (`POST /predictions/{model}`, one keep-alive connection per client), and at the lowest and
  highest level `grpc-stream` (StreamPredictions2) and `oip-stream` (ModelStreamInfer), one
  bidirectional stream per client kept for all its requests (`mariner.loadtest.stream_clients`).
- **mosec** (when installed, digits only): the archive's handler under mosec's HTTP server and
  batcher (`mariner.loadtest.servers.mosec`), same batch size, max wait and torch threads; HTTP
  only. What a server does not serve is skipped and named in the report (`bench_values.UNSERVED`).
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

import contextlib
import json
import math
import os
import shlex
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, replace
from datetime import UTC, datetime
from pathlib import Path

import psutil

from mariner.loadtest import perf_analyzer
from mariner.loadtest.bench_cli import archive_settings, parse_args
from mariner.loadtest.bench_env import machine_info, versions
from mariner.loadtest.bench_plots import plot
from mariner.loadtest.bench_report import output_names, render_markdown, render_scaling, targets
from mariner.loadtest.bench_servers import (
    measure_startup,
    model_name,
    run_cell,
    start_mariner,
    start_mosec,
    start_torchserve,
    warm_up,
)
from mariner.loadtest.bench_values import (
    PADDING_MAX,
    REPO,
    STREAMS,
    TS_STREAM,
    Cell,
    RawResult,
    Report,
    Running,
    ServerFacts,
    Settings,
    unserved,
)
from mariner.loadtest.ceiling import CeilingSpec, measure_raw, median_raw

__all__ = [
    "Cell",
    "RawResult",
    "Report",
    "ServerFacts",
    "Settings",
    "archive_settings",
    "main",
    "parse_args",
    "plan_cells",
    "scaling_configs",
]


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
    the other's load), raw first. grpc-1ch is skipped at one client (the same as grpc there). The
    streams run at the lowest and highest level only (the targets compare those; it keeps the
    default run near ten minutes). A server is skipped over a protocol it does not serve
    (`bench_values.UNSERVED`: TorchServe's streams, mosec's gRPC). The length-blind MiniLM copy
    runs at the highest level only: the comparison it answers is about full batches."""
    hi, lo = max(settings.levels), min(settings.levels)
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
                if proto in STREAMS and level not in (lo, hi):
                    continue
                for server in order:
                    if (server == PADDING_MAX and level != hi) or unserved(server, proto):
                        continue
                    out.append(Cell(level, rep, server, proto))
    return out


def run_benchmark(settings: Settings, bodies: tuple[bytes, ...], report: Report) -> None:
    """Start every server, warm each, then run the planned cells in order."""
    servers = list(settings.servers)
    pad_store = None
    if settings.padding_compare and "mariner" in servers:
        pad_store = padding_copy(settings, report)
        servers.insert(servers.index("mariner") + 1, PADDING_MAX)
    seq_store = None
    if "torchserve" in servers and "grpc-stream" in settings.protocols:
        seq_store = sequence_store(settings)
        servers.insert(servers.index("torchserve") + 1, TS_STREAM)
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
            elif name == TS_STREAM:
                running, facts = start_torchserve(stack, settings, name, store=seq_store)
                cap = min(30.0, settings.torchserve_warmup_cap_s)
            elif name == "mosec":
                running, facts = start_mosec(stack, settings)
                cap = min(20.0, settings.torchserve_warmup_cap_s)
            else:
                running, facts = start_mariner(stack, settings, name)
                cap = min(20.0, settings.torchserve_warmup_cap_s)
            print(
                f"{name} ready in {facts.ready_s:.1f} s (pid {running.pid}, {facts.processes} processes, "
                f"device {facts.device}, args {facts.args})",
                flush=True,
            )
            up[name] = running
            report.servers[name] = replace(facts, warmup=warm_up(running, settings, bodies, cap, hi))
        for server, proto in sorted({(s, p) for s in up for p in settings.protocols if unserved(s, p)}):
            report.notes.append(f"Not measured: {server} over `{proto}` ({unserved(server, proto)}).")
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
        if "mariner" in up and model_name(settings).startswith("digits"):
            # Triton's own load generator on the same server (skipped, with the reason, where it
            # does not run); digits only: its zero input is a valid image of a digit.
            srv = up["mariner"].server
            pa = perf_analyzer.run_matrix(
                http=srv.http_url.removeprefix("http://"), grpc=srv.grpc_target, model=model_name(settings)
            )
            print(perf_analyzer.table(pa), flush=True)
            report.notes.extend(perf_analyzer.notes(pa))
    if "raw" in servers and not report.raw_runs:  # raw alone, or no level reached it
        report.raw_runs.append(measure_raw(ceiling_spec(settings), bodies))
    report.raw = median_raw(report.raw_runs)
    if report.raw:
        report.servers["raw"] = ServerFacts(
            "raw", "handle() in-process", report.raw.device, 1, psutil.cpu_count() or 0, math.nan
        )


def scaling_configs(
    frontends: Sequence[int] = (1, 2), workers: Sequence[int] = (1, 2)
) -> list[tuple[int, int]]:
    """Every (frontends, workers) pair, frontends outermost."""
    return [(f, w) for f in frontends for w in workers]


def scaling_name(frontends: int, workers: int) -> str:
    return f"mariner f{frontends} w{workers}"


def run_scaling(settings: Settings, bodies: tuple[bytes, ...], report: Report) -> list[tuple[int, int]]:
    """Mariner alone at the highest level: every (frontends, workers) config up at once, each
    repeat running all of them in turn (order flipped every repeat), like the main run."""
    configs = scaling_configs(settings.scaling_frontends, settings.scaling_workers)
    hi = max(settings.levels)
    with contextlib.ExitStack() as stack:
        up: dict[str, Running] = {}
        for f, w in configs:
            name = scaling_name(f, w)
            extra = ["--min-workers", str(w), "--frontends", str(f)]
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


def sequence_store(settings: Settings) -> Path:
    """The sequence-batching copy of the archive (`TS_STREAM`), in a store of its own under build/."""
    from mariner.loadtest.servers.sequence_archive import sequence_copy

    store = REPO / "build" / "bench" / f"{settings.model}-sequence"
    done = sequence_copy(settings.store / f"{settings.model}.mar", store, max(max(settings.levels), 64))
    print(f"{TS_STREAM}: {done} (sequenceBatching on, for TorchServe's StreamPredictions2)", flush=True)
    return store


def padding_copy(settings: Settings, report: Report) -> Path:
    """Write the length-blind copy of the archive (`mariner.loadtest.padding`) into a store of its
    own under build/; record what changed in the report."""
    from mariner.loadtest.padding import rewrite_archive

    store = REPO / "build" / "bench" / f"{settings.model}-pad-max"
    done = rewrite_archive(settings.store / f"{settings.model}.mar", store)
    report.padding = list(done.changes) or ["nothing to change (the archive already pads to max_length)"]
    print(f"{PADDING_MAX}: {done.path} ({'; '.join(report.padding)})", flush=True)
    return store


def modes() -> dict[str, Callable[[Sequence[str]], int]]:
    """The benchmark's other modes, by their first word on the command line."""
    from mariner.loadtest import ceiling, quickbench
    from mariner.loadtest.servers.serve_torchserve import serve_torchserve

    return {"quick": quickbench.main, "ceiling": ceiling.main, "serve-torchserve": serve_torchserve}


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] in modes():
        return modes()[args[0]](args[1:])
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
        f"protocols {','.join(settings.protocols)}\n"
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
