"""`context.metrics` for handlers: TorchServe's metrics API, without the `ts` package.

A TorchServe handler records its own metrics through `context.metrics` (`add_counter`,
`add_time`, `add_size`, `add_percent`, `add_metric`, and the newer `add_metric_to_cache` /
`get_metric(...).add_or_update(value, dimension_values)`). TorchServe's backend prints each
update as a `[METRICS]` line on its stdout and its frontend either logs it to model_metrics.log
(metrics_mode `log`, its default, and `legacy`) or turns it into a Prometheus metric labelled by
the metric's dimension names plus `Hostname` (`prometheus`). Here, in the log modes, the worker
prints the same line (the supervisor reads its stdout and writes model_metrics.log); in
prometheus mode the update goes to a prometheus_client metric directly: in a worker process it
is written to the multiprocess files and appears in the supervisor's merged /metrics; in a
single process it lives in `handler_registry()`, which `Metrics` renders.

A metric the metrics.yaml does not declare is dropped, as TorchServe drops it, unless
`model_metrics_auto_detect` is on.

A bad call (wrong number of dimension values, a negative counter increment, a name Prometheus
cannot carry) is logged and dropped, as TorchServe does: a metric never fails an inference.
"""

from __future__ import annotations

import enum
import logging
import re
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from mariner.server.common.metrics_spec import (
    HOSTNAME,
    MetricSpec,
    TsMetricsSpec,
    backend_metric_line,
    current_spec,
    make_metric,
    metrics_mode,
    model_metrics_auto_detect,
)

log = logging.getLogger("mariner.handler_metrics")

_registry: Any = None
_lock = threading.RLock()


def handler_registry() -> Any:
    """The process-wide registry of handler metrics (created on first use)."""
    global _registry
    with _lock:
        if _registry is None:
            from prometheus_client import CollectorRegistry

            _registry = CollectorRegistry(auto_describe=True)
        return _registry


class MetricTypes(enum.Enum):
    """TorchServe's `ts.metrics.metric_type_enum.MetricTypes`; theirs is accepted too."""

    COUNTER = "counter"
    GAUGE = "gauge"
    HISTOGRAM = "histogram"


class Dimension:
    """TorchServe's `ts.metrics.dimension.Dimension`: a (name, value) pair."""

    def __init__(self, name: str, value: str) -> None:
        self.name = name
        self.value = value

    def __str__(self) -> str:
        return f"{self.name}:{self.value}"

    def to_dict(self) -> dict[str, str]:
        return {"Name": self.name, "Value": self.value}


class MetricsCacheKeyError(KeyError):
    """get_metric on a metric that was never declared nor added (TorchServe's error name)."""


_UNITS = {"ms": "Milliseconds", "s": "Seconds", "percent": "Percent", "count": "Count",
          "MB": "Megabytes", "GB": "Gigabytes", "kB": "Kilobytes", "B": "Bytes"}  # fmt: skip


def _kind(metric_type: Any) -> str:
    value = getattr(metric_type, "value", metric_type)
    if value not in ("counter", "gauge", "histogram"):
        raise ValueError(f"metric_type must be a MetricTypes member, not {metric_type!r}")
    return str(value)


def _dimension(d: Any) -> tuple[str, str]:
    if isinstance(d, Mapping):
        return str(d["Name"]), str(d["Value"])
    if isinstance(d, tuple):
        return str(d[0]), str(d[1])
    return str(d.name), str(d.value)


def _prometheus_name(name: str) -> str:
    cleaned = re.sub(r"[^a-zA-Z0-9_]", "_", name)
    return cleaned if cleaned[:1].isalpha() or cleaned[:1] == "_" else f"_{cleaned}"


