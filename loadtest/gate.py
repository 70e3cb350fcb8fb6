"""The p99 gate for locust runs, and the driver behind `make loadtest`.

The gate is a `quitting` listener (installed by `loadtest/locustfile.py`) that judges locust's
in-process statistics of the whole run: the process exits 1 when p99 is over `--p99-ms`, when
the failure ratio is over `--max-fail-ratio`, when nothing completed, when a request kind (one
per user class) made fewer than `--min-requests` requests, or when a user raised; 0 otherwise.
So any headless locust run of our locustfile is a CI check on its own.

Locust keeps response times in buckets of 1 ms below 100 ms, which cannot tell a 0.4 ms
answer from a 1.4 ms one; `install()` swaps in the finer bucketing locust allows
(`locust.stats.bucket_response_time`): 0.01 ms below 10 ms, 0.1 ms below 100 ms.

`python -m mariner.loadtest.gate` (what `make loadtest` runs) starts Mariner on the model store (unless
`--host` points at a running server), runs locust headless against 127.0.0.1 bounded in users
and time with CSV and HTML reports, stops the server, and prints p50/p95/p99 and the verdict.
With `--library` it drives locust in library mode in this process instead of the locust CLI in
a subprocess (the integration tests use that; it keeps pytest itself free of gevent's
monkey-patching, which importing locust would apply to the whole test session).

The run's clock starts after setup: the users' payloads are prepared on locust's `init` event
and, in library mode, the `--run-time` seconds count from the moment every user is spawned.
In library mode the run then goes on until every request kind has made `--min-requests`
requests (bounded by `--max-run-time`), so a slow machine makes a longer run, not an empty one.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mariner.loadtest.slo import (
    DEFAULT_MAX_FAIL_RATIO,
    DEFAULT_MIN_REQUESTS,
    DEFAULT_P99_MS,
    Slo,
    Verdict,
    judge,
)

REPO = Path(__file__).resolve().parent.parent
VERDICT_FILE = "verdict.json"


# -- locust integration -------------------------------------------------------------------------
def add_arguments(parser: Any) -> None:
    """The gate's options on locust's argument parser (also settable as LOCUST_P99_MS etc.)."""
    parser.add_argument(
        "--p99-ms", type=float, default=DEFAULT_P99_MS, help="fail the run when p99 latency exceeds this"
    )
    parser.add_argument(
        "--max-fail-ratio",
        type=float,
        default=DEFAULT_MAX_FAIL_RATIO,
        help="fail the run when this fraction of requests (0..1) or more failed",
    )
    parser.add_argument(
        "--min-requests",
        type=int,
        default=DEFAULT_MIN_REQUESTS,
        help="fail the run when a request kind (one per user class) made fewer requests than this",
    )
    parser.add_argument("--verdict-file", default="", help="also write the verdict as JSON here")


def fine_bucket_response_time(response_time: float) -> float:
    """Locust's response-time bucketing, with sub-millisecond resolution below 100 ms."""
    if response_time < 10:
        return round(response_time, 2)
    if response_time < 100:
        return round(response_time, 1)
    if response_time < 1000:
        return int(round(response_time, -1))
    if response_time < 10000:
        return int(round(response_time, -2))
    return int(round(response_time, -3))


def verdict_of(environment: Any) -> Verdict:
    """Judge a locust Environment's statistics with the SLO from its parsed options."""
    opts = environment.parsed_options
    slo = Slo(
        p99_ms=float(getattr(opts, "p99_ms", DEFAULT_P99_MS)),
        max_fail_ratio=float(getattr(opts, "max_fail_ratio", DEFAULT_MAX_FAIL_RATIO)),
        min_requests=int(getattr(opts, "min_requests", DEFAULT_MIN_REQUESTS)),
    )
    runner = environment.runner
    stats = environment.stats
    return judge(
        stats.total,
        slo,
        user_exceptions=sum(e["count"] for e in runner.exceptions.values()) if runner else 0,
        by_name={f"{method} {name}": e for (name, method), e in stats.entries.items()},
        expected_kinds=len(environment.user_classes or ()),
    )


