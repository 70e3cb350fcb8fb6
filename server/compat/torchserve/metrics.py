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
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

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
    model_metrics_auto_detect,
    on_prometheus,
    system_metrics_disabled,
    use_metrics_config,
    use_metrics_mode,
)
from mariner.server.compat.torchserve.logs import emit as ts_emit
from mariner.server.compat.torchserve.logs.lines import java_double, metric_message, metric_parts
from mariner.server.compat.torchserve.logs.records import Kind
from mariner.server.compat.torchserve.logs.words import MODEL_METRICS, TS_METRICS

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
    "SYSTEM_METRICS",
    "MetricSpec",
    "SystemMetrics",
    "TsFrontendMetrics",
    "TsMetricsSpec",
    "current_spec",
    "label_values",
    "load_spec",
    "log_system_metrics",
    "log_worker_load",
    "make_metric",
    "metrics_mode",
    "record_worker_load",
    "use_metrics_config",
    "use_metrics_mode",
]

log = logging.getLogger("mariner.metrics")


_THREAD = "frontend"  # log4j's %t of these lines (TorchServe's are its Netty threads')
_CLASSES = {"2": "Requests2XX", "4": "Requests4XX", "5": "Requests5XX"}
_UNMADE = object()


class TsFrontendMetrics:
    """The frontend's TorchServe metrics, fed from the measurements Mariner already takes: on
    /metrics (the names the mode serves there) and as TorchServe's log lines (the others)."""

    def __init__(self, registry: Any, spec: TsMetricsSpec | None = None, mode: str | None = None) -> None:
        self.spec = spec or current_spec()
        self.mode = mode or metrics_mode()
        self._metrics: dict[str, tuple[MetricSpec, Any]] = {}
        self._logged: dict[str, tuple[MetricSpec, tuple[str, ...]]] = {}  # name -> spec, dimensions
        for m in self.spec.frontend:
            if m.name in SYSTEM_METRICS or m.name.startswith("GPU"):
                continue  # sampled by SystemMetrics / log_system_metrics
            self._add(m, m.dimensions, registry)
        prediction = self.spec.model_metric("PredictionTime")
        if prediction is None and model_metrics_auto_detect():  # TorchServe's backend emits it anyway
            prediction = MetricSpec("PredictionTime", "gauge", "ms", ("ModelName", "Level"))
        if prediction is not None:
            self._add(prediction, (*prediction.dimensions, "Hostname"), registry)
        self._calls: dict[tuple[str, str, str], tuple[Any, Any, Any]] = {}
        self._pending: dict[tuple[str, str, str], list[Any]] = {}  # calls not yet written: [n, seconds]
        self._flush_scheduled = False
        self._batches: dict[tuple[str, str], tuple[Any, ...]] = {}
        self._known_cache: dict[tuple[str, str], dict[str, str]] = {}
        self._templates: dict[tuple[str, str, str, str], Any] = {}  # logged lines around their values

    def _add(self, m: MetricSpec, dims: tuple[str, ...], registry: Any) -> None:
        if on_prometheus(m.name, self.mode):
            self._metrics[m.name] = (m, make_metric(m, dims, registry))
        else:
            self._logged[m.name] = (m, dims)

    def _child(self, name: str, known: Mapping[str, str]) -> Any:
        entry = self._metrics.get(name)
        if entry is None:
            return None
        spec, metric = entry
        return metric.labels(*label_values(self._dims(name, spec), known))

    @staticmethod
    def _dims(name: str, spec: MetricSpec) -> tuple[str, ...]:
        return spec.dimensions if name != "PredictionTime" else (*spec.dimensions, "Hostname")

    def _known(self, model: str, version: str) -> dict[str, str]:
        known = self._known_cache.get((model, version))
        if known is None:
            known = {
                "Level": "Host",
                "Hostname": HOSTNAME,
                "hostname": HOSTNAME,
                "model_name": model,
                "model_version": version,
                "ModelName": model,
            }
            if len(self._known_cache) < 4096:  # served names and versions: a bounded set
                self._known_cache[(model, version)] = known
        return known

    def _log(self, name: str, value: float, model: str, version: str, level: str, now: float) -> None:
        """One TorchServe metric line (ts_metrics.log; PredictionTime to model_metrics.log). The
        line around its value is made once per metric and label set (`_template`): a frontend in
        log mode writes several per call."""
        target = ts_emit.current()
        if target is None:
            return
        key = (name, model, version, level)
        template = self._templates.get(key, _UNMADE)
        if template is _UNMADE:
            template = self._templates[key] = self._template(name, model, version, level)
        if template is None:
            return
        kind, logger, head, tail = template
        target(kind, now, "INFO", _THREAD, logger, f"{head}{java_double(value)}{tail}{int(now)}")

    def _template(self, name: str, model: str, version: str, level: str) -> tuple[Kind, str, str, str] | None:
        entry = self._logged.get(name)
        if entry is None or len(self._templates) > 16_384:  # label sets are bounded; this is a backstop
            return None
        spec, dims = entry
        known = {**self._known(model, version), "Level": level}
        model_metric = name == "PredictionTime"
        head, tail = metric_parts(name, spec.unit, dims, known, with_request_id=model_metric)
        if model_metric:
            return Kind.MODEL_METRICS, MODEL_METRICS, head, tail
        return Kind.TS_METRICS, TS_METRICS, head, tail

    def record_call(self, model: str, version: str, code: str, seconds: float) -> None:
        """One answered inference call: Requests<N>XX always; the per-model counters when the
        model is served (TorchServe counts latency for answered requests only).

        On the hot path, so calls are summed in a dict and written to the Prometheus values once
        per event-loop turn (`flush`): in multiprocess mode each write is a locked mmap update,
        and a batch's requests finish in the same turn. Without a running loop, written at once.
        Logged metrics are one line per call, as TorchServe writes them.
        """
        if self._logged:
            self._log_call(model, version, code, seconds)
        if not self._metrics:
            return
        key = (model, version, code)
        pending = self._pending.get(key)
        if pending is None:
            self._pending[key] = [1, seconds]
        else:
            pending[0] += 1
            pending[1] += seconds
        if not self._flush_scheduled:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                self.flush()
                return
            self._flush_scheduled = True
            loop.call_soon(self.flush)

    def _log_call(self, model: str, version: str, code: str, seconds: float) -> None:
        now = time.time()
        klass = _CLASSES.get(code[:1])
        if klass:
            self._log(klass, 1.0, "", "", "Host", now)
        if model != "unknown":
            self._log("ts_inference_requests_total", 1.0, model, version, "Host", now)
            if code == "200":
                self._log("ts_inference_latency_microseconds", seconds * 1e6, model, version, "Host", now)

    def flush(self) -> None:
        """Write the calls summed since the last flush (a scrape of this process flushes first)."""
        self._flush_scheduled = False
        pending, self._pending = self._pending, {}
        for key, (count, seconds) in pending.items():
            status, requests, latency = self._call_children(*key)
            if status is not None:
                status.inc(count)
            if requests is not None:
                requests.inc(count)
            if latency is not None:
                latency.inc(seconds * 1e6)

    def _call_children(self, model: str, version: str, code: str) -> tuple[Any, Any, Any]:
        key = (model, version, code)
        children = self._calls.get(key)
        if children is None:
            known = self._known(model, version)
            klass = f"Requests{code[:1]}XX" if code[:1] in ("2", "4", "5") else ""
            served = model != "unknown"
            children = (
                self._child(klass, known) if klass else None,
                self._child("ts_inference_requests_total", known) if served else None,
                self._child("ts_inference_latency_microseconds", known) if served and code == "200" else None,
            )
            self._calls[key] = children
        return children

    def record_batch(
        self,
        model: str,
        version: str,
        queue_waits: Sequence[float],
        versions: Sequence[str | None] = (),
    ) -> None:
        """A batch left the queue: each request's wait (QueueTime keeps the last, in ms), under
        the version each request asked for (`versions`; TorchServe writes "default" for none)."""
        if not queue_waits:
            return
        asked = (
            ["default" if v is None else v for v in versions] if versions else [version] * len(queue_waits)
        )
        if self._logged:
            now = time.time()
            for wait, label in zip(queue_waits, asked, strict=False):  # TorchServe writes both per request
                self._log("ts_queue_latency_microseconds", wait * 1e6, model, label, "Host", now)
                self._log("QueueTime", wait * 1000.0, "", "", "Host", now)
        if not self._metrics:
            return
        for wait, label in zip(queue_waits, asked, strict=False):
            key = (model, label)
            children = self._batches.get(key)
            if children is None:
                known = self._known(model, label)
                children = (
                    self._child("ts_queue_latency_microseconds", known),
                    self._child("QueueTime", known),
                )
                self._batches[key] = children
            total, _ = children
            if total is not None:
                total.inc(wait * 1e6)
        last = self._batches[(model, asked[-1])][1]
        if last is not None:
            last.set(round(queue_waits[-1] * 1000.0, 3))

    def record_compute(self, model: str, version: str, seconds: float) -> None:
        """A batch's time in its worker as the frontend measured it (TorchServe's PredictionTime,
        in ms). The frontend hands a batch to its worker on its event loop, with no thread of its
        own around the call, so TorchServe's WorkerThreadTime (a worker thread's time outside
        the backend's call) is 0 here: the hop is in PredictionTime."""
        if self._logged:
            now = time.time()
            self._log("PredictionTime", round(seconds * 1000.0, 2), model, version, "Model", now)
            self._log("WorkerThreadTime", 0.0, "", "", "Host", now)
        if not self._metrics:
            return
        known = {**self._known(model, version), "Level": "Model"}
        child = self._child("PredictionTime", known)
        if child is not None:
            child.set(round(seconds * 1000.0, 2))
        thread_time = self._child("WorkerThreadTime", {**known, "Level": "Host"})
        if thread_time is not None:
            thread_time.set(0.0)

    def record_load(self, worker: str, seconds: float) -> None:
        child = self._child("WorkerLoadTime", {**self._known("", ""), "WorkerName": worker})
        if child is not None:
            child.set(round(seconds * 1000.0))


