"""The benchmark's plots: latency percentiles and throughput against concurrency, medians of the
repeats, one PNG each, named per model (`bench_report.output_names`).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mariner.loadtest.bench_report import output_names
from mariner.loadtest.bench_summary import MARINER, PADDING_MAX, TS, CellSummary, summarize

if TYPE_CHECKING:
    from mariner.loadtest.bench_values import Report


# ==================================================================================================
# Plots
# ==================================================================================================
def _concurrency_axis(ax: Any, levels: Sequence[int]) -> None:
    """Log-2 x axis labelled with exactly the levels run (no 2x10^0-style minor labels)."""
    ax.set_xscale("log", base=2)
    ax.set_xticks(list(levels), [str(x) for x in levels])
    from matplotlib.ticker import NullLocator

    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xlabel("concurrency (closed-loop clients)")


def _series(report: Report, server: str, proto: str) -> list[CellSummary]:
    cells = (summarize(report.levels, server, proto, lv) for lv in report.settings.levels)
    return [c for c in cells if c is not None]


def plot(report: Report, out: Path) -> list[Path]:
    """Latency (p50, p99) and throughput against concurrency: medians of the repeats."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    s = report.settings
    names = output_names(s.model)
    colors = {
        MARINER: "tab:blue",
        TS: "tab:orange",
        PADDING_MAX: "tab:red",
        "torchserve-seq": "tab:brown",
        "mosec": "tab:green",
    }
    servers = [x for x in colors if any(r.server == x for r in report.levels)]
    styles = {"p50_ms": "-", "p99_ms": ":"}
    paths = []

    fig, axes = plt.subplots(1, len(s.protocols), figsize=(6 * len(s.protocols), 4.5), squeeze=False)
    for ax, proto in zip(axes[0], s.protocols, strict=True):
        for server in servers:
            cells = _series(report, server, proto)
            if not cells:
                continue
            for key, ls in styles.items():
                ax.plot(
                    [c.concurrency for c in cells],
                    [getattr(c, key) for c in cells],
                    ls,
                    marker="o",
                    color=colors[server],
                    label=f"{server} {key[:-3]}",
                )
        if report.raw:
            ax.axhline(report.raw.batch1.p50_ms, color="gray", lw=1, label="raw handle() b=1 p50")
        ax.set(yscale="log", ylabel="latency (ms), median of repeats")
        _concurrency_axis(ax, s.levels)
        ax.set_title(f"{proto}: latency percentiles")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"{s.model}: batchSize {s.batch_size}, maxBatchDelay {s.max_batch_delay_ms} ms")
    fig.tight_layout()
    paths.append(out / names.latency)
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for server in servers:
        for proto, ls in zip(s.protocols, ("-", "--", "-.", ":", (0, (3, 1, 1, 1, 1, 1))), strict=False):
            cells = _series(report, server, proto)
            if cells:
                ax.plot(
                    [c.concurrency for c in cells],
                    [c.rps for c in cells],
                    linestyle=ls,
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
    ax.set(yscale="log", ylabel="requests / s, median of repeats")
    _concurrency_axis(ax, s.levels)
    ax.set_title(f"{s.model}: throughput")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    paths.append(out / names.throughput)
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths
