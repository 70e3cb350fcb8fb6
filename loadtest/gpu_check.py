"""The GPU checklist: one script a machine with an NVIDIA GPU runs before anyone quotes a GPU figure.

    python -m mariner.loadtest.gpu_check                  # on the GPU machine (make gpu-check)
    python -m mariner.loadtest.gpu_check --device cpu --quick   # CI's dry run, so it cannot rot
    python -m mariner.loadtest.gpu_check carry pack DIR   # the MiniLM weights for the trip there

Why one script: a GPU is lent for minutes, so the first run must measure, not debug. Each
section records what it found and never stops the others; the report says which passed:

1. environment: torch/CUDA/driver, the GPUs, onnxruntime's providers, the CPU's ISA flags;
2. every digits archive of the store loaded through the serving handler on the device (TF32
   off), logits compared with the eager model on the CPU over the 270 test digits; AOTInductor is
   exported again on this device (a package only runs where it was built);
3. the compiled variant at every batch size 1..128 (--quick: 1..8) after the handler's
   warm-up: graphs compiled after warm-up must be 0 (a recompile during live traffic is a
   latency spike);
4. out-of-memory: a batch too large for a capped memory fraction must raise an error the
   server's batch split recognises as out-of-memory (CUDA only; skipped on CPU, said so);
5. `mariner serve` on the device (`--require-gpu` on CUDA): every answer correct, describe's
   workers on the device, the GPU memory gauge on /metrics;
6. a short benchmark (raw handler vs Mariner; stock TorchServe when it is installed);
7. the MiniLM and ResNet-18 archives (`gpu_check_families`): each variant on the device vs
   the family's eager archive on the CPU, AOTInductor re-exported here, bf16 autocast and CUDA
   graphs as variants; no graph compiled or recorded after warm-up; both served by
   `mariner serve`; and (`gpu_check_bench`) Mariner vs stock TorchServe at 1/8/64 clients with
   and without bf16 and CUDA graphs.

Sections 7 run inside `--budget-s` (default 480 s on CUDA, so the whole check fits an 8-minute
slot on an H200): a step that no longer fits is skipped and named in the report. How to run
it on the lent GPU machine (no Java, no torchserve, no grpcio-tools; the MiniLM weights do not
fit one transfer): docs/benchmark.md, "GPU checklist".

The report (markdown) goes to --out (default bench/results-gpu.md; the dry run writes under
build/). A run on the CPU is labelled as such: no GPU figure comes from it.
"""

from __future__ import annotations

import argparse
import json
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

import numpy as np
import requests
import torch

from mariner.loadtest.gpu_check_bench import accel_bench, digits_bench
from mariner.loadtest.gpu_check_families import (
    Budget,
    family_recompiles,
    serve_families,
    verify_families,
    workers_on,
)
from mariner.server.core.archive import open_archive
from mariner.server.core.context import Context
from mariner.training.data import load_splits
from mariner.training.verify import load_handler_class

REPO = Path(__file__).resolve().parent.parent
FP32_TOL = 1e-4


@dataclass
class Section:
    """One checklist item: passed, skipped (with why) or failed, plus its table rows."""

    title: str
    status: str = "pending"
    notes: list[str] = field(default_factory=list)
    rows: list[dict[str, Any]] = field(default_factory=list)


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


def stage(mar: Path, into: Path) -> tuple[Path, dict[str, Any], dict[str, Any]]:
    """Check and unpack an archive exactly as the server does; (model dir, manifest, model-config)."""
    archive = open_archive(mar, into)
    return archive.model_dir, archive.manifest, archive.model_config


def load_on(model_dir: Path, manifest: dict[str, Any], config: dict[str, Any], device: str) -> Any:
    ctx = Context(
        manifest["model"]["modelName"],
        str(model_dir),
        manifest,
        batch_size=int(config.get("batchSize", 1)),
        gpu_id=0 if device == "cuda" else None,
        model_yaml_config=config,
    )
    handler = load_handler_class()()
    handler.initialize(ctx)
    return handler


