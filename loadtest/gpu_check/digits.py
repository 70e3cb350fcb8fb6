"""The digits archives on the device: each variant vs the eager model on the CPU (AOTInductor
exported again here), no recompiles after warm-up, out-of-memory recognised, `mariner serve`.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import requests
import torch

from mariner.loadtest.gpu_check.families import workers_on
from mariner.server.common.archive import open_archive
from mariner.server.worker.context import Context
from mariner.training.data import load_splits
from mariner.training.verify import load_handler_class

FP32_TOL = 1e-4


if TYPE_CHECKING:
    from mariner.loadtest.gpu_check.checklist import Section


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
    from mariner.server.worker.failures import Failure, classify

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
