"""What a model worker process adds per request over the handler it runs.

The worker is the floor's nearest neighbour: `ModelHost.run_batch` (the handler plus Mariner's
per-batch wrapper) is work no server can skip, so the worker's CPU per request minus that is the
process model's own cost (frames in and out, the pickle allowlist, the hand-off between the
socket's event loop and the handler, results written back). This tool measures both on the real
code and the same batches, in one run, interleaved:

- `in-process`: `ModelHost.run_batch` on batches of `--batch` requests, called directly here;
  CPU time per request of this process.
- `worker`: the same archive in a real worker process (the supervisor's `WorkerProcess`), driven
  by the frontend's own `WorkerConnection` with `--inflight` batches in flight (two frontends'
  worth by default, as 64 clients keep them); CPU time of the worker process per request, from
  /proc, and this process's CPU per request for the frontend's side of the wire.

Rounds alternate, and the medians are printed (a shared machine moves each figure by tens of
percent between runs; the difference within one round is what to read).

    python -m mariner.loadtest.experiments.worker_overhead --archive model_store/digits_torchscript.mar
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mariner.loadtest.servers.process import process_tree_cpu_seconds


@dataclass(frozen=True)
class Round:
    in_process_us: float  # ModelHost.run_batch CPU per request, in this process
    worker_us: float  # the worker process's CPU per request
    frontend_us: float  # this process's CPU per request while it drove the worker
    worker_rps: float  # requests/s the worker answered


def _requests(bodies: Sequence[bytes], batch: int, start: int, model: str) -> list[Any]:
    from mariner.server.contracts.types import InferRequest, WireProtocol

    return [
        InferRequest(model, "1.0", {"data": bodies[(start + i) % len(bodies)]}, WireProtocol.TS_GRPC, f"r{i}")
        for i in range(batch)
    ]


def _time_in_process(host: Any, batches: Sequence[list[Any]], seconds: float) -> float:
    n, t0, c0 = 0, time.perf_counter(), time.process_time()
    while time.perf_counter() - t0 < seconds:
        host.run_batch(batches[n % len(batches)])
        n += 1
    return (time.process_time() - c0) / (n * len(batches[0])) * 1e6


async def _time_worker(
    conn: Any, pid: int, batches: Sequence[list[Any]], inflight: int, seconds: float
) -> tuple[float, float, float]:
    done = 0

    async def client(k: int) -> None:
        nonlocal done
        i = k
        while time.perf_counter() < end:
            results = await conn.run(batches[i % len(batches)])
            done += len(results)
            i += inflight

    w0, c0, t0 = process_tree_cpu_seconds(pid), time.process_time(), time.perf_counter()
    end = t0 + seconds
    await asyncio.gather(*(client(k) for k in range(inflight)))
    wall = time.perf_counter() - t0
    return (
        (process_tree_cpu_seconds(pid) - w0) / done * 1e6,
        (time.process_time() - c0) / done * 1e6,
        done / wall,
    )


async def measure(
    archive_path: Path, *, batch: int, inflight: int, seconds: float, rounds: int
) -> list[Round]:
    from mariner.loadtest.workloads import family_of, workload
    from mariner.server.common.archive import open_archive
    from mariner.server.frontend.worker_client import WorkerConnection
    from mariner.server.supervisor.worker_process import WorkerProcess, worker_spec
    from mariner.server.worker.device import Placement
    from mariner.server.worker.runner import ModelHost

    bodies = workload(family_of(archive_path.stem)).bodies
    with tempfile.TemporaryDirectory(prefix="worker-overhead-") as work:
        archive = open_archive(archive_path, Path(work))
        batches = [_requests(bodies, batch, k * batch, archive.name) for k in range(8)]
        host = ModelHost(
            archive, id="floor", placement=Placement(gpu_id=None, torch_threads=1), batch_size=batch
        )
        host.load()
        spec = worker_spec(
            archive, instance=0, generation=0, batch_size=batch, gpu_id=None, torch_threads=1,
            socket_dir=Path(work),
        )  # fmt: skip
        process = WorkerProcess(spec)
        endpoint = await process.start(300.0)
        conn = WorkerConnection(endpoint, batch_size=batch)
        await conn.start()
        try:
            for b in batches:  # warm both
                host.run_batch(b)
                await conn.run(b)
            out = []
            for _ in range(rounds):
                floor = _time_in_process(host, batches, seconds)
                w, f, rps = await _time_worker(conn, endpoint.pid, batches, inflight, seconds)
                out.append(Round(floor, w, f, rps))
            return out
        finally:
            conn.close()
            await process.stop(10.0)
            host.unload()


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--archive", type=Path, default=Path("model_store/digits_torchscript.mar"))
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--inflight", type=int, default=2)
    p.add_argument("--seconds", type=float, default=4.0)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", action="store_true", help="print the rounds as JSON")
    args = p.parse_args(argv)
    rounds = asyncio.run(
        measure(
            args.archive, batch=args.batch, inflight=args.inflight, seconds=args.seconds, rounds=args.rounds
        )
    )
    if args.json:
        print(json.dumps([r.__dict__ for r in rounds]))
        return 0

    def med(name: str) -> float:
        return statistics.median(getattr(r, name) for r in rounds)

    print(
        f"{args.archive.name}, batch {args.batch}, {args.inflight} in flight, {len(rounds)} rounds (medians)"
    )
    print(f"  in-process ModelHost.run_batch  {med('in_process_us'):8.1f} µs CPU/request")
    rps = med("worker_rps")
    print(f"  worker process                  {med('worker_us'):8.1f} µs CPU/request  ({rps:,.0f} req/s)")
    over = statistics.median(r.worker_us - r.in_process_us for r in rounds)
    print(f"  worker overhead (same round)    {over:8.1f} µs/request  ({over * args.batch:,.0f} µs/batch)")
    print(f"  frontend side of the wire       {med('frontend_us'):8.1f} µs CPU/request")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
