"""The GPU checklist's CPU dry run: the script a GPU machine runs must not rot between loans.

Runs `python -m mariner.loadtest.gpu_check --device cpu --quick` for real (archives through
the handler, a `mariner serve` subprocess, a one-second benchmark) and reads its report.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mariner.loadtest.gpu_check import Section, report, run_section

REPO = Path(__file__).resolve().parents[2]


def test_cpu_dry_run_passes_every_section_that_can_run_here(tmp_path: Path) -> None:
    out = tmp_path / "gpu-check.md"
    proc = subprocess.run(
        [sys.executable, "-m", "mariner.loadtest.gpu_check", "--device", "cpu", "--quick", "--out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
    )
    text = out.read_text()
    assert proc.returncode == 0, text
    assert text.startswith("# GPU checklist: CPU dry run (no GPU figure here)")
    ran = ("environment", "archives vs eager", "no recompiles after warm-up", "mariner serve", "benchmark")
    for title in ran:
        assert f"| {title} | passed |" in text
    assert "| out-of-memory recognised | skipped |" in text
    assert "Needs CUDA" in text
    # every archive of the store was checked, each on the device it reports
    for name in ("digits_eager", "digits_compiled", "digits_torchscript", "digits_aoti", "digits_onnx"):
        assert f"| {name} | cpu |" in text
    assert "| 1..8 | 0 |" in text  # no graph compiled after the handler's warm-up
    assert (tmp_path / "gpu-check-bench" / "results.md").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="asks for CUDA where there is none")
def test_cuda_requested_without_cuda_is_refused_not_run_on_the_cpu(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "mariner.loadtest.gpu_check", "--out", str(tmp_path / "r.md")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
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
