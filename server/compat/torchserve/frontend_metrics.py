"""TorchServe's frontend metrics (`ts_metrics` of its metrics.yaml: ts_inference_requests_total,
Requests2XX, QueueTime, PredictionTime...), fed from the measurements a Mariner frontend already
takes: on /metrics (the names the metrics mode serves there) and as TorchServe's log lines (the
others). The modes and the internal `<name>:ts` counter names are `metrics`' docstring.

Apart from `metrics` and `system_metrics` because only a frontend process runs this, on its hot
path (calls summed per event-loop turn, log lines made once per label set).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping, Sequence
from typing import Any

from mariner.server.common.metrics_spec import (
    HOSTNAME,
    MetricSpec,
    TsMetricsSpec,
    current_spec,
    label_values,
    make_metric,
    metrics_mode,
    model_metrics_auto_detect,
    on_prometheus,
)
from mariner.server.compat.torchserve.logs import emit as ts_emit
from mariner.server.compat.torchserve.logs.lines import java_double, metric_parts
from mariner.server.compat.torchserve.logs.records import Kind
from mariner.server.compat.torchserve.logs.words import MODEL_METRICS, TS_METRICS
from mariner.server.compat.torchserve.system_metrics import SYSTEM_METRICS

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
