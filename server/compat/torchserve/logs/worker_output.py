"""A model worker's stdout and stderr, as TorchServe's frontend logs them.

TorchServe reads each backend worker's stdout and stderr line by line (its `WorkerLifeCycle`
reader threads, named `W-<port>-<model>_<version>-stdout` / `-stderr`) and logs every line to
`MODEL_LOG` (INFO for stdout, WARN for stderr): handler `print()`s, the backend's log and
tracebacks land in model_log.log, ts_log.log and the console. A line starting with `[METRICS]`
is a handler metric instead: parsed, kept when metrics.yaml declares it (or, with
`model_metrics_auto_detect`, whatever it is) and written to model_metrics.log, in the log
metrics modes; dropped otherwise, as TorchServe drops it.
"""

from __future__ import annotations

from collections.abc import Callable

from mariner.server.common.metrics_spec import TsMetricsSpec
from mariner.server.compat.torchserve.logs.emit import emit
from mariner.server.compat.torchserve.logs.lines import METRICS_PREFIX, model_metric_message, parse_backend_metric
from mariner.server.compat.torchserve.logs.pump import LineReader, OutputPump
from mariner.server.compat.torchserve.logs.records import Kind
from mariner.server.compat.torchserve.logs.words import MODEL_LOG, MODEL_METRICS

LOG_MODES = frozenset({"log", "legacy"})  # the modes in which handler metrics go to model_metrics.log


class BackendMetrics:
    """Which `[METRICS]` lines become model_metrics.log lines, and how they read there."""

    def __init__(self, spec: TsMetricsSpec, mode: str, auto_detect: bool) -> None:
        self.logged = mode in LOG_MODES
        self.auto_detect = auto_detect
        # Declared model metrics carry the Hostname dimension last, as TorchServe adds it.
        self._declared = {m.name: (m.unit, (*m.dimensions, "Hostname")) for m in spec.model}
        self._detected: dict[str, tuple[str, tuple[str, ...]]] = {}

    def message(self, text: str) -> str | None:
        """The model_metrics.log message for one `[METRICS]` line's text, or None (dropped)."""
        if not self.logged:
            return None
        metric = parse_backend_metric(text)
        if metric is None:
            return None
        known = self._declared.get(metric.name) or self._detected.get(metric.name)
        if known is None:
            if not self.auto_detect:
                return None
            known = (metric.unit, (*(name for name, _ in metric.dimensions), "Hostname"))
            if len(self._detected) < 1000:  # a handler inventing names cannot grow this forever
                self._detected[metric.name] = known
        unit, names = known
        return model_metric_message(metric, unit, names)


class WorkerOutput:
    """Hands each worker's stdout and stderr pipes to the pump, with TorchServe's reading of
    them (see the module)."""

    def __init__(self, pump: OutputPump, metrics: BackendMetrics) -> None:
        self.pump = pump
        self.metrics = metrics

    def attach(self, worker: str, stdout_fd: int, stderr_fd: int) -> None:
        """Read `stdout_fd` and `stderr_fd` (read ends; owned from now on) of the worker TorchServe
        would call `worker` (`W-9000-mnist_1.0`)."""
        for fd, stream, level in ((stdout_fd, "stdout", "INFO"), (stderr_fd, "stderr", "WARN")):
            thread = f"{worker}-{stream}"
            self.pump.add(fd, LineReader(self._on_line(thread, level), on_dropped=self._on_dropped(thread)))

    def _on_line(self, thread: str, level: str) -> Callable[[str], None]:
        metrics = self.metrics

        def on_line(line: str) -> None:
            if line.startswith(METRICS_PREFIX):
                message = metrics.message(line[len(METRICS_PREFIX) :])
                if message is not None:
                    emit(Kind.MODEL_METRICS, "INFO", thread, MODEL_METRICS, message)
                return
            emit(Kind.MODEL_LOG, level, thread, MODEL_LOG, line)

        return on_line

    @staticmethod
    def _on_dropped(thread: str) -> Callable[[int], None]:
        def on_dropped(count: int) -> None:
            why = f"[mariner] {count} lines of this worker's output dropped: over the rate it may write"
            emit(Kind.MODEL_LOG, "WARN", thread, MODEL_LOG, why)

        return on_dropped
