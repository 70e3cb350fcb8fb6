"""Conformance: the real tritonclient (gRPC and HTTP, default options) against a live Mariner.

tritonclient runs in its own virtualenv (.venv-triton, made by scripts/ensure_triton_venv.sh)
in a subprocess: it needs protobuf < 7 while our server needs >= 7.35, and its generated
`inference` stubs clash with ours in one process. The subprocess prints a JSON report with one
entry per check (see triton_conformance.py); each check is asserted here as its own test, so a
failure names what Triton users would see break.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest

from mariner.server import protogen
from tests.integration.triton_conformance import CHECKS
from tests.mariner_serve import MarinerServe

if TYPE_CHECKING:
    from tests.conftest import EagerReference

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
TRITON_PYTHON = REPO / ".venv-triton" / "bin" / "python"
SCRIPT = Path(__file__).with_name("triton_conformance.py")
ENSURE_SCRIPT = REPO / "scripts" / "ensure_triton_venv.sh"
MODEL = "digits_torchscript"
N_ROWS = 16
RUN_TIMEOUT_S = 300


@pytest.fixture(scope="module")
def report(
    model_store: Path, eager_reference: EagerReference, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Any]:
    """Start Mariner, run the conformance script once, hand every test its report."""
    if not TRITON_PYTHON.is_file():
        pytest.fail(
            f"{TRITON_PYTHON.relative_to(REPO)} is missing: run `bash scripts/ensure_triton_venv.sh` "
            "(it creates .venv-triton with the pinned tritonclient)"
        )
    # The stamp the script writes names the pinned spec: a venv from an older pin is stale.
    pin = re.search(r"^SPEC='([^']+)'", ENSURE_SCRIPT.read_text(), re.MULTILINE)
    stamp = TRITON_PYTHON.parents[1] / ".installed-stamp"
    if pin is None or not stamp.is_file() or stamp.read_text().strip() != pin[1]:
        pytest.fail(
            f".venv-triton is not at the pinned tritonclient: run `bash {ENSURE_SCRIPT.relative_to(REPO)}`"
        )
    import torch

    from mariner.training.data import to_model_input

    pixels = eager_reference.test_pixels[:N_ROWS].astype(np.float32)
    with torch.inference_mode():
        logits = eager_reference.model(to_model_input(pixels, eager_reference.norm)).float().numpy()
    data = tmp_path_factory.mktemp("triton") / "expected.npz"
    np.savez(data, pixels=pixels, logits=logits)

    protogen.generate()
    # Model management on: the repository checks load and unload a model on the management ports.
    srv = MarinerServe(model_store, f"{MODEL}.mar", enable_model_management=True).start()
    try:
        done = subprocess.run(
            [
                str(TRITON_PYTHON),
                str(SCRIPT),
                "--grpc",
                srv.grpc_target,
                "--http",
                srv.http.removeprefix("http://"),
                "--grpc-management",
                srv.grpc_management_target,
                "--http-management",
                srv.management.removeprefix("http://"),
                "--model",
                MODEL,
                "--data",
                str(data),
            ],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=RUN_TIMEOUT_S,
        )
    finally:
        srv.stop()
    try:
        result = json.loads(done.stdout)
    except ValueError:
        pytest.fail(f"conformance script crashed (exit {done.returncode}):\n{done.stdout}\n{done.stderr}")
    return result


def test_report_covers_every_check(report: dict[str, Any]) -> None:
    assert [r["check"] for r in report["checks"]] == list(CHECKS)
    assert report["tritonclient"]


@pytest.mark.parametrize("check", CHECKS)
def test_tritonclient(report: dict[str, Any], check: str) -> None:
    entry = next((r for r in report["checks"] if r["check"] == check), None)
    assert entry is not None, f"{check} did not run"
    assert entry["ok"], f"{check}: {entry['detail']}"
