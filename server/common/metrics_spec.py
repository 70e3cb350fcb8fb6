"""TorchServe's metrics.yaml as data: the metrics a server declares, and the Prometheus metric
behind each.

The spec is shared by every layer that records TorchServe metrics: handlers through
`context.metrics` (core's `handler_metrics`, in the worker), the frontend's request metrics and
the /metrics exposition (control's `ts_metrics` and `ts_exposition`). See `ts_metrics` for the
naming contract and its quirks.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

# Set by the supervisor (from --metrics-config / metrics_config) so frontends and workers, which
# inherit the environment, read the same file.
METRICS_CONFIG_ENV = "MARINER_METRICS_CONFIG"
# Likewise TorchServe's metrics_mode and model_metrics_auto_detect (also the settings' own
# MARINER_* variables: the supervisor writes back the value it resolved).
METRICS_MODE_ENV = "MARINER_METRICS_MODE"
AUTO_DETECT_ENV = "MARINER_MODEL_METRICS_AUTO_DETECT"
NO_SYSTEM_METRICS_ENV = "MARINER_DISABLE_SYSTEM_METRICS"
# TorchServe's modes: `log` (its default) writes its metrics to ts_metrics.log and
# model_metrics.log, `prometheus` serves them on /metrics, `legacy` serves only these three on
# /metrics and logs the rest.
METRICS_MODES = ("log", "prometheus", "legacy")
LEGACY_PROMETHEUS = frozenset(
    {"ts_inference_requests_total", "ts_inference_latency_microseconds", "ts_queue_latency_microseconds"}
)
COUNTER_SUFFIX = ":ts"
HOSTNAME = socket.gethostname()
KINDS = ("counter", "gauge", "histogram")


@dataclass(frozen=True)
class MetricSpec:
    """One metric of a metrics.yaml: its name, Prometheus type, unit and label names."""

    name: str
    kind: str
    unit: str
    dimensions: tuple[str, ...]

    @property
    def help(self) -> str:
        return f"TorchServe-compatible {self.kind} metric with unit: {self.unit}"


_LH = ("Level", "Hostname")
_MVH = ("model_name", "model_version", "hostname")


def _m(name: str, kind: str, unit: str, dims: tuple[str, ...]) -> MetricSpec:
    return MetricSpec(name, kind, unit, dims)


# TorchServe 0.12's default ts/configs/metrics.yaml, as data (used when no metrics_config is set).
DEFAULT_FRONTEND: tuple[MetricSpec, ...] = (
    _m("Requests2XX", "counter", "Count", _LH),
    _m("Requests4XX", "counter", "Count", _LH),
    _m("Requests5XX", "counter", "Count", _LH),
    _m("ts_inference_requests_total", "counter", "Count", _MVH),
    _m("ts_inference_latency_microseconds", "counter", "Microseconds", _MVH),
    _m("ts_queue_latency_microseconds", "counter", "Microseconds", _MVH),
    _m("QueueTime", "gauge", "Milliseconds", _LH),
    _m("WorkerThreadTime", "gauge", "Milliseconds", _LH),
    _m("WorkerLoadTime", "gauge", "Milliseconds", ("WorkerName", *_LH)),
    _m("CPUUtilization", "gauge", "Percent", _LH),
    _m("MemoryUsed", "gauge", "Megabytes", _LH),
    _m("MemoryAvailable", "gauge", "Megabytes", _LH),
    _m("MemoryUtilization", "gauge", "Percent", _LH),
    _m("DiskUsage", "gauge", "Gigabytes", _LH),
    _m("DiskUtilization", "gauge", "Percent", _LH),
    _m("DiskAvailable", "gauge", "Gigabytes", _LH),
    _m("GPUMemoryUtilization", "gauge", "Percent", ("Level", "DeviceId", "Hostname")),
    _m("GPUMemoryUsed", "gauge", "Megabytes", ("Level", "DeviceId", "Hostname")),
    _m("GPUUtilization", "gauge", "Percent", ("Level", "DeviceId", "Hostname")),
)
DEFAULT_MODEL: tuple[MetricSpec, ...] = (
    _m("HandlerTime", "gauge", "ms", ("ModelName", "Level")),
    _m("PredictionTime", "gauge", "ms", ("ModelName", "Level")),
)


@dataclass(frozen=True)
class TsMetricsSpec:
    """The frontend (`ts_metrics`) and model (`model_metrics`) sections of a metrics.yaml."""

    frontend: tuple[MetricSpec, ...] = DEFAULT_FRONTEND
    model: tuple[MetricSpec, ...] = DEFAULT_MODEL

    def frontend_metric(self, name: str) -> MetricSpec | None:
        return next((m for m in self.frontend if m.name == name), None)

    def model_metric(self, name: str) -> MetricSpec | None:
        return next((m for m in self.model if m.name == name), None)


def _section(doc: Mapping[str, Any], key: str) -> tuple[MetricSpec, ...]:
    section = doc.get(key) or {}
    if not isinstance(section, Mapping):
        raise ValueError(f"metrics config: '{key}' must map counter/gauge/histogram to lists")
    out: list[MetricSpec] = []
    for kind, entries in section.items():
        if kind not in KINDS:
            raise ValueError(f"metrics config: '{key}.{kind}' is not one of {', '.join(KINDS)}")
        for entry in entries or ():
            try:
                dims = tuple(str(d) for d in entry.get("dimensions") or ())
                out.append(MetricSpec(str(entry["name"]), kind, str(entry.get("unit", "")), dims))
            except (KeyError, AttributeError, TypeError) as exc:
                raise ValueError(f"metrics config: bad entry under '{key}.{kind}': {entry!r}") from exc
    return tuple(out)


def load_spec(path: str | Path | None) -> TsMetricsSpec:
    """TorchServe's metrics.yaml format (its anchors included); the default without a path."""
    if not path:
        return TsMetricsSpec()
    import yaml

    doc = yaml.safe_load(Path(path).read_text()) or {}
    if not isinstance(doc, Mapping):
        raise ValueError(f"metrics config {path}: not a YAML mapping")
    return TsMetricsSpec(_section(doc, "ts_metrics"), _section(doc, "model_metrics"))


