"""Triton's perf_analyzer, a client we did not write, against a live `mariner serve`.

It reads the model's metadata and config, then statistics before and after every window, and
drives 64 synchronous clients: the calls a Triton user's benchmark makes. Each run must end by
itself within its bound, over HTTP and gRPC (a run that does not is reported hung and fails
here). Runs use time windows: perf_analyzer's `--request-count` mode can hang after the last
answer against any server, Mariner or not (see `mariner.loadtest.perf_analyzer`).

Skipped when perf_analyzer does not run here (`bash scripts/ensure_perf_analyzer.sh` fetches it
and, on Debian 12, the Debian 13 glibc it needs).
"""

from __future__ import annotations

import pytest

from mariner.loadtest import perf_analyzer as pa
from tests.mariner_serve import MarinerServe

pytestmark = pytest.mark.integration

MODEL = "digits_torchscript"
# Wide stability and few trials: figures are not judged here, only that every run ends.
OPTIONS = pa.Options(measurement_ms=2000, stability_pct=100.0, max_trials=4, timeout_s=60.0)


def test_perf_analyzer_runs_end_over_http_and_grpc(request: pytest.FixtureRequest) -> None:
    launcher = pa.locate()
    if isinstance(launcher, str):
        pytest.skip(launcher)
    # The session's shared server (tests/integration/conftest.py), asked for only once the test
    # runs: perf_analyzer only sends requests, and reads statistics as differences of its own.
    srv: MarinerServe = request.getfixturevalue("shared_digits_torchscript").alive()
    results = pa.run_matrix(
        http=srv.http.removeprefix("http://"),
        grpc=srv.grpc_target,
        model=MODEL,
        concurrencies=(64,),
        options=OPTIONS,
        launcher=launcher,
    )
    text = pa.table(results)
    assert [r.protocol for r in results] == ["http", "grpc"], text
    assert not [r for r in results if r.status in ("hung", "failed")], text
    for r in results:
        if r.status == "ok":
            assert r.throughput > 0, text
            assert r.p50_us > 0, text
