"""TorchServe's log files and console, as its log4j2 configuration writes them.

TorchServe 0.12 writes five files (`ts_log.log`, `model_log.log`, `access_log.log` under
`$LOG_LOCATION`, `ts_metrics.log`, `model_metrics.log` under `$METRICS_LOCATION`, both `logs`
by default; see `server/compat/torchserve/logdirs.py`) and prints its log on stdout. Operators' log shippers,
scripts and launchers read them, so Mariner writes the same files with the same line formats:

- `lines`: the line formats (log4j's ISO8601 timestamp and patterns, the access line,
  TorchServe's metric lines, the backend's `[METRICS]` lines parsed).
- `files`: one size-bounded file with a bounded number of rotated ones.
- `sink`: the supervisor's one writer of every file and of the console (a thread fed by a
  bounded buffer: no event loop ever waits on a disk).
- `pump`: the supervisor's reader of its children's pipes (each worker's stdout and stderr,
  each frontend's record pipe), line and rate bounded.
- `records`: how a frontend hands its records (access lines, metric lines, TorchServe's
  lifecycle lines) to the supervisor, buffered and never blocking.
- `emit`: the process-wide entry every producer calls, whichever process it runs in.
- `words`: TorchServe's own sentences for its worker lifecycle (what its tests and operators wait
  for), and the thread names they carry.
"""
