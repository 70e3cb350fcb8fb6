"""Triton's perf_analyzer against a running Mariner: concurrency 1 and 64 over HTTP and gRPC.

perf_analyzer is the load generator Triton users already trust, so its figures are ones they can
compare with their own; it is a C++ client we did not write, so it also checks that our Open
Inference Protocol endpoints (metadata, config, statistics, infer) satisfy a real Triton tool.

Finding it: `MARINER_PERF_ANALYZER` (the binary) and `MARINER_PERF_ANALYZER_LIBDIR` (a directory
with a newer glibc's `ld-linux-x86-64.so.2`, libc and libstdc++), else what
`scripts/ensure_perf_analyzer.sh` put in `.tools/perf_analyzer`, else `perf_analyzer` on PATH.
The 2.60 wheel's binary needs glibc 2.38; on Debian 12 it runs through Debian 13's loader with
`--library-path`, which is what a LIBDIR means here. When none runs, every level is skipped with
the reason printed, and the bench goes on.

Each level is one perf_analyzer process with a wall-clock bound: a run past it is reported as
hung (and killed with its process group), never waited on, so a client that stops at its end
cannot stall a bench. Figures come from its `-f` CSV: throughput (infer/s), p50 and p99 (µs).
Its server-side section is not used: perf_analyzer matches statistics by an integer version
(`std::to_string(std::stoll(version))`), so a TorchServe version such as "1.0" reads as "1" and
its server counts show 0 although our statistics are there under "1.0".
"""

from __future__ import annotations

import argparse
import csv
import io
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TOOLS = REPO / ".tools" / "perf_analyzer"
SYSTEM_LIBS = ("/lib/x86_64-linux-gnu", "/usr/lib/x86_64-linux-gnu")
LOADER = "ld-linux-x86-64.so.2"
PROTOCOLS = ("http", "grpc")
CONCURRENCIES = (1, 64)
# A level is 3+ windows (stability needs the last three) plus start-up; past this it is hung.
DEFAULT_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class Launcher:
    """The argv prefix that starts perf_analyzer here (binary alone, or through a loader)."""

    argv: tuple[str, ...]
    version: str


@dataclass(frozen=True)
class Options:
    """How each level measures. perf_analyzer's defaults (2 s windows, stable within 10 %,
    10 trials); a shared or noisy machine needs a wider `stability_pct` to get figures at all."""

    measurement_ms: int = 2000
    stability_pct: float = 10.0
    max_trials: int = 10
    input_data: str = "zero"
    timeout_s: float = DEFAULT_TIMEOUT_S


@dataclass(frozen=True)
class LevelResult:
    """One perf_analyzer run: `status` is ok, unstable (no stable window, no figures), failed,
    hung or skipped; figures are NaN unless ok."""

    protocol: str
    concurrency: int
    status: str
    throughput: float = float("nan")
    p50_us: float = float("nan")
    p99_us: float = float("nan")
    seconds: float = 0.0
    detail: str = ""


def _launchers(binary: str, libdir: str | None) -> list[tuple[str, ...]]:
    out: list[tuple[str, ...]] = [(binary,)]
    if libdir:
        path = ":".join((libdir, *SYSTEM_LIBS))
        out.insert(0, (str(Path(libdir) / LOADER), "--library-path", path, binary))
    return out


