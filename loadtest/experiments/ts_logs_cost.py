"""What TorchServe's log files cost a frontend per call: the access line and, in TorchServe's
default `log` metrics mode, its metric lines, against a frontend writing neither.

It drives the inference listener's real ASGI app for `/predictions` (as `percall` does: no
uvicorn, no socket, a runner that answers at once, 64 calls in flight) four ways, interleaved in
small blocks so a shared machine's drift falls on each alike:

- `none`: no TorchServe log records at all (metrics mode `prometheus`, no access line);
- `access`: the access line (`HttpAccessLog`) into a real record pipe, mode `prometheus`;
- `log mode`: the access line and the metric lines of TorchServe's `log` mode (its default);
- `legacy`: the access line, three Prometheus counters and the other metric lines.

The record pipe is drained by a thread, as the supervisor's reader would: the frontend's own CPU
(`time.process_time` of this process less that thread's) is what is counted.

    python -m mariner.loadtest.experiments.ts_logs_cost      # prints the table in microseconds per call
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import threading
import time
from collections.abc import Sequence
from typing import Any

from mariner.loadtest.experiments.percall import (
    CONCURRENCY,
    Piece,
    _drive,
    _http_scope,
    _plane,
    http_receiver,
    http_send,
    table,
)

MODES = (("none", "prometheus", False), ("access", "prometheus", True), ("log mode", "log", True),
         ("legacy", "legacy", True))  # fmt: skip


def _drain(fd: int, stop: threading.Event, spent: list[float]) -> None:
    """Read the record pipe as the supervisor does, timing this thread's own CPU."""
    t0 = time.thread_time()
    while not stop.is_set():
        try:
            if not os.read(fd, 1 << 16):
                break
        except BlockingIOError:
            time.sleep(0.001)
    spent.append(time.thread_time() - t0)


async def _interleaved(calls: int) -> dict[str, float]:
    from mariner.server.common.metrics_spec import METRICS_MODE_ENV
    from mariner.server.compat.torchserve.logs import emit
    from mariner.server.compat.torchserve.logs.access import HttpAccessLog
    from mariner.server.compat.torchserve.logs.records import RecordPipe
    from mariner.server.frontend.protocols.http_listener import inference_app

    read_fd, write_fd = os.pipe()
    os.set_blocking(read_fd, False)
    pipe = RecordPipe(write_fd)
    pipe.attach(asyncio.get_running_loop())
    apps: dict[str, Any] = {}
    for name, mode, logged in MODES:
        os.environ[METRICS_MODE_ENV] = mode  # read when each plane's metrics are built
        app = inference_app(_plane())
        apps[name] = (HttpAccessLog(app, "frontend-0") if logged else app, logged)

    stop = threading.Event()
    drained: list[float] = []
    reader = threading.Thread(target=_drain, args=(read_fd, stop, drained), daemon=True)
    reader.start()
    spent = dict.fromkeys(apps, 0.0)
    block = CONCURRENCY * 20
    rounds = max(1, calls // block)
    for _ in range(rounds):
        for name, (app, logged) in apps.items():
            emit.set_target(pipe.put_fields if logged else None)

            async def call(i: int, app: Any = app) -> None:
                await app(_http_scope("/predictions/digits"), http_receiver(), http_send)

            t0 = time.process_time()
            await _drive(call, block)
            await asyncio.sleep(0)  # the pipe's write of this block's last turn
            spent[name] += time.process_time() - t0
    emit.set_target(None)
    stop.set()
    reader.join()
    pipe.close()
    os.close(read_fd)
    n = rounds * block
    # The reader thread's CPU fell on the logged ways alone: take it off them in proportion.
    logged_cpu = sum(v for k, v in spent.items() if k != "none")
    reader_cpu = drained[0] if drained else 0.0
    out = {}
    for name, cpu in spent.items():
        share = reader_cpu * cpu / logged_cpu if name != "none" and logged_cpu else 0.0
        out[name] = (cpu - share) / n * 1e6
    return out


def pieces(calls: int, rounds: int) -> list[Piece]:
    from mariner.server.common import event_loop

    event_loop.run(_interleaved(calls // 4))  # warm-up
    best = [event_loop.run(_interleaved(calls)) for _ in range(rounds)]
    per = {name: min(r[name] for r in best) for name, _, _ in MODES}
    base = per["none"]
    return [
        Piece("HTTP /predictions, no TorchServe log records", base, "metrics mode prometheus"),
        Piece("  + the access line", per["access"] - base, "one record, buffered"),
        Piece(
            "  + access and metric lines (log mode, TorchServe's default)",
            per["log mode"] - base,
            "7 records per call",
        ),  # fmt: skip
        Piece("  + access and metric lines (legacy mode)", per["legacy"] - base, "5 records + 3 counters"),
    ]


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m mariner.loadtest.experiments.ts_logs_cost", description=__doc__.split("\n")[0]
    )
    ap.add_argument(
        "--calls", type=int, default=CONCURRENCY * 200, help="calls per way and round (%(default)s)"
    )
    ap.add_argument("--rounds", type=int, default=5, help="rounds; the best is kept (default %(default)s)")
    a = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="mariner-tslogs-") as tmp:
        os.environ.setdefault("PROMETHEUS_MULTIPROC_DIR", tmp)  # metrics as a frontend writes them
        print(table(pieces(a.calls, a.rounds)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
