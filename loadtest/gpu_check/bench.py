"""The GPU checklist's benchmarks: the digits archive's short one, and the MiniLM and ResNet-18
archives with and without bf16 and CUDA graphs.

What a user asks of a GPU lease: how much do `autocast: bf16` and `cudaGraphs: true` buy on each
workload, served by Mariner and by stock TorchServe, at 1, 8 and 64 closed-loop clients. Each
setting is the family's eager archive rewritten with that handler key (`variant_archive`, same
file name and members; on CUDA also `deviceType: gpu`) in a store of its own, and
`mariner.loadtest.bench --model` runs it; this module only chooses the runs, fits them in the
time left, and gathers one table.

Stock TorchServe needs Java 17 and the torchserve wheel: where either is missing (the GPU
machine has no Java) it is left out and the report says so. A run whose estimated cost no longer
fits the budget is skipped and named in the notes.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mariner.loadtest.gpu_check.families import Budget
from mariner.loadtest.gpu_check.workloads import ACCEL_VARIANTS, family_archives, on_gpu, variant_archive

if TYPE_CHECKING:
    from mariner.loadtest.gpu_check.checklist import Section

FIRST_RUN_ESTIMATE_S = 45.0  # before any run was timed: start-up, warm-up, levels, raw ceiling


@dataclass(frozen=True)
class Plan:
    """The runs a benchmark makes: archives (stems), accel settings, servers, levels, seconds."""

    models: tuple[str, ...]
    settings: tuple[str, ...]  # "fp32" (as built) or keys of ACCEL_VARIANTS
    servers: tuple[str, ...]
    levels: tuple[int, ...]
    duration_s: float
    raw_seconds: float


def torchserve_available() -> str | None:
    """Why stock TorchServe cannot run here, or None when it can."""
    if shutil.which("java") is None:
        return "no Java on PATH (stock TorchServe's frontend is Java 17)"
    try:
        import ts  # noqa: F401
    except ImportError:
        return "the torchserve package is not installed"
    return None


def plan(store: Path, device: str, quick: bool, torchserve: bool) -> Plan:
    found = family_archives(store)
    eager = tuple(f"{fam}_eager" for fam in sorted(found) if (store / f"{fam}_eager.mar").exists())
    if quick:  # the dry run proves the path (variant archive, bench --model, results): one run
        return Plan(eager[:1], ("bf16",), ("mariner",), (1,), 1.0, 1.0)
    # most telling first: a budget that runs out drops the last ones
    settings = ("fp32", "bf16+graphs", "bf16", "graphs") if device == "cuda" else ("fp32", "bf16")
    servers = ("raw", "mariner", "torchserve") if torchserve else ("raw", "mariner")
    return Plan(eager, settings, servers, (1, 8, 64), 3.0, 2.0)


def bench_args(p: Plan, model: str, store: Path, out: Path) -> list[str]:
    return [
        "--store", str(store), "--model", model, "--servers", ",".join(p.servers),
        "--levels", ",".join(map(str, p.levels)), "--duration", str(p.duration_s),
        "--repeats", "1", "--protocols", "http", "--warmup", "20", "--raw-seconds", str(p.raw_seconds),
        "--no-startup", "--no-padding-compare", "--torchserve-warmup-cap", "10", "--out", str(out),
    ]  # fmt: skip


def rows_from(results: dict[str, Any], model: str, setting: str) -> list[dict[str, Any]]:
    """One row per server and client level (plus the raw ceiling) from bench's results JSON."""
    rows: list[dict[str, Any]] = []
    raw = results.get("raw") or {}
    if raw.get("batched_rps"):
        rows.append(
            {"model": model, "setting": setting, "server": "raw (full batches)", "clients": "-",
             "req/s": f"{raw['batched_rps']:.0f}", "p99 ms": "-", "errors": 0}
        )  # fmt: skip
    for cell in results.get("levels", []):
        rows.append(
            {
                "model": model,
                "setting": setting,
                "server": cell["server"],
                "clients": cell["concurrency"],
                "req/s": f"{cell['throughput_rps']:.0f}",
                "p99 ms": f"{cell['latency']['p99_ms']:.1f}",
                "errors": cell["errors"],
            }
        )
    return rows


