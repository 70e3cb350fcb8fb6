"""The benchmark's report: results.md (tables, medians of repeats, ratios, the targets), the scaling
table, and the PNG plots.

Ratios between servers are the median of per-repeat ratios: each repeat runs the servers back to
back, so both see about the same machine, and pairing by repeat cancels the drift of a shared
machine that a ratio of two separately-taken medians would keep.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from mariner.loadtest.closedloop import LevelResult

if TYPE_CHECKING:
    from mariner.loadtest.bench_values import Report

TS = "torchserve"
MARINER = "mariner"
THREAD_BASELINE = "mariner-thread"
PADDING_MAX = "mariner-pad-max"
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


# ==================================================================================================
# Arithmetic on runs
# ==================================================================================================
def median(xs: Sequence[float]) -> float:
    """Median of the measured values (NaN ignored); NaN when nothing was measured."""
    vals = [x for x in xs if not math.isnan(x)]
    return statistics.median(vals) if vals else math.nan


def ratio(a: float, b: float) -> float:
    return a / b if b and not math.isnan(a) and not math.isnan(b) else math.nan


def runs(levels: Sequence[LevelResult], server: str, protocol: str, c: int) -> list[LevelResult]:
    """Every repeat of one cell, in repeat order."""
    found = [r for r in levels if (r.server, r.protocol, r.concurrency) == (server, protocol, c)]
    return sorted(found, key=lambda r: r.repeat)


def paired_ratios(
    levels: Sequence[LevelResult],
    num: str,
    den: str,
    protocol: str,
    c: int,
    key: Callable[[LevelResult], float],
) -> list[float]:
    """key(num) / key(den) for each repeat both servers ran (a repeat missing on either is left out)."""
    dens = {r.repeat: r for r in runs(levels, den, protocol, c)}
    out = []
    for r in runs(levels, num, protocol, c):
        d = dens.get(r.repeat)
        if d is not None:
            q = ratio(key(r), key(d))
            if not math.isnan(q):
                out.append(q)
    return out


def median_ratio(
    levels: Sequence[LevelResult],
    num: str,
    den: str,
    protocol: str,
    c: int,
    key: Callable[[LevelResult], float],
) -> float:
    return median(paired_ratios(levels, num, den, protocol, c, key))


def throughput(r: LevelResult) -> float:
    return r.throughput_rps


def p50(r: LevelResult) -> float:
    return r.latency.p50_ms


def cpu_per_request(r: LevelResult) -> float:
    return r.cpu_us_per_request


@dataclass(frozen=True)
class CellSummary:
    """The repeats of one cell, summarised: medians, and the spread of throughput."""

    server: str
    protocol: str
    concurrency: int
    runs: int
    errors: int
    rps: float
    rps_min: float
    rps_max: float
    p50_ms: float
    p99_ms: float
    server_cores: float
    cpu_us_per_request: float
    connections: int


def summarize(levels: Sequence[LevelResult], server: str, protocol: str, c: int) -> CellSummary | None:
    rs = runs(levels, server, protocol, c)
    if not rs:
        return None
    rps = [r.throughput_rps for r in rs]
    return CellSummary(
        server=server,
        protocol=protocol,
        concurrency=c,
        runs=len(rs),
        errors=sum(r.errors for r in rs),
        rps=median(rps),
        rps_min=min(rps),
        rps_max=max(rps),
        p50_ms=median([r.latency.p50_ms for r in rs]),
        p99_ms=median([r.latency.p99_ms for r in rs]),
        server_cores=median([r.server_cores for r in rs]),
        cpu_us_per_request=median([r.cpu_us_per_request for r in rs]),
        connections=rs[0].connections,
    )


def stopped_rising(rates: Sequence[float], tolerance: float) -> bool:
    """True when the last two throughput windows are within `tolerance` of each other: the server
    has stopped getting faster (a JVM's JIT) and a measurement now says what it sustains."""
    if len(rates) < 2:
        return False
    a, b = rates[-2], rates[-1]
    return max(a, b) > 0 and abs(b - a) <= tolerance * max(a, b)


def rps(x: float) -> str:
    """Requests/s for a table: whole numbers, one decimal below 100 (a transformer's 11.4 req/s)."""
    return "n/a" if math.isnan(x) else f"{x:,.{1 if x < 100 else 0}f}"


def fmt(x: float, digits: int = 2) -> str:
    """A figure for the report; n/a when it was not measured."""
    return "n/a" if math.isnan(x) else f"{x:.{digits}f}"


def other_cores(r: LevelResult) -> float:
    """Cores used by everything but the clients and the server during a level (never negative)."""
    return max(0.0, r.machine_cores - r.client_cores - r.server_cores)


# ==================================================================================================
# Targets
# ==================================================================================================
@dataclass(frozen=True)
class Target:
    what: str
    value: float
    limit: float
    higher_is_better: bool
    not_applicable: str = ""  # why the target does not apply to this run, e.g. "ran on cpu"
    unit: str = ""

    @property
    def held(self) -> bool | None:
        if self.not_applicable or math.isnan(self.value):
            return None
        return self.value >= self.limit if self.higher_is_better else self.value <= self.limit

    @property
    def verdict(self) -> str:
        if self.not_applicable:
            return f"n/a ({self.not_applicable})"
        return {True: "held", False: "missed", None: "not measured"}[self.held]

    @property
    def shown(self) -> str:
        return "n/a" if math.isnan(self.value) else fmt(self.value) + self.unit

    @property
    def wanted(self) -> str:
        return f"{'>=' if self.higher_is_better else '<='} {self.limit:g}{self.unit}"

    def row(self) -> str:
        verdict = self.verdict if self.held is None else f"**{self.verdict}**"
        return f"| {self.what} | {self.shown} | {self.wanted} | {verdict} |"


def _ran_on(report: Report, server: str) -> str:
    facts = report.servers.get(server)
    return facts.device if facts else "unknown"


def targets(report: Report) -> list[Target]:
    """The targets of the process model, from the measured cells:

    - highest level: median throughput Mariner / TorchServe >= 1.5 on grpc (many channels) and
      http; Mariner's server CPU per request <= TorchServe's (ratio <= 1) on both; grpc-1ch no
      worse than the single-process server with thread workers (>= 0.95: the medians of three
      runs move by a few percent between runs of the same build);
    - lowest level: p50 TorchServe / Mariner >= 5 on grpc and http;
    - start-up to ready for the whole store <= 3 s;
    - on a GPU only: Mariner >= 90% of the raw batched handler (n/a when it ran on a CPU).

    Those are the digits CNN's; the MiniLM and ResNet archives have their own
    (`mariner.loadtest.family_report.family_targets`).
    """
    s = report.settings
    if s.family != "digits":
        from mariner.loadtest.family_report import family_targets

        return family_targets(report)
    lo, hi = min(s.levels), max(s.levels)
    lv = report.levels
    out: list[Target] = []
    for proto in ("grpc", "http"):
        if proto not in s.protocols:
            continue
        n = len(paired_ratios(lv, MARINER, TS, proto, hi, throughput))
        out.append(
            Target(
                f"{proto} c={hi}: throughput Mariner / TorchServe (median of {n})",
                median_ratio(lv, MARINER, TS, proto, hi, throughput),
                1.5,
                True,
            )
        )
        out.append(
            Target(
                f"{proto} c={hi}: server CPU per request Mariner / TorchServe (median of {n})",
                median_ratio(lv, MARINER, TS, proto, hi, cpu_per_request),
                1.0,
                False,
            )
        )
    if "grpc-1ch" in s.protocols:
        n = len(paired_ratios(lv, MARINER, THREAD_BASELINE, "grpc-1ch", hi, throughput))
        out.append(
            Target(
                f"grpc-1ch c={hi}: throughput Mariner / baseline {THREAD_BASELINE} (median of {n})",
                median_ratio(lv, MARINER, THREAD_BASELINE, "grpc-1ch", hi, throughput),
                0.95,
                True,
            )
        )
    for proto in ("grpc", "http"):
        if proto in s.protocols:
            out.append(
                Target(
                    f"{proto} c={lo}: p50 TorchServe / Mariner",
                    median_ratio(lv, TS, MARINER, proto, lo, p50),
                    5,
                    True,
                )
            )
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


def process_hop_us(report: Report) -> dict[str, float]:
    """p50 of Mariner (process workers) minus p50 of the thread-worker build at the lowest level,
    in microseconds, per protocol: what the hop to a worker process adds to one request."""
    lo = min(report.settings.levels)
    out = {}
    for proto in ("grpc", "http"):
        m = summarize(report.levels, MARINER, proto, lo)
        t = summarize(report.levels, THREAD_BASELINE, proto, lo)
        if m and t:
            out[proto] = (m.p50_ms - t.p50_ms) * 1e3
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
        "it; `http`: HTTP/1.1 keep-alive, one connection per client. "
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


def _hop_section(report: Report) -> list[str]:
    """The digits CNN's process hop: what the hop to a worker process adds at one client."""
    hop = process_hop_us(report)
    lines = ["", "## The process hop", ""]
    if hop:
        base = report.servers.get(THREAD_BASELINE)
        lines.append(
            f"p50 at c={min(report.settings.levels)} of Mariner minus the baseline {THREAD_BASELINE} "
            f"(`{base.args if base else '?'}`), same run: "
            + ", ".join(f"{p} {v:+.0f} µs" for p, v in hop.items())
            + "."
        )
    else:
        lines.append("Not measured: no single-process baseline ran (this build has no `--worker-mode`).")
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
    if not digits:
        from mariner.loadtest.family_report import inside_section, padding_section

        lines += padding_section(report)
        lines += inside_section(report)
    else:
        lines += _hop_section(report)
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