class HandlerMetric:
    """One metric as `get_metric` / `add_metric_to_cache` return it. `logged`: printed as
    TorchServe's backend prints it (the log metrics modes), else a prometheus_client metric."""

    def __init__(
        self, name: str, unit: str, dimension_names: Sequence[str], kind: str, *, logged: bool = False
    ) -> None:
        self.metric_name = name
        self.unit = unit
        self.dimension_names = list(dimension_names)
        self.metric_type = MetricTypes(kind)
        self._logged = logged
        self._unit_name = _UNITS.get(unit, unit)
        self._metric: Any = None
        if logged:
            return
        # Prometheus names are [a-zA-Z_][a-zA-Z0-9_]*: other characters become "_" (as the
        # exposition would escape them), so every format shows the same names.
        spec = MetricSpec(_prometheus_name(name), kind, self._unit_name, tuple(self.dimension_names))
        labels = (*(_prometheus_name(d) for d in self.dimension_names), "Hostname")
        self._metric = make_metric(spec, labels, handler_registry())

    def add_or_update(self, value: float, dimension_values: Sequence[str] = (), request_id: str = "") -> None:
        """Counters add `value`, gauges are set to it, histograms observe it."""
        values = [str(v) for v in dimension_values or ()]
        if len(values) != len(self.dimension_names):
            log.error("metric %s: dimension values %s do not match its dimensions %s; dropped",
                      self.metric_name, values, self.dimension_names)  # fmt: skip
            return
        if self.metric_type is MetricTypes.COUNTER and value < 0:
            log.error("metric %s: a counter cannot decrease (%s); dropped", self.metric_name, value)
            return
        if self._logged:
            dims = list(zip(self.dimension_names, values, strict=True))
            line = backend_metric_line(
                self.metric_name, self._unit_name, value, dims, self.metric_type.name, request_id
            )
            _print_line(line)
            return
        child = self._metric.labels(*values, HOSTNAME)
        if self.metric_type is MetricTypes.COUNTER:
            child.inc(value)
        elif self.metric_type is MetricTypes.GAUGE:
            child.set(value)
        else:
            child.observe(value)

    def update(self, value: float, request_id: str = "", dimensions: Sequence[Any] = ()) -> None:
        """TorchServe's older form: dimensions as Dimension objects, in the declared order."""
        self.add_or_update(value, [_dimension(d)[1] for d in dimensions], request_id)


class DroppedMetric:
    """What a handler gets for a metric that cannot be exposed (logged once): its updates are
    ignored, so the handler's code runs on as it does on TorchServe."""

    def __init__(self, name: str, dimension_names: list[str]) -> None:
        self.metric_name = name
        self.dimension_names = dimension_names

    def add_or_update(self, value: float, dimension_values: Sequence[str] = (), request_id: str = "") -> None:
        pass

    def update(self, value: float, request_id: str = "", dimensions: Sequence[Any] = ()) -> None:
        pass


