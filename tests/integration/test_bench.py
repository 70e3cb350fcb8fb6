"""The side-by-side benchmark end to end, tiny: real servers, real clients, real report files.

Each run is bounded by request counts (`--requests`), not by a clock, and asserts what was
counted (every request answered and checked, every planned cell present, the report written);
no figure is judged, so a slow or shared machine gives a longer run, not a different verdict.
The benchmark runs as users run it, `python -m mariner.loadtest.bench` in a subprocess.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
REQUESTS = 24  # timed requests per cell
LEVEL = 2


def run_bench(store: Path, out: Path, *args: str) -> dict[str, Any]:
    cmd = [
        sys.executable, "-m", "mariner.loadtest.bench", "--store", str(store), "--out", str(out),
        "--levels", str(LEVEL), "--requests", str(REQUESTS), "--warmup", "4", "--repeats", "1",
        "--protocols", "http", "--no-startup", "--torchserve-warmup-cap", "0", "--raw-seconds", "0.2",
        *args,
    ]  # fmt: skip
    # The timeout only catches a hung run; the run itself is bounded by requests made.
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900, check=False)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return {"stdout": proc.stdout}


def cells(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {r["server"]: r for r in report["levels"]}


def test_digits_against_torchserve_writes_the_default_report(model_store: Path, tmp_path: Path) -> None:
    run_bench(model_store, tmp_path, "--servers", "raw,mariner,torchserve")
    report = json.loads((tmp_path / "results.json").read_text())
    by_server = cells(report)
    # digits also runs the thread-worker baseline when this build has --worker-mode
    assert {"mariner", "torchserve"} <= set(by_server) <= {"mariner", "torchserve", "mariner-thread"}
    for name in by_server:
        r = by_server[name]
        assert r["errors"] == 0, r["first_error"]
        assert r["latency"]["n"] == REQUESTS  # every timed request answered with a prediction
        assert r["concurrency"] == LEVEL
    assert len(report["raw_runs"]) == 1
    assert report["raw_runs"][0]["batch_size"] == 32  # the archive's batchSize
    text = (tmp_path / "results.md").read_text()
    assert text.startswith("# Benchmark: raw model vs Mariner vs stock TorchServe\n")
    assert "## Performance targets" in text
    assert (tmp_path / "latency.png").stat().st_size > 0
    assert (tmp_path / "throughput.png").stat().st_size > 0


def test_minilm_runs_the_length_blind_copy_and_names_its_files(model_store: Path, tmp_path: Path) -> None:
    if not (model_store / "minilm_onnx.mar").is_file():
        pytest.fail(f"{model_store / 'minilm_onnx.mar'} is missing: run `make models`")
    # batches of 4: a full batch of 32 texts takes seconds on a shared core, and the ceiling
    # times several
    run_bench(
        model_store, tmp_path, "--model", "minilm_onnx", "--servers", "raw,mariner", "--batch-size", "4"
    )
    report = json.loads((tmp_path / "results-minilm_onnx.json").read_text())
    by_server = cells(report)
    assert set(by_server) == {"mariner", "mariner-pad-max"}
    for r in by_server.values():
        assert r["errors"] == 0, r["first_error"]  # 384 floats of unit norm, every answer
        assert r["latency"]["n"] == REQUESTS
    assert "handler.padding" in " ".join(report["padding"])
    text = (tmp_path / "results-minilm_onnx.md").read_text()
    assert "## Length-aware batching (MiniLM)" in text
    assert "word pieces per text: min" in text
    assert (tmp_path / "throughput-minilm_onnx.png").stat().st_size > 0
    assert not (tmp_path / "results.md").exists()