def _version(argv: tuple[str, ...]) -> str | None:
    try:
        done = subprocess.run([*argv, "--version"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    text = (done.stdout + done.stderr).strip()
    return text if done.returncode == 0 and "Perf Analyzer" in text else None


def locate(env: dict[str, str] | None = None) -> Launcher | str:
    """A runnable perf_analyzer, or the reason there is none (what was tried)."""
    env = dict(os.environ) if env is None else env
    candidates: list[tuple[str, str | None]] = []
    if env.get("MARINER_PERF_ANALYZER"):
        candidates.append((env["MARINER_PERF_ANALYZER"], env.get("MARINER_PERF_ANALYZER_LIBDIR")))
    local = TOOLS / "bin" / "perf_analyzer"
    if local.exists():
        candidates.append((str(local), str(TOOLS / "glibc" / "usr" / "lib" / "x86_64-linux-gnu")))
    on_path = shutil.which("perf_analyzer", path=env.get("PATH"))
    if on_path:
        candidates.append((on_path, env.get("MARINER_PERF_ANALYZER_LIBDIR")))
    if not candidates:
        return (
            "perf_analyzer not found: set MARINER_PERF_ANALYZER (and MARINER_PERF_ANALYZER_LIBDIR "
            "for a private glibc) or run scripts/ensure_perf_analyzer.sh"
        )
    tried = []
    for binary, libdir in candidates:
        for argv in _launchers(binary, libdir if libdir and Path(libdir, LOADER).exists() else None):
            version = _version(argv)
            if version:
                return Launcher(argv, version)
            tried.append(" ".join(argv))
    return "perf_analyzer does not run (tried: " + "; ".join(tried) + ")"


def parse_csv(text: str) -> dict[int, tuple[float, float, float]]:
    """perf_analyzer's `-f` report: concurrency -> (infer/s, p50 µs, p99 µs)."""
    out = {}
    for row in csv.DictReader(io.StringIO(text)):
        try:
            level = int(row["Concurrency"])
            out[level] = (
                float(row["Inferences/Second"]),
                float(row["p50 latency"]),
                float(row["p99 latency"]),
            )
        except (KeyError, TypeError, ValueError):
            continue
    return out


def command(
    launcher: Launcher,
    *,
    protocol: str,
    url: str,
    model: str,
    concurrency: int,
    csv_path: Path,
    options: Options = Options(),
) -> list[str]:
    """The perf_analyzer argv for one level (synchronous calls, one request per client)."""
    return [
        *launcher.argv,
        "-m", model, "-u", url, "-i", protocol,
        "--concurrency-range", str(concurrency),
        "--measurement-interval", str(options.measurement_ms),
        "--stability-percentage", str(options.stability_pct),
        "--max-trials", str(options.max_trials),
        "--input-data", options.input_data,
        "-f", str(csv_path),
    ]  # fmt: skip


def run_level(
    launcher: Launcher, *, protocol: str, url: str, model: str, concurrency: int, options: Options = Options()
) -> LevelResult:
    """One level; a run past `options.timeout_s` is killed with its process group and reported hung."""
    timeout_s = options.timeout_s
    with tempfile.TemporaryDirectory(prefix="mariner-pa-") as tmp:
        csv_path = Path(tmp) / "report.csv"
        argv = command(
            launcher,
            protocol=protocol,
            url=url,
            model=model,
            concurrency=concurrency,
            csv_path=csv_path,
            options=options,
        )
        started = time.monotonic()
        proc = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
        )
        try:
            output, _ = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            output, _ = proc.communicate()
            tail = output.strip().splitlines()[-1:] or [""]
            detail = f"killed after {timeout_s:.0f} s; last line: {tail[0]}"
            return LevelResult(protocol, concurrency, "hung", seconds=timeout_s, detail=detail)
        seconds = time.monotonic() - started
        rows = parse_csv(csv_path.read_text()) if csv_path.exists() else {}
    if concurrency in rows:
        throughput, p50, p99 = rows[concurrency]
        return LevelResult(protocol, concurrency, "ok", throughput, p50, p99, seconds)
    lines = [line for line in output.strip().splitlines() if line.strip()]
    detail = lines[-1] if lines else f"exit status {proc.returncode}"
    # No stable windows, or a window no request both started and ended in (a loaded machine):
    # the measurement's fault, not an answer's, so not "failed".
    unstable = "stable measurement" in output or "No valid requests recorded" in output
    status = "unstable" if unstable else "failed"
    return LevelResult(protocol, concurrency, status, seconds=seconds, detail=detail)


def run_matrix(
    *,
    http: str | None,
    grpc: str | None,
    model: str,
    concurrencies: Sequence[int] = CONCURRENCIES,
    options: Options = Options(),
    launcher: Launcher | str | None = None,
) -> list[LevelResult]:
    """Every (protocol, concurrency) against the addresses given ("host:port"); skipped when
    perf_analyzer does not run here or an address is missing."""
    found = locate() if launcher is None else launcher
    urls = {"http": http, "grpc": grpc}
    out = []
    for protocol in PROTOCOLS:
        for level in concurrencies:
            url = urls[protocol]
            if isinstance(found, str) or not url:
                reason = found if isinstance(found, str) else f"no {protocol} address"
                out.append(LevelResult(protocol, level, "skipped", detail=reason))
                continue
            out.append(
                run_level(found, protocol=protocol, url=url, model=model, concurrency=level, options=options)
            )
    return out


def table(results: Sequence[LevelResult]) -> str:
    """A markdown table of the levels (figures for ok levels, the reason for the others)."""
    lines = [
        "| protocol | clients | status | infer/s | p50 ms | p99 ms | note |",
        "|---|---:|---|---:|---:|---:|---|",
    ]
    for r in results:
        if r.status == "ok":
            figures = f"{r.throughput:.0f} | {r.p50_us / 1000:.2f} | {r.p99_us / 1000:.2f}"
        else:
            figures = "– | – | –"
        lines.append(f"| {r.protocol} | {r.concurrency} | {r.status} | {figures} | {r.detail} |")
    return "\n".join(lines)


def notes(results: Sequence[LevelResult]) -> list[str]:
    """One report note per level, for the bench's notes list (one line each, no table)."""
    out = []
    for r in results:
        where = f"perf_analyzer (Triton's load generator) over {r.protocol} at {r.concurrency} clients"
        if r.status == "ok":
            p50, p99 = r.p50_us / 1000, r.p99_us / 1000
            out.append(f"{where}: {r.throughput:,.0f} infer/s, p50 {p50:.2f} ms, p99 {p99:.2f} ms.")
        else:
            out.append(f"{where}: {r.status} ({r.detail}).")
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--http", help="Mariner's REST inference address, host:port")
    parser.add_argument("--grpc", help="Mariner's gRPC inference address, host:port")
    parser.add_argument("--model", required=True)
    parser.add_argument("--concurrency", type=int, nargs="+", default=list(CONCURRENCIES))
    parser.add_argument("--measurement-ms", type=int, default=2000)
    parser.add_argument("--stability-pct", type=float, default=10.0)
    parser.add_argument("--max-trials", type=int, default=10)
    parser.add_argument("--input-data", default="zero", help="zero, random or a JSON file")
    parser.add_argument("--timeout-s", type=float, default=DEFAULT_TIMEOUT_S)
    args = parser.parse_args(argv)
    found = locate()
    if isinstance(found, str):
        print(f"perf_analyzer: skipped: {found}")
        return 0
    print(f"perf_analyzer: {found.version} ({' '.join(found.argv)})")
    results = run_matrix(
        http=args.http,
        grpc=args.grpc,
        model=args.model,
        concurrencies=args.concurrency,
        options=Options(
            args.measurement_ms, args.stability_pct, args.max_trials, args.input_data, args.timeout_s
        ),
        launcher=found,
    )
    print(table(results))
    return 1 if any(r.status == "hung" for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
