"""One-off measurements behind design decisions, kept runnable so their figures can be reproduced.

Each module's result, with the command that produced it, lives in docs/benchmark.md (or
bench/http-servers.md): the per-call pieces (`percall`) and what TorchServe's log files cost
(`ts_logs_cost`), a worker's own overhead (`worker_overhead`), process starts under load
(`child_starts`), start-up against stock TorchServe (`startup`, `make bench-startup`), the HTTP
server evaluation (`http_servers`, `http_servers_bench`, `http_server_limits`), an OIP server
that answers at once (`instant_oip`), two builds served side by side (`ab_live`), the frontend
compiled (`compiled_frontend`) and what the kernel does per request: context switches,
migrations, pinning (`sched_counts`). None is part of the product's tools (the benchmark, the
servers it starts, the gate and the GPU checklist are `mariner.loadtest`); their tests run apart
from `make test` (`make test-experiments`, which CI also runs).
"""
