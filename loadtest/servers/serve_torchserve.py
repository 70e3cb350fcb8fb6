"""`make serve-torchserve`: stock TorchServe on the model store, in the foreground until Ctrl-C.

Run as `python -m mariner.loadtest.bench serve-torchserve [--model-store DIR] [--models all] ...`:
the side-by-side baseline by hand, for a look at what the benchmark compares against.
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from mariner.loadtest.servers.process import Ports, ServerError
from mariner.loadtest.servers.torchserve import StockTorchServe


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m mariner.loadtest.bench serve-torchserve",
        description="Serve .mar archives with stock TorchServe 0.12 on 127.0.0.1 until Ctrl-C.",
    )
    parser.add_argument("--model-store", type=Path, default=Path("model_store"))
    parser.add_argument("--models", default="all", help="'all' or comma-separated archive names")
    parser.add_argument("--batch-size", type=int, default=None, help="override the archives' batchSize")
    parser.add_argument(
        "--max-batch-delay", type=int, default=None, help="override the archives' maxBatchDelay (ms)"
    )
    parser.add_argument("--workers", type=int, default=1, help="workers per model")
    parser.add_argument(
        "--free-ports", action="store_true", help="pick free ports instead of 8080/8081/8082/7070/7071"
    )
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for readiness")
    return parser.parse_args(argv)


def _interrupt(signum: int, _frame: object) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


def serve_torchserve(argv: Sequence[str] | None = None) -> int:
    """Start, print the URLs, wait for SIGINT/SIGTERM, stop. Exit 1 if TorchServe fails or dies."""
    args = _parse_args(argv)
    try:
        ts = StockTorchServe(
            args.model_store,
            args.models,
            batch_size=args.batch_size,
            max_batch_delay_ms=args.max_batch_delay,
            workers=args.workers,
            ports=None if args.free_ports else Ports.defaults(),
        )
    except ServerError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    # Both signals take the Ctrl-C path, also while start() is still waiting (it cleans up on
    # KeyboardInterrupt). Installing the SIGINT handler explicitly matters: a shell starts
    # background jobs with SIGINT ignored, and Python would inherit that.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _interrupt)
    print(f"starting stock TorchServe with {', '.join(ts.model_names)} ...", flush=True)
    try:
        ts.start(timeout=args.timeout)
        print(
            f"inference   {ts.http_url}   (POST /predictions/<model>)\n"
            f"management  {ts.management_url}\n"
            f"metrics     {ts.metrics_url}/metrics\n"
            f"gRPC        {ts.grpc_target} (inference), {ts.grpc_management_target} (management)\n"
            f"models      {', '.join(ts.model_names)}\n"
            f"logs        {ts.log_dir}\n"
            "Ctrl-C to stop",
            flush=True,
        )
        while ts.running:
            time.sleep(1.0)
        print(f"error: TorchServe exited on its own\n{ts.log_tail()}", file=sys.stderr)
        return 1
    except ServerError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        # A second Ctrl-C must not cut the cleanup short and orphan Java; stop() is bounded.
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)
        ts.stop()
        print("stopped", flush=True)
