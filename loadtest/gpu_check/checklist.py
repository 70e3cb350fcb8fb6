"""The GPU checklist's frame: a section that never stops the others, the environment section,
the report, and `main`, which runs every section in order (the package docstring lists them).
"""

from __future__ import annotations

import argparse
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from mariner.loadtest.gpu_check.bench import accel_bench, digits_bench
from mariner.loadtest.gpu_check.digits import out_of_memory, recompiles, serve, verify_archives
from mariner.loadtest.gpu_check.families import Budget, family_recompiles, serve_families, verify_families

REPO = Path(__file__).resolve().parents[2]


@dataclass
class Section:
    """One checklist item: passed, skipped (with why) or failed, plus its table rows."""

    title: str
    status: str = "pending"
    notes: list[str] = field(default_factory=list)
    rows: list[dict[str, Any]] = field(default_factory=list)


# The sections' keys for --only, in the order `main` runs them (the package docstring's 1 to 7).
SECTION_KEYS = (
    "environment",
    "archives",
    "recompiles",
    "oom",
    "serve",
    "families",
    "family-recompiles",
    "family-serve",
    "accel-bench",
    "bench",
)


def section_keys(text: str) -> frozenset[str]:
    """--only's value: comma-separated keys of SECTION_KEYS, at least one."""
    keys = frozenset(k.strip() for k in text.split(",") if k.strip())
    unknown = sorted(keys - set(SECTION_KEYS))
    if unknown or not keys:
        named = ", ".join(unknown) or "(none given)"
        raise argparse.ArgumentTypeError(
            f"unknown section {named}; the sections are {', '.join(SECTION_KEYS)}"
        )
    return keys


def not_asked(title: str, only: frozenset[str]) -> Section:
    """A section left out by --only: skipped, and the report says why."""
    return Section(title, "skipped", notes=[f"Not asked for: --only {','.join(sorted(only))}."])


def run_section(title: str, fn: Callable[[Section], None]) -> Section:
    sec = Section(title)
    t0 = time.perf_counter()
    try:
        fn(sec)
        if sec.status == "pending":
            sec.status = "passed"
    except Exception:
        sec.status = "failed"
        sec.notes.append("```\n" + traceback.format_exc(limit=6) + "```")
    sec.notes.append(f"({time.perf_counter() - t0:.1f} s)")
    print(f"[gpu-check] {title}: {sec.status}", flush=True)
    return sec


def cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def environment(sec: Section, device: str) -> None:
    sec.rows.append({"fact": "python", "value": platform.python_version()})
    sec.rows.append({"fact": "torch", "value": torch.__version__})
    sec.rows.append({"fact": "cuda (torch build)", "value": str(torch.version.cuda)})
    if device == "cuda":
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            sec.rows.append(
                {
                    "fact": f"cuda:{i}",
                    "value": f"{p.name}, {p.total_memory / 2**30:.0f} GiB, sm_{p.major}{p.minor}",
                }
            )
    try:
        import onnxruntime as ort

        sec.rows.append({"fact": "onnxruntime providers", "value": ", ".join(ort.get_available_providers())})
    except ImportError:
        sec.rows.append({"fact": "onnxruntime", "value": "not installed"})
    if shutil.which("nvidia-smi"):
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        sec.rows.append({"fact": "nvidia-smi", "value": out.stdout.strip().replace("\n", "; ")})
    isa = sorted(cpu_flags() & {"avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16"})
    sec.rows.append(
        {"fact": "cpu", "value": f"{platform.processor() or platform.machine()}; {' '.join(isa)}"}
    )


def table(rows: Sequence[dict[str, Any]]) -> list[str]:
    if not rows:
        return []
    keys = list(dict.fromkeys(k for r in rows for k in r))
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(str(r.get(k, "")) for k in keys) + " |" for r in rows]
    return lines


