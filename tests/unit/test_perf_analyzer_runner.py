"""The perf_analyzer runner's own logic, with stand-in binaries instead of perf_analyzer.

The stand-ins are shell scripts that answer `--version` as perf_analyzer does and write a `-f`
report (or sleep past the bound), so finding, parsing, the hung bound and the skip reasons are
checked without a server or the real binary.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest

from mariner.loadtest import perf_analyzer as pa

pytestmark = pytest.mark.unit

# The `-f` report perf_analyzer 2.60 wrote for one 64-client gRPC level against Mariner.
REPORT = (
    "Concurrency,Inferences/Second,Client Send,Network+Server Send/Recv,Server Queue,"
    "Server Compute Input,Server Compute Infer,Server Compute Output,Client Recv,"
    "p50 latency,p90 latency,p95 latency,p99 latency\n"
    "64,809.797,6,78691,0,0,0,0,2,69863,114007,170889,210781\n"
)


def stand_in(tmp_path: Path, body: str) -> Path:
    """An executable that answers --version like perf_analyzer and runs `body` otherwise."""
    script = tmp_path / "perf_analyzer"
    script.write_text(
        "#!/bin/sh\n"
        'if [ "$1" = --version ]; then echo "Perf Analyzer Version 9.9 (stand-in)"; exit 0; fi\n'
        'while [ $# -gt 0 ]; do [ "$1" = -f ] && out="$2"; shift; done\n' + body
    )
    script.chmod(0o755)
    return script


def test_parse_csv_reads_throughput_and_percentiles() -> None:
    assert pa.parse_csv(REPORT) == {64: (809.797, 69863.0, 210781.0)}
    assert pa.parse_csv("") == {}
    assert pa.parse_csv("Concurrency,Inferences/Second\nx,1\n") == {}


def test_locate_says_how_to_get_it_when_nothing_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pa, "TOOLS", tmp_path / "absent")
    reason = pa.locate({"PATH": str(tmp_path)})
    assert isinstance(reason, str)
    assert "ensure_perf_analyzer.sh" in reason
    broken = tmp_path / "broken"
    broken.write_text("#!/bin/sh\nexit 1\n")
    broken.chmod(0o755)
    reason = pa.locate({"PATH": "", "MARINER_PERF_ANALYZER": str(broken)})
    assert isinstance(reason, str)
    assert "does not run" in reason
    assert str(broken) in reason


def test_locate_takes_the_binary_named_by_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(pa, "TOOLS", tmp_path / "absent")
    binary = stand_in(tmp_path, "exit 0\n")
    found = pa.locate({"PATH": "", "MARINER_PERF_ANALYZER": str(binary)})
    assert isinstance(found, pa.Launcher)
    assert found.argv == (str(binary),)
    assert "stand-in" in found.version


def test_command_uses_time_windows_never_a_request_count() -> None:
    """--request-count makes perf_analyzer wait for a record count it can miss (its workers start
    before it clears their records), hanging after the last answer: the runner never passes it."""
    argv = pa.command(
        pa.Launcher(("pa",), "v"),
        protocol="grpc",
        url="127.0.0.1:1",
        model="m",
        concurrency=64,
        csv_path=Path("/x.csv"),
    )
    assert "--request-count" not in argv
    assert "--measurement-mode" not in argv
    assert argv[argv.index("--concurrency-range") + 1] == "64"
    assert argv[argv.index("-i") + 1] == "grpc"


def test_run_level_reports_figures(tmp_path: Path) -> None:
    report = tmp_path / "report.txt"
    report.write_text(REPORT)
    launcher = pa.Launcher((str(stand_in(tmp_path, f'cp "{report}" "$out"\n')),), "v")
    result = pa.run_level(launcher, protocol="grpc", url="127.0.0.1:1", model="m", concurrency=64)
    assert result.status == "ok"
    assert (result.throughput, result.p50_us, result.p99_us) == (809.797, 69863.0, 210781.0)


def test_notes_say_figures_or_why_not() -> None:
    ok = pa.LevelResult("grpc", 64, "ok", 809.797, 69863.0, 210781.0)
    skipped = pa.LevelResult("http", 1, "skipped", detail="perf_analyzer not found")
    assert pa.notes([ok, skipped]) == [
        "perf_analyzer (Triton's load generator) over grpc at 64 clients: 810 infer/s, p50 69.86 ms, "
        "p99 210.78 ms.",
        "perf_analyzer (Triton's load generator) over http at 1 clients: skipped (perf_analyzer not found).",
    ]


def test_run_level_reports_unstable_and_hung(tmp_path: Path) -> None:
    unstable = stand_in(tmp_path, 'echo "Failed to obtain stable measurement."; exit 2\n')
    result = pa.run_level(
        pa.Launcher((str(unstable),), "v"), protocol="http", url="127.0.0.1:1", model="m", concurrency=1
    )
    assert result.status == "unstable"
    assert math.isnan(result.throughput)
    empty = tmp_path / "empty"
    empty.mkdir()
    no_window = stand_in(empty, 'echo "No valid requests recorded within time interval."; exit 3\n')
    result = pa.run_level(
        pa.Launcher((str(no_window),), "v"), protocol="http", url="127.0.0.1:1", model="m", concurrency=64
    )
    assert result.status == "unstable"

    sleeper = tmp_path / "sleeper"
    sleeper.mkdir()
    hung = stand_in(sleeper, "echo 'Request concurrency: 64'; exec sleep 30\n")
    options = pa.Options(timeout_s=1.0)
    result = pa.run_level(
        pa.Launcher((str(hung),), "v"), protocol="grpc", url="x", model="m", concurrency=64, options=options
    )
    assert result.status == "hung"
    assert "Request concurrency: 64" in result.detail


def test_run_matrix_skips_every_level_with_the_reason() -> None:
    results = pa.run_matrix(http="127.0.0.1:1", grpc=None, model="m", launcher="no perf_analyzer here")
    assert [(r.protocol, r.concurrency, r.status) for r in results] == [
        ("http", 1, "skipped"),
        ("http", 64, "skipped"),
        ("grpc", 1, "skipped"),
        ("grpc", 64, "skipped"),
    ]
    assert all(r.detail == "no perf_analyzer here" for r in results)
    text = pa.table(results)
    assert text.count("| skipped |") == 4
    assert "no perf_analyzer here" in text


def test_main_skips_with_a_printed_reason(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(pa, "TOOLS", tmp_path / "absent")
    monkeypatch.setattr(os, "environ", {"PATH": str(tmp_path)})
    assert pa.main(["--model", "m", "--http", "127.0.0.1:1"]) == 0
    assert "perf_analyzer: skipped:" in capsys.readouterr().out
