"""The SLO a locust run is judged by, and the judgement: `mariner.loadtest.gate` applies it to
locust's statistics of the whole run (the unit tests to fakes of them).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Protocol

# Twice the server's default --slo-ms (25 ms): locust shares the CPU with the server on a small
# machine, and its own greenlet scheduling lands in every latency it measures.
DEFAULT_P99_MS = 50.0
DEFAULT_MAX_FAIL_RATIO = 0.01
DEFAULT_MIN_REQUESTS = 1


class StatsEntryLike(Protocol):
    """The part of locust's StatsEntry the gate reads (a fake in unit tests provides it)."""

    num_requests: int
    num_failures: int

    @property
    def fail_ratio(self) -> float: ...

    @property
    def total_rps(self) -> float: ...

    def get_response_time_percentile(self, percent: float) -> float: ...


@dataclass(frozen=True)
class Slo:
    p99_ms: float = DEFAULT_P99_MS
    max_fail_ratio: float = DEFAULT_MAX_FAIL_RATIO
    # Each request kind (one per user class) must make at least this many requests.
    min_requests: int = DEFAULT_MIN_REQUESTS


@dataclass(frozen=True)
class Verdict:
    """What the run measured, the SLO it was judged by, and why it failed (empty: it passed)."""

    requests: int
    failures: int
    fail_ratio: float
    rps: float
    p50_ms: float
    p95_ms: float
    p99_ms: float
    slo: Slo
    reasons: tuple[str, ...] = ()
    by_name: Mapping[str, Mapping[str, float]] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return not self.reasons

    def line(self) -> str:
        """One line for humans: the figures, the SLO and the verdict."""
        head = (
            f"requests={self.requests} failures={self.failures} ({self.fail_ratio:.2%}) "
            f"rps={self.rps:.0f} p50={self.p50_ms:.2f}ms p95={self.p95_ms:.2f}ms p99={self.p99_ms:.2f}ms "
            f"[SLO p99<={self.slo.p99_ms:g}ms, failures<={self.slo.max_fail_ratio:.2%}]"
        )
        return f"{head} -> PASS" if self.passed else f"{head} -> FAIL: {'; '.join(self.reasons)}"

    def to_json(self) -> str:
        return json.dumps({**asdict(self), "passed": self.passed}, indent=2)


def _summary(entry: StatsEntryLike) -> dict[str, float]:
    return {
        "requests": entry.num_requests,
        "failures": entry.num_failures,
        "p50_ms": float(entry.get_response_time_percentile(0.50)),
        "p95_ms": float(entry.get_response_time_percentile(0.95)),
        "p99_ms": float(entry.get_response_time_percentile(0.99)),
    }


def judge(
    total: StatsEntryLike,
    slo: Slo,
    *,
    user_exceptions: int = 0,
    by_name: Mapping[str, StatsEntryLike] | None = None,
    expected_kinds: int = 0,
) -> Verdict:
    """The verdict on a run's aggregate statistics; percentiles in ms as locust reports them.

    `expected_kinds` is how many request kinds (user classes) ran: a kind with no entry in
    `by_name` made no request at all, which `slo.min_requests` counts as too few.
    """
    s = _summary(total)
    reasons = []
    if total.num_requests == 0:
        reasons.append("no request completed")
    counts = {name: e.num_requests for name, e in (by_name or {}).items()}
    short = {name: n for name, n in counts.items() if n < slo.min_requests}
    if total.num_requests and (short or len(counts) < expected_kinds):
        missing = max(0, expected_kinds - len(counts))
        what = [f"{name}: {n}" for name, n in sorted(short.items())]
        what += [f"{missing} kind(s) with none"] if missing else []
        reasons.append(f"fewer than {slo.min_requests} requests per kind ({', '.join(what)})")
    if s["p99_ms"] > slo.p99_ms:
        reasons.append(f"p99 {s['p99_ms']:.2f} ms is over the SLO of {slo.p99_ms:g} ms")
    if total.fail_ratio > slo.max_fail_ratio:
        reasons.append(f"failure ratio {total.fail_ratio:.2%} is over the allowed {slo.max_fail_ratio:.2%}")
    if user_exceptions:
        reasons.append(f"{user_exceptions} unhandled exception(s) in locust users (a broken test)")
    return Verdict(
        requests=total.num_requests,
        failures=total.num_failures,
        fail_ratio=total.fail_ratio,
        rps=total.total_rps,
        p50_ms=s["p50_ms"],
        p95_ms=s["p95_ms"],
        p99_ms=s["p99_ms"],
        slo=slo,
        reasons=tuple(reasons),
        by_name={name: _summary(e) for name, e in (by_name or {}).items()},
    )
