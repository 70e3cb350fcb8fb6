"""TorchServe's metric names on /metrics: recorded by the one call path, exposed as TorchServe
exposes them, filtered and negotiated as its API and Prometheus ask, configurable by its
metrics.yaml; and `context.metrics`, TorchServe's handler metrics API, without `ts`."""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import requests
from prometheus_client import CollectorRegistry
from prometheus_client.openmetrics.parser import text_string_to_metric_families

from mariner.server.common.config_loading import load_config
from mariner.server.common.handler_metrics import Dimension, MetricsCacheKeyError, MetricTypes
from mariner.server.common.metrics_spec import AUTO_DETECT_ENV
from mariner.server.compat.torchserve import exposition as ts_exposition
from mariner.server.compat.torchserve import metrics as ts_metrics
from mariner.server.compat.torchserve.frontend_metrics import TsFrontendMetrics
from mariner.server.compat.torchserve.properties import from_torchserve_properties
from mariner.server.contracts.types import WireProtocol
from mariner.server.frontend.protocols.call import run_call
from mariner.server.supervisor.metrics_http import metrics_app
from mariner.server.worker.context import Context
from tests.integration.metrics_archive import parse_exposition
from tests.unit.fakes import FakePlane, QuietMetrics, serve

pytestmark = pytest.mark.unit

HOST = ts_metrics.HOSTNAME
REPO = Path(__file__).resolve().parents[2]


def text_of(plane: FakePlane, accept: str | None = None, names: tuple[str, ...] = ()) -> str:
    return plane.metrics.exposition(accept, names)[0].decode()


def sample(text: str, name: str, **labels: str) -> float | None:
    """The value of the sample `name{labels}` (labels in any order), None when absent."""
    for line in text.splitlines():
        head, _, value = line.rpartition(" ")
        if head.split("{", 1)[0] != name:
            continue
        if all(f'{k}="{v}"' in head for k, v in labels.items()):
            return float(value)
    return None


async def _call(plane: FakePlane, model: str, version: str | None = None) -> None:
    async def work(infer: object) -> int:
        plane.resolve(model, version)  # what the adapters' work does first: 404 for an unknown model
        return 1

    await run_call(plane, WireProtocol.TS_HTTP, model, version, work)


