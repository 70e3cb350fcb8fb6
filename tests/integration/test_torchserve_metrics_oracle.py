"""Stock TorchServe is the oracle for /metrics: a dashboard, alert or autoscaling rule written
for TorchServe must find the same metrics on Mariner.

Both servers serve the same archive (its handler records its own metrics through
`context.metrics`) with the same metrics.yaml (TorchServe's default plus the handler's metrics),
get the same traffic, and then expose the same metric names, each with the same type and, where
both have samples, the same label names. Mariner's own `mariner_*` metrics are beside them.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from mariner.loadtest.servers import MarinerProcess, StockTorchServe
from tests.integration.metrics_archive import (
    NAME,
    Family,
    build_metered_archive,
    metrics_yaml_with_handler_metrics,
    parse_exposition,
)

pytestmark = pytest.mark.integration

TIMEOUT = 60
CALLS = 4
# What the traffic must have produced on both servers before they are compared.
ANSWERED = (
    *("Requests2XX", "Requests4XX", "ts_inference_requests_total", "ts_queue_latency_microseconds"),
    *("QueueTime", "PredictionTime", "HandlerTime", "MeteredItems", "MeteredBatches", "WorkerLoadTime"),
)


def default_metrics_yaml() -> Path:
    ts = pytest.importorskip("ts", reason="stock TorchServe is installed by the project's setup")
    return Path(ts.__file__).parent / "configs" / "metrics.yaml"


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("metrics-oracle")
    store = root / "store"
    build_metered_archive(store)
    config = root / "metrics.yaml"
    config.write_text(metrics_yaml_with_handler_metrics(default_metrics_yaml().read_text()))
    return store, config


def traffic(base_url: str) -> None:
    for _ in range(CALLS):
        r = requests.post(f"{base_url}/predictions/{NAME}", data=b"{}", timeout=TIMEOUT)
        assert r.status_code == 200, r.text
    assert requests.post(f"{base_url}/predictions/nosuch", data=b"{}", timeout=TIMEOUT).status_code == 404


def scrape_when_answered(metrics_url: str, cap_s: float = 120.0) -> dict[str, Family]:
    """TorchServe turns its handlers' metrics into Prometheus samples from the worker's log,
    asynchronously: scrape until every metric the traffic touches has its sample (bounded)."""
    deadline = time.monotonic() + cap_s
    while True:
        families = parse_exposition(requests.get(f"{metrics_url}/metrics", timeout=TIMEOUT).text)
        missing = [n for n in ANSWERED if not (n in families and families[n].label_sets)]
        if not missing:
            return families
        if time.monotonic() > deadline:
            pytest.fail(f"{metrics_url}: no samples for {missing} after the traffic")
        time.sleep(0.5)


@pytest.fixture(scope="module")
def torchserve_metrics(setup: tuple[Path, Path]) -> dict[str, Family]:
    if shutil.which("java") is None:
        pytest.fail("stock TorchServe needs Java 17 on PATH: run `make java`")
    store, config = setup
    with StockTorchServe(store, [NAME], extra_config={"metrics_config": str(config)}) as ts:
        traffic(ts.http_url)
        return scrape_when_answered(ts.metrics_url)


@pytest.fixture(scope="module")
def mariner_metrics(setup: tuple[Path, Path]) -> Iterator[dict[str, Family]]:
    store, config = setup
    # TorchServe's names on /metrics: its prometheus metrics mode on both (StockTorchServe sets it).
    with MarinerProcess(
        store, NAME, extra_args=["--metrics-config", str(config), "--metrics-mode", "prometheus"]
    ) as srv:
        traffic(srv.http_url)
        yield scrape_when_answered(srv.metrics_url)


def torchserve_named(families: dict[str, Family]) -> dict[str, Family]:
    return {name: f for name, f in families.items() if not name.startswith("mariner_")}


def test_the_same_metric_names_exist_on_both(
    torchserve_metrics: dict[str, Family], mariner_metrics: dict[str, Family]
) -> None:
    assert set(torchserve_metrics) == set(torchserve_named(mariner_metrics))
    assert {"ts_inference_requests_total", "Requests2XX", "MeteredItems"} <= set(torchserve_metrics)


def test_each_metric_has_the_same_type_and_label_names(
    torchserve_metrics: dict[str, Family], mariner_metrics: dict[str, Family]
) -> None:
    for name, theirs in torchserve_metrics.items():
        ours = mariner_metrics[name]
        assert ours.type == theirs.type, name
        if theirs.label_sets and ours.label_sets:
            assert ours.label_sets == theirs.label_sets, name
        # A counter's sample carries the metric's own name on both (no `_total` appended).
        assert ours.sample_names <= {name}, name
    for name in ANSWERED:
        assert mariner_metrics[name].label_sets == torchserve_metrics[name].label_sets, name


def test_mariner_metrics_stay_beside_torchserves(mariner_metrics: dict[str, Family]) -> None:
    assert mariner_metrics["mariner_requests_total"].type == "counter"
    assert mariner_metrics["mariner_request_duration_seconds"].type == "histogram"