SYSTEM_METRICS = (
    "CPUUtilization",
    "MemoryUsed",
    "MemoryAvailable",
    "MemoryUtilization",
    "DiskUsage",
    "DiskUtilization",
    "DiskAvailable",
)


class SystemMetrics:
    """TorchServe's host metrics on /metrics in prometheus mode, sampled when /metrics is
    scraped (in the log modes `log_system_metrics` writes them every metric_time_interval
    instead; `disable_system_metrics` turns both off). GPU metrics stay declared without
    samples: the supervisor that serves /metrics never touches CUDA (see TRAPS.md), and
    Mariner's own per-device mariner_gpu_memory_allocated_bytes comes from the workers that use
    the GPU."""

    def __init__(self, spec: TsMetricsSpec, disk_path: str = "/") -> None:
        self.spec = spec
        self.disk_path = disk_path

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily

        if metrics_mode() != "prometheus" or system_metrics_disabled():
            return
        values = _host_values(self.disk_path)
        for m in self.spec.frontend:
            if m.name not in values:
                continue
            family = GaugeMetricFamily(m.name, m.help, labels=m.dimensions)
            family.add_metric(label_values(m.dimensions, {"Level": "Host", "Hostname": HOSTNAME}),
                              values[m.name])  # fmt: skip
            yield family


