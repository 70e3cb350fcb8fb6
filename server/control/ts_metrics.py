"""TorchServe's metric names on Mariner's /metrics, so dashboards, alerts and autoscaling rules
written for TorchServe keep working after the switch.

TorchServe (metrics_mode=prometheus) exposes the metrics its `metrics.yaml` declares: the
frontend's (`ts_metrics`: ts_inference_requests_total, Requests2XX, QueueTime, system metrics...)
and the handlers' (`model_metrics`: HandlerTime, PredictionTime and whatever a handler adds
through `context.metrics`). Names, types and label names are the contract; we keep them exactly,
including TorchServe's quirks: counters whose sample is the bare name (`Requests2XX`, not
`Requests2XX_total`) and declared metrics listed (HELP/TYPE) before they have a sample.

prometheus_client appends `_total` to every counter sample and, in multiprocess mode, merges
only what the processes wrote. So TorchServe counters are created under an internal name
(`<name>:ts`: a colon never appears in a TorchServe name and stops prometheus_client from
stripping a `_total` the name itself ends with), and `ts_exposition` renames them back when
/metrics is rendered, adds the declared families nobody has written yet, and applies
TorchServe's `name[]=` filter.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

# The spec half lives in core (handlers' `context.metrics` reads it in the worker); these names
# stay importable from here for the frontend, the supervisor and the exposition.
from mariner.server.core.metrics_spec import (
    COUNTER_SUFFIX,
    DEFAULT_FRONTEND,
    DEFAULT_MODEL,
    HOSTNAME,
    KINDS,
    METRICS_CONFIG_ENV,
    MetricSpec,
    TsMetricsSpec,
    current_spec,
    label_values,
    load_spec,
    make_metric,
    use_metrics_config,
)

__all__ = [
    "COUNTER_SUFFIX",
    "DEFAULT_FRONTEND",
    "DEFAULT_MODEL",
    "HOSTNAME",
    "KINDS",
    "METRICS_CONFIG_ENV",
    "SYSTEM_METRICS",
    "MetricSpec",
    "SystemMetrics",
    "TsFrontendMetrics",
    "TsMetricsSpec",
    "current_spec",
    "label_values",
    "load_spec",
    "make_metric",
    "record_worker_load",
    "use_metrics_config",
]

log = logging.getLogger("mariner.metrics")


class TsFrontendMetrics:
    """The frontend's TorchServe metrics, fed from the measurements Mariner already takes."""

    def __init__(self, registry: Any, spec: TsMetricsSpec | None = None) -> None:
        self.spec = spec or current_spec()
        self._metrics: dict[str, tuple[MetricSpec, Any]] = {}
        for m in self.spec.frontend:
            if m.name in SYSTEM_METRICS or m.name.startswith("GPU"):
                continue  # sampled at scrape time by SystemMetrics
            self._metrics[m.name] = (m, make_metric(m, m.dimensions, registry))
        for m in self.spec.model:
            if m.name == "PredictionTime":
                self._metrics[m.name] = (m, make_metric(m, (*m.dimensions, "Hostname"), registry))
        self._calls: dict[tuple[str, str, str], tuple[Any, Any, Any]] = {}
        self._pending: dict[tuple[str, str, str], list[Any]] = {}  # calls not yet written: [n, seconds]
        self._flush_scheduled = False
        self._batches: dict[tuple[str, str], tuple[Any, ...]] = {}

    def _child(self, name: str, known: Mapping[str, str]) -> Any:
        entry = self._metrics.get(name)
        if entry is None:
            return None
        spec, metric = entry
        dims = spec.dimensions if name != "PredictionTime" else (*spec.dimensions, "Hostname")
        return metric.labels(*label_values(dims, known))

    def _known(self, model: str, version: str) -> dict[str, str]:
        return {
            "Level": "Host",
            "Hostname": HOSTNAME,
            "hostname": HOSTNAME,
            "model_name": model,
            "model_version": version,
            "ModelName": model,
        }

    def record_call(self, model: str, version: str, code: str, seconds: float) -> None:
        """One answered inference call: Requests<N>XX always; the per-model counters when the
        model is served (TorchServe counts latency for answered requests only).

        On the hot path, so calls are summed in a dict and written to the Prometheus values once
        per event-loop turn (`flush`): in multiprocess mode each write is a locked mmap update,
        and a batch's requests finish in the same turn. Without a running loop, written at once.
        """
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

    def record_batch(self, model: str, version: str, queue_waits: Sequence[float]) -> None:
        """A batch left the queue: its requests' waits (QueueTime keeps the last, in ms)."""
        key = (model, version)
        children = self._batches.get(key)
        if children is None:
            known = self._known(model, version)
            children = (self._child("ts_queue_latency_microseconds", known), self._child("QueueTime", known))
            self._batches[key] = children
        total, last = children
        if queue_waits:
            if total is not None:
                total.inc(sum(queue_waits) * 1e6)
            if last is not None:
                last.set(round(queue_waits[-1] * 1000.0, 3))

    def record_compute(self, model: str, version: str, seconds: float) -> None:
        """A batch's handler time as the frontend measured it (TorchServe's PredictionTime and
        WorkerThreadTime are both per-batch times in ms)."""
        known = {**self._known(model, version), "Level": "Model"}
        child = self._child("PredictionTime", known)
        if child is not None:
            child.set(round(seconds * 1000.0, 2))

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
    """TorchServe's host metrics, sampled when /metrics is scraped (TorchServe samples them once
    a minute in a subprocess). GPU metrics stay declared without samples: the supervisor that
    serves /metrics never touches CUDA (see TRAPS.md), and Mariner's own per-device
    mariner_gpu_memory_allocated_bytes comes from the workers that use the GPU."""

    def __init__(self, spec: TsMetricsSpec, disk_path: str = "/") -> None:
        self.spec = spec
        self.disk_path = disk_path

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily

        values = _host_values(self.disk_path)
        for m in self.spec.frontend:
            if m.name not in values:
                continue
            family = GaugeMetricFamily(m.name, m.help, labels=m.dimensions)
            family.add_metric(label_values(m.dimensions, {"Level": "Host", "Hostname": HOSTNAME}),
                              values[m.name])  # fmt: skip
            yield family


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
    """A model worker process's load time as TorchServe's WorkerLoadTime (ms), written to the
    multiprocess files the supervisor's /metrics merges; nothing without multiprocess mode."""
    if not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        return
    spec = current_spec().frontend_metric("WorkerLoadTime")
    if spec is None:
        return
    gauge = make_metric(spec, spec.dimensions, None)
    known = {"Level": "Host", "Hostname": HOSTNAME, "hostname": HOSTNAME, "WorkerName": worker}
    gauge.labels(*label_values(spec.dimensions, known)).set(round(seconds * 1000.0))
