"""Prometheus metrics, named as in DESIGN.md, on a registry of our own (not the global one).

Buckets are dense around the p99 SLO so the quantiles users alert on are resolved where it
matters. Label values come from a bounded set: model names and versions are those loaded
from the store, protocols and codes are enums; a client never mints a label value.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import CONTENT_TYPE_LATEST, choose_encoder

from mariner.server.common import metric_values  # noqa: F401 - before any metric is created
from mariner.server.common.deferred_metrics import (
    DeferredCounter,
    DeferredGauge,
    DeferredHistogram,
    FlushOnCollect,
)
from mariner.server.compat.torchserve import exposition as ts_exposition
from mariner.server.compat.torchserve import metrics as ts_metrics
from mariner.server.compat.torchserve.frontend_metrics import TsFrontendMetrics
from mariner.server.compat.torchserve.system_metrics import SystemMetrics

# prometheus_client's multiprocess mode: every process writes its samples to files in this dir,
# and the supervisor's /metrics merges them. It must be set before prometheus_client is imported.
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"

CONTENT_TYPE = CONTENT_TYPE_LATEST


def latency_buckets(slo_s: float) -> tuple[float, ...]:
    """Geometric buckets from 50 us to 10 s, plus a dense band from SLO/4 to 2xSLO."""
    base = [5e-5 * 2**k for k in range(18)]  # 50 us .. ~6.5 s
    dense = [slo_s * f for f in (0.25, 0.375, 0.5, 0.625, 0.75, 0.875, 1.0, 1.25, 1.5, 2.0)]
    return tuple(sorted({round(b, 7) for b in [*base, *dense, 10.0]}))


BATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 256, 512)
# Padded tokens per batch (rows x longest row): a 256-token text alone up to a large budget.
TOKEN_BUCKETS = (64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536)


@dataclass(frozen=True)
class MetricsConfig:
    slo_seconds: float = 0.025


class Metrics:
    """All server metrics. One instance per server; tests make their own."""

    def __init__(self, cfg: MetricsConfig | None = None) -> None:
        cfg = cfg or MetricsConfig()
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(FlushOnCollect())  # first: pending writes land before any read
        lat = latency_buckets(cfg.slo_seconds)
        labels = ("model", "version")
        self.request_duration = Histogram(
            "mariner_request_duration_seconds",
            "Time from request arrival to answer, per model version and protocol.",
            (*labels, "protocol"),
            buckets=lat,
            registry=self.registry,
        )
        self.queue_duration = Histogram(
            "mariner_queue_duration_seconds",
            "Time a request waited in the batcher queue before its batch started.",
            labels,
            buckets=lat,
            registry=self.registry,
        )
        self.compute_duration = Histogram(
            "mariner_compute_duration_seconds",
            "Time the handler took for one batch (preprocess + inference + postprocess).",
            labels,
            buckets=lat,
            registry=self.registry,
        )
        self.batch_size = Histogram(
            "mariner_batch_size",
            "Items per batch handed to the handler.",
            labels,
            buckets=BATCH_BUCKETS,
            registry=self.registry,
        )
        self.batch_tokens = Histogram(
            "mariner_batch_tokens",
            "Tokens per batch of a model with a tokenCounter: kind=padded is rows x longest row "
            "(what the model computes), kind=unpadded each request padded only to its own longest.",
            (*labels, "kind"),
            buckets=TOKEN_BUCKETS,
            registry=self.registry,
        )
        self.queue_depth = Gauge(
            "mariner_queue_depth",
            "Items waiting to run: in the batcher queue, or sent to a busy worker and not yet started.",
            labels,
            multiprocess_mode="livesum",
            registry=self.registry,
        )
        self.requests = Counter(
            "mariner_requests",
            "Requests answered, by model version, protocol and result code.",
            (*labels, "protocol", "code"),
            registry=self.registry,
        )
        self.model_load_seconds = Gauge(
            "mariner_model_load_seconds",
            "Seconds the last load of this model version took (unpack + initialize + warm-up).",
            labels,
            multiprocess_mode="mostrecent",
            registry=self.registry,
        )
        self.model_ready = Gauge(
            "mariner_model_ready",
            "1 when the model version has at least one ready instance.",
            labels,
            multiprocess_mode="livemax",
            registry=self.registry,
        )
        self.instance_restarts = Counter(
            "mariner_instance_restarts",
            "Model instances replaced after their handler hung or ended the instance.",
            (*labels, "reason"),
            registry=self.registry,
        )
        self.oom_splits = Counter(
            "mariner_oom_batch_splits",
            "Batches split in halves and retried after running out of memory.",
            labels,
            registry=self.registry,
        )
        self.gpu_memory_bytes = gpu_memory_gauge(self.registry)
        # TorchServe's names beside ours (see ts_metrics), fed from the same measurements.
        self.ts = TsFrontendMetrics(self.registry)
        self._call_children: dict[tuple[str, str, str, str], tuple[Any, Any]] = {}

    def call_children(self, model: str, version: str, protocol: str, code: str) -> tuple[Any, Any]:
        """The `mariner_requests_total` and `mariner_request_duration_seconds` children of one
        label set, looked up once: `labels()` takes a lock and builds a key on every call, and
        the call path records every request. The label sets are bounded (see the module doc),
        so the cache is too."""
        key = (model, version, protocol, code)
        children = self._call_children.get(key)
        if children is None:
            children = (
                DeferredCounter(self.requests.labels(model, version, protocol, code)),
                DeferredHistogram(self.request_duration.labels(model, version, protocol)),
            )
            self._call_children[key] = children
        return children

    @staticmethod
    def defer(child: Any) -> Any:
        """`child` (a labelled counter, gauge or histogram) with its writes made once per
        event-loop turn (see `common.deferred_metrics`): for the children the hot path feeds."""
        if isinstance(child, Histogram):
            return DeferredHistogram(child)
        if isinstance(child, Gauge):
            return DeferredGauge(child)
        if isinstance(child, Counter):
            return DeferredCounter(child)
        raise TypeError(f"cannot defer the writes of {type(child).__name__}")

    def exposition(self, accept: str | None = None, names: Sequence[str] = ()) -> tuple[bytes, str]:
        """This process's samples, handler metrics and host metrics included, in the format
        `accept` asks for (OpenMetrics or Prometheus text), restricted to `names` if any."""
        self._sample_gpu()
        self.ts.flush()  # (our own pending writes flush when the registry is collected)
        from mariner.server.common.handler_metrics import handler_registry

        spec = self.ts.spec
        families = [*self.registry.collect(), *handler_registry().collect()]
        families.extend(SystemMetrics(spec).collect())
        return encode(families, spec, accept, names)

    def _sample_gpu(self) -> None:
        # Only a process that already uses CUDA samples;
        # `is_initialized` never initialises CUDA, `is_available` may (see supervisor.devices).
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_initialized():
            for i in range(torch.cuda.device_count()):
                self.gpu_memory_bytes.labels(f"cuda:{i}").set(torch.cuda.memory_allocated(i))


GPU_MEMORY_METRIC = "mariner_gpu_memory_allocated_bytes"


def gpu_memory_gauge(registry: CollectorRegistry | None) -> Gauge:
    """torch.cuda.memory_allocated per device. In multiprocess mode each worker process writes its
    own allocation and /metrics sums the live processes per device (`livesum`): several workers
    sharing a GPU add up, a dead worker's value goes with it (`mark_process_dead`)."""
    return Gauge(
        GPU_MEMORY_METRIC,
        "torch.cuda.memory_allocated per device (only when CUDA is in use).",
        ("device",),
        multiprocess_mode="livesum",
        registry=registry,
    )