def export_aoti_here(eager_dir: Path, manifest: dict[str, Any], config: dict[str, Any], out: Path) -> Path:
    """Build an AOTInductor package for this device from the eager archive's weights."""
    from mariner.training.export import export_program
    from mariner.training.verify import load_staged

    handler = load_staged(eager_dir, manifest, config)
    model = handler.model.to("cuda")
    program = export_program(model)  # export_program's example input lives on the CPU
    path = out / "digits_aoti_cuda.pt2"
    torch._inductor.aoti_compile_and_package(program, package_path=str(path))
    return path


def archives(store: Path) -> list[Path]:
    """The digits archives of the store (the other families have their own sections)."""
    index = json.loads((store / "index.json").read_text())
    return [store / a["file"] for a in index["archives"] if a["file"].startswith("digits_")]


def verify_archives(sec: Section, store: Path, device: str, work: Path) -> None:
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 compared with fp32, not TF32
    torch.backends.cudnn.allow_tf32 = False
    test = load_splits().test
    staged = {mar.stem: stage(mar, work) for mar in archives(store)}
    ref = load_on(*staged["digits_eager"], device="cpu")
    x = ref.normalise(test.x)
    ref_logits = ref.logits(x)
    for name, (mdir, manifest, config) in staged.items():
        row: dict[str, Any] = {"archive": name}
        try:
            cfg = json.loads(json.dumps(config))
            section = cfg.setdefault("handler", {})
            if device == "cuda" and section.get("format") == "aoti":
                section["device"] = "cuda"
                cfg["deviceType"] = "gpu"  # the store's CPU package says deviceType: cpu
                pt2 = export_aoti_here(*staged["digits_eager"], work)
                shutil.copy(pt2, mdir / manifest["model"]["serializedFile"])
                row["note"] = "AOTInductor exported on this device"
            handler = load_on(mdir, manifest, cfg, device)
            logits = torch.cat([handler.logits(c) for c in x.split(32)])
            quantized = "int8" in name
            diff = float((logits - ref_logits).abs().max())
            agree = float((logits.argmax(1) == ref_logits.argmax(1)).float().mean())
            ok = agree >= 0.99 if quantized else diff <= FP32_TOL
            row.update(device=str(handler.device), max_abs_dlogit=f"{diff:.2e}", top1_agree=f"{agree:.2%}")
            row["ok"] = "yes" if ok else "NO"
            if device == "cuda" and handler.device.type != "cuda" and not quantized:
                row["ok"] = "NO (ran on the CPU)"
        except Exception as exc:
            row.update(ok="NO", error=f"{type(exc).__name__}: {exc}"[:200])
        sec.rows.append(row)
    if any(not str(r.get("ok", "")).startswith("yes") for r in sec.rows):
        sec.status = "failed"
    sec.notes.append(f"Reference: digits_eager on the CPU; fp32 tolerance {FP32_TOL:g}, int8: top-1 >= 99%.")


def recompiles(sec: Section, store: Path, device: str, work: Path, top: int) -> None:
    from torch._dynamo.utils import counters

    mdir, manifest, config = stage(store / "digits_compiled.mar", work / "recompile")
    handler = load_on(mdir, manifest, config, device)  # the handler warms up its buckets here
    before = counters["stats"]["unique_graphs"]
    zeros = np.zeros((top, 64), dtype=np.float32)
    t0 = time.perf_counter()
    for b in range(1, top + 1):
        handler.logits(handler.normalise(zeros[:b]))
    after = counters["stats"]["unique_graphs"]
    sec.rows.append(
        {
            "batch sizes": f"1..{top}",
            "graphs compiled after warm-up": after - before,
            "seconds": f"{time.perf_counter() - t0:.2f}",
        }
    )
    if after != before:
        sec.status = "failed"


