"""The benchmark's report: results.md (tables, medians of repeats, ratios, the digits CNN's
targets) and the scaling table; the arithmetic is `bench_summary`'s, the plots `bench_plots`'.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from mariner.loadtest.bench_summary import (
    MARINER,
    TS,
    Target,
    cpu_per_request,
    fmt,
    median,
    median_ratio,
    other_cores,
    p50,
    ratio,
    rps,
    runs,
    summarize,
    throughput,
)
from mariner.loadtest.bench_targets import cross_section, latency_targets, throughput_targets
from mariner.loadtest.closedloop import LevelResult

if TYPE_CHECKING:
    from mariner.loadtest.bench_values import Report

DEFAULT_MODEL = "digits_torchscript"


@dataclass(frozen=True)
class OutputNames:
    """The files one run writes: the default digits archive keeps the names its docs link to,
    any other model gets its own, so every model's report can sit side by side in bench/."""

    markdown: str
    json: str
    latency: str
    throughput: str


def output_names(model: str) -> OutputNames:
    if model == DEFAULT_MODEL:
        return OutputNames("results.md", "results.json", "latency.png", "throughput.png")
    return OutputNames(
        f"results-{model}.md", f"results-{model}.json", f"latency-{model}.png", f"throughput-{model}.png"
    )


def _ran_on(report: Report, server: str) -> str:
    facts = report.servers.get(server)
    return facts.device if facts else "unknown"


def targets(report: Report) -> list[Target]:
    """The targets of the process model, from the measured cells:

    - throughput, CPU per request and p50, across servers and client set-ups (unary gRPC, HTTP,
      the streams, mosec): `mariner.loadtest.bench_targets`;
    - start-up to ready for the whole store <= 3 s;
    - on a GPU only: Mariner >= 90% of the raw batched handler (n/a when it ran on a CPU).

    Those are the digits CNN's; the MiniLM and ResNet archives have their own
    (`mariner.loadtest.family_report.family_targets`).
    """
    s = report.settings
    if s.family != "digits":
        from mariner.loadtest.family_report import family_targets

        return family_targets(report)
    hi = max(s.levels)
    lv = report.levels
    out = [*throughput_targets(report), *latency_targets(report)]
    out.append(
        Target(
            "start-up to ready, whole store (`--models all`), median",
            median(report.startup_s.get("all", [])),
            3,
            False,
            unit=" s",
        )
    )
    raw = report.raw.batched_rps if report.raw else math.nan
    device = _ran_on(report, MARINER)
    for proto in ("grpc", "http"):
        if proto in s.protocols:
            cell = summarize(lv, MARINER, proto, hi)
            out.append(
                Target(
                    f"{proto} c={hi}: throughput Mariner / raw batched (GPU)",
                    ratio(cell.rps, raw) if cell else math.nan,
                    0.90,
                    True,
                    not_applicable="" if "cuda" in device else f"ran on {device}",
                )
            )
    return out