class WorkerGpuGauge:
    """A model worker's own GPU memory sample, written after each batch (and at load) when the
    worker runs on a GPU and the server merges metrics over processes; a no-op otherwise."""

    def __init__(self, gpu_id: int | None) -> None:
        self._gpu_id = gpu_id
        self._child: Any = None
        if gpu_id is not None and multiprocess_enabled():
            self._child = gpu_memory_gauge(None).labels(f"cuda:{gpu_id}")
        self.sample()

    def sample(self) -> None:
        if self._child is None:
            return
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_initialized():
            self._child.set(torch.cuda.memory_allocated(self._gpu_id))


def multiprocess_enabled() -> bool:
    return bool(os.environ.get(MULTIPROC_ENV))


def encode(families: list[Any], spec: ts_metrics.TsMetricsSpec, accept: str | None,
           names: Sequence[str]) -> tuple[bytes, str]:  # fmt: skip
    """Families in the negotiated format, TorchServe's names restored (see ts_metrics.expose)."""
    encoder, content_type = choose_encoder(accept or "")
    openmetrics = content_type.startswith("application/openmetrics-text")
    exposed = ts_exposition.expose(families, spec, openmetrics=openmetrics, names=names)
    if openmetrics:
        return encoder(ts_exposition.Families(exposed)), content_type
    return ts_exposition.text_exposition(exposed), content_type


def exposition_multiprocess(accept: str | None = None, names: Sequence[str] = ()) -> tuple[bytes, str]:
    """Every process's samples merged (the supervisor's /metrics), in the negotiated format,
    restricted to `names` if any: counters and histograms are summed over processes, gauges as
    their `multiprocess_mode` says (queue depth summed over the live frontends, model readiness
    the max over live frontends). The host metrics are sampled here, by the process that serves
    /metrics."""
    from prometheus_client import multiprocess

    spec = ts_metrics.current_spec()
    families = list(multiprocess.MultiProcessCollector(None).collect())
    families.extend(SystemMetrics(spec).collect())
    return encode(families, spec, accept, names)


class MultiprocessMetrics:
    """What the /metrics app needs (`exposition`) over every process's samples."""

    def exposition(self, accept: str | None = None, names: Sequence[str] = ()) -> tuple[bytes, str]:
        return exposition_multiprocess(accept, names)