@lru_cache(maxsize=4)
def _spec_for(path: str) -> TsMetricsSpec:
    return load_spec(path or None)


def use_metrics_config(path: str | Path | None) -> None:
    """Serve the metrics.yaml at `path` (checked now, so a bad file fails the start with its
    reason); the frontends and workers started later inherit it through the environment."""
    if not path:
        return
    resolved = str(Path(path).resolve())
    load_spec(resolved)
    os.environ[METRICS_CONFIG_ENV] = resolved


def current_spec() -> TsMetricsSpec:
    """The spec this process serves: the file named by MARINER_METRICS_CONFIG, else the default."""
    return _spec_for(os.environ.get(METRICS_CONFIG_ENV, ""))


def label_values(dims: Sequence[str], known: Mapping[str, str]) -> tuple[str, ...]:
    """A metric's label values by dimension name (a custom yaml may reorder or drop them)."""
    return tuple(known.get(d, "") for d in dims)


def make_metric(spec: MetricSpec, labelnames: Sequence[str], registry: Any) -> Any:
    """The prometheus_client metric behind a TorchServe one (counters under their internal name).

    Gauges keep the most recent value written by any process, as TorchServe's gauges do.
    """
    from prometheus_client import Counter, Gauge, Histogram

    from mariner.server.common import metric_values  # noqa: F401 - before any metric is created

    if spec.kind == "counter":
        return Counter(spec.name + COUNTER_SUFFIX, spec.help, labelnames, registry=registry)
    if spec.kind == "gauge":
        return Gauge(spec.name, spec.help, labelnames, multiprocess_mode="mostrecent", registry=registry)
    return Histogram(spec.name, spec.help, labelnames, registry=registry)


def use_metrics_mode(mode: str, auto_detect: bool = False, disable_system: bool = False) -> None:
    """Serve TorchServe's metrics in `mode`, with or without auto-detected handler metrics and
    host metrics; the frontends and workers started later inherit this through the environment."""
    if mode not in METRICS_MODES:
        raise ValueError(f"metrics_mode must be one of {', '.join(METRICS_MODES)}, got {mode!r}")
    os.environ[METRICS_MODE_ENV] = mode
    os.environ[AUTO_DETECT_ENV] = "true" if auto_detect else "false"
    os.environ[NO_SYSTEM_METRICS_ENV] = "true" if disable_system else "false"


def metrics_mode() -> str:
    """The mode this process serves TorchServe's metrics in (TorchServe's default: log)."""
    mode = os.environ.get(METRICS_MODE_ENV, "log").strip().lower()
    return mode if mode in METRICS_MODES else "log"


def model_metrics_auto_detect() -> bool:
    """Whether a handler metric metrics.yaml does not declare is kept (TorchServe drops it)."""
    return os.environ.get(AUTO_DETECT_ENV, "false").strip().lower() == "true"


def system_metrics_disabled() -> bool:
    """TorchServe's `disable_system_metrics`: no CPU, memory, disk or GPU samples at all."""
    return os.environ.get(NO_SYSTEM_METRICS_ENV, "false").strip().lower() == "true"


def on_prometheus(name: str, mode: str) -> bool:
    """Whether TorchServe's metric `name` is served on /metrics in `mode` (else it is logged)."""
    return mode == "prometheus" or (mode == "legacy" and name in LEGACY_PROMETHEUS)


def backend_metric_line(
    name: str, unit: str, value: float, dimensions: Sequence[tuple[str, str]], kind: str, request_id: str = ""
) -> str:
    """The line a TorchServe backend prints on its stdout for one metric update (its
    `CachingMetric.emit_metrics`): `[METRICS]name.unit:value|#dims|#type:GAUGE|#hostname:h,time`
    and the request id; the server reads it from the worker's output in the log modes."""
    dims = ",".join(f"{k}:{v}" for k, v in dimensions)
    head = f"[METRICS]{name}.{unit}:{value}|#{dims}|#type:{kind.upper()}"
    line = f"{head}|#hostname:{HOSTNAME},{int(time.time())}"
    return f"{line},{request_id}" if request_id else line