def report(sections: Sequence[Section], device: str, quick: bool, seconds: float) -> str:
    head = "# GPU checklist" if device == "cuda" else "# GPU checklist: CPU dry run (no GPU figure here)"
    lines = [
        head,
        "",
        f"`python -m mariner.loadtest.gpu_check --device {device}{' --quick' if quick else ''}`,",
    ]
    lines += [f"{seconds:.0f} s, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}.", ""]
    lines += ["| section | status |", "|---|---|"] + [f"| {s.title} | {s.status} |" for s in sections]
    for s in sections:
        lines += ["", f"## {s.title}: {s.status}", "", *table(s.rows), "", *s.notes]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["carry"]:  # pack the MiniLM weights here, unpack them there
        from mariner.loadtest.gpu_check import carry

        return carry.main(args[1:])
    p = argparse.ArgumentParser(
        prog="python -m mariner.loadtest.gpu_check", description=__doc__.split("\n")[0]
    )
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--quick", action="store_true", help="batch sizes 1..8 and a 1-second benchmark")
    p.add_argument("--store", type=Path, default=REPO / "model_store")
    p.add_argument("--out", type=Path, default=None, help="report file (default bench/results-gpu.md)")
    p.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="seconds for the whole check; steps that no longer fit are skipped and named "
        "(default 480 on CUDA: an 8-minute slot; no limit on the CPU)",
    )
    p.add_argument(
        "--only",
        type=section_keys,
        default=None,
        metavar="KEY[,KEY...]",
        help="run only these sections, the others reported as skipped (a rerun of what failed, "
        f"or the dry run split in parts): {', '.join(SECTION_KEYS)}",
    )
    a = p.parse_args(args)
    if a.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda but CUDA is not available here (use --device cpu for the dry run)")
    out = a.out or (
        REPO / "bench" / "results-gpu.md" if a.device == "cuda" else REPO / "build" / "gpu-check.md"
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    store = a.store.resolve()
    t0 = time.perf_counter()
    top = 8 if a.quick else 128
    bench_out = out.parent / f"{out.stem}-bench"
    budget = Budget.of(a.budget_s or (480.0 if a.device == "cuda" else 3600.0))
    n = 8 if a.quick else 64  # requests per family compared with the CPU reference
    with tempfile.TemporaryDirectory(prefix="mariner-gpu-check-") as tmp:
        work = Path(tmp)
        steps: list[tuple[str, str, Callable[[Section], None]]] = [  # (--only key, title, step)
            ("environment", "environment", lambda s: environment(s, a.device)),
            ("archives", "archives vs eager", lambda s: verify_archives(s, store, a.device, work)),
            (
                "recompiles",
                "no recompiles after warm-up",
                lambda s: recompiles(s, store, a.device, work, top),
            ),
            ("oom", "out-of-memory recognised", lambda s: out_of_memory(s, store, a.device, work)),
            ("serve", "mariner serve", lambda s: serve(s, store, a.device, work)),
            (
                "families",
                "minilm and resnet18 vs eager",
                lambda s: verify_families(s, store, a.device, work, n, budget),
            ),
            (
                "family-recompiles",
                "minilm and resnet18: no graphs after warm-up",
                lambda s: family_recompiles(s, store, a.device, work, 4 if a.quick else top, budget),
            ),
            (
                "family-serve",
                "mariner serve: minilm and resnet18",
                lambda s: serve_families(s, store, a.device, work, n, budget),
            ),
            (
                "accel-bench",
                "minilm and resnet18: bf16 and CUDA graphs benchmark",
                lambda s: accel_bench(
                    s, store, a.device, a.quick, work, out.parent / f"{out.stem}-accel", budget
                ),
            ),
            ("bench", "benchmark", lambda s: digits_bench(s, store, a.quick, bench_out, budget)),
        ]
        assert tuple(key for key, _, _ in steps) == SECTION_KEYS
        sections = [
            run_section(title, step) if a.only is None or key in a.only else not_asked(title, a.only)
            for key, title, step in steps
        ]
    out.write_text(report(sections, a.device, a.quick, time.perf_counter() - t0))
    print(f"[gpu-check] report: {out}", flush=True)
    return 1 if any(s.status == "failed" for s in sections) else 0
