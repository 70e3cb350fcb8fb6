"""The benchmark's report: results.md (tables, ratios, the performance targets) and the PNG plots."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mariner.loadtest.closedloop import LevelResult

if TYPE_CHECKING:
    from mariner.loadtest.bench import Report


def _cell(report: Report, server: str, protocol: str, c: int) -> LevelResult | None:
    return next(
        (r for r in report.levels if (r.server, r.protocol, r.concurrency) == (server, protocol, c)), None
    )


def _ratio(a: float, b: float) -> float:
    return a / b if b and not math.isnan(a) and not math.isnan(b) else math.nan


def fmt(x: float, digits: int = 2) -> str:
    """A figure for the report; n/a when it was not measured."""
    return "n/a" if math.isnan(x) else f"{x:.{digits}f}"


@dataclass(frozen=True)
class Target:
    what: str
    value: float
    limit: float
    higher_is_better: bool

    @property
    def held(self) -> bool | None:
        if math.isnan(self.value):
            return None
        return self.value >= self.limit if self.higher_is_better else self.value <= self.limit

    def row(self) -> str:
        op = ">=" if self.higher_is_better else "<="
        verdict = {True: "**held**", False: "**missed**", None: "not measured"}[self.held]
        return f"| {self.what} | {fmt(self.value)} | {op} {self.limit:g} | {verdict} |"


def targets(report: Report) -> list[Target]:
    """Mariner's performance targets, from the measured cells (the lowest and highest levels run):
    latency against stock TorchServe at the lowest level; throughput against TorchServe and against
    the raw model, and the tail (p99/p50), at the highest."""
    s = report.settings
    lo, hi = min(s.levels), max(s.levels)
    raw = report.raw.batched_rps if report.raw else math.nan
    gpu = "gpu" in report.machine
    out: list[Target] = []
    for proto in s.protocols:
        m_lo, t_lo = _cell(report, "mariner", proto, lo), _cell(report, "torchserve", proto, lo)
        m_hi, t_hi = _cell(report, "mariner", proto, hi), _cell(report, "torchserve", proto, hi)
        nan = math.nan
        out += [
            Target(
                f"{proto} c={lo}: p50 TorchServe / Mariner",
                _ratio(t_lo.latency.p50_ms, m_lo.latency.p50_ms) if m_lo and t_lo else nan,
                6,
                True,
            ),
            Target(
                f"{proto} c={lo}: p99 TorchServe / Mariner",
                _ratio(t_lo.latency.p99_ms, m_lo.latency.p99_ms) if m_lo and t_lo else nan,
                4,
                True,
            ),
            Target(
                f"{proto} c={hi}: throughput Mariner / TorchServe",
                _ratio(m_hi.throughput_rps, t_hi.throughput_rps) if m_hi and t_hi else nan,
                3,
                True,
            ),
            Target(
                f"{proto} c={hi}: throughput Mariner / raw batched",
                _ratio(m_hi.throughput_rps, raw) if m_hi else nan,
                0.90 if gpu else 0.85,
                True,
            ),
            Target(
                f"{proto} c={hi}: Mariner p99 / p50",
                _ratio(m_hi.latency.p99_ms, m_hi.latency.p50_ms) if m_hi else nan,
                4,
                False,
            ),
        ]
    return out


def other_cores(r: LevelResult) -> float:
    """Cores used by everything but the clients and the server during a level (never negative)."""
    return max(0.0, r.machine_cores - r.client_cores - r.server_cores)


def render_markdown(report: Report) -> str:
    s = report.settings
    m = report.machine
    per_level = f"{s.duration_s:g} s per level" if s.duration_s else f"{s.requests} timed requests per level"
    lines = [
        "# Benchmark: raw model vs Mariner vs stock TorchServe",
        "",
        f"Command: `{report.command}`",
        "",
        f"- Started {report.started}, took {report.elapsed_s / 60:.1f} min.",
        f"- Machine: {m['cpu']}, {m['logical_cpus']} logical CPUs, {m['memory_gib']} GiB, {m['os']}"
        + (f", GPU {m['gpu']}" if "gpu" in m else "")
        + f"; load average at start {m['load_average_at_start']}, at end {m.get('load_average_at_end')}.",
        "- Versions: " + ", ".join(f"{k} {v}" for k, v in report.versions.items()) + ".",
        f"- Archive `{s.model}.mar`; both servers: batchSize {s.batch_size}, maxBatchDelay "
        f"{s.max_batch_delay_ms} ms, 1 instance/worker, {s.torch_threads} torch thread(s) "
        "(Mariner `--torch-threads`, TorchServe worker `OMP_NUM_THREADS`; raw `torch.set_num_threads`).",
        f"- Clients: closed loop, up to {s.client_procs} client process(es) per level, separate from the "
        "servers (uvloop; grpc.aio; HTTP/1.1 keep-alive on asyncio streams, one connection per "
        f"coroutine); {per_level} after {s.warmup} warm-up requests; payloads: the 270 test-set "
        "digits in turn.",
        "- Latency: per request, nearest-rank percentiles, ms. Throughput: completed requests / wall "
        "time of the timed phase. Cores: CPU seconds / wall seconds of the client processes, of the "
        'server\'s process tree, and of everything else on the machine ("other": other users of a '
        "shared machine, the OS, the benchmark's own parent process).",
    ]
    lines += [f"- {n}" for n in report.notes]
    if report.levels:
        others = [other_cores(r) for r in report.levels]
        clients = [r.client_cores for r in report.levels]
        lines.append(
            f"- CPU taken by the clients: {min(clients):.2f} to {max(clients):.2f} cores per level; by "
            f"other work on the machine: {statistics.mean(others):.2f} cores on average "
            f"(up to {max(others):.2f})"
            + (": the machine was shared during this run." if max(others) > 0.25 else ".")
        )
    lines.append(
        "- Why targets are missed, with profiles: [docs/benchmark.md](../docs/benchmark.md) "
        '("Where Mariner\'s time goes").'
    )
    if report.raw:
        r = report.raw
        lines += [
            "",
            "## Raw: the handler in-process (the ceiling)",
            "",
            f"Device {r.device}, {r.torch_threads} torch thread(s), no clients running.",
            "",
            f"| call | p50 ms | p90 ms | p99 ms | max ms | throughput at batch {r.batch_size} (req/s) |",
            "|---|---:|---:|---:|---:|---:|",
            f"| `handle()` (JSON decode + model + top-k) | {fmt(r.batch1.p50_ms, 3)} | "
            f"{fmt(r.batch1.p90_ms, 3)} | {fmt(r.batch1.p99_ms, 3)} | {fmt(r.batch1.max_ms, 3)} | "
            f"{r.batched_rps:,.0f} |",
            f"| `predict_topk()` (model + top-k only) | {fmt(r.model_batch1.p50_ms, 3)} | "
            f"{fmt(r.model_batch1.p90_ms, 3)} | {fmt(r.model_batch1.p99_ms, 3)} | "
            f"{fmt(r.model_batch1.max_ms, 3)} | {r.model_batched_rps:,.0f} |",
            "",
            '"Raw batched" below is the `handle()` figure: the work a server must do per request, '
            "minus transport and queueing.",
        ]
    lines += [
        "",
        "## Servers",
        "",
        "| server | protocol | conc. | requests | errors | p50 ms | p90 ms | p99 ms | max ms | req/s "
        "| client cores | server cores | other cores |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in report.levels:
        lat = r.latency
        lines.append(
            f"| {r.server} | {r.protocol} | {r.concurrency} | {lat.n} | {r.errors} | {fmt(lat.p50_ms)} | "
            f"{fmt(lat.p90_ms)} | {fmt(lat.p99_ms)} | {fmt(lat.max_ms)} | {r.throughput_rps:,.0f} | "
            f"{r.client_cores:.2f} | {r.server_cores:.2f} | {other_cores(r):.2f} |"
        )
    raw = report.raw.batched_rps if report.raw else math.nan
    lines += [
        "",
        "## Ratios",
        "",
        "| protocol | conc. | p50 TS/Mariner | p99 TS/Mariner | throughput Mariner/TS | "
        "Mariner / raw batched |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for proto in s.protocols:
        for c in s.levels:
            mm, tt = _cell(report, "mariner", proto, c), _cell(report, "torchserve", proto, c)
            p50 = _ratio(tt.latency.p50_ms, mm.latency.p50_ms) if mm and tt else math.nan
            p99 = _ratio(tt.latency.p99_ms, mm.latency.p99_ms) if mm and tt else math.nan
            thr = _ratio(mm.throughput_rps, tt.throughput_rps) if mm and tt else math.nan
            frac = _ratio(mm.throughput_rps, raw) if mm else math.nan
            lines.append(
                f"| {proto} | {c} | {fmt(p50, 1)}x | {fmt(p99, 1)}x | {fmt(thr, 1)}x | "
                f"{'n/a' if math.isnan(frac) else f'{frac:.0%}'} |"
            )
    lines += [
        "",
        "## Performance targets",
        "",
        f"Latency against stock TorchServe at c={min(report.settings.levels)}; throughput against "
        f"TorchServe and against the raw batched model, and the tail (p99 / p50), at "
        f"c={max(report.settings.levels)}.",
        "",
        "| target | measured | wanted | verdict |",
        "|---|---:|---:|---|",
        *(t.row() for t in targets(report)),
        "",
        "![latency percentiles vs concurrency](latency.png)",
        "",
        "![throughput vs concurrency](throughput.png)",
        "",
    ]
    return "\n".join(lines)


def _concurrency_axis(ax: Any, levels: Sequence[int]) -> None:
    """Log-2 x axis labelled with exactly the levels run (no 2x10^0-style minor labels)."""
    ax.set_xscale("log", base=2)
    ax.set_xticks(list(levels), [str(x) for x in levels])
    from matplotlib.ticker import NullLocator

    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xlabel("concurrency (closed-loop clients)")


def plot(report: Report, out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    s = report.settings
    colors = {"mariner": "tab:blue", "torchserve": "tab:orange"}
    styles = {"p50_ms": "-", "p90_ms": "--", "p99_ms": ":"}
    paths = []

    fig, axes = plt.subplots(1, len(s.protocols), figsize=(6 * len(s.protocols), 4.5), squeeze=False)
    for ax, proto in zip(axes[0], s.protocols, strict=True):
        for server in ("mariner", "torchserve"):
            cells = [c for c in (_cell(report, server, proto, lv) for lv in s.levels) if c]
            if not cells:
                continue
            xs = [c.concurrency for c in cells]
            for key, ls in styles.items():
                ax.plot(
                    xs,
                    [getattr(c.latency, key) for c in cells],
                    ls,
                    marker="o",
                    color=colors[server],
                    label=f"{server} {key[:-3]}",
                )
        if report.raw:
            ax.axhline(report.raw.batch1.p50_ms, color="gray", lw=1, label="raw handle() b=1 p50")
        ax.set(yscale="log", ylabel="latency (ms)")
        _concurrency_axis(ax, s.levels)
        ax.set_title(f"{proto}: latency percentiles")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"{s.model}: batchSize {s.batch_size}, maxBatchDelay {s.max_batch_delay_ms} ms")
    fig.tight_layout()
    paths.append(out / "latency.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for server in ("mariner", "torchserve"):
        for proto, ls in zip(s.protocols, ("-", "--"), strict=False):
            cells = [c for c in (_cell(report, server, proto, lv) for lv in s.levels) if c]
            if cells:
                ax.plot(
                    [c.concurrency for c in cells],
                    [c.throughput_rps for c in cells],
                    ls,
                    marker="o",
                    color=colors[server],
                    label=f"{server} {proto}",
                )
    if report.raw:
        ax.axhline(
            report.raw.batched_rps,
            color="gray",
            lw=1,
            label=f"raw handle() at batch {report.raw.batch_size}",
        )
    ax.set(yscale="log", ylabel="requests / s")
    _concurrency_axis(ax, s.levels)
    ax.set_title(f"{s.model}: throughput")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    paths.append(out / "throughput.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths
