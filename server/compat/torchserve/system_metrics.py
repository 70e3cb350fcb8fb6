"""TorchServe's system metrics (CPUUtilization, MemoryUsed, DiskUsage...): the host's numbers,
sampled when /metrics is scraped in prometheus mode (`SystemMetrics`) or written as TorchServe's
lines to ts_metrics.log every metric_time_interval in the log modes (`log_system_metrics`).

Apart from `frontend_metrics`: these are the supervisor's (its /metrics and its log timer), read
from the host (psutil), not from any call.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

from mariner.server.common.metrics_spec import (
    HOSTNAME,
    TsMetricsSpec,
    label_values,
    metrics_mode,
    system_metrics_disabled,
)
from mariner.server.compat.torchserve.logs import emit as ts_emit
from mariner.server.compat.torchserve.logs.lines import metric_message
from mariner.server.compat.torchserve.logs.records import Kind
from mariner.server.compat.torchserve.logs.words import TS_METRICS

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
