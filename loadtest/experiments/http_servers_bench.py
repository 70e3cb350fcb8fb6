"""Interleaved comparison of HTTP servers under the same app: uvicorn vs granian (ASGI, RSGI), vs
a bare httptools protocol (the floor of a Python frontend), and Mariner's own inference listener
against its ASGI app under plain uvicorn.

Every server x app pair (`mariner.loadtest.experiments.http_servers`) runs as a process of its own for the
whole comparison; each repeat measures every pair once, one after the other (A, B, C, A, B, C...),
so a noisy neighbour on a shared machine hits all of them alike. A measurement is a closed loop
from a separate, spawned client process on uvloop: `connections` keep-alive HTTP/1.1
connections (`HttpConnection`, the benchmark's own client), each sending its next POST when the
previous answer arrived, for `seconds`; then one connection alone for `latency_seconds` (latency
without queueing). Server CPU is the server process's user + system time over the timed phase
(psutil), divided by the requests answered in it. Ratios are taken per repeat against uvicorn
serving the same app, then the median over repeats is reported.

    python -m mariner.loadtest.experiments.http_servers_bench --repeats 3 --seconds 5 --json out.json
    python -m mariner.loadtest.experiments.http_servers_bench \
        --servers uvicorn,bare-protocol,mariner-listener --apps raw,mariner   # without granian
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import statistics
import subprocess
import sys
import time
from array import array
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection
from typing import Any

import psutil

from mariner.loadtest.closedloop import Percentiles
from mariner.loadtest.experiments.http_servers import ANSWER, APPS, HOST, MODEL, PORT_LINE, SERVERS
from mariner.loadtest.http_connection import HttpConnection

BODY = b'{"data": [0, 1, 2, 3, 4, 5, 6, 7]}'
PAIRS: tuple[tuple[str, str], ...] = (
    ("uvicorn", "raw"),
    ("granian-asgi", "raw"),
    ("granian-rsgi", "raw"),
    ("bare-protocol", "raw"),
    ("uvicorn", "floor"),
    ("granian-asgi", "floor"),
    ("uvicorn", "mariner"),
    ("granian-asgi", "mariner"),
    ("bare-mariner", "mariner"),
    ("mariner-listener", "mariner"),
)
WARMUP_S = 1.0
START_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class Sample:
    """One closed-loop measurement of one server x app pair."""

    server: str
    app: str
    connections: int
    answered: int
    errors: int
    wall_s: float
    rps: float
    server_cpu_us: float  # server CPU seconds per answered request, in microseconds
    client_cores: float
    latency: Percentiles
    first_error: str = ""


# -- the client process --------------------------------------------------------------------------
async def _closed_loop(port: int, connections: int, seconds: float, pipe: Connection) -> dict[str, Any]:
    conns = [HttpConnection(HOST, port, f"/predictions/{MODEL}") for _ in range(connections)]
    await asyncio.gather(*(c.connect() for c in conns))
    latencies = array("d")
    counts = {"answered": 0, "errors": 0}
    first_error: list[str] = []
    timing = False
    end = 0.0

    async def one(conn: HttpConnection) -> None:
        while True:
            t = time.perf_counter()
            timed = timing  # only requests sent in the timed phase count
            if timed and t >= end:
                return
            try:
                status, data = await conn.post(BODY)
                ok = status == 200 and data == ANSWER
                problem = "" if ok else f"status {status}: {data[:80]!r}"
            except (OSError, asyncio.IncompleteReadError, ValueError) as exc:
                ok, problem = False, f"{type(exc).__name__}: {exc}"
                await conn.close()
            if timed:
                if ok:
                    counts["answered"] += 1
                    latencies.append((time.perf_counter() - t) * 1e3)
                else:
                    counts["errors"] += 1
                    if not first_error:
                        first_error.append(problem)

    async def warm_then_time() -> None:
        nonlocal timing, end
        await asyncio.sleep(WARMUP_S)
        pipe.send("start")  # the parent samples the server's CPU now
        end = time.perf_counter() + seconds
        timing = True

    clock = asyncio.create_task(warm_then_time())
    # Coroutines that see `timing` off keep warming until the clock flips it.
    workers = [asyncio.create_task(one(c)) for c in conns]
    await clock
    started = time.perf_counter()
    await asyncio.gather(*workers)
    wall = time.perf_counter() - started
    for c in conns:
        await c.close()
    return {
        "answered": counts["answered"],
        "errors": counts["errors"],
        "wall_s": wall,
        "latencies": latencies.tolist(),
        "first_error": first_error[0] if first_error else "",
    }


def _client_main(port: int, connections: int, seconds: float, pipe: Connection) -> None:
    from mariner.server.common import event_loop

    async def run() -> int:
        result = await _closed_loop(port, connections, seconds, pipe)
        cpu = psutil.Process().cpu_times()
        result["client_cpu_s"] = cpu.user + cpu.system
        pipe.send(result)
        return 0

    event_loop.run(run())


# -- the parent ----------------------------------------------------------------------------------
class ServerProc:
    """One `mariner.loadtest.experiments.http_servers` process, started and ready (its port announced)."""

    def __init__(self, server: str, app: str) -> None:
        self.server, self.app = server, app
        cmd = [sys.executable, "-m", "mariner.loadtest.experiments.http_servers", server, app]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.port = self._read_port()
        self.ps = psutil.Process(self.proc.pid)

    def _read_port(self) -> int:
        assert self.proc.stdout is not None
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                err = self.proc.stderr.read() if self.proc.stderr else ""
                raise RuntimeError(f"{self.server}/{self.app} exited before listening: {err[-2000:]}")
            if line.startswith(PORT_LINE):
                return int(line[len(PORT_LINE) :])
        raise RuntimeError(f"{self.server}/{self.app} did not listen within {START_TIMEOUT_S:g} s")

    def cpu_seconds(self) -> float:
        t = self.ps.cpu_times()
        return t.user + t.system

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def measure(server: ServerProc, connections: int, seconds: float) -> Sample:
    """One closed-loop run against `server` from a fresh spawned client process."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    client = ctx.Process(target=_client_main, args=(server.port, connections, seconds, child), daemon=True)
    client.start()
    timeout = WARMUP_S + seconds + START_TIMEOUT_S
    if not parent.poll(timeout) or parent.recv() != "start":
        raise RuntimeError("the client process did not start its timed phase")
    cpu0 = server.cpu_seconds()
    if not parent.poll(timeout):
        raise RuntimeError("the client process did not report")
    result = parent.recv()
    cpu1 = server.cpu_seconds()
    client.join(10)
    answered = result["answered"]
    wall = result["wall_s"]
    return Sample(
        server.server,
        server.app,
        connections,
        answered,
        result["errors"],
        wall,
        answered / wall if wall else 0.0,
        (cpu1 - cpu0) / answered * 1e6 if answered else float("nan"),
        result["client_cpu_s"] / wall if wall else 0.0,
        Percentiles.of(result["latencies"]),
        result["first_error"],
    )


