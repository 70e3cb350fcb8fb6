"""The digits benchmark's throughput and latency targets, across servers and client set-ups.

`bench_summary.median_ratio` compares two servers over one client set-up. The targets also compare
across set-ups: Mariner over a stream (`grpc-stream`, `oip-stream`) against TorchServe's unary
`grpc`, and Mariner's HTTP against mosec's. A side of a comparison is (server, protocol); the
ratio is still the median of per-repeat ratios (each repeat runs every server over every set-up
back to back), so the drift of a shared machine cancels as it does for the same-protocol ratios.

The targets (highest level unless said):

- unary `grpc` and `grpc-1ch`: throughput Mariner / TorchServe >= 1.0, with the server CPU per
  request of both shown, and Mariner's CPU per request <= TorchServe's;
- `http`: throughput Mariner / TorchServe >= 2, Mariner / mosec >= 0.8 (mosec, when it ran);
- each stream: Mariner's throughput >= 2x TorchServe's unary `grpc` and >= 1.5x TorchServe's own
  stream: StreamPredictions2 on `torchserve-seq`, the sequence-batching copy TorchServe needs for
  it; not applicable for ModelStreamInfer, which TorchServe lacks (`bench_values.UNSERVED`);
- lowest level: p50 TorchServe / Mariner >= 5 for every protocol Mariner ran; a stream is compared
  with TorchServe's own stream where it ran, else with TorchServe's unary `grpc`.
"""

from __future__ import annotations

from collections.abc import Sequence

from mariner.loadtest.bench_summary import (
    MARINER,
    TS,
    Side,
    Target,
    cpu_per_request,
    cross_ratios,
    fmt,
    median_cross,
    p50,
    runs,
    summarize,
    throughput,
)
from mariner.loadtest.bench_values import STREAMS, TS_STREAM, Report, unserved
from mariner.loadtest.closedloop import LevelResult

MOSEC = "mosec"


def stream_baseline(stream: str) -> Side:
    """TorchServe's own form of a stream: StreamPredictions2 on the sequence-batching copy."""
    return Side(TS_STREAM, stream) if stream == "grpc-stream" else Side(TS, stream)


def _cpu(levels: Sequence[LevelResult], side: Side, c: int) -> str:
    m = summarize(levels, side.server, side.protocol, c)
    return fmt(m.cpu_us_per_request, 0) if m else "n/a"


def _throughput(
    levels: Sequence[LevelResult], num: Side, den: Side, c: int, limit: float, why_not: str = ""
) -> Target:
    n = len(cross_ratios(levels, num, den, c, throughput))
    return Target(
        f"c={c}: throughput {num} / {den} (median of {n}; CPU µs/req {_cpu(levels, num, c)} vs "
        f"{_cpu(levels, den, c)})",
        median_cross(levels, num, den, c, throughput),
        limit,
        True,
        not_applicable=why_not,
    )


def throughput_targets(report: Report) -> list[Target]:
    """Throughput (and CPU per request) at the highest level, per the module's list."""
    s, lv = report.settings, report.levels
    hi = max(s.levels)
    out: list[Target] = []
    for proto in ("grpc", "grpc-1ch"):
        if proto not in s.protocols:
            continue
        m, t = Side(MARINER, proto), Side(TS, proto)
        out.append(_throughput(lv, m, t, hi, 1.0))
        n = len(cross_ratios(lv, m, t, hi, cpu_per_request))
        out.append(
            Target(
                f"c={hi}: server CPU per request {m} / {t} (median of {n})",
                median_cross(lv, m, t, hi, cpu_per_request),
                1.0,
                False,
            )
        )
    if "http" in s.protocols:
        m = Side(MARINER, "http")
        out.append(_throughput(lv, m, Side(TS, "http"), hi, 2.0))
        n = len(cross_ratios(lv, m, Side(TS, "http"), hi, cpu_per_request))
        out.append(
            Target(
                f"c={hi}: server CPU per request {m} / torchserve http (median of {n})",
                median_cross(lv, m, Side(TS, "http"), hi, cpu_per_request),
                1.0,
                False,
            )
        )
        absent = "" if MOSEC in s.servers else "mosec not in --servers (not installed?)"
        out.append(_throughput(lv, m, Side(MOSEC, "http"), hi, 0.8, absent))
    for stream in STREAMS:
        if stream not in s.protocols:
            continue
        m = Side(MARINER, stream)
        if "grpc" in s.protocols:
            out.append(_throughput(lv, m, Side(TS, "grpc"), hi, 2.0))
        base = stream_baseline(stream)
        out.append(_throughput(lv, m, base, hi, 1.5, unserved(base.server, stream)))
    return out


def latency_targets(report: Report) -> list[Target]:
    """p50 TorchServe / Mariner at the lowest level, every protocol Mariner ran."""
    s, lv = report.settings, report.levels
    lo = min(s.levels)
    out: list[Target] = []
    for proto in s.protocols:
        if proto == "grpc-1ch" and lo == 1:
            continue  # not run at one client: the same as grpc there
        base = Side(TS, "grpc" if unserved(TS, proto) else proto)
        if proto in STREAMS and runs(lv, TS_STREAM, proto, lo):
            base = stream_baseline(proto)
        out.append(
            Target(
                f"c={lo}: p50 {base} / {Side(MARINER, proto)}",
                median_cross(lv, base, Side(MARINER, proto), lo, p50),
                5,
                True,
            )
        )
    return out


def cross_section(report: Report) -> list[str]:
    """The report's table of comparisons across set-ups and peers, every level both sides ran."""
    s, lv = report.settings, report.levels
    pairs = [(Side(MARINER, p), Side(TS, "grpc")) for p in STREAMS if p in s.protocols]
    pairs += [(Side(MARINER, p), stream_baseline(p)) for p in STREAMS if p in s.protocols]
    pairs += [(Side(TS_STREAM, "grpc-stream"), Side(TS, "grpc"))]
    pairs += [(Side(MARINER, p), Side(MARINER, "grpc")) for p in STREAMS if p in s.protocols]
    pairs += [(Side(MARINER, "http"), Side(MOSEC, "http")), (Side(MOSEC, "http"), Side(TS, "http"))]
    rows = []
    for num, den in pairs:
        for c in s.levels:
            if not runs(lv, num.server, num.protocol, c) or not runs(lv, den.server, den.protocol, c):
                continue
            rows.append(
                f"| {num} | {den} | {c} | {fmt(median_cross(lv, num, den, c, throughput), 2)}x | "
                f"{fmt(median_cross(lv, den, num, c, p50), 1)}x | "
                f"{fmt(median_cross(lv, num, den, c, cpu_per_request), 2)}x |"
            )
    if not rows:
        return []
    return [
        "",
        "## Across client set-ups and peers (median of per-repeat ratios)",
        "",
        "| A | B | conc. | throughput A/B | p50 B/A | CPU per request A/B |",
        "|---|---|---:|---:|---:|---:|",
        *rows,
    ]
