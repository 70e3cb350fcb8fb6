"""Two builds of Mariner served side by side and driven in turn: what one change does live.

    python -m mariner.loadtest.experiments.ab_live --base a58a503              # 10 rounds of 3 s, 64 clients
    python -m mariner.loadtest.experiments.ab_live --base HEAD~1 --clients 8 --rounds 6

`--base` is any git ref: it is checked out into a temporary worktree and served from there (a
directory on PYTHONPATH whose `mariner` is that tree, ahead of this checkout's editable install),
with this checkout's generated gRPC stubs (`server/_proto`, not in git) and model store. The other
server is this checkout. Both run `mariner serve` with the benchmark's settings (one model, one
torch thread, TorchServe's metric names) and are driven by the benchmark's closed-loop client
(`closedloop.run_level`, HTTP `/predictions`), one after the other in each round.

Why a tool of its own: on a small shared machine the same build moves by 10% and more between
runs, more than most single changes, so only builds measured in the same minutes compare. And
the server measured first in a round does better (the client processes' start-up lands on the
other), so each build goes first in half the rounds. Per-process CPU (frontend, worker,
supervisor) comes from /proc over each level, warm-up included (~1% of the requests).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import psutil

from mariner.loadtest.closedloop import LevelResult, LoadSpec, run_level
from mariner.loadtest.payloads import test_digit_bodies
from mariner.loadtest.servers.mariner import REPO, MarinerProcess
from mariner.loadtest.servers.process import LOCALHOST

# A server process's role, from its command line (the supervisor is whatever else runs).
ROLES = (("frontend", "frontend.main"), ("worker", "worker.main"), ("zygote", "worker.zygote"))
WARMUP = 256


@dataclass(frozen=True)
class Sample:
    """One level of one build: throughput, latency and CPU µs per request by process role."""

    rps: float
    p50_ms: float
    p99_ms: float
    cpu_us: dict[str, float]


def role(cmdline: Sequence[str]) -> str:
    line = " ".join(cmdline)
    return next((name for name, mark in ROLES if mark in line), "supervisor")


def cpu_by_role(pid: int) -> dict[str, float]:
    """CPU seconds so far of the server's process tree, summed by role."""
    out: dict[str, float] = {}
    root = psutil.Process(pid)
    for p in [root, *root.children(recursive=True)]:
        with contextlib.suppress(psutil.Error):
            t = p.cpu_times()
            r = role(p.cmdline())
            out[r] = out.get(r, 0.0) + t.user + t.system
    return out


def path_first(path: Path) -> dict[str, str]:
    """This process's environment with `path` first on PYTHONPATH."""
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(path), os.environ.get("PYTHONPATH")])),
    }


def imported_from(path: Path, module: str) -> str:
    """The file `module` is imported from with `path` first on PYTHONPATH."""
    code = f"import {module} as m; print(m.__file__)"
    return subprocess.run([sys.executable, "-c", code], env=path_first(path), capture_output=True,
                          text=True, check=True).stdout.strip()  # fmt: skip


@contextlib.contextmanager
def checkout(ref: str) -> Iterator[Path]:
    """A directory to put on PYTHONPATH that imports `mariner` from `ref`'s tree."""
    tmp = Path(tempfile.mkdtemp(prefix="ab-live-"))
    tree = tmp / "tree"
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", "-q", str(tree), ref], check=True)
    try:
        shutil.copytree(REPO / "server" / "_proto", tree / "server" / "_proto", dirs_exist_ok=True)
        (tmp / "path").mkdir()
        (tmp / "path" / "mariner").symlink_to(tree)
        origin = imported_from(tmp / "path", "mariner.server.cli")
        if not origin.startswith(str(tmp / "path")):
            raise RuntimeError(f"the base build would import mariner from {origin}, not from {tree}")
        yield tmp / "path"
    finally:
        subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree)], check=False)
        shutil.rmtree(tmp, ignore_errors=True)


def drive(
    server: MarinerProcess, name: str, *, model: str, clients: int, seconds: float, bodies: tuple[bytes, ...]
) -> tuple[LevelResult, int]:
    """One level of the benchmark's closed loop (HTTP `/predictions`) against `server`, refused on
    any error; with the requests it answered, warm-up included (a CPU reading taken around it
    covers those too)."""
    assert server.pid is not None
    level = run_level(
        server=name, protocol="http", host=LOCALHOST, port=server.ports.inference, model=model,
        concurrency=clients, load=LoadSpec(requests=0, warmup=WARMUP, duration_s=seconds),
        bodies=bodies, server_pid=server.pid,
    )  # fmt: skip
    if level.errors:
        raise RuntimeError(f"{name}: {level.errors} errors, the first: {level.first_error}")
    return level, level.latency.n + max(WARMUP, clients * LoadSpec(0, 0).min_warmup_per_client)