def enough_requests(environment: Any, min_requests: int) -> bool:
    """Whether every user class's request kind has made `min_requests` requests (each of our
    user classes makes one kind of request, so there is one stats entry per class)."""
    entries = environment.stats.entries.values()
    kinds = len(environment.user_classes or ())
    return len(entries) >= kinds and all(e.num_requests >= min_requests for e in entries)


def _on_quitting(environment: Any, **_kw: Any) -> None:
    verdict = verdict_of(environment)
    for name, s in verdict.by_name.items():
        print(
            f"gate: {name}: requests={s['requests']:.0f} failures={s['failures']:.0f} "
            f"p50={s['p50_ms']:.2f}ms p95={s['p95_ms']:.2f}ms p99={s['p99_ms']:.2f}ms",
            flush=True,
        )
    print(f"gate: {verdict.line()}", flush=True)
    path = getattr(environment.parsed_options, "verdict_file", "")
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(verdict.to_json() + "\n")
    environment.process_exit_code = 0 if verdict.passed else 1


def install(events: Any) -> None:
    """Finer response-time buckets, and the gate on `quitting`. Called by the locustfile."""
    import locust.stats

    locust.stats.bucket_response_time = fine_bucket_response_time
    events.quitting.add_listener(_on_quitting)


# -- library mode ---------------------------------------------------------------------------------
def run_library(
    *,
    host: str,
    grpc_target: str,
    model: str,
    protocols: Sequence[str],
    users: int,
    spawn_rate: float,
    run_time_s: float,
    slo: Slo,
    report_dir: Path | None = None,
    max_run_time_s: float = 600.0,
) -> tuple[int, Verdict]:
    """Run the locustfile's users in this process (locust's library mode); (exit code, verdict).

    The clock starts once setup is over: payloads are prepared on `init` (before `runner.start`)
    and the `run_time_s` seconds count from the moment every user is spawned. After them the run
    continues until each request kind has made `slo.min_requests` requests, so the verdict
    rests on requests made, not on how fast this machine got through setup. `max_run_time_s`
    (counted from the start) bounds a run against a server that never answers enough; such a
    run fails on the request count.

    Imports locust, which monkey-patches this process for gevent: call it from a process of its
    own (`python -m mariner.loadtest.gate --library`), not from a test runner or a server.
    """
    import gevent
    import gevent.event
    from locust import events
    from locust.argument_parser import parse_options
    from locust.env import Environment
    from locust.html import get_html_report
    from locust.stats import PERCENTILES_TO_REPORT, StatsCSVFileWriter, stats_history

    from mariner.loadtest import locustfile

    user_classes = _user_classes(protocols)
    argv = [
        "-f", locustfile.__file__, "--headless", "--host", host, "--grpc-target", grpc_target,
        "--model", model, "--p99-ms", str(slo.p99_ms), "--max-fail-ratio", str(slo.max_fail_ratio),
        "--min-requests", str(slo.min_requests),
    ]  # fmt: skip
    if report_dir is not None:
        argv += ["--verdict-file", str(report_dir / VERDICT_FILE)]
    options = parse_options(argv)
    env = Environment(user_classes=user_classes, events=events, host=host, parsed_options=options)
    runner = env.create_local_runner()
    started = time.monotonic()
    events.init.fire(environment=env, runner=runner, web_ui=None)  # the locustfile prepares payloads
    spawned = gevent.event.Event()
    events.spawning_complete.add_listener(lambda **_kw: spawned.set())
    csv_writer = None
    if report_dir is not None:
        report_dir.mkdir(parents=True, exist_ok=True)
        prefix = str(report_dir / "stats")
        csv_writer = StatsCSVFileWriter(env, PERCENTILES_TO_REPORT, prefix, full_history=False)
        gevent.spawn(csv_writer.stats_writer)
        gevent.spawn(stats_history, runner)  # the HTML report's charts

    def stop_when_measured() -> None:
        left = max(0.0, max_run_time_s - (time.monotonic() - started))
        if spawned.wait(timeout=left):
            gevent.sleep(min(run_time_s, max(0.0, max_run_time_s - (time.monotonic() - started))))
            while not enough_requests(env, slo.min_requests) and time.monotonic() - started < max_run_time_s:
                gevent.sleep(0.05)
        runner.quit()

    runner.start(users, spawn_rate=spawn_rate)
    gevent.spawn(stop_when_measured)
    runner.greenlet.join()
    events.quitting.fire(environment=env, reverse=True)
    if report_dir is not None and csv_writer is not None:
        csv_writer.close_files()
        (report_dir / "report.html").write_text(get_html_report(env, show_download_link=False))
    code = env.process_exit_code if env.process_exit_code is not None else 1
    return code, verdict_of(env)


