"""Quick latency benchmark: one sequential client, Mariner vs stock TorchServe vs bare floors.

`python -m loadtest.quickbench` serves one archive (default: the TorchScript digits model) with
Mariner and with stock TorchServe, one after the other on free 127.0.0.1 ports, and measures a
single closed-loop client over gRPC (TorchServe Predictions) and HTTP (/predictions). Two floors
show what the transport alone costs: a bare grpc.aio server answering the same RPC with fixed
bytes, and a bare Starlette/uvicorn app doing the same over HTTP. It also reports Mariner's
time from process start to /readyz 200 for the whole store. Figures are medians of the run;
ratios are computed within the run, so a noisy machine affects both sides alike.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
import requests

from loadtest.stock_torchserve import StockTorchServe, pick_free_ports

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


def sample_body() -> bytes:
    from sklearn.datasets import load_digits

    return json.dumps(load_digits().data[0].tolist()).encode()


def grpc_caller(target: str, model: str, body: bytes) -> tuple[Callable[[], None], grpc.Channel]:
    from server._proto.torchserve import inference_pb2, inference_pb2_grpc

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


def wait_http(url: str, proc: subprocess.Popen[bytes], timeout: float = 120.0) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args} exited with {proc.returncode}")
        try:
            if requests.get(url, timeout=1).status_code == 200:
                return time.monotonic() - t0
        except requests.ConnectionError:
            pass
        time.sleep(0.02)
    raise RuntimeError(f"{url} not ready after {timeout} s")


def start_mariner(
    store: Path, models: str, extra: list[str]
) -> tuple[subprocess.Popen[bytes], dict[str, int], float]:
    ports = pick_free_ports()
    cmd = [
        sys.executable, "-m", "server.cli", "serve", "--model-store", str(store), "--models", models,
        "--inference-address", f"127.0.0.1:{ports.inference}",
        "--management-address", f"127.0.0.1:{ports.management}",
        "--metrics-address", f"127.0.0.1:{ports.metrics}",
        "--grpc-inference-address", f"127.0.0.1:{ports.grpc_inference}",
        "--grpc-management-address", f"127.0.0.1:{ports.grpc_management}",
        "--log-level", "WARNING", *extra,
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=REPO, start_new_session=True)
    ready = wait_http(f"http://127.0.0.1:{ports.inference}/readyz", proc)
    return proc, {"http": ports.inference, "grpc": ports.grpc_inference}, ready


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def start_floor() -> tuple[subprocess.Popen[bytes], dict[str, int]]:
    ports = pick_free_ports()
    proc = subprocess.Popen(
        [sys.executable, "-m", "loadtest.floor", "--grpc-port", str(ports.grpc_inference),
         "--http-port", str(ports.inference)],
        cwd=REPO, start_new_session=True,
    )  # fmt: skip
    wait_http(f"http://127.0.0.1:{ports.inference}/ping", proc)
    return proc, {"http": ports.inference, "grpc": ports.grpc_inference}


def run(args: argparse.Namespace) -> list[Latency]:
    from server import protogen

    protogen.generate()
    body = sample_body()
    model = Path(args.archive).stem
    results: list[Latency] = []

    def bench(name: str, grpc_target: str, http_url: str) -> None:
        call, channel = grpc_caller(grpc_target, model, body)
        try:
            results.append(measure(name, "grpc", call, args.requests, args.warmup))
        finally:
            channel.close()
        results.append(measure(name, "http", http_caller(http_url, body), args.requests, args.warmup))

    proc, ports = start_floor()
    try:
        bench("floor", f"127.0.0.1:{ports['grpc']}", f"http://127.0.0.1:{ports['http']}/predictions/{model}")
    finally:
        stop(proc)

    proc, ports, ready = start_mariner(args.store, args.archive, [])
    try:
        bench(
            "mariner", f"127.0.0.1:{ports['grpc']}", f"http://127.0.0.1:{ports['http']}/predictions/{model}"
        )
    finally:
        stop(proc)

    with StockTorchServe(args.store, [model]) as ts:
        bench("torchserve", ts.grpc_inference_target, f"{ts.base_url}/predictions/{model}")

    proc, _, store_ready = start_mariner(args.store, "all", [])
    stop(proc)
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--store", type=Path, default=REPO / "model_store")
    p.add_argument("--archive", default="digits_torchscript.mar")
    p.add_argument("--requests", type=int, default=2000, help="timed requests per target and protocol")
    p.add_argument("--warmup", type=int, default=200)
    args = p.parse_args(argv)
    print(f"quickbench: {args.archive}, {args.requests} sequential requests per target x protocol")
    print(report(run(args)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
