"""Where TorchServe's log files live, as its log4j2 configuration reads it.

TorchServe 0.12 writes `ts_log.log`, `model_log.log` and `access_log.log` under
`${env:LOG_LOCATION:-logs}` and `ts_metrics.log`, `model_metrics.log` under
`${env:METRICS_LOCATION:-logs}`, relative to the server's working directory; its config snapshots
go to `config/` under the non-metrics log directory. Log shippers, scripts and TorchServe's own
tests look there, so every module that writes one of those files asks this one (the log writer,
the config snapshots).

A location that cannot be created or written to does not stop the server: the files simply do
not appear there (`usable_dir` answers None), as with TorchServe.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

LOG_LOCATION_ENV = "LOG_LOCATION"
METRICS_LOCATION_ENV = "METRICS_LOCATION"
DEFAULT_DIR = "logs"
SNAPSHOT_SUBDIR = "config"


def _location(env: Mapping[str, str] | None, name: str) -> Path:
    value = (os.environ if env is None else env).get(name, "")
    return Path(value) if value else Path(DEFAULT_DIR)


def log_dir(env: Mapping[str, str] | None = None) -> Path:
    """The directory of ts_log.log, model_log.log and access_log.log: `$LOG_LOCATION`, else
    `logs` (relative paths are relative to the working directory, as in TorchServe)."""
    return _location(env, LOG_LOCATION_ENV)


def metrics_dir(env: Mapping[str, str] | None = None) -> Path:
    """The directory of ts_metrics.log and model_metrics.log: `$METRICS_LOCATION`, else `logs`."""
    return _location(env, METRICS_LOCATION_ENV)


def snapshot_dir(env: Mapping[str, str] | None = None) -> Path:
    """Where TorchServe's config snapshots go (`*-startup.cfg`, `*-snapshot.cfg`,
    `*-shutdown.cfg`): `config` under the non-metrics log directory."""
    return log_dir(env) / SNAPSHOT_SUBDIR


def usable_dir(path: Path) -> Path | None:
    """`path`, created (with its parents) if missing, when this process can write files in it;
    None when it cannot be created or written to (a read-only location): the caller then writes
    nothing there and the server goes on."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError:
        return None
    if not path.is_dir() or not os.access(path, os.W_OK | os.X_OK):
        return None
    return path