def _user_classes(protocols: Sequence[str]) -> list[Any]:
    from mariner.loadtest import locustfile

    unknown = [p for p in protocols if p not in USER_CLASS_NAMES]
    if unknown:
        raise ValueError(f"unknown protocol(s) {unknown}; known: {sorted(USER_CLASS_NAMES)}")
    return [getattr(locustfile, USER_CLASS_NAMES[p]) for p in protocols]


# The locustfile's user class per protocol: the one registry, read without importing locust (so
# the driver process is not monkey-patched). "grpc" and "http" speak TorchServe's API, "oip-*"
# the Open Inference Protocol v2; the default drives all four.
USER_CLASS_NAMES = {
    "grpc": "TorchServeGrpcUser",
    "http": "PredictionsHttpUser",
    "oip-grpc": "OipGrpcUser",
    "oip-http": "OipHttpUser",
}


# -- the `make loadtest` driver ---------------------------------------------------------------------
def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m mariner.loadtest.gate",
        description="Load-test Mariner with locust and gate on p99 latency and failures (make loadtest).",
    )
    p.add_argument("--store", type=Path, default=REPO / "model_store", help="model store to serve")
    p.add_argument("--model", default="digits_torchscript", help="model (archive stem) to load and call")
    p.add_argument(
        "--torch-threads",
        type=int,
        default=1,
        help="Mariner's --torch-threads; 1 because intra-op threads that outnumber the free cores "
        "stall the server for hundreds of ms when locust shares the machine (docs/benchmark.md)",
    )
    p.add_argument(
        "--host", default="", help="test this running server's HTTP URL instead of starting Mariner"
    )
    p.add_argument("--grpc-target", default="", help="with --host: the server's gRPC host:port")
    p.add_argument(
        "--protocols",
        default=",".join(USER_CLASS_NAMES),
        help=f"comma-separated, from {sorted(USER_CLASS_NAMES)}; users are split evenly among them",
    )
    p.add_argument("--users", type=int, default=8, help="concurrent locust users (bounded load)")
    p.add_argument("--spawn-rate", type=float, default=0.0, help="users started per second (0: all at once)")
    p.add_argument(
        "--run-time", type=float, default=20.0, help="seconds of load, counted once every user is spawned"
    )
    p.add_argument("--p99-ms", type=float, default=DEFAULT_P99_MS)
    p.add_argument("--max-fail-ratio", type=float, default=DEFAULT_MAX_FAIL_RATIO)
    p.add_argument(
        "--min-requests",
        type=int,
        default=DEFAULT_MIN_REQUESTS,
        help="requests each protocol must make; with --library the run goes on until they are made",
    )
    p.add_argument(
        "--max-run-time",
        type=float,
        default=600.0,
        help="with --library: stop after this many seconds even when --min-requests is not reached",
    )
    p.add_argument(
        "--report-dir", type=Path, default=REPO / "build" / "loadtest", help="CSV, HTML and verdict.json"
    )
    p.add_argument(
        "--library", action="store_true", help="drive locust in library mode in this process (no CLI)"
    )
    args = p.parse_args(argv)
    if bool(args.host) != bool(args.grpc_target):
        p.error("--host and --grpc-target go together (both name a running server)")
    args.protocols = [x.strip() for x in args.protocols.split(",") if x.strip()]
    unknown = [x for x in args.protocols if x not in USER_CLASS_NAMES]
    if unknown or not args.protocols:
        p.error(f"--protocols: unknown {unknown}; known: {sorted(USER_CLASS_NAMES)}")
    if args.users < len(args.protocols):
        p.error("--users must be at least the number of protocols (one user each)")
    return args