class HandlerMetrics:
    """`context.metrics`: one per model instance; metrics are shared by name within a process."""

    def __init__(self, model_name: str, spec: TsMetricsSpec | None = None) -> None:
        self.model_name = model_name
        self.request_ids: Any = None
        self._spec = spec
        self._cache: dict[tuple[str, str], HandlerMetric | DroppedMetric] = {}
        self._declared = False

    def _declare(self) -> None:
        # The yaml's model_metrics exist before any handler writes them, as in TorchServe.
        self._declared = True
        for m in (self._spec or current_spec()).model:
            self._put(m.name, m.unit, m.dimensions, m.kind)

    def _put(self, name: str, unit: str, dims: Sequence[str], kind: str) -> HandlerMetric | DroppedMetric:
        spec = self._spec or current_spec()
        if spec.model_metric(name) is None and not model_metrics_auto_detect():
            # Not in metrics.yaml: TorchServe's frontend drops it (model_metrics_auto_detect off).
            metric: HandlerMetric | DroppedMetric = DroppedMetric(name, list(dims))
            self._cache[(kind, name)] = metric
            return metric
        try:
            metric = _shared(name, unit, tuple(dims), kind)
        except ValueError as exc:  # an invalid Prometheus name or a clash with another type
            log.error("metric %s (%s) cannot be exposed: %s; dropped", name, kind, exc)
            metric = DroppedMetric(name, list(dims))
        self._cache[(kind, name)] = metric
        return metric

    # -- the newer API ----------------------------------------------------------------------
    def add_metric_to_cache(
        self,
        metric_name: str,
        unit: str,
        dimension_names: Sequence[str] = (),
        metric_type: Any = MetricTypes.COUNTER,
    ) -> HandlerMetric | DroppedMetric:
        if not self._declared:
            self._declare()
        return self._put(
            str(metric_name), str(unit), [str(d) for d in dimension_names or ()], _kind(metric_type)
        )

    def get_metric(
        self, metric_name: str, metric_type: Any = MetricTypes.COUNTER
    ) -> HandlerMetric | DroppedMetric:
        if not self._declared:
            self._declare()
        try:
            return self._cache[(_kind(metric_type), metric_name)]
        except KeyError:
            raise MetricsCacheKeyError(
                f"Metric of type '{_kind(metric_type)}' and name '{metric_name}' doesn't exist"
            ) from None

    # -- the classic API -------------------------------------------------------------------
    def add_metric(
        self,
        name: str,
        value: float,
        unit: str = "",
        idx: Any = None,
        dimensions: Sequence[Any] | None = None,
        metric_type: Any = MetricTypes.COUNTER,
    ) -> None:
        self._add(name, value, unit, dimensions, _kind(metric_type), model_level=True)

    def add_counter(
        self, name: str, value: float, idx: Any = None, dimensions: Sequence[Any] | None = None
    ) -> None:
        self._add(name, value, "count", dimensions, "counter", model_level=True)

    def add_time(
        self,
        name: str,
        value: float,
        idx: Any = None,
        unit: str = "ms",
        dimensions: Sequence[Any] | None = None,
        metric_type: Any = MetricTypes.GAUGE,
    ) -> None:
        if unit not in ("ms", "s"):
            raise ValueError("the unit for a timed metric should be one of ['ms', 's']")
        self._add(name, value, unit, dimensions, _kind(metric_type), model_level=True)

    def add_size(
        self,
        name: str,
        value: float,
        idx: Any = None,
        unit: str = "MB",
        dimensions: Sequence[Any] | None = None,
        metric_type: Any = MetricTypes.GAUGE,
    ) -> None:
        if unit not in ("MB", "kB", "GB", "B"):
            raise ValueError("The unit for size based metric is one of ['MB','kB', 'GB', 'B']")
        self._add(name, value, unit, dimensions, _kind(metric_type), model_level=True)

    def add_percent(
        self,
        name: str,
        value: float,
        idx: Any = None,
        dimensions: Sequence[Any] | None = None,
        metric_type: Any = MetricTypes.GAUGE,
    ) -> None:
        self._add(name, value, "percent", dimensions, _kind(metric_type), model_level=True)

    def add_error(self, name: str, value: float, dimensions: Sequence[Any] | None = None) -> None:
        self._add(name, value, "", dimensions, "counter", model_level=False)

    def _add(
        self,
        name: str,
        value: float,
        unit: str,
        dimensions: Sequence[Any] | None,
        kind: str,
        *,
        model_level: bool,
    ) -> None:
        """TorchServe adds ModelName and Level=Model (Level=Error for add_error) unless given."""
        dims = dict(_dimension(d) for d in dimensions or ())
        if model_level:
            dims.setdefault("ModelName", self.model_name)
            dims.setdefault("Level", "Model")
        else:
            dims.setdefault("Level", "Error")
        if not self._declared:
            self._declare()
        metric = self._cache.get((kind, name))
        if metric is None or metric.dimension_names != list(dims):
            metric = self._put(name, unit, list(dims), kind)
        metric.add_or_update(value, [dims[n] for n in metric.dimension_names])


_shared_metrics: dict[tuple[str, str, bool], HandlerMetric] = {}


def _shared(name: str, unit: str, dims: tuple[str, ...], kind: str) -> HandlerMetric:
    """One metric per name and type in a process (instances of one model, or a re-declared
    metric, share it); a re-declaration with other dimensions is refused. Printed or Prometheus
    as the metrics mode says (one mode per server; a process that changes it gets new ones)."""
    logged = metrics_mode() != "prometheus"
    with _lock:
        existing = _shared_metrics.get((kind, name, logged))
        if existing is not None:
            if tuple(existing.dimension_names) != dims:
                raise ValueError(f"already declared with dimensions {existing.dimension_names}")
            return existing
        metric = HandlerMetric(name, unit, dims, kind, logged=logged)
        _shared_metrics[(kind, name, logged)] = metric
        return metric


def _print_line(line: str) -> None:
    """A `[METRICS]` line on the worker's own stdout (whatever the handler did to sys.stdout),
    where the supervisor reads it."""
    import sys

    out = sys.__stdout__
    if out is None:
        return
    try:
        out.write(line + "\n")
        out.flush()
    except (OSError, ValueError):
        pass  # no stdout to write to: the metric is lost, never the inference
