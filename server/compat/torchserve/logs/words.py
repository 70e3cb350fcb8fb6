"""TorchServe's own sentences about its workers, on its console and in ts_log.log.

Operators' alerts, TorchServe's launcher and its tests wait for these exact words (its
`WorkerThread`, `WorkerLifeCycle` and `ModelServer`), so Mariner says them where the same thing
happens: a worker that does not answer within its startup or response timeout ("Backend worker
error" and, on the next line, the `WorkerInitializationException`), the count of consecutive
timed-out inferences, a worker gone ("Worker disconnected"), the recovery clock ("Auto recovery
start timestamp", "Auto recovery failed again", "Auto recovery succeeded, reset
recoveryStartTS"), the retry ("Retry worker: 9000 in 1 seconds."). Mariner's JSON log says the
same facts in its own words.

A worker is named as TorchServe names its thread: `W-<port>-<model>_<version>`. Mariner's
workers listen on Unix sockets, so the "port" is TorchServe's number for the worker slot
(counted from 9000, TorchServe's initial_worker_port), kept across the slot's restarts as
TorchServe keeps a worker thread's.
"""

from __future__ import annotations

import time

from mariner.server.compat.torchserve.logs.emit import emit, enabled
from mariner.server.compat.torchserve.logs.records import Kind

WORKER_THREAD = "org.pytorch.serve.wlm.WorkerThread"
MODEL_LOG = "MODEL_LOG"
ACCESS_LOG = "ACCESS_LOG"
TS_METRICS = "TS_METRICS"
MODEL_METRICS = "MODEL_METRICS"
FIRST_WORKER_PORT = 9000  # TorchServe's initial_worker_port
SERVER_STARTED = "Model server started."
WORKER_TIMEOUT = (
    "Backend worker error\n"
    "org.pytorch.serve.wlm.WorkerInitializationException: Backend worker did not respond in given time"
)


def worker_name(port: int, model: str, version: str) -> str:
    """TorchServe's worker thread name: `W-9000-mnist_1.0`."""
    return f"W-{port}-{model}_{version}"


def server_started() -> None:
    """TorchServe's bare console line once it serves (`System.out.println`, not a log line)."""
    emit(Kind.CONSOLE, "INFO", "main", "", SERVER_STARTED)


def worker_timed_out(worker: str, failures: int) -> None:
    """A worker did not answer within its startup or response timeout: the count of consecutive
    unanswered calls, then the exception TorchServe logs with "Backend worker error" (one record,
    so the exception is always the very next line)."""
    if not enabled():
        return
    emit(Kind.TS, "ERROR", worker, WORKER_THREAD, f"Number or consecutive unsuccessful inference {failures}")
    emit(Kind.TS, "ERROR", worker, WORKER_THREAD, WORKER_TIMEOUT)


class Recovery:
    """One worker slot's recovery clock and retry lines, as TorchServe's WorkerThread keeps them:
    the time of the first failure since the worker last loaded, reset when it loads again."""

    def __init__(self, port: int, model: str, version: str) -> None:
        self.port = port
        self.thread = worker_name(port, model, version)
        self.started_ms = 0  # TorchServe's recoveryStartTS: 0 while healthy

    def _say(self, level: str, message: str) -> None:
        emit(Kind.TS, level, self.thread, WORKER_THREAD, message)

    def stopped(self, state: str) -> None:
        """The worker process is gone (`state`: what it was doing, TorchServe's state name)."""
        self._say("INFO", f"{self.port} Worker disconnected. {state}")
        if self.started_ms == 0:
            self.started_ms = int(time.time() * 1000)
            self._say("INFO", f"Auto recovery start timestamp: {self.started_ms}")
        else:
            self._say("WARN", "Auto recovery failed again")

    def retry(self, delay_s: float) -> None:
        self._say("INFO", f"Retry worker: {self.port} in {delay_s:g} seconds.")

    def loaded(self) -> None:
        if self.started_ms:
            self._say("INFO", "Auto recovery succeeded, reset recoveryStartTS")
            self.started_ms = 0

    def failing_for_s(self) -> float:
        """Seconds since the first failure of this recovery (0 while healthy)."""
        return time.time() - self.started_ms / 1000 if self.started_ms else 0.0