# ==================================================================================================
# Markdown
# ==================================================================================================
def _header(report: Report, title: str) -> list[str]:
    s = report.settings
    m = report.machine
    per = f"{s.duration_s:g} s per measurement" if s.duration_s else f"{s.requests} timed requests each"
    lines = [
        f"# {title}",
        "",
        f"Command: `{report.command}`",
        "",
        f"- Started {report.started}, took {report.elapsed_s / 60:.1f} min.",
        f"- Machine: {m['cpu']}, {m['logical_cpus']} logical CPUs, {m['memory_gib']} GiB, {m['os']}"
        + (f", GPU {m['gpu']}" if "gpu" in m else "")
        + f"; load average at start {m['load_average_at_start']}, at end {m.get('load_average_at_end')}.",
        "- Versions: " + ", ".join(f"{k} {v}" for k, v in report.versions.items()) + ".",
        f"- Archive `{s.model}.mar`; batchSize {s.batch_size}, maxBatchDelay {s.max_batch_delay_ms} ms, "
        f"{s.torch_threads} torch thread(s) per worker (Mariner `--torch-threads`, TorchServe worker "
        "`OMP_NUM_THREADS`; raw `torch.set_num_threads`); Mariner arguments: "
        f"`{' '.join(s.mariner_args) or '(defaults)'}`.",
        f"- Clients: closed loop, up to {s.client_procs} client process(es), separate from the servers "
        f"(uvloop); `grpc`: {s.grpc_channels} gRPC channels (one HTTP/2 connection each) spread over "
        "the client processes; `grpc-1ch`: one channel, one client process, every call multiplexed on "
        "it; `http`: HTTP/1.1 keep-alive, one connection per client (mosec: `POST /inference`); "
        "`grpc-stream` (StreamPredictions2) and `oip-stream` (ModelStreamInfer): one bidirectional "
        f"stream per client, kept for all its requests, over the {s.grpc_channels} channels, at the "
        "lowest and highest level only. "
        f"{per} after {s.warmup} warm-up requests (at least {s.warmup_per_client} per client); payloads: "
        f"{report.workload or 'the 270 test-set digits in turn'}.",
        f"- Repeats: the highest level ran {s.repeats} time(s), every server in each repeat, the order "
        "reversed every other repeat; all servers stay up for the whole run (idle while another is "
        "measured). Ratios are medians of the per-repeat ratios.",
        "- Latency: per request, nearest-rank percentiles, ms. Throughput: completed requests / wall "
        "time. Cores: CPU seconds / wall seconds of the client processes, of the server's process "
        'tree, and of everything else ("other": other users of a shared machine, the OS). CPU per '
        "request: server cores / req/s, in µs.",
    ]
    lines += [f"- {n}" for n in report.notes]
    if report.levels:
        others = [other_cores(r) for r in report.levels]
        lines.append(
            f"- CPU taken by other work on the machine: {statistics.mean(others):.2f} cores on average "
            f"(up to {max(others):.2f})" + (": the machine was shared." if max(others) > 0.25 else ".")
        )
    return lines


def _servers_table(report: Report) -> list[str]:
    if not report.servers:
        return []
    lines = [
        "",
        "## Servers under test (as they reported themselves)",
        "",
        "| server | arguments | device | processes | CPUs allowed | ready s | warm-up |",
        "|---|---|---|---:|---:|---:|---|",
    ]
    for f in report.servers.values():
        w = f.warmup
        warm = "—"
        if w is not None:
            windows = "; ".join(f"{p}: " + ", ".join(f"{x:,.0f}" for x in xs) for p, xs in w.windows.items())
            state = "stable" if w.stable else "cap reached"
            warm = f"{w.seconds:.0f} s, {state} (req/s per 2 s window: {windows})"
        lines.append(
            f"| {f.name} | `{f.args}` | {f.device} | {f.processes} | {f.cpus_allowed} | {fmt(f.ready_s, 1)} "
            f"| {warm} |"
        )
    return lines