def measure(
    servers: dict[str, MarinerProcess], *, model: str, rounds: int, seconds: float, clients: int
) -> dict[str, list[Sample]]:
    bodies = test_digit_bodies()
    names = list(servers)
    samples: dict[str, list[Sample]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:  # each build first in half the rounds
            server = servers[name]
            assert server.pid is not None
            before = cpu_by_role(server.pid)
            level, answered = drive(
                server, name, model=model, clients=clients, seconds=seconds, bodies=bodies
            )
            after = cpu_by_role(server.pid)
            cpu = {k: (after[k] - before.get(k, 0.0)) / answered * 1e6 for k in after}
            samples[name].append(
                Sample(level.throughput_rps, level.latency.p50_ms, level.latency.p99_ms, cpu)
            )
            by_role = ", ".join(f"{k} {v:.0f}" for k, v in sorted(cpu.items()))
            rate, p50 = level.throughput_rps, level.latency.p50_ms
            line = f"  round {r + 1} {name:>4}: {rate:7.0f} req/s, p50 {p50:.2f} ms, {by_role} µs/req"
            print(line, flush=True)
    return samples


def report(samples: dict[str, list[Sample]]) -> str:
    """Medians per build, and the median of the per-round ratios new / base."""
    roles = sorted({k for runs in samples.values() for s in runs for k in s.cpu_us})
    head = "| build | req/s | p50 ms | p99 ms | " + " | ".join(f"{r} µs/req" for r in roles) + " | total |"
    lines = [head, "|---" * (5 + len(roles)) + "|"]
    for name, runs in samples.items():
        cpu = [statistics.median(s.cpu_us.get(r, 0.0) for s in runs) for r in roles]
        total = statistics.median(sum(s.cpu_us.values()) for s in runs)
        rps = statistics.median(s.rps for s in runs)
        p50 = statistics.median(s.p50_ms for s in runs)
        p99 = statistics.median(s.p99_ms for s in runs)
        by_role = " | ".join(f"{c:.1f}" for c in cpu)
        lines.append(f"| {name} | {rps:,.0f} | {p50:.2f} | {p99:.2f} | {by_role} | {total:.1f} |")
    base, new = samples["base"], samples["new"]
    pairs = list(zip(new, base, strict=True))
    rps_ratio = statistics.median(n.rps / b.rps for n, b in pairs)
    fe_ratio = statistics.median(
        n.cpu_us.get("frontend", 0.0) / b.cpu_us.get("frontend", 1.0) for n, b in pairs
    )
    lines.append(
        f"\nnew / base, median of the rounds: throughput {rps_ratio:.3f}, frontend CPU {fe_ratio:.3f}"
    )
    return "\n".join(lines)


def live_parser(doc: str | None, *, rounds: int, seconds: float) -> argparse.ArgumentParser:
    """The options of every live experiment: the model served and its store, and the closed
    loop's rounds (`rounds` by default), seconds per level and clients (64)."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="digits_torchscript")
    p.add_argument("--model-store", type=Path, default=REPO / "model_store")
    p.add_argument("--rounds", type=int, default=rounds)
    p.add_argument("--seconds", type=float, default=seconds)
    p.add_argument("--clients", type=int, default=64)
    return p


def check_live(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    """Refuse (as argparse does) rounds, seconds or clients that are not positive."""
    if a.rounds < 1 or a.seconds <= 0 or a.clients < 1:
        p.error("--rounds, --seconds and --clients must be positive")


def main(argv: Sequence[str] | None = None) -> None:
    p = live_parser(__doc__, rounds=10, seconds=3.0)
    p.add_argument("--base", required=True, help="git ref of the build to compare this checkout with")
    a = p.parse_args(argv)
    check_live(p, a)
    with checkout(a.base) as path:
        compare(a, base_env=path_first(path), new_env=None, names=(a.base, "this checkout"))


def compare(
    a: argparse.Namespace,
    *,
    base_env: dict[str, str] | None,
    new_env: dict[str, str] | None,
    names: tuple[str, str],
) -> None:
    """Serve the two builds (each env's PYTHONPATH picks its `mariner`; None: this checkout),
    drive them in turn as `a` says (model, model_store, rounds, seconds, clients) and print the
    rounds and the report."""
    builds = {
        "base": MarinerProcess(a.model_store, a.model, torch_threads=1, env=base_env),
        "new": MarinerProcess(a.model_store, a.model, torch_threads=1, env=new_env),
    }
    with contextlib.ExitStack() as stack:
        for server in builds.values():
            stack.enter_context(server)
        print(f"base: {names[0]}; new: {names[1]}; {a.clients} clients, {a.rounds} x {a.seconds:g} s")
        samples = measure(builds, model=a.model, rounds=a.rounds, seconds=a.seconds, clients=a.clients)
        print(report(samples), flush=True)


if __name__ == "__main__":
    main()
