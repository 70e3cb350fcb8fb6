"""Arithmetic on the benchmark's runs: medians of repeats, paired ratios, one cell's summary, the
figures' formatting, and a target's verdict. The digits report (`bench_report`) and the MiniLM and
ResNet-18 reports (`family_report`) both build on these.

Ratios between servers are the median of per-repeat ratios: each repeat runs the servers back to
back, so both see about the same machine, and pairing by repeat cancels the drift of a shared
machine that a ratio of two separately-taken medians would keep.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from mariner.loadtest.closedloop import LevelResult

TS = "torchserve"
MARINER = "mariner"
# MiniLM only: the same archive with padding to max_length and no token budget (length-blind batches)
PADDING_MAX = "mariner-pad-max"


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


@dataclass(frozen=True)
class Side:
    """One side of a comparison: a server over a client set-up."""

    server: str
    protocol: str

    def __str__(self) -> str:
        return f"{self.server} {self.protocol}"


def cross_ratios(
    levels: Sequence[LevelResult], num: Side, den: Side, c: int, key: Callable[[LevelResult], float]
) -> list[float]:
    """key(num) / key(den) for each repeat both sides ran (a repeat missing on either is left out);
    the sides may use different client set-ups (a stream against TorchServe's unary calls)."""
    dens = {r.repeat: r for r in runs(levels, den.server, den.protocol, c)}
    out = []
    for r in runs(levels, num.server, num.protocol, c):
        d = dens.get(r.repeat)
        if d is not None:
            q = ratio(key(r), key(d))
            if not math.isnan(q):
                out.append(q)
    return out


def median_cross(
    levels: Sequence[LevelResult], num: Side, den: Side, c: int, key: Callable[[LevelResult], float]
) -> float:
    return median(cross_ratios(levels, num, den, c, key))


def paired_ratios(
    levels: Sequence[LevelResult],
    num: str,
    den: str,
    protocol: str,
    c: int,
    key: Callable[[LevelResult], float],
) -> list[float]:
    """key(num) / key(den) for each repeat both servers ran over the same client set-up."""
    return cross_ratios(levels, Side(num, protocol), Side(den, protocol), c, key)


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
