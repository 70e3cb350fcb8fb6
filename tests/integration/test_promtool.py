"""promtool lints the live /metrics of a real `mariner serve` after traffic.

Every `mariner_*` metric must pass `promtool check metrics` clean. TorchServe's names must stay
as TorchServe serves them (dashboards query them), and some break Prometheus' naming
conventions: CamelCase names and labels (`QueueTime`, `ModelName`), counters without `_total`
(`Requests2XX`), microsecond units. promtool reports those as lint problems; the test accepts
exactly those complaints, on exactly those names, and fails on any other.

The same scrape is checked in OpenMetrics (strict parser) and with TorchServe's `name[]=` filter.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
from prometheus_client.openmetrics.parser import text_string_to_metric_families

from mariner.loadtest.servers import MarinerProcess
from tests.integration.metrics_archive import NAME, build_metered_archive, parse_exposition

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
TIMEOUT = 60

# What promtool 2.42 says about TorchServe's own names once they have samples; nothing else.
CAMEL = "metric names should be written in 'snake_case' not 'camelCase'"
CAMEL_LABEL = "label names should be written in 'snake_case' not 'camelCase'"
NO_TOTAL = 'counter metrics should have "_total" suffix'
MICRO = 'use base unit "seconds" instead of "microseconds"'
EXPECTED = {
    f"{name} {problem}"
    for name, problems in {
        "Requests2XX": [NO_TOTAL],
        "Requests4XX": [NO_TOTAL],
        "ts_inference_latency_microseconds": [NO_TOTAL, MICRO],
        "ts_queue_latency_microseconds": [NO_TOTAL, MICRO],
        "QueueTime": [CAMEL],
        "WorkerThreadTime": [CAMEL],
        "PredictionTime": [CAMEL, CAMEL_LABEL],
        "HandlerTime": [CAMEL, CAMEL_LABEL],
        "WorkerLoadTime": [CAMEL, CAMEL_LABEL],
        "MemoryUsed": [CAMEL],
        "MemoryAvailable": [CAMEL],
        "MemoryUtilization": [CAMEL],
        "DiskUsage": [CAMEL],
        "DiskUtilization": [CAMEL],
        "DiskAvailable": [CAMEL],
        "MeteredItems": [NO_TOTAL, CAMEL, CAMEL_LABEL],
        "MeteredBatches": [NO_TOTAL, CAMEL, CAMEL_LABEL],
    }.items()
    for problem in problems
}


def promtool() -> str:
    for candidate in (REPO / ".tools" / "bin" / "promtool", shutil.which("promtool")):
        if candidate and Path(candidate).is_file():
            return str(candidate)
    pytest.fail("promtool is not installed: run `make promtool`")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MarinerProcess]:
    store = tmp_path_factory.mktemp("store")
    build_metered_archive(store)
    # TorchServe's names on /metrics (its prometheus mode), the handler's own metrics kept though
    # the default metrics.yaml does not declare them (its model_metrics_auto_detect).
    flags = ["--metrics-mode", "prometheus", "--model-metrics-auto-detect"]
    with MarinerProcess(store, NAME, log_level="INFO", extra_args=flags) as srv:
        for _ in range(3):
            ok = requests.post(f"{srv.http_url}/predictions/{NAME}", data=b"{}", timeout=TIMEOUT)
            assert ok.status_code == 200, ok.text
        missing = requests.post(f"{srv.http_url}/predictions/nosuch", data=b"{}", timeout=TIMEOUT)
        assert missing.status_code == 404
        wait_until_counted(srv)
        yield srv


def wait_until_counted(srv: MarinerProcess, cap_s: float = 60.0) -> None:
    """A frontend writes its TorchServe counters once per event-loop turn, just after answering:
    wait for the four calls to be written (bounded) before linting the scrape."""
    deadline = time.monotonic() + cap_s
    while True:
        families = parse_exposition(scrape(srv).text)
        if families["Requests2XX"].label_sets and families["Requests4XX"].label_sets:
            return
        if time.monotonic() > deadline:
            pytest.fail("the calls never appeared in Requests2XX / Requests4XX")
        time.sleep(0.1)


def scrape(srv: MarinerProcess, **kwargs: object) -> requests.Response:
    r = requests.get(f"{srv.metrics_url}/metrics", timeout=TIMEOUT, **kwargs)  # type: ignore[arg-type]
    assert r.status_code == 200, r.text
    return r


def test_promtool_reports_only_torchserves_own_naming(server: MarinerProcess) -> None:
    text = scrape(server).text
    families = parse_exposition(text)
    # The traffic reached every TorchServe metric the complaints are about (a sample each).
    for name in (
        "Requests2XX",
        "Requests4XX",
        "ts_inference_requests_total",
        "MeteredItems",
        "WorkerLoadTime",
    ):
        assert families[name].sample_names == {name}, name
    assert families["ts_inference_requests_total"].type == "counter"
    lint = subprocess.run(
        [promtool(), "check", "metrics"], input=text, capture_output=True, text=True, check=False
    )
    complaints = {line.strip() for line in (lint.stdout + lint.stderr).splitlines() if line.strip()}
    assert not [c for c in complaints if c.startswith("mariner_")], complaints
    assert complaints == EXPECTED
    assert lint.returncode == 3  # lint problems only; 1 would mean it could not parse the text


def test_openmetrics_scrape_parses_strictly_with_torchserve_series_names(server: MarinerProcess) -> None:
    r = scrape(server, headers={"Accept": "application/openmetrics-text; version=1.0.0"})
    assert r.headers["content-type"].startswith("application/openmetrics-text")
    assert r.text.endswith("# EOF\n")
    samples = {s.name for f in text_string_to_metric_families(r.text) for s in f.samples}
    # The series names dashboards query are the same as in the text format.
    assert {"Requests2XX", "ts_inference_requests_total", "MeteredItems", "mariner_requests_total"} <= samples


def test_name_filter_returns_only_the_named_metrics(server: MarinerProcess) -> None:
    r = scrape(server, params=[("name[]", "ts_inference_requests_total"), ("name[]", "Requests4XX")])
    families = parse_exposition(r.text)
    assert set(families) == {"ts_inference_requests_total", "Requests4XX"}
    assert families["ts_inference_requests_total"].label_sets == {
        frozenset({"model_name", "model_version", "hostname"})
    }
    (line,) = [x for x in r.text.splitlines() if x.startswith("ts_inference_requests_total{")]
    assert f'model_name="{NAME}"' in line
    assert line.endswith(" 3.0")  # the three answered calls; the unknown model is not a model's
