"""TorchServe's metrics, in the mode TorchServe's `metrics_mode` asks for, so dashboards, alerts,
autoscaling rules and log shippers written for TorchServe keep working after the switch.

TorchServe's `metrics.yaml` declares the frontend's metrics (`ts_metrics`:
ts_inference_requests_total, Requests2XX, QueueTime, system metrics...) and the handlers'
(`model_metrics`: HandlerTime, PredictionTime and whatever a handler adds through
`context.metrics`). Its `metrics_mode` says where they go:

- `log` (TorchServe's default): one line per update in ts_metrics.log (frontend and system
  metrics) and model_metrics.log (handler metrics), TorchServe's `LogMetric` format
  (`compat.torchserve.logs.lines.metric_message`); nothing of them on /metrics;
- `prometheus`: on /metrics, names, types and label names exactly as TorchServe serves them,
  including its quirks: counters whose sample is the bare name (`Requests2XX`, not
  `Requests2XX_total`) and declared metrics listed (HELP/TYPE) before they have a sample;
- `legacy`: ts_inference_requests_total, ts_inference_latency_microseconds and
  ts_queue_latency_microseconds on /metrics, everything else logged.

Mariner's own `mariner_*` metrics are on /metrics in every mode.

prometheus_client appends `_total` to every counter sample and, in multiprocess mode, merges
only what the processes wrote. So TorchServe counters are created under an internal name
(`<name>:ts`: a colon never appears in a TorchServe name and stops prometheus_client from
stripping a `_total` the name itself ends with), and `ts_exposition` renames them back when
/metrics is rendered, adds the declared families nobody has written yet, keeps what the mode
serves, and applies TorchServe's `name[]=` filter.

TorchServe's frontend metrics are `frontend_metrics`' (`TsFrontendMetrics`), its host metrics
`system_metrics`'. This module holds what every process names: the spec's names (re-exported
below) and WorkerLoadTime, which the worker writes (`record_worker_load`) and the supervisor
logs (`log_worker_load`).
"""

from __future__ import annotations

import logging
import os

# The spec half lives in core (handlers' `context.metrics` reads it in the worker); these names
# stay importable from here for the frontend, the supervisor and the exposition.
from mariner.server.common.metrics_spec import (
    COUNTER_SUFFIX,
    DEFAULT_FRONTEND,
    DEFAULT_MODEL,
    HOSTNAME,
    KINDS,
    LEGACY_PROMETHEUS,
    METRICS_CONFIG_ENV,
    METRICS_MODE_ENV,
    METRICS_MODES,
    MetricSpec,
    TsMetricsSpec,
    current_spec,
    label_values,
    load_spec,
    make_metric,
    metrics_mode,
    on_prometheus,
    use_metrics_config,
    use_metrics_mode,
)
from mariner.server.compat.torchserve.logs import emit as ts_emit
from mariner.server.compat.torchserve.logs.lines import metric_message
from mariner.server.compat.torchserve.logs.records import Kind
from mariner.server.compat.torchserve.logs.words import TS_METRICS

__all__ = [
    "COUNTER_SUFFIX",
    "DEFAULT_FRONTEND",
    "DEFAULT_MODEL",
    "HOSTNAME",
    "KINDS",
    "LEGACY_PROMETHEUS",
    "METRICS_CONFIG_ENV",
    "METRICS_MODE_ENV",
    "METRICS_MODES",
    "MetricSpec",
    "TsMetricsSpec",
    "current_spec",
    "label_values",
    "load_spec",
    "log_worker_load",
    "make_metric",
    "metrics_mode",
    "record_worker_load",
    "use_metrics_config",
    "use_metrics_mode",
]

log = logging.getLogger("mariner.metrics")


def record_worker_load(worker: str, seconds: float) -> None:
    """A model worker process's load time as TorchServe's WorkerLoadTime (ms) on /metrics, written
    by the worker to the multiprocess files the supervisor's /metrics merges (prometheus mode;
    nothing without multiprocess mode). In the log modes the supervisor logs it (`log_worker_load`)."""
    if not os.environ.get("PROMETHEUS_MULTIPROC_DIR") or not on_prometheus("WorkerLoadTime", metrics_mode()):
        return
    spec = current_spec().frontend_metric("WorkerLoadTime")
    if spec is None:
        return
    gauge = make_metric(spec, spec.dimensions, None)
    known = {"Level": "Host", "Hostname": HOSTNAME, "hostname": HOSTNAME, "WorkerName": worker}
    gauge.labels(*label_values(spec.dimensions, known)).set(round(seconds * 1000.0))


def log_worker_load(worker: str, seconds: float) -> None:
    """WorkerLoadTime (ms) as TorchServe's line in ts_metrics.log, when the mode logs it."""
    spec = current_spec().frontend_metric("WorkerLoadTime")
    if spec is None or on_prometheus("WorkerLoadTime", metrics_mode()):
        return
    known = {"Level": "Host", "Hostname": HOSTNAME, "WorkerName": worker}
    message = metric_message(spec.name, spec.unit, round(seconds * 1000.0), spec.dimensions, known)
    ts_emit.emit(Kind.TS_METRICS, "INFO", worker, TS_METRICS, message)
