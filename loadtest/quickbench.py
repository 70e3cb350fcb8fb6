"""Quick latency benchmark: one sequential client, Mariner vs stock TorchServe vs bare floors.

`python -m mariner.loadtest.bench quick` (`make quickbench`) serves one archive (default: the
TorchScript digits model) with Mariner and with stock TorchServe, one after the other on free
127.0.0.1 ports, and measures a single closed-loop client over gRPC (TorchServe Predictions) and
HTTP (/predictions). Two floors show what the transport alone costs: a bare grpc.aio server
answering the same RPC with fixed bytes, and a bare Starlette/uvicorn app doing the same over
HTTP (`mariner.loadtest.servers.floor`). It also reports Mariner's time from process start to
/readyz 200 for the whole store. Figures are medians of the run; ratios are computed within the
run, so a noisy machine affects both sides alike.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
import requests

from mariner.loadtest.payloads import test_digit_bodies
from mariner.loadtest.servers import FloorProcess, MarinerProcess, ServerProcess, StockTorchServe

REPO = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Latency:
    target: str
    protocol: str
    n: int
    p50_ms: float
    p90_ms: float
    p99_ms: float
    max_ms: float


def measure(name: str, protocol: str, call: Callable[[], None], n: int, warmup: int) -> Latency:
    for _ in range(warmup):
        call()
    samples = []
    for _ in range(n):
        t0 = time.perf_counter()
        call()
        samples.append((time.perf_counter() - t0) * 1e3)
    samples.sort()
    q = statistics.quantiles(samples, n=100, method="inclusive")
    return Latency(name, protocol, n, statistics.median(samples), q[89], q[98], samples[-1])


def grpc_caller(target: str, model: str, body: bytes) -> tuple[Callable[[], None], grpc.Channel]:
    from mariner.server._proto.torchserve import inference_pb2, inference_pb2_grpc

    channel = grpc.insecure_channel(target)
    stub = inference_pb2_grpc.InferenceAPIsServiceStub(channel)
    req = inference_pb2.PredictionsRequest(model_name=model, input={"data": body})

    def call() -> None:
        stub.Predictions(req, timeout=10)

    return call, channel


def http_caller(url: str, body: bytes) -> Callable[[], None]:
    session = requests.Session()
    headers = {"Content-Type": "application/json"}

    def call() -> None:
        r = session.post(url, data=body, headers=headers, timeout=10)
        if r.status_code != 200:
            raise RuntimeError(f"{url} answered {r.status_code}: {r.text[:200]}")

    return call


def run(args: argparse.Namespace) -> list[Latency]:
    from mariner.server import protogen

    protogen.generate()
    body = test_digit_bodies()[0]  # one digit: this measures latency, not payload variety
    model = Path(args.archive).stem
    results: list[Latency] = []

    def bench(name: str, server: ServerProcess) -> None:
        with server:
            call, channel = grpc_caller(server.grpc_target, model, body)
            try:
                results.append(measure(name, "grpc", call, args.requests, args.warmup))
            finally:
                channel.close()
            http = http_caller(f"{server.http_url}/predictions/{model}", body)
            results.append(measure(name, "http", http, args.requests, args.warmup))

    bench("floor", FloorProcess())
    mariner = MarinerProcess(args.store, args.archive)
    bench("mariner", mariner)
    ready = mariner.ready_seconds or 0.0
    bench("torchserve", StockTorchServe(args.store, [model]))

    with MarinerProcess(args.store, "all") as whole_store:
        store_ready = whole_store.ready_seconds or 0.0
    print(f"mariner ready: {ready:.2f} s for {args.archive}; {store_ready:.2f} s for the whole store")
    return results


def report(results: list[Latency]) -> str:
    by = {(r.target, r.protocol): r for r in results}
    lines = [
        "| target | protocol | p50 ms | p90 ms | p99 ms | max ms |",
        "|---|---|---:|---:|---:|---:|",
    ]
    lines += [
        f"| {r.target} | {r.protocol} | {r.p50_ms:.3f} | {r.p90_ms:.3f} | {r.p99_ms:.3f} | {r.max_ms:.3f} |"
        for r in results
    ]
    lines.append("")
    for proto in ("grpc", "http"):
        m, t, f = by[("mariner", proto)], by[("torchserve", proto)], by[("floor", proto)]
        lines.append(
            f"{proto}: TorchServe/Mariner p50 {t.p50_ms / m.p50_ms:.1f}x (target >= 6x), "
            f"p99 {t.p99_ms / m.p99_ms:.1f}x (target >= 4x); Mariner/floor p50 {m.p50_ms / f.p50_ms:.2f}x "
            "(target <= 1.5x)"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m mariner.loadtest.bench quick",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--store", type=Path, default=REPO / "model_store")
    p.add_argument("--archive", default="digits_torchscript.mar")
    p.add_argument("--requests", type=int, default=2000, help="timed requests per target and protocol")
    p.add_argument("--warmup", type=int, default=200)
    args = p.parse_args(argv)
    print(f"quickbench: {args.archive}, {args.requests} sequential requests per target x protocol")
    print(report(run(args)))
    return 0