def _runs_table(levels: Sequence[LevelResult]) -> list[str]:
    lines = [
        "| server | protocol | conc. | run | conns | requests | errors | p50 ms | p99 ms | max ms | req/s "
        "| client cores | server cores | other cores | CPU µs/req |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in levels:
        lat = r.latency
        lines.append(
            f"| {r.server} | {r.protocol} | {r.concurrency} | {r.repeat + 1} | {r.connections} | {lat.n} | "
            f"{r.errors} | {fmt(lat.p50_ms)} | {fmt(lat.p99_ms)} | {fmt(lat.max_ms)} | "
            f"{rps(r.throughput_rps)} | {r.client_cores:.2f} | {r.server_cores:.2f} | {other_cores(r):.2f} | "
            f"{fmt(r.cpu_us_per_request, 0)} |"
        )
    return lines


def _cells(levels: Sequence[LevelResult]) -> list[tuple[str, str, int]]:
    seen: dict[tuple[str, str, int], None] = {}
    for r in levels:
        seen[(r.server, r.protocol, r.concurrency)] = None
    return list(seen)


def _medians_table(levels: Sequence[LevelResult]) -> list[str]:
    lines = [
        "| server | protocol | conc. | runs | median req/s | min–max req/s | p50 ms | p99 ms "
        "| server cores | CPU µs/req |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for server, proto, c in sorted(_cells(levels), key=lambda k: (k[2], k[1], k[0])):
        m = summarize(levels, server, proto, c)
        assert m is not None
        lines.append(
            f"| {server} | {proto} | {c} | {m.runs} | {rps(m.rps)} | {rps(m.rps_min)}–{rps(m.rps_max)} | "
            f"{fmt(m.p50_ms)} | {fmt(m.p99_ms)} | {m.server_cores:.2f} | {fmt(m.cpu_us_per_request, 0)} |"
        )
    return lines


def render_markdown(report: Report) -> str:
    s = report.settings
    names = output_names(s.model)
    digits = s.family == "digits"
    title = "Benchmark: raw model vs Mariner vs stock TorchServe"
    lines = _header(report, title if digits else f"{title}: `{s.model}`")
    lines.append(
        "- Why targets are missed, with profiles: [docs/benchmark.md](../docs/benchmark.md) "
        '("Where Mariner\'s time goes").'
    )
    if not digits:
        from mariner.loadtest.family_report import workload_section

        lines += workload_section(report)
    lines += _servers_table(report)
    if report.startup_s:
        lines += [
            "",
            "## Mariner start-up to ready",
            "",
            "Seconds from `mariner serve` starting to `/readyz` answering 200, with the run's Mariner "
            "arguments.",
            "",
            "| models | runs (s) | median s |",
            "|---|---|---:|",
        ]
        for models, xs in report.startup_s.items():
            lines.append(f"| `{models}` | {', '.join(f'{x:.2f}' for x in xs)} | {fmt(median(xs))} |")
    if report.raw:
        r = report.raw
        runs_rps = ", ".join(rps(x.batched_rps) for x in report.raw_runs)
        lines += [
            "",
            "## Raw: the handler in-process (the ceiling)",
            "",
            f"Device {r.device}, {r.torch_threads} torch thread(s), no clients running; the run with the "
            f"median batched throughput of {len(report.raw_runs)} ({runs_rps} req/s).",
            "",
            f"| call | p50 ms | p90 ms | p99 ms | max ms | throughput at batch {r.batch_size} (req/s) |",
            "|---|---:|---:|---:|---:|---:|",
            f"| `handle()` ({'JSON decode + model + top-k' if digits else 'decode + model + answer'}) "
            f"| {fmt(r.batch1.p50_ms, 3)} | "
            f"{fmt(r.batch1.p90_ms, 3)} | {fmt(r.batch1.p99_ms, 3)} | {fmt(r.batch1.max_ms, 3)} | "
            f"{r.batched_rps:,.{0 if digits else 1}f} |",
        ]
        if not math.isnan(r.model_batched_rps):
            lines.append(
                f"| `predict_topk()` (model + top-k only) | {fmt(r.model_batch1.p50_ms, 3)} | "
                f"{fmt(r.model_batch1.p90_ms, 3)} | {fmt(r.model_batch1.p99_ms, 3)} | "
                f"{fmt(r.model_batch1.max_ms, 3)} | {r.model_batched_rps:,.0f} |"
            )
        if not math.isnan(r.sorted_batched_rps):
            lines.append(
                f"| `handle()` on full batches of length-sorted texts (what grouping by length can reach) "
                f"| | | | | {rps(r.sorted_batched_rps)} |"
            )
        if not digits:
            lines += [
                "",
                f"One full batch of {r.batch_size} requests through `handle()`: {fmt(r.batch_ms, 1)} ms "
                "(median). Payloads in turn, so each batch mixes lengths or sizes as live traffic does.",
            ]
    lines += ["", "## Medians over repeats", "", *_medians_table(report.levels)]
    raw = report.raw.batched_rps if report.raw else math.nan
    lines += [
        "",
        "## Ratios (median of per-repeat ratios)",
        "",
        "| protocol | conc. | p50 TS/Mariner | p99 TS/Mariner | throughput Mariner/TS | "
        "CPU per request Mariner/TS | Mariner / raw batched |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for proto in s.protocols:
        for c in s.levels:
            if not runs(report.levels, MARINER, proto, c) or not runs(report.levels, TS, proto, c):
                continue
            lv = report.levels
            q50 = median_ratio(lv, TS, MARINER, proto, c, p50)
            q99 = median_ratio(lv, TS, MARINER, proto, c, lambda r: r.latency.p99_ms)
            thr = median_ratio(lv, MARINER, TS, proto, c, throughput)
            cpu = median_ratio(lv, MARINER, TS, proto, c, cpu_per_request)
            m = summarize(lv, MARINER, proto, c)
            frac = ratio(m.rps, raw) if m else math.nan
            lines.append(
                f"| {proto} | {c} | {fmt(q50, 1)}x | {fmt(q99, 1)}x | {fmt(thr, 2)}x | {fmt(cpu, 2)}x | "
                f"{'n/a' if math.isnan(frac) else f'{frac:.0%}'} |"
            )
    lines += cross_section(report)
    if not digits:
        from mariner.loadtest.family_report import inside_section, padding_section

        lines += padding_section(report)
        lines += inside_section(report)
    lines += [
        "",
        "## Performance targets",
        "",
        "| target | measured | wanted | verdict |",
        "|---|---:|---:|---|",
        *(t.row() for t in targets(report)),
        "",
        "## Every run",
        "",
        *_runs_table(report.levels),
        "",
        f"![latency percentiles vs concurrency]({names.latency})",
        "",
        f"![throughput vs concurrency]({names.throughput})",
        "",
    ]
    return "\n".join(lines)


def scaling_rows(
    levels: Sequence[LevelResult], configs: Sequence[tuple[int, int]], protocols: Sequence[str], c: int
) -> list[str]:
    """The scaling table: one row per (frontends, workers), median req/s and CPU per request for
    each protocol, and the throughput relative to frontends 1 x workers 1 (median of per-repeat
    ratios)."""
    head = (
        "| frontends | workers | "
        + " | ".join(f"{p} req/s | {p} µs/req | {p} vs f1 w1" for p in protocols)
        + " |"
    )
    lines = [head, "|---:|---:|" + "---:|---:|---:|" * len(protocols)]
    base = f"mariner f{configs[0][0]} w{configs[0][1]}" if configs else ""
    for f, w in configs:
        name = f"mariner f{f} w{w}"
        cells = []
        for p in protocols:
            m = summarize(levels, name, p, c)
            rel = median_ratio(levels, name, base, p, c, throughput)
            cells += [
                f"{m.rps:,.0f} ({m.rps_min:,.0f}–{m.rps_max:,.0f})" if m else "n/a",
                fmt(m.cpu_us_per_request, 0) if m else "n/a",
                f"{fmt(rel, 2)}x",
            ]
        lines.append(f"| {f} | {w} | " + " | ".join(cells) + " |")
    return lines


def render_scaling(report: Report, configs: Sequence[tuple[int, int]]) -> str:
    s = report.settings
    hi = max(s.levels)
    lines = _header(report, f"Mariner scaling: frontends x workers at {hi} clients")
    lines += _servers_table(report)
    lines += [
        "",
        f"## Scaling at c={hi} (median of {s.repeats} run(s); range in brackets)",
        "",
        *scaling_rows(report.levels, configs, s.protocols, hi),
        "",
        "## Every run",
        "",
        *_runs_table(report.levels),
        "",
    ]
    return "\n".join(lines)
