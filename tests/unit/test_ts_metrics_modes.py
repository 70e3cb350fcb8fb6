"""TorchServe's metrics_mode: `log` (its default) writes its metric lines, `prometheus` serves its
names on /metrics, `legacy` serves three counters there and logs the rest; Mariner's own
`mariner_*` metrics are on /metrics in every mode. Handler metrics follow the mode too, and an
undeclared one is kept only with model_metrics_auto_detect."""

from __future__ import annotations

import re

import pytest
from prometheus_client import CollectorRegistry

from mariner.server.common.metrics_spec import AUTO_DETECT_ENV, METRICS_MODE_ENV
from mariner.server.compat.torchserve import exposition as ts_exposition
from mariner.server.compat.torchserve import metrics as ts_metrics
from mariner.server.compat.torchserve.logs.records import Kind, Record
from mariner.server.worker.context import Context
from tests.unit.fakes import QuietMetrics
from tests.unit.ts_logs_support import captured

__all__ = ["captured"]  # the fixture, used by name

pytestmark = pytest.mark.unit

TS_NAMES = ("Requests2XX", "ts_inference_requests_total", "QueueTime", "PredictionTime", "CPUUtilization")


def _traffic(metrics: QuietMetrics) -> None:
    ts = metrics.ts
    ts.record_call("digits", "default", "200", 0.004)
    ts.record_call("unknown", "unknown", "404", 0.001)
    ts.record_batch("digits", "1", [0.002], [None])
    ts.record_compute("digits", "1", 0.003)
    ts.flush()
    metrics.requests.labels("digits", "1", "torchserve-http", "200").inc()


def _exposed(metrics: QuietMetrics) -> str:
    return metrics.exposition()[0].decode()


def test_log_mode_writes_torchserves_lines_and_keeps_its_names_off_metrics(
    monkeypatch: pytest.MonkeyPatch, captured: list[Record]
) -> None:
    monkeypatch.setenv(METRICS_MODE_ENV, "log")
    metrics = QuietMetrics()
    _traffic(metrics)
    by_name = {r.message.split(".", 1)[0]: r for r in captured}
    assert set(by_name) >= {
        "Requests2XX", "Requests4XX", "ts_inference_requests_total", "ts_inference_latency_microseconds",
        "ts_queue_latency_microseconds", "QueueTime", "PredictionTime", "WorkerThreadTime",
    }  # fmt: skip
    assert "ts_inference_requests_total" in by_name
    assert re.fullmatch(
        r"ts_inference_requests_total\.Count:1\.0\|#model_name:digits,model_version:default\|#hostname:.+,timestamp:\d+",
        by_name["ts_inference_requests_total"].message,
    )
    assert by_name["ts_queue_latency_microseconds"].message.startswith(
        "ts_queue_latency_microseconds.Microseconds:2000.0|#model_name:digits,model_version:default|"
    )
    assert by_name["Requests2XX"].kind == Kind.TS_METRICS
    assert by_name["PredictionTime"].kind == Kind.MODEL_METRICS  # a model metric: model_metrics.log
    text = _exposed(metrics)
    assert "mariner_requests_total" in text
    for name in TS_NAMES:
        assert name not in text


def test_prometheus_mode_serves_torchserves_names_as_its_java_client_writes_them(
    monkeypatch: pytest.MonkeyPatch, captured: list[Record]
) -> None:
    monkeypatch.setenv(METRICS_MODE_ENV, "prometheus")
    metrics = QuietMetrics()
    _traffic(metrics)
    assert captured == []  # nothing logged
    text = _exposed(metrics)
    # Declared order and the trailing comma of every TorchServe label set.
    assert re.search(r'^Requests2XX\{Level="Host",Hostname="[^"]+",\} 1\.0$', text, re.M)
    assert re.search(
        r'^ts_inference_requests_total\{model_name="digits",model_version="default",'
        r'hostname="[^"]+",\} 1\.0$',
        text,
        re.M,
    )
    assert re.search(
        r'^PredictionTime\{ModelName="digits",Level="Model",Hostname="[^"]+",\} 3\.0$', text, re.M
    )
    assert re.search(
        r"^mariner_requests_total\{[^}]*[^,]\} 1\.0$", text, re.M
    )  # ours as prometheus_client writes


def test_legacy_mode_serves_three_counters_and_logs_the_rest(
    monkeypatch: pytest.MonkeyPatch, captured: list[Record]
) -> None:
    monkeypatch.setenv(METRICS_MODE_ENV, "legacy")
    metrics = QuietMetrics()
    _traffic(metrics)
    text = _exposed(metrics)
    for name in ts_metrics.LEGACY_PROMETHEUS:
        assert f"# TYPE {name} counter" in text
    for name in ("Requests2XX", "QueueTime", "PredictionTime", "WorkerThreadTime", "CPUUtilization"):
        assert name not in text
    logged = {r.message.split(".", 1)[0] for r in captured}
    assert {"Requests2XX", "QueueTime", "PredictionTime"} <= logged
    assert not logged & ts_metrics.LEGACY_PROMETHEUS


def test_exposition_orders_an_auto_detected_metrics_labels_as_torchserve() -> None:
    registry = CollectorRegistry()
    spec = ts_metrics.TsMetricsSpec()
    gauge = ts_metrics.make_metric(
        ts_metrics.MetricSpec("HandlerMethodTime", "gauge", "ms", ()),
        ("MethodName", "ModelName", "Level", "Hostname"),
        registry,
    )
    gauge.labels("preprocess", "m", "Model", "h").set(1.5)
    families = ts_exposition.expose(registry.collect(), spec, openmetrics=False, mode="prometheus")
    text = ts_exposition.text_exposition(families).decode()
    assert 'HandlerMethodTime{MethodName="preprocess",ModelName="m",Level="Model",Hostname="h",} 1.5' in text


def test_handler_metrics_in_log_mode_are_printed_as_torchservess_backend_prints_them(
    monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv(METRICS_MODE_ENV, "log")
    monkeypatch.setenv(AUTO_DETECT_ENV, "false")
    ctx = Context("log_model", "/tmp", {}, batch_size=1, gpu_id=None)
    ctx.metrics.add_time("HandlerTime", 2.5)  # declared in the default metrics.yaml
    ctx.metrics.add_counter("LogModeUndeclared", 1)  # not declared: dropped
    out = capfd.readouterr().out
    assert re.search(
        r"^\[METRICS\]HandlerTime\.Milliseconds:2\.5\|#ModelName:log_model,Level:Model\|#type:GAUGE\|#hostname:.+,\d+$",
        out,
        re.M,
    )
    assert "LogModeUndeclared" not in out
    monkeypatch.setenv(AUTO_DETECT_ENV, "true")
    Context("log_model", "/tmp", {}, batch_size=1, gpu_id=None).metrics.add_counter("LogModeDetected", 2)
    assert (
        "[METRICS]LogModeDetected.Count:2|#ModelName:log_model,Level:Model|#type:COUNTER"
        in capfd.readouterr().out
    )