def run(
    pairs: Sequence[tuple[str, str]],
    repeats: int,
    seconds: float,
    connections: int,
    latency_seconds: float,
) -> list[Sample]:
    """Every pair measured once per repeat, interleaved; all servers stay up throughout."""
    servers = [ServerProc(s, a) for s, a in pairs]
    samples: list[Sample] = []
    try:
        for r in range(repeats):
            for srv in servers:
                samples.append(measure(srv, connections, seconds))
                if latency_seconds > 0:
                    samples.append(measure(srv, 1, latency_seconds))
                print(f"repeat {r + 1}: {srv.server}/{srv.app} done", file=sys.stderr, flush=True)
    finally:
        for srv in servers:
            srv.stop()
    return samples


def summary(samples: Sequence[Sample]) -> list[dict[str, Any]]:
    """Medians per server x app x connections, and the median per-repeat ratio to uvicorn."""
    rows: list[dict[str, Any]] = []
    keys = sorted(
        {(s.app, s.connections, s.server) for s in samples},
        key=lambda k: (APPS.index(k[0]), -k[1], SERVERS.index(k[2])),
    )
    for app, conns, server in keys:
        mine = [s for s in samples if (s.app, s.connections, s.server) == (app, conns, server)]
        base = [s for s in samples if (s.app, s.connections, s.server) == (app, conns, "uvicorn")]
        pairs = list(zip(mine, base, strict=False))

        def ratio(field: str, pairs: list[tuple[Sample, Sample]] = pairs) -> float:
            if not pairs:
                return float("nan")
            return statistics.median(_get(a, field) / _get(b, field) for a, b in pairs)

        rows.append(
            {
                "app": app,
                "connections": conns,
                "server": server,
                "repeats": len(mine),
                "answered": sum(s.answered for s in mine),
                "errors": sum(s.errors for s in mine),
                "rps": statistics.median(s.rps for s in mine),
                "cpu_us": statistics.median(s.server_cpu_us for s in mine),
                "p50_ms": statistics.median(s.latency.p50_ms for s in mine),
                "p99_ms": statistics.median(s.latency.p99_ms for s in mine),
                "client_cores": statistics.median(s.client_cores for s in mine),
                "rps_ratio": ratio("rps"),
                "cpu_ratio": ratio("server_cpu_us"),
                "p50_ratio": ratio("p50_ms"),
                "p99_ratio": ratio("p99_ms"),
            }
        )
    return rows


def _get(s: Sample, field: str) -> float:
    if field in ("p50_ms", "p99_ms"):
        return float(getattr(s.latency, field))
    return float(getattr(s, field))


def markdown(rows: Sequence[dict[str, Any]]) -> str:
    head = (
        "| app | conns | server | req/s | CPU µs/req | p50 ms | p99 ms | req/s ÷ uvicorn | "
        "CPU ÷ uvicorn | p50 ÷ uvicorn | p99 ÷ uvicorn | errors |\n"
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n"
    )
    lines = [
        f"| {r['app']} | {r['connections']} | {r['server']} | {r['rps']:.0f} | {r['cpu_us']:.1f} | "
        f"{r['p50_ms']:.2f} | {r['p99_ms']:.2f} | {r['rps_ratio']:.2f} | {r['cpu_ratio']:.2f} | "
        f"{r['p50_ratio']:.2f} | {r['p99_ratio']:.2f} | {r['errors']} |"
        for r in rows
    ]
    return head + "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mariner.loadtest.experiments.http_servers_bench")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=5.0, help="timed phase at --connections")
    parser.add_argument("--connections", type=int, default=64)
    parser.add_argument("--latency-seconds", type=float, default=3.0, help="timed phase at 1 connection")
    parser.add_argument("--apps", default="raw,floor,mariner")
    parser.add_argument("--servers", default=",".join(SERVERS), help="of " + ", ".join(SERVERS))
    parser.add_argument("--json", help="write every sample and the summary here")
    args = parser.parse_args(argv)
    apps = set(args.apps.split(","))
    servers = set(args.servers.split(","))
    pairs = [p for p in PAIRS if p[1] in apps and p[0] in servers]
    samples = run(pairs, args.repeats, args.seconds, args.connections, args.latency_seconds)
    rows = summary(samples)
    print(markdown(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"samples": [asdict(s) for s in samples], "summary": rows}, f, indent=1)
    return 0 if all(s.errors == 0 and s.answered > 0 for s in samples) else 1


if __name__ == "__main__":
    sys.exit(main())
