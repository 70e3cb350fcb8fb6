"""TorchServe's log files and console for one `mariner serve` (see `server/ts_logging`).

The supervisor is their one writer: it starts the writer (`LogSink`) and the reader of its
children's pipes (`OutputPump`) before any child, points this process's records at the writer,
gives every worker's stdout/stderr and every frontend's record pipe to the reader, samples the
host metrics into ts_metrics.log in the log metrics modes (at start and every
`metric_time_interval` seconds, as TorchServe's MetricCollector), prints TorchServe's
"Model server started." when it serves, and flushes everything at the very end of shutdown.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os

from mariner.server.common.config import ServerConfig
from mariner.server.common.metrics_spec import model_metrics_auto_detect, system_metrics_disabled
from mariner.server.compat.torchserve.logs import emit, words
from mariner.server.compat.torchserve.logs.pump import LineReader, OutputPump
from mariner.server.compat.torchserve.logs.records import MAX_RECORD_LINE, decode, widen_pipe
from mariner.server.compat.torchserve.logs.sink import LogSettings, LogSink
from mariner.server.compat.torchserve.logs.worker_output import LOG_MODES, BackendMetrics, WorkerOutput
from mariner.server.compat.torchserve.metrics import current_spec, metrics_mode
from mariner.server.compat.torchserve.system_metrics import log_system_metrics

log = logging.getLogger("mariner.logs")


class TsLogs:
    """TorchServe's logs of this server: start, hand out pipes, close."""

    def __init__(self, cfg: ServerConfig) -> None:
        self.cfg = cfg
        self.settings = LogSettings.from_env(
            max_bytes=cfg.ts_log_max_bytes,
            backups=cfg.ts_log_backups,
            console=cfg.ts_console,
            async_logging=cfg.async_logging,
            files=cfg.ts_log_files,
        )
        self.sink = LogSink(self.settings)
        self.pump: OutputPump | None = None
        self.workers: WorkerOutput | None = None
        self._handler = emit.ServerRecords("supervisor")
        self._system: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Create the files, start writing and reading; from now on this process's log records
        also go to ts_log.log."""
        self.sink.start()
        emit.set_target(self.sink.put_fields)
        logging.getLogger().addHandler(self._handler)
        self.pump = OutputPump()
        metrics = BackendMetrics(current_spec(), metrics_mode(), model_metrics_auto_detect())
        self.workers = WorkerOutput(self.pump, metrics)
        if metrics_mode() in LOG_MODES and not system_metrics_disabled():
            self._system = asyncio.get_running_loop().create_task(self._sample_host(), name="system-metrics")

    def attach(self, worker: str, stdout_fd: int, stderr_fd: int) -> None:
        """A worker's stdout and stderr (read ends), read as TorchServe's MODEL_LOG from now on;
        closed at once (the worker then writes into a closed pipe) if the logs were not started."""
        if self.workers is None:
            for fd in (stdout_fd, stderr_fd):
                os.close(fd)
            return
        self.workers.attach(worker, stdout_fd, stderr_fd)

    def frontend_pipe(self) -> int:
        """A new record pipe for a frontend: returns the write end (the frontend's to inherit;
        the caller closes its copy once the frontend started), the read end is read from now on."""
        assert self.pump is not None, "start() first"
        read_fd, write_fd = os.pipe2(os.O_CLOEXEC)
        widen_pipe(write_fd)
        self.pump.add(read_fd, LineReader(self._record, max_line=MAX_RECORD_LINE, rate=None))
        return write_fd

    def _record(self, line: str) -> None:
        record = decode(line)
        if record is not None:
            self.sink.put(record)

    def server_started(self) -> None:
        """TorchServe's "Model server started." on the console."""
        words.server_started()

    async def _sample_host(self) -> None:
        spec = current_spec()
        while True:
            try:
                await asyncio.to_thread(log_system_metrics, spec)
            except Exception:  # noqa: BLE001 - a failed sample is skipped, the next one is taken
                log.exception("sampling the host metrics failed")
            await asyncio.sleep(self.cfg.metric_time_interval)

    async def close(self) -> None:
        """Stop sampling, read what the children left in their pipes, write and close the files."""
        if self._system is not None:
            self._system.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._system
        if self.pump is not None:
            await asyncio.to_thread(self.pump.close)
        logging.getLogger().removeHandler(self._handler)
        emit.set_target(None)
        await asyncio.to_thread(self.sink.close)