def out_of_memory(sec: Section, store: Path, device: str, work: Path) -> None:
    if device != "cuda":
        sec.status = "skipped"
        sec.notes.append("Needs CUDA: a capped memory fraction is a CUDA allocator feature.")
        return
    from mariner.server.core.failures import Failure, classify

    mdir, manifest, config = stage(store / "digits_eager.mar", work / "oom")
    handler = load_on(mdir, manifest, config, device)
    free, total = torch.cuda.mem_get_info(0)
    torch.cuda.set_per_process_memory_fraction(min(1.0, (torch.cuda.memory_allocated(0) + 2**28) / total), 0)
    rows = 2**22  # activations of 4M digits need far more than the 256 MiB left
    try:
        handler.logits(torch.zeros(rows, 1, 8, 8))
        sec.status = "failed"
        sec.notes.append(f"{rows} rows did not run out of memory under the cap")
    except Exception as exc:
        kind = classify(exc)
        sec.rows.append({"rows": rows, "raised": type(exc).__name__, "classified": kind.value})
        if kind not in (Failure.OOM, Failure.POSSIBLE_OOM):
            sec.status = "failed"
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, 0)
        torch.cuda.empty_cache()


def serve(sec: Section, store: Path, device: str, work: Path) -> None:
    from mariner.loadtest.payloads import test_digit_bodies
    from mariner.loadtest.servers import MarinerProcess

    # on CUDA, the GPU-capable archives only: int8 kernels and the store's AOTI package are CPU code
    names = [
        m.stem for m in archives(store) if device == "cpu" or not any(k in m.stem for k in ("int8", "aoti"))
    ]
    extra = ("--require-gpu",) if device == "cuda" else ()
    bodies = test_digit_bodies()
    ref = load_on(*stage(store / "digits_eager.mar", work / "serve-ref"), device="cpu")
    expected = ref.logits(ref.normalise(load_splits().test.x)).argmax(1).tolist()
    with MarinerProcess(store, ",".join(n + ".mar" for n in names), extra_args=extra) as srv:
        for name in names:
            url = f"{srv.http_url}/predictions/{name}"
            answers = [requests.post(url, data=b, timeout=60).json() for b in bodies]
            agree = sum(a.get("label") == y for a, y in zip(answers, expected, strict=True)) / len(expected)
            devices = workers_on(srv, name)
            sec.rows.append(
                {"model": name, "labels as eager on CPU": f"{agree:.2%}", "workers on": ",".join(devices)}
            )
            if agree < 0.99 or (device == "cuda" and devices != ["gpu"]):
                sec.status = "failed"
        metrics = requests.get(srv.metrics_url, timeout=30).text
        gauges = [ln for ln in metrics.splitlines() if "gpu_memory" in ln and not ln.startswith("#")]
        sec.notes.append("GPU memory gauge: " + ("; ".join(gauges) if gauges else "none"))
        if device == "cuda" and not gauges:
            sec.status = "failed"


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
    if args[:1] == ["carry"]:  # pack the MiniLM weights here, unpack them there (gpu_check_carry)
        from mariner.loadtest import gpu_check_carry

        return gpu_check_carry.main(args[1:])
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
        sections = [
            run_section("environment", lambda s: environment(s, a.device)),
            run_section("archives vs eager", lambda s: verify_archives(s, store, a.device, work)),
            run_section(
                "no recompiles after warm-up",
                lambda s: recompiles(s, store, a.device, work, top),
            ),
            run_section("out-of-memory recognised", lambda s: out_of_memory(s, store, a.device, work)),
            run_section("mariner serve", lambda s: serve(s, store, a.device, work)),
            run_section(
                "minilm and resnet18 vs eager", lambda s: verify_families(s, store, a.device, work, n, budget)
            ),
            run_section(
                "minilm and resnet18: no graphs after warm-up",
                lambda s: family_recompiles(s, store, a.device, work, 4 if a.quick else top, budget),
            ),
            run_section(
                "mariner serve: minilm and resnet18",
                lambda s: serve_families(s, store, a.device, work, n, budget),
            ),
            run_section(
                "minilm and resnet18: bf16 and CUDA graphs benchmark",
                lambda s: accel_bench(
                    s, store, a.device, a.quick, work, out.parent / f"{out.stem}-accel", budget
                ),
            ),
            run_section("benchmark", lambda s: digits_bench(s, store, a.quick, bench_out, budget)),
        ]
    out.write_text(report(sections, a.device, a.quick, time.perf_counter() - t0))
    print(f"[gpu-check] report: {out}", flush=True)
    return 1 if any(s.status == "failed" for s in sections) else 0


if __name__ == "__main__":
    sys.exit(main())
