"""The report's parts for the sentence-encoder and image-classifier archives: their targets, the
length-aware batching comparison, and what their payloads were.

The digits CNN is tiny, so its targets are about transport and CPU per request
(`mariner.loadtest.bench_report.targets`). A MiniLM or ResNet-18 batch costs about a second on a
core: there the questions are whether the server loses anything against the handler called
directly (Mariner >= 90% of the raw batched ceiling), whether it beats stock TorchServe on the
same archive (>= 1.2x throughput, lower p99), and, for MiniLM, what grouping texts by length buys
(pad to longest + token budget >= 1.5x padding everything to maxLength).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from mariner.loadtest.bench_summary import (
    MARINER,
    PADDING_MAX,
    TS,
    Target,
    cpu_per_request,
    fmt,
    median,
    median_ratio,
    paired_ratios,
    ratio,
    runs,
    summarize,
    throughput,
)
from mariner.loadtest.closedloop import LevelResult

if TYPE_CHECKING:
    from mariner.loadtest.bench_values import Report

RAW_SHARE = 0.90
OVER_TORCHSERVE = 1.2
LENGTH_AWARE = 1.5


def p99(r: LevelResult) -> float:
    return r.latency.p99_ms


def raw_ratios(report: Report, server: str, protocol: str, c: int) -> list[float]:
    """Per repeat: the server's throughput / the raw batched throughput measured in that repeat
    (the raw ceiling runs first in every repeat of the highest level)."""
    raws = {i: r.batched_rps for i, r in enumerate(report.raw_runs)}
    out = []
    for r in runs(report.levels, server, protocol, c):
        q = ratio(r.throughput_rps, raws.get(r.repeat, math.nan))
        if not math.isnan(q):
            out.append(q)
    return out


def family_targets(report: Report) -> list[Target]:
    """At the highest level, per protocol (grpc and http): Mariner / raw batched >= 0.9 (on this
    CPU too: a second-long batch leaves the transport no excuse), Mariner / TorchServe >= 1.2 in
    throughput and <= 1 in p99; MiniLM: Mariner / Mariner padded to max_length >= 1.5."""
    s = report.settings
    hi = max(s.levels)
    lv = report.levels
    out: list[Target] = []
    for proto in ("grpc", "http"):
        if proto not in s.protocols:
            continue
        shares = raw_ratios(report, MARINER, proto, hi)
        out.append(
            Target(
                f"{proto} c={hi}: throughput Mariner / raw batched handle() (median of {len(shares)})",
                median(shares),
                RAW_SHARE,
                True,
            )
        )
        n = len(paired_ratios(lv, MARINER, TS, proto, hi, throughput))
        out.append(
            Target(
                f"{proto} c={hi}: throughput Mariner / TorchServe (median of {n})",
                median_ratio(lv, MARINER, TS, proto, hi, throughput),
                OVER_TORCHSERVE,
                True,
            )
        )
        out.append(
            Target(
                f"{proto} c={hi}: p99 Mariner / TorchServe (median of {n})",
                median_ratio(lv, MARINER, TS, proto, hi, p99),
                1.0,
                False,
            )
        )
        if s.family == "minilm" and s.padding_compare:
            k = len(paired_ratios(lv, MARINER, PADDING_MAX, proto, hi, throughput))
            out.append(
                Target(
                    f"{proto} c={hi}: throughput pad to longest + token budget / pad to max_length "
                    f"(median of {k})",
                    median_ratio(lv, MARINER, PADDING_MAX, proto, hi, throughput),
                    LENGTH_AWARE,
                    True,
                )
            )
    return out


def inside_section(report: Report) -> list[str]:
    """Mariner's own account of the highest level (its /metrics, per measurement, medians over
    repeats): how full its batches were, the handler's time per batch against the raw ceiling's,
    the queue wait, and for MiniLM the padded tokens per batch and the share that was padding."""
    s = report.settings
    hi = max(s.levels)
    stats = [b for b in report.batch_stats if b.concurrency == hi]
    if not stats:
        return []
    raw = f"{fmt(report.raw.batch_ms, 0)} ms" if report.raw else "n/a"
    lines = [
        "",
        f"## Inside Mariner at c={hi} (its /metrics)",
        "",
        f"Per measurement (after minus before), medians over repeats. The raw ceiling's full batch of "
        f"{s.batch_size} took {raw} (arrival order).",
        "",
        "| server | protocol | runs | mean batch | handler ms / batch | queue ms / request "
        "| padded tokens / batch | padding share |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    keys = sorted({(b.server, b.protocol) for b in stats})
    for server, proto in keys:
        mine = [b for b in stats if (b.server, b.protocol) == (server, proto)]
        share = median([b.padding_share for b in mine])
        lines.append(
            f"| {server} | {proto} | {len(mine)} | {fmt(median([b.mean_batch for b in mine]), 1)} | "
            f"{fmt(median([b.compute_ms_per_batch for b in mine]), 0)} | "
            f"{fmt(median([b.queue_ms_per_request for b in mine]), 0)} | "
            f"{fmt(median([b.padded_tokens_per_batch for b in mine]), 0)} | "
            f"{'n/a' if math.isnan(share) else f'{share:.0%}'} |"
        )
    return lines


def workload_section(report: Report) -> list[str]:
    if not report.workload:
        return []
    return ["", "## Payloads", "", f"{report.workload}. Every answer was checked ({_checked(report)})."]


def _checked(report: Report) -> str:
    return {
        "minilm": "384 floats of unit norm",
        "resnet18": "five {label, index, probability} entries, probabilities falling",
    }.get(report.settings.family, "a prediction")


def padding_section(report: Report) -> list[str]:
    """Length-aware batching: the archive as built against its length-blind copy, same run."""
    s = report.settings
    if s.family != "minilm" or not s.padding_compare:
        return []
    hi = max(s.levels)
    lines = [
        "",
        "## Length-aware batching (MiniLM)",
        "",
        f"`{PADDING_MAX}` serves a copy of the same archive, written under `build/bench/`, whose "
        "model-config was changed only in: " + "; ".join(report.padding or ["(not run)"]) + ". "
        "Same server, batchSize and payloads; interleaved with the others in every repeat.",
        "",
        "| protocol | conc. | as built req/s | p50 ms | p99 ms | CPU µs/req | pad to max req/s | p50 ms "
        "| p99 ms | CPU µs/req | throughput ratio | CPU per request ratio (pad to max / as built) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for proto in s.protocols:
        a, b = summarize(report.levels, MARINER, proto, hi), summarize(report.levels, PADDING_MAX, proto, hi)
        if a is None or b is None:
            continue
        q = median_ratio(report.levels, MARINER, PADDING_MAX, proto, hi, throughput)
        cpu = median_ratio(report.levels, PADDING_MAX, MARINER, proto, hi, cpu_per_request)
        lines.append(
            f"| {proto} | {hi} | {a.rps:,.1f} | {fmt(a.p50_ms, 0)} | {fmt(a.p99_ms, 0)} | "
            f"{fmt(a.cpu_us_per_request, 0)} | {b.rps:,.1f} | {fmt(b.p50_ms, 0)} | {fmt(b.p99_ms, 0)} | "
            f"{fmt(b.cpu_us_per_request, 0)} | {fmt(q, 2)}x | {fmt(cpu, 2)}x |"
        )
    lines += [
        "",
        "Throughput ratios are medians of per-repeat ratios (both copies measured back to back); the "
        "CPU per request ratio (server CPU seconds per answer) is the one a machine shared with other "
        "work moves least.",
    ]
    return lines