def _run_cli(args: argparse.Namespace, host: str, grpc_target: str) -> int:
    """The locust CLI, headless, in a subprocess; its output goes straight to ours."""
    report = args.report_dir
    cmd = [
        sys.executable, "-m", "locust", "-f", str(REPO / "loadtest" / "locustfile.py"), "--headless",
        "--only-summary", "-u", str(args.users), "-r", str(args.spawn_rate or args.users),
        "-t", f"{args.run_time:g}s", "--stop-timeout", "5",
        "--host", host, "--grpc-target", grpc_target, "--model", args.model,
        "--p99-ms", str(args.p99_ms), "--max-fail-ratio", str(args.max_fail_ratio),
        "--min-requests", str(args.min_requests),
        "--csv", str(report / "stats"), "--html", str(report / "report.html"),
        "--verdict-file", str(report / VERDICT_FILE),
        *(USER_CLASS_NAMES[p] for p in args.protocols),
    ]  # fmt: skip
    print("$ " + " ".join(cmd), flush=True)
    return subprocess.run(cmd, cwd=REPO, check=False).returncode


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse(argv)
    args.report_dir.mkdir(parents=True, exist_ok=True)
    (args.report_dir / VERDICT_FILE).unlink(missing_ok=True)
    server = None
    if args.host:
        host, grpc_target = args.host, args.grpc_target
    else:
        from mariner.loadtest.servers import MarinerProcess

        server = MarinerProcess(args.store, f"{args.model}.mar", torch_threads=args.torch_threads)
        print(f"starting Mariner with {args.model} from {args.store} ...", flush=True)
        server.start()
        host, grpc_target = server.http_url, server.grpc_target
        print(f"Mariner ready in {server.ready_seconds:.1f} s: {host}, gRPC {grpc_target}", flush=True)
    try:
        if args.library:
            code, verdict = run_library(
                host=host,
                grpc_target=grpc_target,
                model=args.model,
                protocols=args.protocols,
                users=args.users,
                spawn_rate=args.spawn_rate or args.users,
                run_time_s=args.run_time,
                slo=Slo(args.p99_ms, args.max_fail_ratio, args.min_requests),
                report_dir=args.report_dir,
                max_run_time_s=args.max_run_time,
            )
        else:
            code = _run_cli(args, host, grpc_target)
    finally:
        if server is not None:
            server.stop()
            print("Mariner stopped", flush=True)
    verdict_path = args.report_dir / VERDICT_FILE
    if not verdict_path.exists():
        print(f"loadtest: no verdict (locust exited {code} before judging the run)", file=sys.stderr)
        return code or 2
    v = json.loads(verdict_path.read_text())
    print(
        f"loadtest: p50={v['p50_ms']:.2f} ms  p95={v['p95_ms']:.2f} ms  p99={v['p99_ms']:.2f} ms  "
        f"failures={v['fail_ratio']:.2%}  rps={v['rps']:.0f}  -> {'PASS' if v['passed'] else 'FAIL'}"
        + ("" if v["passed"] else f" ({'; '.join(v['reasons'])})")
        + f"\nreports: {args.report_dir}/stats_stats.csv, {args.report_dir}/report.html",
        flush=True,
    )
    return code


if __name__ == "__main__":
    sys.exit(main())
