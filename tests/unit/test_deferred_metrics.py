"""Prometheus writes summed per event-loop turn give exactly what writing each at once gives."""

from __future__ import annotations

import asyncio
import random

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from mariner.server.common.deferred_metrics import (
    WRITES,
    DeferredCounter,
    DeferredGauge,
    DeferredHistogram,
    FlushOnCollect,
)
from mariner.server.common.metrics import Metrics, latency_buckets

pytestmark = pytest.mark.unit


def _pair() -> tuple[CollectorRegistry, CollectorRegistry, list[object], list[object]]:
    out = []
    for _ in range(2):
        reg = CollectorRegistry()
        reg.register(FlushOnCollect())
        h = Histogram("lat_seconds", "x", ("m",), buckets=latency_buckets(0.025), registry=reg).labels("a")
        c = Counter("calls", "x", ("m",), registry=reg).labels("a")
        g = Gauge("depth", "x", ("m",), registry=reg).labels("a")
        out.append((reg, [h, c, g]))
    (r1, direct), (r2, deferred) = out
    return r1, r2, direct, deferred


def test_folded_observations_equal_direct_ones_including_bucket_edges() -> None:
    r1, r2, (h, c, g), (hd, cd, gd) = _pair()
    dh, dc, dg = DeferredHistogram(hd), DeferredCounter(cd), DeferredGauge(gd)
    rng = random.Random(7)
    bounds = list(latency_buckets(0.025))
    values = [rng.choice([*bounds, 0.0, 20.0]) for _ in range(200)] + [rng.random() for _ in range(300)]

    async def turn() -> None:
        for i, v in enumerate(values):
            h.observe(v)
            dh.observe(v)
            c.inc(2)
            dc.inc(2)
            g.set(i)
            dg.set(i)
        same(r1, r2)  # a collect flushes what is pending
        await asyncio.sleep(0)

    asyncio.run(turn())
    same(r1, r2)


def same(r1: CollectorRegistry, r2: CollectorRegistry) -> None:
    """Equal samples: counts and buckets exactly; a histogram's sum up to float rounding, since
    the fold adds a turn's values before adding them to the sum."""

    def samples(r: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        return {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for m in r.collect()
            for s in m.samples
            if not s.name.endswith("_created")  # when each registry was made
        }

    a, b = samples(r1), samples(r2)
    assert a.keys() == b.keys()
    for key, value in a.items():
        if key[0].endswith("_sum"):
            assert b[key] == pytest.approx(value, rel=1e-12)
        else:
            assert b[key] == value, key


def test_writes_of_a_turn_are_made_once_when_the_turn_ends() -> None:
    reg = CollectorRegistry()
    child = Counter("calls", "x", registry=reg)
    writes: list[float] = []
    real_inc = child.inc

    def counting_inc(amount: float = 1.0) -> None:
        writes.append(amount)
        real_inc(amount)

    child.inc = counting_inc  # type: ignore[method-assign]
    deferred = DeferredCounter(child)

    async def main() -> None:
        for _ in range(32):
            deferred.inc()
        assert writes == []
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert writes == [32.0]

    asyncio.run(main())


def test_without_a_loop_a_write_is_made_at_once() -> None:
    reg = CollectorRegistry()
    child = Counter("calls", "x", registry=reg)
    DeferredCounter(child).inc(3)
    assert reg.get_sample_value("calls_total") == 3.0
    WRITES.flush()


def test_metrics_defer_refuses_what_it_cannot_defer() -> None:
    with pytest.raises(TypeError, match="cannot defer"):
        Metrics.defer(object())