@pytest.fixture(autouse=True)
def _prometheus_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests read TorchServe's names on /metrics: its `prometheus` metrics mode (in its
    default `log` mode they go to its log files: tests/unit/test_ts_metrics_modes.py), with
    handler metrics kept whether or not metrics.yaml declares them (model_metrics_auto_detect)."""
    monkeypatch.setenv(ts_metrics.METRICS_MODE_ENV, "prometheus")
    monkeypatch.setenv(AUTO_DETECT_ENV, "true")


@pytest.fixture
def plane() -> FakePlane:
    return FakePlane(metrics=QuietMetrics())


def test_default_spec_is_torchserves_default_metrics_yaml() -> None:
    ts = pytest.importorskip("ts", reason="stock TorchServe is installed by the project's setup")
    theirs = ts_metrics.load_spec(Path(ts.__file__).parent / "configs" / "metrics.yaml")
    assert theirs == ts_metrics.TsMetricsSpec()


def test_each_call_counts_in_torchserves_counters_under_their_exact_names(plane: FakePlane) -> None:
    async def traffic() -> None:
        await _call(plane, "digits")
        await _call(plane, "digits", "1")
        await _call(plane, "nosuch")

    asyncio.run(traffic())
    text = text_of(plane)
    families = parse_exposition(text)
    for name in (
        "Requests2XX",
        "Requests4XX",
        "ts_inference_requests_total",
        "ts_inference_latency_microseconds",
    ):
        assert families[name].type == "counter"
        assert families[name].sample_names == {name}  # no `_total` appended, no `_created`
    assert sample(text, "Requests2XX", Level="Host", Hostname=HOST) == 2.0
    assert sample(text, "Requests4XX", Level="Host", Hostname=HOST) == 1.0
    assert sample(text, "Requests5XX") is None
    # TorchServe labels a call by the version it asked for, "default" when it named none.
    for asked in ("1", "default"):
        assert (
            sample(
                text, "ts_inference_requests_total", model_name="digits", model_version=asked, hostname=HOST
            )
            == 1
        )
    assert sample(text, "ts_inference_requests_total", model_name="unknown") is None  # 404s count as 4XX only
    latency = sample(text, "ts_inference_latency_microseconds", model_name="digits")
    assert latency is not None
    assert latency > 0
    # Declared but not written yet: listed, as TorchServe lists them.
    assert families["Requests5XX"].type == "counter"
    assert not families["Requests5XX"].label_sets
    assert families["HandlerTime"].type == "gauge"
    assert sample(text, "mariner_requests_total", model="digits", code="200") == 2.0  # ours stay


def test_batcher_measurements_feed_queue_and_prediction_times(plane: FakePlane) -> None:
    ts = plane.metrics.ts
    ts.record_batch("digits", "1", [0.002, 0.004])
    ts.record_compute("digits", "1", 0.0125)
    text = text_of(plane)
    assert sample(
        text, "ts_queue_latency_microseconds", model_name="digits", model_version="1"
    ) == pytest.approx(6000)
    assert sample(text, "QueueTime", Level="Host") == 4.0  # the last request's wait, in ms
    assert sample(text, "PredictionTime", ModelName="digits", Level="Model", Hostname=HOST) == 12.5


def test_name_filter_keeps_only_the_named_families(plane: FakePlane) -> None:
    asyncio.run(_call(plane, "digits"))
    text = text_of(plane, names=("ts_inference_requests_total", "mariner_requests_total", "QueueTime"))
    # (prometheus_client writes a single-process counter's `_created` as a gauge family of its own)
    assert {n for n in parse_exposition(text) if not n.endswith("_created")} == {
        "ts_inference_requests_total",
        "mariner_requests_total",
        "QueueTime",
    }


def test_openmetrics_is_valid_and_keeps_the_series_names(plane: FakePlane) -> None:
    asyncio.run(_call(plane, "digits"))
    body, content_type = plane.metrics.exposition("application/openmetrics-text; version=1.0.0", ())
    assert content_type.startswith("application/openmetrics-text")
    families = {f.name: f for f in text_string_to_metric_families(body.decode())}  # strict: raises if invalid
    assert families["Requests2XX"].type == "unknown"  # a counter sample must end in _total in OpenMetrics
    assert [s.name for s in families["Requests2XX"].samples] == ["Requests2XX"]
    assert families["ts_inference_requests"].type == "counter"
    assert {s.name for s in families["ts_inference_requests"].samples} == {"ts_inference_requests_total"}


def test_metrics_http_passes_filter_and_accept_through(plane: FakePlane) -> None:
    asyncio.run(_call(plane, "digits"))
    with serve(metrics_app(plane)) as base:  # type: ignore[arg-type]
        r = requests.get(
            f"{base}/metrics?name[]=Requests2XX",
            headers={"Accept": "application/openmetrics-text"},
            timeout=10,
        )
        plain = requests.get(f"{base}/metrics", timeout=10)
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("application/openmetrics-text")
    assert [f.name for f in text_string_to_metric_families(r.text)] == ["Requests2XX"]
    assert plain.headers["content-type"].startswith("text/plain; version=0.0.4")
    assert "# TYPE Requests2XX counter\n" in plain.text


def test_a_metrics_yaml_decides_names_and_labels(tmp_path: Path) -> None:
    config = tmp_path / "metrics.yaml"
    config.write_text(
        textwrap.dedent("""\
            dimensions:
              - &hostname "Hostname"
            ts_metrics:
              counter:
                - name: ts_inference_requests_total
                  unit: Count
                  dimensions: ["model_name", *hostname]
            model_metrics:
              gauge:
                - name: PredictionTime
                  unit: ms
                  dimensions: ["ModelName"]
            """)
    )
    spec = ts_metrics.load_spec(config)
    registry = CollectorRegistry()
    ts = TsFrontendMetrics(registry, spec)
    ts.record_call("digits", "1", "200", 0.001)
    ts.record_compute("digits", "1", 0.002)
    ts.record_batch("digits", "1", [0.001])  # not declared in this yaml: nothing to record
    text = ts_exposition.text_exposition(
        ts_exposition.expose(registry.collect(), spec, openmetrics=False)
    ).decode()
    families = parse_exposition(text)
    assert set(families) == {"ts_inference_requests_total", "PredictionTime"}
    assert families["ts_inference_requests_total"].label_sets == {frozenset({"model_name", "Hostname"})}
    assert families["PredictionTime"].label_sets == {frozenset({"ModelName", "Hostname"})}
    bad = tmp_path / "bad.yaml"
    bad.write_text("ts_metrics:\n  summary:\n    - name: X\n")
    with pytest.raises(ValueError, match="summary"):
        ts_metrics.load_spec(bad)


def test_metrics_config_comes_from_flag_or_config_properties(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    assert load_config(["--metrics-config", "/etc/m.yaml"], env={}).metrics_config == Path("/etc/m.yaml")
    with caplog.at_level(logging.WARNING):
        mapped = from_torchserve_properties({"metrics_config": "/etc/m.yaml", "metrics_mode": "prometheus"})
    assert mapped["metrics_config"] == "/etc/m.yaml"
    assert "metrics_mode" not in caplog.text
    with caplog.at_level(logging.WARNING):
        assert from_torchserve_properties({"metrics_mode": "log"})["metrics_mode"] == "log"
    assert "metrics_mode" not in caplog.text  # read, as every mode is served


# -- context.metrics ---------------------------------------------------------------------------
def handler_text() -> str:
    return QuietMetrics().exposition()[0].decode()


def test_context_metrics_classic_api_adds_torchserves_default_dimensions() -> None:
    ctx = Context("unit_model", "/tmp", {}, batch_size=1, gpu_id=None)
    ctx.metrics.add_counter("UnitCounter", 2)
    ctx.metrics.add_counter("UnitCounter", 3)
    ctx.metrics.add_time("UnitTime", 7.5)
    ctx.metrics.add_size("UnitSize", 12, unit="kB")
    ctx.metrics.add_percent("UnitPercent", 40, dimensions=[Dimension("Stage", "post")])
    ctx.metrics.add_metric("UnitGeneric", 1, "count", metric_type=MetricTypes.GAUGE)
    text = handler_text()
    model = {"ModelName": "unit_model", "Level": "Model", "Hostname": HOST}
    assert sample(text, "UnitCounter", **model) == 5.0
    assert sample(text, "UnitTime", **model) == 7.5
    assert sample(text, "UnitSize", **model) == 12.0
    assert sample(text, "UnitPercent", Stage="post", **model) == 40.0
    assert sample(text, "UnitGeneric", **model) == 1.0
    assert parse_exposition(text)["UnitCounter"].type == "counter"
    with pytest.raises(ValueError, match="timed metric"):
        ctx.metrics.add_time("UnitTime", 1, unit="us")


def test_context_metrics_cache_api_and_its_errors(caplog: pytest.LogCaptureFixture) -> None:
    ctx = Context("unit_model", "/tmp", {}, batch_size=1, gpu_id=None)
    counter = ctx.metrics.add_metric_to_cache("UnitCached", "count", ["Stage"])
    counter.add_or_update(4, ["pre"])
    assert ctx.metrics.get_metric("UnitCached", MetricTypes.COUNTER) is counter
    hist = ctx.metrics.add_metric_to_cache("UnitHist", "ms", ["Stage"], MetricTypes.HISTOGRAM)
    hist.add_or_update(3.0, ["pre"])
    with caplog.at_level(logging.ERROR):
        counter.add_or_update(1, ["a", "b"])  # wrong number of dimension values: dropped
        counter.add_or_update(-1, ["pre"])  # a counter never decreases: dropped
    assert "do not match" in caplog.text
    assert "cannot decrease" in caplog.text
    text = handler_text()
    assert sample(text, "UnitCached", Stage="pre", Hostname=HOST) == 4.0
    assert sample(text, "UnitHist_count", Stage="pre") == 1.0
    with pytest.raises(MetricsCacheKeyError):
        ctx.metrics.get_metric("UnitCached", MetricTypes.GAUGE)
    # A name Prometheus cannot carry gets "_" for its odd characters, the same in every format.
    ctx.metrics.add_counter("unit-odd name", 1)
    text = handler_text()
    assert "# TYPE unit_odd_name counter\n" in text
    assert sample(text, "unit_odd_name", ModelName="unit_model") == 1.0
    ctx.metrics.add_metric_to_cache("UnitOddLabel", "count", ["odd label"]).add_or_update(1, ["x"])
    assert sample(handler_text(), "UnitOddLabel", odd_label="x") == 1.0
    # Prometheus cannot change a family's labels: a re-declaration with others is logged and
    # dropped, and the handler's code runs on.
    with caplog.at_level(logging.ERROR):
        ctx.metrics.add_metric_to_cache("UnitCached", "count", ["Other"]).add_or_update(9, ["y"])
    assert "UnitCached (counter) cannot be exposed" in caplog.text
    assert sample(handler_text(), "UnitCached", Other="y") is None
    # The yaml's model metrics are there before the handler writes them.
    assert ctx.metrics.get_metric("HandlerTime", MetricTypes.GAUGE).dimension_names == ["ModelName", "Level"]


def test_handler_metrics_written_in_a_worker_process_reach_the_merged_metrics(tmp_path: Path) -> None:
    """A worker writes through prometheus_client's multiprocess files; the supervisor merges."""
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    write = (
        "from mariner.server.worker.context import Context\n"
        "c = Context('mp_model', '/tmp', {}, batch_size=1, gpu_id=None)\n"
        "c.metrics.add_counter('MpCounter', 3)\n"
        "c.metrics.add_time('HandlerTime', 2.5)\n"
    )
    for _ in range(2):  # two worker processes: counters add up
        subprocess.run([sys.executable, "-c", write], env=env, check=True, cwd=REPO)
    render = (
        "from mariner.server.common.metrics import exposition_multiprocess\n"
        "print(exposition_multiprocess()[0].decode())\n"
    )
    text = subprocess.run(
        [sys.executable, "-c", render], env=env, check=True, cwd=REPO, capture_output=True, text=True
    ).stdout
    assert sample(text, "MpCounter", ModelName="mp_model", Level="Model", Hostname=HOST) == 6.0
    assert sample(text, "HandlerTime", ModelName="mp_model", Level="Model", Hostname=HOST) == 2.5
    assert "# TYPE MpCounter counter\n" in text
    assert sample(text, "CPUUtilization", Level="Host", Hostname=HOST) is not None
