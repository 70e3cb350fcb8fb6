"""Closed-loop load from client processes of their own: the engine of `mariner.loadtest.bench`.

Each level runs in fresh spawned processes, separate from the server under test, each running
`concurrency / processes` coroutines on uvloop: grpc.aio for TorchServe gRPC `Predictions`
(`grpc_channels` channels spread over the processes, each its own HTTP/2 connection, the
coroutines of a process spread over its channels and their calls multiplexed on them as real gRPC
clients do; one channel means one client process), and HTTP/1.1
keep-alive over raw asyncio streams for `POST /predictions/{model}` (one connection per
coroutine; another route for a peer such as mosec), and one bidirectional gRPC stream per
coroutine, spread over the channels as unary calls are, for `grpc-stream` and `oip-stream`
(`mariner.loadtest.stream_clients`). Closed loop: every coroutine sends its next request when the
previous answer arrives, so concurrency is exact and throughput is what the server sustains at it.

Every level warms up, then all client processes start the timed phase together (a barrier that
the parent joins, so it samples CPU counters at the same moment). An answer counts only if it
is a valid prediction of the model's family (`mariner.loadtest.workloads.check_answer`: a digit
prediction, a unit-norm 384-float embedding, a top-5 list); anything else is an error, the first
one kept for the report. HTTP bodies go with the family's content type (JSON, text, JPEG). CPU
time of the clients, of the server's process tree and of the whole machine is measured over the
timed phase: on a small machine the clients compete with the server, and on
a shared one other people's work does too.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import multiprocessing as mp
import sys
import threading
import time
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import psutil

from mariner.loadtest.http_connection import HttpConnection
from mariner.loadtest.servers import process_tree_cpu_seconds
from mariner.loadtest.stream_clients import STREAM_PROTOCOLS, stream_callers
from mariner.loadtest.workloads import check_answer

REQUEST_TIMEOUT_S = 30.0
WIRE_PROTOCOLS = ("grpc", "http", *STREAM_PROTOCOLS)
BARRIER_TIMEOUT_S = 180.0


@dataclass(frozen=True)
class Percentiles:
    n: int
    p50_ms: float
    p90_ms: float
    p99_ms: float
    max_ms: float

    @classmethod
    def of(cls, samples_ms: Sequence[float]) -> Percentiles:
        if not samples_ms:
            return cls(0, math.nan, math.nan, math.nan, math.nan)
        s = sorted(samples_ms)

        def q(p: float) -> float:  # nearest-rank: a real sample, never an interpolation
            return s[min(len(s) - 1, max(0, math.ceil(p * len(s)) - 1))]

        return cls(len(s), q(0.50), q(0.90), q(0.99), s[-1])


@dataclass(frozen=True)
class LevelResult:
    """One server x protocol x concurrency cell."""

    server: str
    protocol: str
    concurrency: int
    latency: Percentiles
    errors: int
    wall_s: float
    throughput_rps: float
    client_cores: float  # CPU seconds of all client processes / wall seconds
    server_cores: float
    machine_cores: float  # every process on the machine (clients + server + anyone else)
    first_error: str = ""
    connections: int = 0  # gRPC channels (one HTTP/2 connection each) or HTTP/1.1 connections
    repeat: int = 0  # which repeat of this cell (the benchmark runs the busiest level several times)

    @property
    def cpu_us_per_request(self) -> float:
        """Server CPU per answered request: server cores / req/s, in microseconds."""
        return self.server_cores / self.throughput_rps * 1e6 if self.throughput_rps > 0 else math.nan


@dataclass(frozen=True)
class ClientJob:
    protocol: str
    host: str
    port: int
    model: str
    coroutines: int
    warmup: int
    requests: int  # timed requests for this process (ignored with duration_s)
    duration_s: float | None
    bodies: tuple[bytes, ...]
    offset: int  # where in the bodies this process starts, so processes send different digits
    channels: int = 1  # gRPC channels this process opens (coroutines are spread over them)
    family: str = "digits"  # which answers are valid (mariner.loadtest.workloads)
    content_type: str = "application/json"  # of the HTTP bodies
    http_path: str = ""  # the HTTP route; "" means TorchServe's /predictions/{model}
    tag: str = ""  # this process's part of stream sequence ids (distinct per process)


@dataclass(frozen=True)
class ClientResult:
    latencies_ms: array[float]
    errors: int
    first_error: str
    t_start: float  # time.monotonic(): CLOCK_MONOTONIC is one clock for every process
    t_end: float
    cpu_s: float


async def _client(job: ClientJob, barrier: Any) -> ClientResult:
    bodies = job.bodies
    errors = 0
    first_error = ""
    latencies: array[float] = array("d")
    channels: list[Any] = []
    close_streams: Any = None

    if job.protocol in ("grpc", *STREAM_PROTOCOLS):
        import grpc

        from mariner.server._proto.torchserve import inference_pb2, inference_pb2_grpc

        # A local subchannel pool per channel: with the (default) global pool, channels to the
        # same target with the same arguments share one TCP connection, and N channels would be
        # one HTTP/2 connection to the server (and one SO_REUSEPORT choice of frontend).
        options = [("grpc.use_local_subchannel_pool", 1)]
        channels = [
            grpc.aio.insecure_channel(f"{job.host}:{job.port}", options=options)
            for _ in range(max(1, job.channels))
        ]
    if job.protocol in STREAM_PROTOCOLS:
        callers, close_streams = stream_callers(
            job.protocol, channels, job.model, bodies, job.coroutines, REQUEST_TIMEOUT_S, tag=job.tag
        )
    elif job.protocol == "grpc":
        stubs = [inference_pb2_grpc.InferenceAPIsServiceStub(ch) for ch in channels]
        requests = [inference_pb2.PredictionsRequest(model_name=job.model, input={"data": b}) for b in bodies]

        def make_caller(k: int) -> Any:
            stub = stubs[k % len(stubs)]

            async def call(i: int) -> bytes:
                response = await stub.Predictions(requests[i], timeout=REQUEST_TIMEOUT_S)
                return bytes(response.prediction)

            return call
    else:
        conns: list[HttpConnection] = []

        def make_caller(k: int) -> Any:
            path = job.http_path or f"/predictions/{job.model}"
            conn = HttpConnection(job.host, job.port, path, job.content_type)
            conns.append(conn)

            async def call(i: int) -> bytes:
                try:
                    status, data = await asyncio.wait_for(conn.post(bodies[i]), REQUEST_TIMEOUT_S)
                except BaseException:
                    await conn.close()  # the stream is mid-message: start afresh next time
                    raise
                if status != 200:
                    raise RuntimeError(f"HTTP {status}: {data[:120]!r}")
                return data

            return call

    if job.protocol not in STREAM_PROTOCOLS:
        callers = [make_caller(k) for k in range(job.coroutines)]
    state = {"left": 0, "next": job.offset, "deadline": math.inf, "record": False}

    async def worker(call: Any) -> None:
        nonlocal errors, first_error
        while state["left"] > 0 and time.monotonic() < state["deadline"]:
            state["left"] -= 1
            i = state["next"] % len(bodies)
            state["next"] += 1
            t0 = time.perf_counter()
            try:
                check_answer(job.family, await call(i))
            except Exception as exc:  # noqa: BLE001 - every failure is counted, the first one kept
                errors += 1
                first_error = first_error or f"{type(exc).__name__}: {exc}"[:300]
                continue
            if state["record"]:
                latencies.append((time.perf_counter() - t0) * 1e3)

    async def phase(count: int, duration: float | None) -> None:
        state["left"] = count if duration is None else sys.maxsize
        state["deadline"] = math.inf if duration is None else time.monotonic() + duration
        await asyncio.gather(*(worker(c) for c in callers))

    await phase(max(job.warmup, job.coroutines), None)
    errors, first_error = 0, ""
    # Every client process (and the parent, which samples CPU counters) starts the timed phase
    # together; waiting happens in a thread so the event loop keeps the connections serviced.
    await asyncio.get_running_loop().run_in_executor(None, barrier.wait, BARRIER_TIMEOUT_S)
    state["record"] = True
    cpu0, t0 = time.process_time(), time.monotonic()
    await phase(job.requests, job.duration_s)
    t1, cpu1 = time.monotonic(), time.process_time()
    if close_streams is not None:
        close_streams()
    for channel in channels:
        await channel.close()
    if job.protocol == "http":
        for conn in conns:
            await conn.close()
    return ClientResult(latencies, errors, first_error, t0, t1, cpu1 - cpu0)


def _client_main(job: ClientJob, barrier: Any, conn: Any) -> None:
    """Entry point of a client process: run the job on uvloop, send the result back."""
    try:
        import uvloop

        result = uvloop.run(_client(job, barrier))
    except BaseException as exc:
        with contextlib.suppress(Exception):
            barrier.abort()
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        raise
    conn.send(("ok", result))


def _split(total: int, parts: int) -> list[int]:
    return [total // parts + (1 if i < total % parts else 0) for i in range(parts)]


@dataclass(frozen=True)
class LoadSpec:
    """How much load a level applies, besides its concurrency."""

    requests: int  # timed requests per level (all client processes together)
    warmup: int  # untimed requests first (at least `min_warmup_per_client` per coroutine)
    duration_s: float | None = None  # if set: run the timed phase this long instead of `requests`
    client_procs: int = 2  # at most this many client processes (never more than the concurrency)
    grpc_channels: int | None = None  # gRPC channels in all (None: one per client process)
    # 4 for a millisecond model; 1 for a model whose batch takes a second (four would be minutes)
    min_warmup_per_client: int = 4


def run_level(
    *,
    server: str,
    protocol: str,
    host: str,
    port: int,
    model: str,
    concurrency: int,
    load: LoadSpec,
    bodies: tuple[bytes, ...],
    server_pid: int | None,
    label: str | None = None,
    repeat: int = 0,
    family: str = "digits",
    content_type: str = "application/json",
    http_path: str = "",
) -> LevelResult:
    """One closed-loop level against a running server, in fresh client processes.

    `protocol` is the wire protocol ("grpc", "http", or a stream: "grpc-stream", "oip-stream",
    `mariner.loadtest.stream_clients`); `label` names the cell in the result (e.g. "grpc-1ch"),
    default the protocol. `family` says which answers are valid and `content_type` goes with the
    HTTP bodies (`mariner.loadtest.workloads`); `http_path` is the HTTP route when the server
    is not TorchServe-shaped (default `/predictions/{model}`).
    """
    if protocol not in WIRE_PROTOCOLS:
        raise ValueError(f"protocol must be one of {WIRE_PROTOCOLS}, not {protocol!r}")
    procs, channels = client_layout(protocol, concurrency, load.client_procs, load.grpc_channels)
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(procs + 1)
    coroutines = _split(concurrency, procs)
    counts = _split(load.requests, procs)
    warmups = _split(max(load.warmup, concurrency * load.min_warmup_per_client), procs)
    workers, pipes = [], []
    for k in range(procs):
        job = ClientJob(
            protocol, host, port, model, coroutines[k], warmups[k], counts[k], load.duration_s,
            bodies, offset=k * len(bodies) // procs, channels=channels[k], family=family,
            content_type=content_type, http_path=http_path, tag=f"p{k}-",
        )  # fmt: skip
        parent_end, child_end = ctx.Pipe(duplex=False)
        p = ctx.Process(target=_client_main, args=(job, barrier, child_end), daemon=True)
        p.start()
        child_end.close()
        workers.append(p)
        pipes.append(parent_end)
    try:
        try:
            barrier.wait(BARRIER_TIMEOUT_S)
        except threading.BrokenBarrierError:
            raise RuntimeError(f"a client process failed while warming up: {_errors(pipes)}") from None
        t0, server0, machine0 = (
            time.monotonic(),
            process_tree_cpu_seconds(server_pid),
            _machine_busy_seconds(),
        )
        results: list[ClientResult] = []
        for pipe, p in zip(pipes, workers, strict=True):
            status, payload = pipe.recv()
            if status != "ok":
                raise RuntimeError(f"client process {p.pid} failed: {payload}")
            results.append(payload)
        server1, machine1 = process_tree_cpu_seconds(server_pid), _machine_busy_seconds()
        sampled = time.monotonic() - t0
    except BaseException:
        with contextlib.suppress(Exception):
            barrier.abort()
        raise
    finally:
        for p in workers:
            p.join(10)
            if p.is_alive():
                p.kill()
    wall = max(r.t_end for r in results) - min(r.t_start for r in results)
    samples = [x for r in results for x in r.latencies_ms]
    return LevelResult(
        server=server,
        protocol=label or protocol,
        concurrency=concurrency,
        latency=Percentiles.of(samples),
        errors=sum(r.errors for r in results),
        wall_s=wall,
        throughput_rps=len(samples) / wall if wall > 0 else 0.0,
        client_cores=sum(r.cpu_s for r in results) / wall if wall > 0 else 0.0,
        server_cores=(server1 - server0) / sampled if sampled > 0 else 0.0,
        machine_cores=(machine1 - machine0) / sampled if sampled > 0 else 0.0,
        first_error=next((r.first_error for r in results if r.first_error), ""),
        connections=concurrency if protocol == "http" else sum(channels),
        repeat=repeat,
    )


def client_layout(
    protocol: str, concurrency: int, client_procs: int, grpc_channels: int | None
) -> tuple[int, list[int]]:
    """How many client processes a level uses and how many gRPC channels each opens.

    Never more processes than coroutines; for gRPC never more channels than coroutines (a channel
    with no caller would be idle), and never more processes than channels (a channel cannot be
    shared between processes), so one channel means one process carrying every call.
    """
    procs = max(1, min(client_procs, concurrency))
    if protocol == "http":
        return procs, [1] * procs
    total = procs if grpc_channels is None else max(1, min(grpc_channels, concurrency))
    procs = min(procs, total)
    return procs, _split(total, procs)


def _errors(pipes: list[Any]) -> str:
    found = []
    for pipe in pipes:
        with contextlib.suppress(EOFError, OSError):
            if pipe.poll(5):
                status, payload = pipe.recv()
                if status != "ok":
                    found.append(str(payload))
    return "; ".join(found) or "no message (see its traceback above)"


def _machine_busy_seconds() -> float:
    """CPU seconds every process on the machine has used (all CPUs; idle and iowait excluded)."""
    t = psutil.cpu_times()
    return sum(getattr(t, k, 0.0) for k in ("user", "nice", "system", "irq", "softirq"))
