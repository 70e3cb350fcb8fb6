"""The held-bytes attack, replayed and measured: a victim's latency and the frontend's memory,
quiet and under gRPC streams sending large messages (127.0.0.1 only, bounded in time).

    python -m mariner.loadtest.held_attack [--streams 12] [--message-mib 7] [--seconds 15]

One `mariner serve` with the store's digits archive. A victim client sends one small HTTP
prediction after another, first alone (the quiet figures), then while `--streams`
StreamPredictions2 streams each send `--message-mib` MiB messages as fast as the server reads
them; then the attack stops and the frontend's memory is read once more. Prints the victim's
p50/p99 both ways and the frontend's RSS before, at its peak under the attack, and after.
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import psutil
import requests

from mariner.loadtest.servers.mariner import REPO, MarinerProcess
from mariner.server._proto.torchserve import inference_pb2, inference_pb2_grpc

MIB = 1 << 20
ATTACK_MODEL = __import__("os").environ.get("ATTACK_MODEL", "digits")
BODY = b"[" + b",".join([b"4.0"] * 64) + b"]"


def _victim(url: str, seconds: float) -> list[float]:
    out: list[float] = []
    end = time.monotonic() + seconds
    with requests.Session() as s:
        while time.monotonic() < end:
            t0 = time.perf_counter()
            r = s.post(url, data=BODY, headers={"Content-Type": "application/json"}, timeout=30)
            out.append((time.perf_counter() - t0) * 1e3)
            r.raise_for_status()
    return out


def _attacker(target: str, n: int, size: int, stop: Any, sent: list[int]) -> None:
    payload = b"\x00" * size

    def messages() -> Iterator[inference_pb2.PredictionsRequest]:
        i = 0
        while not stop.is_set():
            sent[n] += 1
            yield inference_pb2.PredictionsRequest(
                model_name=ATTACK_MODEL, sequence_id=f"attack{n}-{i}", input={"body": payload}
            )
            i += 1

    with grpc.insecure_channel(target, options=[("grpc.max_send_message_length", size + MIB)]) as ch:
        stub = inference_pb2_grpc.InferenceAPIsServiceStub(ch)
        try:
            for _ in stub.StreamPredictions2(messages(), timeout=120):
                pass
        except grpc.RpcError:
            pass  # refused or cut: the attacker does not care


def _attack(target: str, streams: int, size: int, stop: Any, total: Any, cpu: Any) -> None:
    """The attackers, in a process of their own: serializing large messages holds the GIL, which
    would otherwise slow the victim's client rather than the server."""
    sent = [0] * streams
    threads = [
        threading.Thread(target=_attacker, args=(target, n, size, stop, sent), daemon=True)
        for n in range(streams)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=130)
    total.value = sum(sent)
    cpu.value = sum(psutil.Process().cpu_times()[:2])


def _frontend(server: MarinerProcess) -> psutil.Process:
    sup = psutil.Process(server.pid)
    return next(c for c in sup.children() if "mariner.server.frontend.main" in " ".join(c.cmdline()))


def _workers(server: MarinerProcess) -> list[psutil.Process]:
    sup = psutil.Process(server.pid)
    return [p for p in sup.children(recursive=True) if "mariner.server.worker.main" in " ".join(p.cmdline())]


def _cpu(procs: list[psutil.Process]) -> float:
    return sum(sum(p.cpu_times()[:2]) for p in procs)


def _pcts(ms: list[float]) -> str:
    q = statistics.quantiles(ms, n=100)
    return f"p50 {statistics.median(ms):.1f} ms, p99 {q[98]:.1f} ms ({len(ms)} calls)"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--store", type=Path, default=REPO / "model_store")
    ap.add_argument("--streams", type=int, default=12)
    ap.add_argument("--message-mib", type=float, default=7.0)
    ap.add_argument("--seconds", type=float, default=15.0)
    ap.add_argument("--mariner-args", default="", help="extra `mariner serve` arguments")
    ap.add_argument(
        "--victim-archive",
        default="",
        help="serve the victim from this archive of the store (default: digits)",
    )
    args = ap.parse_args()
    models = "digits=digits_torchscript.mar" + (
        f",victim={args.victim_archive}" if args.victim_archive else ""
    )
    server = MarinerProcess(args.store, models, extra_args=args.mariner_args.split())
    with server:
        url = f"{server.http_url}/predictions/{'victim' if args.victim_archive else 'digits'}"
        _victim(url, 2.0)  # warm-up
        frontend = _frontend(server)
        rss0 = frontend.memory_info().rss
        quiet = _victim(url, args.seconds)
        ctx = multiprocessing.get_context("spawn")
        stop, total, attacker_cpu = ctx.Event(), ctx.Value("i", 0), ctx.Value("d", 0.0)
        size = int(args.message_mib * MIB)
        attack = ctx.Process(
            target=_attack, args=(server.grpc_target, args.streams, size, stop, total, attacker_cpu)
        )
        workers = _workers(server)
        cpu0, wcpu0, t0 = sum(frontend.cpu_times()[:2]), _cpu(workers), time.monotonic()
        attack.start()
        peak = [rss0]

        def sample() -> None:
            while not stop.is_set():
                peak[0] = max(peak[0], frontend.memory_info().rss)
                time.sleep(0.2)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        time.sleep(2.0)  # the streams fill what they may
        attacked = _victim(url, args.seconds)
        stop.set()
        attack.join(timeout=130)
        cpu = sum(frontend.cpu_times()[:2]) - cpu0
        wcpu, took = _cpu(workers) - wcpu0, time.monotonic() - t0
        acpu = attacker_cpu.value
        time.sleep(5.0)
        rss1 = frontend.memory_info().rss
    print(f"victim quiet:        {_pcts(quiet)}")
    print(
        f"victim under attack: {_pcts(attacked)}  ({args.streams} streams, {args.message_mib:g} MiB messages)"
    )
    ratio = statistics.quantiles(attacked, n=100)[98] / statistics.quantiles(quiet, n=100)[98]
    print(f"p99 ratio: {ratio:.2f}x")
    print(f"attack messages sent: {total.value} ({total.value * args.message_mib:.0f} MiB)")
    per = cpu / max(1, total.value) * 1e3
    print(
        f"CPU during the {took:.1f} s attack: frontend {cpu:.1f} s ({per:.1f} ms per attack message), "
        f"workers {wcpu:.1f} s ({wcpu / max(1, total.value) * 1e3:.1f} ms per attack message), "
        f"the attacking client {acpu:.1f} s (on the same {psutil.cpu_count()} cores)"
    )
    print(
        f"frontend RSS: {rss0 / MIB:.0f} MiB before, {peak[0] / MIB:.0f} MiB peak under attack, "
        f"{rss1 / MIB:.0f} MiB 5 s after"
    )


if __name__ == "__main__":
    main()