def speedups(rows: Sequence[dict[str, Any]]) -> list[str]:
    """Each setting's Mariner throughput at its highest client level over the fp32 archive's."""
    top: dict[tuple[str, str], tuple[int, float]] = {}
    for r in rows:
        if r["server"] != "mariner" or r["clients"] == "-":
            continue
        key, level = (r["model"], r["setting"]), int(r["clients"])
        if level >= top.get(key, (0, 0.0))[0]:
            top[key] = (level, float(r["req/s"]))
    out = []
    for (model, setting), (level, rps) in sorted(top.items()):
        base = top.get((model, "fp32"))
        if setting != "fp32" and base and base[0] == level and base[1] > 0:
            out.append(
                f"{model} {setting}: {rps / base[1]:.2f}x the fp32 archive's Mariner req/s at {level} clients"
            )
    return out


def accel_bench(
    sec: Section, store: Path, device: str, quick: bool, work: Path, out: Path, budget: Budget
) -> None:
    why_not_ts = None if quick else torchserve_available()
    p = plan(store, device, quick, torchserve=why_not_ts is None)
    if not p.models:
        sec.status = "skipped"
        sec.notes.append("No minilm_eager or resnet18_eager archive in the store.")
        return
    if why_not_ts and not quick:
        sec.notes.append(f"Stock TorchServe left out: {why_not_ts}.")
    if quick:
        sec.notes.append("Dry run: one family's bf16 variant, Mariner only, 1 client for 1 s.")
    estimate = FIRST_RUN_ESTIMATE_S
    failed = False
    for setting in p.settings:  # every model at a setting before the next setting
        for model in p.models:
            if not budget.fits(estimate):
                sec.notes.append(
                    f"skipped {model} {setting}: {budget.left():.0f} s left, a run takes ~{estimate:.0f} s"
                )
                continue
            vstore = work / "bench-stores" / setting
            mar = store / f"{model}.mar"
            variant_archive(mar, vstore, ACCEL_VARIANTS.get(setting, {}), on_gpu(device, mar))
            run_out = out / setting
            cmd = [sys.executable, "-m", "mariner.loadtest.bench", *bench_args(p, model, vstore, run_out)]
            t0 = time.perf_counter()
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=max(60.0, budget.left() + 60))
            took = time.perf_counter() - t0
            estimate = max(estimate if estimate != FIRST_RUN_ESTIMATE_S else 0.0, took)
            result = run_out / f"results-{model}.json"
            if proc.returncode != 0 or not result.exists():
                failed = True
                tail = proc.stdout[-1200:] + proc.stderr[-1200:]
                sec.notes.append(f"`{' '.join(cmd[1:])}` exited {proc.returncode}:\n```\n{tail}```")
                continue
            sec.rows.extend(rows_from(json.loads(result.read_text()), model, setting))
            sec.notes.append(f"{model} {setting}: {took:.0f} s, report {run_out / f'results-{model}.md'}")
    sec.notes.extend(speedups(sec.rows))
    if any(int(r.get("errors") or 0) for r in sec.rows):
        failed = True
        sec.notes.append("Some answers were errors (see the errors column).")
    if failed:
        sec.status = "failed"


def digits_bench(sec: Section, store: Path, quick: bool, out: Path, budget: Budget) -> None:
    """The digits archive's short benchmark: raw handler vs Mariner (stock TorchServe when installed)."""
    if not budget.fits(90.0):
        sec.status = "skipped"
        sec.notes.append(f"time budget: {budget.left():.0f} s left, the digits benchmark takes ~90 s")
        return
    servers = ["raw", "mariner"]
    try:
        import ts  # noqa: F401  (stock TorchServe, when installed)

        if not quick:  # its start-up alone outlasts the dry run
            servers.append("torchserve")
    except ImportError:
        sec.notes.append("stock TorchServe is not installed here: Mariner and the raw handler only.")
    args = ["--store", str(store), "--servers", ",".join(servers), "--out", str(out), "--no-startup"]
    if quick:
        args += [
            "--levels",
            "1,8",
            "--duration",
            "1",
            "--warmup",
            "20",
            "--repeats",
            "1",
            "--raw-seconds",
            "1",
        ]
        args += ["--protocols", "http"]
    else:
        args += ["--levels", "1,8,64", "--duration", "5", "--repeats", "1", "--protocols", "grpc,http"]
    cmd = [sys.executable, "-m", "mariner.loadtest.bench", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    sec.notes.append(f"`{' '.join(cmd[1:])}` exited {proc.returncode}; report: {out / 'results.md'}")
    if proc.returncode != 0:
        sec.status = "failed"
        sec.notes.append("```\n" + proc.stdout[-1500:] + proc.stderr[-1500:] + "```")
