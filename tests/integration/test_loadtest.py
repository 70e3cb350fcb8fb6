"""The locust p99 gate against a live Mariner: a reachable SLO passes, an impossible one fails.

Locust runs in library mode in a subprocess (`python -m mariner.loadtest.gate --library`): importing
locust monkey-patches the importing process for gevent, which would leak into every later test
of this pytest session. Mariner runs as users run it, `mariner serve` in a subprocess.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from mariner.loadtest.gate import Slo, fine_bucket_response_time, judge
from mariner.loadtest.servers import MarinerProcess

pytestmark = [pytest.mark.integration, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
MODEL = "digits_torchscript"
RUN_SECONDS = 3
USERS = 4  # split between the gRPC and the HTTP user


@pytest.fixture(scope="module")
def mariner(model_store: Path) -> Iterator[MarinerProcess]:
    with MarinerProcess(model_store, f"{MODEL}.mar", torch_threads=1) as server:
        yield server


def run_gate(
    server: MarinerProcess, report_dir: Path, *, p99_ms: float, model: str = MODEL
) -> tuple[int, dict[str, Any]]:
    """One bounded library-mode locust run; (exit code, verdict.json)."""
    cmd = [
        sys.executable, "-m", "mariner.loadtest.gate", "--library",
        "--host", server.http_url, "--grpc-target", server.grpc_target, "--model", model,
        "--users", str(USERS), "--run-time", str(RUN_SECONDS),
        "--p99-ms", str(p99_ms), "--max-fail-ratio", "0.01", "--report-dir", str(report_dir),
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=60, check=False)
    verdict_path = report_dir / "verdict.json"
    assert verdict_path.exists(), (
        f"no verdict; exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    )
    return proc.returncode, json.loads(verdict_path.read_text())


def test_reachable_slo_passes_with_traffic_on_both_protocols(mariner: MarinerProcess, tmp_path: Path) -> None:
    code, verdict = run_gate(mariner, tmp_path, p99_ms=2000.0)  # generous: the machine is shared
    assert code == 0, verdict
    assert verdict["passed"] is True
    assert verdict["failures"] == 0
    by_name = verdict["by_name"]
    assert by_name["grpc Predictions"]["requests"] > 20
    assert by_name[f"POST /predictions/{MODEL}"]["requests"] > 20
    assert 0 < verdict["p50_ms"] <= verdict["p95_ms"] <= verdict["p99_ms"] <= 2000.0
    # The headless run leaves its reports behind.
    assert (tmp_path / "stats_stats.csv").read_text().count("\n") >= 3
    assert "<html" in (tmp_path / "report.html").read_text()[:2000].lower()


def test_impossible_slo_fails_the_run(mariner: MarinerProcess, tmp_path: Path) -> None:
    code, verdict = run_gate(mariner, tmp_path, p99_ms=0.001)  # no round trip takes 1 us
    assert code == 1
    assert verdict["passed"] is False
    assert verdict["failures"] == 0  # it failed on latency alone
    assert any("p99" in r for r in verdict["reasons"]), verdict["reasons"]


def test_failures_over_the_allowed_ratio_fail_the_run(mariner: MarinerProcess, tmp_path: Path) -> None:
    code, verdict = run_gate(mariner, tmp_path, p99_ms=2000.0, model="no_such_model")
    assert code == 1
    assert verdict["fail_ratio"] == 1.0
    assert any("failure ratio" in r for r in verdict["reasons"]), verdict["reasons"]


# -- the judgement itself, on locust-shaped statistics -----------------------------------------------
def stats(requests: int, failures: int, p99: float, p50: float = 1.0) -> SimpleNamespace:
    def percentile(q: float) -> float:
        return p99 if q >= 0.99 else p50

    return SimpleNamespace(
        num_requests=requests,
        num_failures=failures,
        fail_ratio=failures / requests if requests else 0.0,
        total_rps=100.0,
        get_response_time_percentile=percentile,
    )


def test_judge_applies_both_limits_and_refuses_an_empty_run() -> None:
    slo = Slo(p99_ms=10.0, max_fail_ratio=0.01)
    assert judge(stats(1000, 10, 10.0), slo).passed  # both exactly at their limits
    assert judge(stats(1000, 11, 5.0), slo).reasons == ("failure ratio 1.10% is over the allowed 1.00%",)
    assert judge(stats(1000, 0, 10.01), slo).reasons == ("p99 10.01 ms is over the SLO of 10 ms",)
    assert not judge(stats(0, 0, 0.0), slo).passed
    assert not judge(stats(1000, 0, 1.0), slo, user_exceptions=1).passed


def test_fine_buckets_keep_sub_millisecond_resolution() -> None:
    assert fine_bucket_response_time(0.437) == 0.44
    assert fine_bucket_response_time(1.4) != fine_bucket_response_time(0.6)
    assert fine_bucket_response_time(42.37) == 42.4
    assert fine_bucket_response_time(147) == 150  # locust's own bucketing above 100 ms
