"""The benchmark's report logic: medians of repeats, ratios paired by repeat, targets that do not apply.

Nothing is measured or started: results are built by hand with known figures, so every assertion
checks arithmetic and wording, never timing.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from mariner.loadtest import bench
from mariner.loadtest.bench_report import render_markdown, render_scaling, scaling_rows, targets
from mariner.loadtest.bench_summary import (
    Target,
    median,
    median_ratio,
    paired_ratios,
    stopped_rising,
    summarize,
    throughput,
)
from mariner.loadtest.closedloop import LevelResult, Percentiles, client_layout

pytestmark = pytest.mark.unit


def cell(
    server: str,
    protocol: str,
    c: int,
    rps: float,
    *,
    repeat: int = 0,
    p50_ms: float = 1.0,
    server_cores: float = 1.0,
) -> LevelResult:
    return LevelResult(
        server=server,
        protocol=protocol,
        concurrency=c,
        latency=Percentiles(100, p50_ms, p50_ms * 2, p50_ms * 3, p50_ms * 4),
        errors=0,
        wall_s=1.0,
        throughput_rps=rps,
        client_cores=0.5,
        server_cores=server_cores,
        machine_cores=2.0,
        connections=16,
        repeat=repeat,
    )


def make_report(levels: list[LevelResult], *, device: str = "cpu", **settings: object) -> bench.Report:
    base = bench.parse_args(["--levels", "1,64", "--out", "/nonexistent"])
    s = replace(base, **settings)  # type: ignore[arg-type]
    report = bench.Report(
        settings=s,
        command="python -m mariner.loadtest.bench",
        started="now",
        machine={
            "cpu": "test",
            "logical_cpus": 2,
            "memory_gib": 1,
            "os": "linux",
            "load_average_at_start": [],
        },
        versions={},
        levels=levels,
    )
    report.servers["mariner"] = bench.ServerFacts("mariner", "", device, 3, 2, 1.0)
    return report


def named(found: list[Target], prefix: str) -> Target:
    """The one target labelled `prefix`, or else the one whose label starts with it."""
    hits = [t for t in found if t.what == prefix] or [t for t in found if t.what.startswith(prefix)]
    assert len(hits) == 1, [t.what for t in found]
    return hits[0]


def test_median_ignores_unmeasured_values_and_is_nan_for_nothing() -> None:
    assert median([3.0, math.nan, 1.0, 2.0]) == 2.0
    assert math.isnan(median([]))
    assert math.isnan(median([math.nan]))


def test_ratio_is_the_median_of_per_repeat_ratios_not_the_ratio_of_medians() -> None:
    # Repeat 1 ran on a busy machine: both servers slower. Pairing by repeat keeps that out.
    levels = [
        cell("mariner", "grpc", 64, 3000, repeat=0),
        cell("torchserve", "grpc", 64, 1000, repeat=0),
        cell("mariner", "grpc", 64, 900, repeat=1),
        cell("torchserve", "grpc", 64, 600, repeat=1),
        cell("mariner", "grpc", 64, 2000, repeat=2),
        cell("torchserve", "grpc", 64, 1000, repeat=2),
    ]
    assert paired_ratios(levels, "mariner", "torchserve", "grpc", 64, throughput) == [3.0, 1.5, 2.0]
    assert median_ratio(levels, "mariner", "torchserve", "grpc", 64, throughput) == 2.0
    # The ratio of the medians would be 2000 / 1000 too here, but not in general:
    assert summarize(levels, "mariner", "grpc", 64).rps == 2000  # type: ignore[union-attr]


def test_a_repeat_missing_on_one_side_is_left_out_of_the_pairs() -> None:
    levels = [
        cell("mariner", "http", 64, 3000, repeat=0),
        cell("torchserve", "http", 64, 1000, repeat=0),
        cell("mariner", "http", 64, 4000, repeat=1),  # TorchServe's repeat 1 failed
    ]
    assert paired_ratios(levels, "mariner", "torchserve", "http", 64, throughput) == [3.0]


def test_summary_gives_median_spread_and_cpu_per_request() -> None:
    levels = [
        cell("mariner", "http", 64, 1000, repeat=0, server_cores=1.0),
        cell("mariner", "http", 64, 4000, repeat=1, server_cores=1.0),
        cell("mariner", "http", 64, 2000, repeat=2, server_cores=1.0),
    ]
    m = summarize(levels, "mariner", "http", 64)
    assert m is not None
    assert (m.runs, m.rps, m.rps_min, m.rps_max) == (3, 2000, 1000, 4000)
    assert m.cpu_us_per_request == pytest.approx(500.0)  # per run: 1000, 250, 500 µs
    assert summarize(levels, "torchserve", "http", 64) is None


def test_throughput_and_cpu_targets_use_the_median_paired_ratio() -> None:
    levels = []
    for rep, (m, t) in enumerate([(3000, 1000), (1400, 1000), (1600, 1000)]):
        levels += [
            cell("mariner", "grpc", 64, m, repeat=rep, server_cores=1.0),
            cell("torchserve", "grpc", 64, t, repeat=rep, server_cores=1.2),
        ]
    found = targets(make_report(levels, protocols=("grpc",)))
    thr = named(found, "c=64: throughput mariner grpc / torchserve grpc (median of 3;")
    assert thr.value == pytest.approx(1.6)
    assert thr.held is True
    # the CPU per request of both sides is in the label, medians of the runs: Mariner 1 core at
    # 3000/1400/1600 req/s -> 333/714/625 µs; TorchServe 1.2 cores at 1000 req/s -> 1200 µs
    assert "CPU µs/req 625 vs 1200" in thr.what
    cpu = named(found, "c=64: server CPU per request mariner grpc / torchserve grpc (median of 3)")
    # Mariner: 1.0 core / 1600 req/s; TorchServe: 1.2 cores / 1000 req/s.
    assert cpu.value == pytest.approx((1.0 / 1600) / (1.2 / 1000))
    assert cpu.held is True


def test_latency_target_at_one_client_and_unmeasured_targets_say_so() -> None:
    levels = [
        cell("mariner", "http", 1, 900, p50_ms=0.5),
        cell("torchserve", "http", 1, 200, p50_ms=2.0),
    ]
    found = targets(make_report(levels, protocols=("http",)))
    lat = named(found, "c=1: p50 torchserve http / mariner http")
    assert lat.value == 4.0
    assert lat.held is False
    assert "**missed**" in lat.row()
    thr = named(found, "c=64: throughput mariner http / torchserve http (median of 0;")
    assert thr.verdict == "not measured"


def test_gpu_target_is_not_applicable_when_mariner_ran_on_cpu() -> None:
    levels = [cell("mariner", "grpc", 64, 950)]
    report = make_report(levels, device="cpu", protocols=("grpc",))
    report.raw = bench.RawResult(Percentiles.of([1.0]), 1000.0, Percentiles.of([1.0]), 2000.0, 32, 1, "cpu")
    gpu = next(t for t in targets(report) if "raw batched (GPU)" in t.what)
    assert gpu.value == pytest.approx(0.95)
    assert gpu.held is None
    assert gpu.verdict == "n/a (ran on cpu)"
    assert "n/a (ran on cpu)" in render_markdown(report)

    on_gpu = make_report(levels, device="cuda:0", protocols=("grpc",))
    on_gpu.raw = report.raw
    gpu = next(t for t in targets(on_gpu) if "raw batched (GPU)" in t.what)
    assert gpu.verdict == "held"


def test_startup_target_is_the_median_of_the_whole_store_runs() -> None:
    report = make_report([])
    report.startup_s = {"all": [2.5, 9.0, 2.9], "digits_torchscript.mar": [1.0]}
    start = next(t for t in targets(report) if t.what.startswith("start-up"))
    assert start.value == 2.9
    assert start.held is True
    assert start.shown == "2.90 s"
    assert next(t for t in targets(make_report([])) if t.what.startswith("start-up")).shown == "n/a"


def test_one_channel_grpc_has_its_own_target_and_no_thread_worker_section() -> None:
    levels = [
        cell("mariner", "grpc-1ch", 64, 1900, repeat=0),
        cell("torchserve", "grpc-1ch", 64, 950, repeat=0),
    ]
    thr = named(targets(make_report(levels)), "c=64: throughput mariner grpc-1ch / torchserve grpc-1ch")
    assert (thr.value, thr.limit, thr.held) == (2.0, 1.0, True)
    assert "The process hop" not in render_markdown(make_report(levels))


def test_stopped_rising_needs_two_windows_within_the_tolerance() -> None:
    assert not stopped_rising([], 0.05)
    assert not stopped_rising([1000.0], 0.05)
    assert not stopped_rising([1000.0, 1200.0], 0.05)  # still rising
    assert stopped_rising([1000.0, 1200.0, 1230.0], 0.05)
    assert stopped_rising([1230.0, 1200.0], 0.05)  # a small dip counts as level
    assert not stopped_rising([0.0, 0.0], 0.05)  # nothing answered is not a plateau


def test_plan_interleaves_servers_and_repeats_only_the_highest_level() -> None:
    s = bench.parse_args(["--levels", "1,64", "--repeats", "2", "--protocols", "grpc,grpc-1ch"])
    cells = bench.plan_cells(s, ["raw", "mariner", "torchserve"])
    low = [(c.server, c.protocol) for c in cells if c.level == 1]
    assert low == [("mariner", "grpc"), ("torchserve", "grpc")]
    high = [(c.repeat, c.server, c.protocol) for c in cells if c.level == 64]
    assert high == [
        (0, "raw", ""),
        (0, "mariner", "grpc"),
        (0, "torchserve", "grpc"),
        (0, "mariner", "grpc-1ch"),
        (0, "torchserve", "grpc-1ch"),
        (1, "raw", ""),
        (1, "torchserve", "grpc"),
        (1, "mariner", "grpc"),
        (1, "torchserve", "grpc-1ch"),
        (1, "mariner", "grpc-1ch"),
    ]


def test_client_layout_spreads_channels_and_one_channel_means_one_process() -> None:
    assert client_layout("grpc", 64, 2, 16) == (2, [8, 8])
    assert client_layout("grpc", 64, 2, 1) == (1, [1])
    assert client_layout("grpc", 64, 2, None) == (2, [1, 1])  # one per process, as before
    assert client_layout("grpc", 4, 2, 16) == (2, [2, 2])  # never more channels than clients
    assert client_layout("grpc", 1, 2, 16) == (1, [1])
    assert client_layout("http", 64, 2, 16) == (2, [1, 1])


def test_cli_defaults_and_mariner_args_pass_through() -> None:
    s = bench.parse_args([])
    assert (s.duration_s, s.repeats, s.grpc_channels, s.protocols) == (
        6.0,
        3,
        16,
        ("grpc", "grpc-1ch", "http", "grpc-stream", "oip-stream"),
    )
    s = bench.parse_args(["--requests", "500", "--mariner-args", "--frontends 2 --min-workers 2"])
    assert s.duration_s is None
    assert s.requests == 500
    assert s.mariner_args == ("--frontends", "2", "--min-workers", "2")
    assert s.load_for("grpc").grpc_channels == 16
    assert s.load_for("grpc-1ch").grpc_channels == 1
    assert s.load_for("http").grpc_channels is None


def test_scaling_table_rows_and_relative_throughput() -> None:
    levels = []
    for rep in range(2):
        levels += [
            cell("mariner f1 w1", "http", 64, 2000, repeat=rep),
            cell("mariner f2 w1", "http", 64, 3600 + rep * 400, repeat=rep),
        ]
    rows = scaling_rows(levels, [(1, 1), (2, 1)], ["http"], 64)
    assert rows[2].startswith("| 1 | 1 | 2,000 (2,000–2,000) | 500 | 1.00x |")
    assert rows[3].startswith("| 2 | 1 | 3,800 (3,600–4,000) |")
    assert rows[3].endswith("| 1.90x |")
    report = make_report(levels, protocols=("http",), repeats=2)
    text = render_scaling(report, [(1, 1), (2, 1)])
    assert "## Scaling at c=64 (median of 2 run(s)" in text
    assert bench.scaling_configs() == [(1, 1), (1, 2), (2, 1), (2, 2)]
    assert bench.scaling_configs((1, 4), (2,)) == [(1, 2), (4, 2)]
