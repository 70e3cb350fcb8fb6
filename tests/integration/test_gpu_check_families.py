"""The GPU checklist's CPU dry run, its second part: the MiniLM and ResNet-18 sections (the digits
sections and the checks the dry run cannot show are in test_gpu_check.py; a module of its own so
that `make test`'s two pytest processes can run the two parts side by side)."""

from __future__ import annotations

from pathlib import Path

from tests.integration.test_gpu_check import (
    DIGITS_TITLES,
    FAMILY_ARCHIVES,
    FAMILY_SECTIONS,
    FAMILY_TITLES,
    dry_run,
)


def test_cpu_dry_run_passes_every_family_section(tmp_path: Path) -> None:
    text = dry_run(tmp_path, FAMILY_SECTIONS)
    # the sentence encoder and the image classifier, each variant against its eager archive
    for title in FAMILY_TITLES:
        assert f"| {title} | passed |" in text
    for name in (*FAMILY_ARCHIVES, "minilm_eager +bf16", "resnet18_eager +bf16"):
        assert f"| {name} | cpu |" in text
    for name in ("minilm_eager +bf16+graphs", "resnet18_eager +bf16+graphs"):
        assert f"| {name} | cpu |" in text
    assert text.count("| 1..4 | 0 | 0 | 0 |") == 2  # batch sizes, graphs, recompiles, unrecorded calls
    assert "| minilm_eager | 8 | 0 | cosine min" in text  # served, 8 requests, none refused
    assert "| resnet18_eager | 8 | 0 | top-1 100.0%, top-5 identical 100.0% |" in text
    assert (tmp_path / "gpu-check-accel" / "bf16" / "results-minilm_eager.json").exists()
    # the other part's sections are reported, not run
    for title in (*DIGITS_TITLES, "out-of-memory recognised"):
        assert f"| {title} | skipped |" in text
    assert not (tmp_path / "gpu-check-bench").exists()