def log_system_metrics(spec: TsMetricsSpec, disk_path: str = "/") -> int:
    """One sample of the host metrics as TorchServe's lines in ts_metrics.log (its
    MetricCollector's, run at start and every metric_time_interval seconds): the ones the
    metrics.yaml declares. Returns how many were written."""
    values = _host_values(disk_path)
    now = time.time()
    known = {"Level": "Host", "Hostname": HOSTNAME}
    written = 0
    for m in spec.frontend:
        if m.name in values:
            message = metric_message(m.name, m.unit, values[m.name], m.dimensions, known, now=now)
            ts_emit.emit(Kind.TS_METRICS, "INFO", "pool-metrics", TS_METRICS, message, now)
            written += 1
    return written


def _host_values(disk_path: str) -> dict[str, float]:
    try:
        import psutil
    except ImportError:  # pragma: no cover - psutil comes with the server's dependencies
        return {}
    mem = psutil.virtual_memory()
    disk = psutil.disk_usage(disk_path)
    return {
        "CPUUtilization": float(psutil.cpu_percent(interval=None)),
        "MemoryUsed": mem.used / 1024**2,
        "MemoryAvailable": mem.available / 1024**2,
        "MemoryUtilization": float(mem.percent),
        "DiskUsage": disk.used / 1024**3,
        "DiskUtilization": float(disk.percent),
        "DiskAvailable": disk.free / 1024**3,
    }


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
